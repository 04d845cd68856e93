"""A DeepSpeed config JSON read as the run the planner prices.

JSON with whole-line ``//`` or ``#`` comments (DeepSpeed reads it with hjson), keys as
the DeepSpeed configuration reference names them (DeepSpeed 0.16-0.19,
``deepspeed/runtime/config.py``, ``deepspeed/runtime/zero/config.py``), the same the
exporter (:mod:`planner.export.deepspeed`) writes. The batch sizes follow DeepSpeed's
rule ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps
* data-parallel ranks``: with all three the GPU count follows; with two, the third comes
from the GPU count (``--gpus`` or the cluster). Every rank is a data-parallel rank
(tensor, pipeline and context parallelism are set up in code, not in this config).
``zero_optimization.stage`` is the ZeRO stage, ``mics_shard_size`` the shard group of
ZeRO-3 (hybrid sharding), ``communication_data_type`` the gradient-reduction dtype
(absent: the gradients' own, half precision under bf16/fp16), ``overlap_comm`` whether
the reduction overlaps backward (DeepSpeed's default: only under ZeRO-3; without ZeRO
the engine reduces after backward).

What the config does not hold comes from the options: the model and its sequence
length (``--model``), and recompute (DeepSpeed's ``activation_checkpointing`` section
only configures ``deepspeed.checkpointing``, which the model code calls: priced without
recompute). Refused: CPU/NVMe offload, ZeRO++ (hpZ, quantized weights or gradients),
AutoTP and Ulysses degrees, automatic mixed precision (``amp``), and the training-time
changes (curriculum learning, progressive layer drop, sparse attention).
"""

from __future__ import annotations

from typing import Any

from planner.errors import SpecError
from planner.export.deepspeed import COMMUNICATION_DTYPES
from planner.frameworks import KERNELS, Framework
from planner.importers.common import (
    ImportedRun,
    Options,
    Settings,
    build_run,
    choose_model,
    resolve_world,
)
from planner.io import parse_json
from planner.spec import CompressionKind, DType, Optimizer, Training

__all__ = ["FORMAT", "SIGNATURE_KEYS", "read_deepspeed", "without_comments"]

FORMAT = "deepspeed"
# Top-level keys that make a JSON object a DeepSpeed config.
SIGNATURE_KEYS = (
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)  # fmt: skip
_REDUCTIONS = {name: kind for kind, name in COMMUNICATION_DTYPES.items()}
_HALF = {DType.BF16: CompressionKind.BF16, DType.FP16: CompressionKind.FP16}
_OFF = (None, "none")
# Keys that change what a step computes or keeps in a way the planner does not price:
# key -> (harmless values, why).
_UNPRICED: dict[str, tuple[tuple[Any, ...], str]] = {
    "zero_optimization.offload_optimizer.device": (_OFF, "the planner does not model CPU or "
                                                   "NVMe offload"),
    "zero_optimization.offload_param.device": (_OFF, "the planner does not model CPU or NVMe "
                                               "offload"),
    "zero_optimization.zero_hpz_partition_size": ((None, 1), "ZeRO++ hierarchical partitioning "
                                                  "(hpZ) keeps a second weight copy the "
                                                  "planner does not price"),
    "zero_optimization.zero_quantized_weights": ((None, False), "ZeRO++ quantized weight "
                                                 "gathers are not priced"),
    "zero_optimization.zero_quantized_gradients": ((None, False), "ZeRO++ quantized gradient "
                                                   "reductions are not priced"),
    "tensor_parallel.autotp_size": ((None, 1), "AutoTP shards only linear layers, not as the "
                                    "planner's tensor parallelism"),
    "sequence_parallel_size": ((None, 1), "Ulysses sequence parallelism is not priced"),
    "amp.enabled": ((None, False), "automatic mixed precision (apex amp) is not priced"),
    "curriculum_learning.enabled": ((None, False), "the sequence length changes during "
                                    "training"),
    "progressive_layer_drop.enabled": ((None, False), "layers are skipped during training"),
    "sparse_attention.mode": ((None,), "sparse attention is not priced"),
    "expert_parallel.enabled": ((None, False), "AutoEP (0.19.6 on) swaps in its own MoE layers "
                                "found by module-name presets, not the planner's experts"),
}  # fmt: skip


def read_deepspeed(text: str, source: str, detected: str, options: Options) -> ImportedRun:
    """The run ``text`` (a DeepSpeed config) describes, completed by ``options``."""
    data = parse_json(without_comments(text), source, what="DeepSpeed config")
    if not isinstance(data, dict):
        raise SpecError(f"cannot read {source}: a DeepSpeed config is a JSON object")
    settings = Settings.nested(data, source)
    _refuse_unpriced(settings)
    notes = ["the model, its sequence length and recompute come from the options: a DeepSpeed "
             "config holds none of them (priced without recompute)"]  # fmt: skip
    model = choose_model(settings, None, "a DeepSpeed config holds none", options.model)
    derived, how = _world(settings)
    cluster = resolve_world(settings, options, derived, how)
    micro, accumulation, total = _batch_sizes(settings, cluster.num_gpus)
    stage = settings.integer("zero_optimization.stage", 0, least=0)
    if stage > 3:
        raise settings.refuse("zero_optimization.stage", stage, "ZeRO stages are 0-3", "use 0-3")
    dtype = _dtype(settings)
    kind = _reduction(settings, dtype, notes)
    optimizer = _optimizer(settings, notes)
    strategy = {
        "dp": cluster.num_gpus, "dp_shard": _shard_group(settings, stage, cluster.num_gpus),
        "zero": stage, "micro_batch_size": micro, "num_microbatches": accumulation,
        "compression": {"kind": kind.value},
    }  # fmt: skip
    training = {
        "global_batch_size": total, "dtype": dtype.value, "optimizer": optimizer.value,
        "grad_clip": settings.number("gradient_clipping", 0.0) > 0,
    }  # fmt: skip
    overlap = _overlap(settings, stage, notes)
    return build_run(
        settings, format=FORMAT, detected=detected, model=model, cluster=cluster,
        training=training, strategy=strategy,
        options={"overlap_grad_reduce": overlap, **KERNELS[Framework.DEEPSPEED]},
        notes=notes,
    )  # fmt: skip


# keys whose values price nothing: the learning-rate schedule, the optimizer's hyperparameters
_UNPRICED_PREFIXES = ("scheduler.", "optimizer.params.")


def without_comments(text: str) -> str:
    """``text`` without its whole-line ``//`` and ``#`` comments (DeepSpeed reads its
    config with hjson, which takes them as comments)."""
    return "\n".join(
        "" if line.lstrip().startswith(("//", "#")) else line for line in text.splitlines()
    )


def _refuse_unpriced(settings: Settings) -> None:
    """Refuse the ``"auto"`` values of keys that are priced, all at once (those of the
    learning-rate schedule and the optimizer's hyperparameters price nothing), then the
    unpriced settings."""
    auto = [
        key for key, value in settings.values.items()
        if value == "auto" and not key.startswith(_UNPRICED_PREFIXES)
    ]  # fmt: skip
    if auto:
        raise settings.refuse(
            auto[0], "auto",
            "'auto' is filled in by the Hugging Face Trainer at run time"
            + (f" (and in {', '.join(auto[1:])})" if auto[1:] else ""),
            "write the values the run uses",
        )  # fmt: skip
    settings.check_unpriced(_UNPRICED)


def _world(settings: Settings) -> tuple[int | None, str]:
    """The data-parallel ranks all three batch sizes imply, or None and why not."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if not all(key in settings for key in keys):
        return None, (
            "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            "ranks leaves the GPU count open unless all three are given"
        )
    total, micro, steps = (settings.integer(key, 1) for key in keys)
    if total % (micro * steps):
        raise settings.refuse(
            "train_batch_size", total,
            f"not a multiple of train_micro_batch_size_per_gpu x gradient_accumulation_steps "
            f"= {micro * steps}",
            "make the batch sizes agree",
        )  # fmt: skip
    return total // (micro * steps), (
        f"train_batch_size / (train_micro_batch_size_per_gpu x gradient_accumulation_steps) "
        f"= {total} / ({micro} x {steps})"
    )


def _batch_sizes(settings: Settings, ranks: int) -> tuple[int, int, int]:
    """(micro-batch, accumulation steps, global batch) as DeepSpeed completes them for
    ``ranks`` data-parallel ranks."""
    total = settings.integer("train_batch_size", 0, least=0) or None
    micro = settings.integer("train_micro_batch_size_per_gpu", 0, least=0) or None
    steps = settings.integer("gradient_accumulation_steps", 0, least=0) or None
    if total is None and micro is None:
        raise SpecError(
            f"cannot read {settings.source}: it gives neither train_batch_size nor "
            "train_micro_batch_size_per_gpu; give one of them"
        )
    if total is None:
        assert micro is not None
        return micro, steps or 1, micro * (steps or 1) * ranks
    if micro is None:
        steps = steps or 1
        micro = _divide(settings, "train_batch_size", total, ranks * steps, "ranks x accumulation")
        return micro, steps, total
    steps = steps or _divide(settings, "train_batch_size", total, ranks * micro, "ranks x micro")
    if micro * steps * ranks != total:
        raise settings.refuse(
            "train_batch_size", total,
            f"!= train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps "
            f"({steps}) x {ranks} ranks",
            "make the batch sizes and the GPU count agree",
        )  # fmt: skip
    return micro, steps, total


def _divide(settings: Settings, key: str, total: int, by: int, what: str) -> int:
    if total % by:
        raise settings.refuse(
            key, total, f"not divisible by {what} = {by}", "make the batch sizes agree"
        )
    return total // by


def _shard_group(settings: Settings, stage: int, ranks: int) -> int | None:
    """ZeRO-3's shard group (MiCS ``mics_shard_size``; None: all ranks)."""
    size = settings.get("zero_optimization.mics_shard_size", -1)
    if size in (-1, 0):
        return None
    size = settings.integer("zero_optimization.mics_shard_size", 1)
    if stage != 3 or ranks % size:
        raise settings.refuse(
            "zero_optimization.mics_shard_size", size,
            f"MiCS shards ZeRO-3 in groups that divide the {ranks} ranks "
            f"(zero_optimization.stage = {stage})",
            "use stage 3 and a divisor of the GPU count, or remove mics_shard_size",
        )  # fmt: skip
    return size


def _dtype(settings: Settings) -> DType:
    bf16 = settings.flag("bf16.enabled") or settings.flag("bfloat16.enabled")
    fp16 = settings.flag("fp16.enabled")
    if bf16 and fp16:
        raise settings.refuse(
            "fp16.enabled", True, "bf16 is enabled too", "enable one of bf16 and fp16"
        )
    return DType.BF16 if bf16 else DType.FP16 if fp16 else DType.FP32


def _reduction(settings: Settings, dtype: DType, notes: list[str]) -> CompressionKind:
    """The gradient-reduction dtype: ``communication_data_type``, else the gradients'."""
    name = settings.get("communication_data_type")
    if name is None:
        kind = _HALF.get(dtype, CompressionKind.NONE)
        if kind is not CompressionKind.NONE:
            notes.append(
                f"no communication_data_type: DeepSpeed reduces {dtype.value} gradients in "
                f"{dtype.value} (priced as {kind.value} compression)"
            )
        return kind
    if name not in _REDUCTIONS:
        raise settings.refuse(
            "communication_data_type", name, f"the planner prices {', '.join(_REDUCTIONS)}",
            "use one of them",
        )  # fmt: skip
    return _REDUCTIONS[name]


def _optimizer(settings: Settings, notes: list[str]) -> Optimizer:
    name = settings.get("optimizer.type")
    if name is None:
        default = Training.model_fields["optimizer"].default
        notes.append(f"no optimizer section (the training script builds it): priced with "
                     f"{default.value}")  # fmt: skip
        return default
    kind = str(name).lower()
    if kind not in ("adam", "adamw"):
        raise settings.refuse(
            "optimizer.type", name, "the planner prices the optimizer states of Adam and AdamW",
            "use Adam or AdamW, or remove the optimizer section to price AdamW",
        )  # fmt: skip
    # DeepSpeed's Adam is FusedAdam, which decouples weight decay unless adam_w_mode is off
    if kind == "adam" and not settings.flag("optimizer.params.adam_w_mode", True):
        return Optimizer.ADAM
    return Optimizer.ADAMW


def _overlap(settings: Settings, stage: int, notes: list[str]) -> bool:
    """Whether the gradient reduction overlaps backward (``overlap_comm``; DeepSpeed's
    default is on under ZeRO-3 only, and without ZeRO the engine reduces after backward)."""
    overlap = stage >= 1 and settings.flag("zero_optimization.overlap_comm", stage == 3)
    if not overlap:
        why = "overlap_comm is off" if stage else "without ZeRO the engine reduces after backward"
        notes.append(f"{why}: the gradient reduction is priced exposed, after backward")
    return overlap
