"""A torchtitan job-config fragment (TOML) for a plan.

Option names are those of torchtitan's ``torchtitan/config/job_config.py``
(pytorch/torchtitan at commit 6404b93: the ``Parallelism``, ``Training``,
``ActivationCheckpoint``, ``Optimizer`` and ``Model`` dataclasses); behaviour checked
against ``torchtitan/distributed/utils.py`` (``maybe_enable_amp``) and
``parallelize_llama``. Merge the keys into a job config, or pass them as
``--section.key value`` overrides.

Mapping: ``dp_replicate``/``dp_shard``/``tp``/``pp``/``cp`` degrees one to one (the
same mesh order, FSDP over ``dp_shard x cp`` as our runtime); ZeRO-3 is FSDP with
``fsdp_reshard_after_forward = "always"``, ZeRO-1/2 without resharding (``"never"``,
as :mod:`strategies.fsdp` runs them); ``plan.stages`` is
``module_fqns_per_model_part``; our zero-bubble schedule runs
``ScheduleInterleavedZeroBubble`` over the plan's chunks in loop order, torchtitan's
``InterleavedZeroBubble`` (``ZBVZeroBubble`` places chunks in a V). Refused: fp16
weights and bf16/fp16 gradient reduction (``mixed_precision_param`` takes bfloat16 or
float32, ``mixed_precision_reduce`` only float32), tensor parallelism without sequence
parallelism (torchtitan always shards norms on the sequence), DDP next to other
parallelism, ZeRO-0 with context parallelism (torchtitan shards weights over cp),
bf16 with tp or pp but no FSDP (torchtitan then trains in fp32), SGD, per-stage or
first-k-blocks recompute, and PowerSGD or local SGD.
"""

from __future__ import annotations

import math

from planner.export.common import (
    check_hook_compression,
    check_megatron_layout,
    check_recompute_blocks,
    header,
    refuse,
    seq_len,
    uniform_recompute,
)
from planner.io import dumps_json
from planner.spec import CompressionKind, DType, Optimizer, Plan, RecomputeMode, Schedule

__all__ = ["to_torchtitan"]

TARGET = "torchtitan"
_SCHEDULES = {
    Schedule.GPIPE: "GPipe",
    Schedule.ONE_F_ONE_B: "1F1B",
    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B",
    Schedule.ZERO_BUBBLE: "InterleavedZeroBubble",
}
_OPTIMIZERS = {Optimizer.ADAMW: "AdamW", Optimizer.ADAM: "Adam"}
_PARAM_DTYPES = {DType.BF16: "bfloat16", DType.FP8: "bfloat16", DType.FP32: "float32"}

TomlValue = bool | int | float | str | list["TomlValue"]


def to_torchtitan(plan: Plan) -> str:
    """The plan as torchtitan ``[parallelism]``, ``[training]``, ``[activation_checkpoint]``
    and ``[optimizer]`` tables (and ``[model]`` converters for fp8); raises
    :class:`~planner.errors.ExportError` for what torchtitan cannot express."""
    check_hook_compression(plan, TARGET)
    _check_data_parallel(plan)
    _check_precision(plan)
    notes = _tensor_parallel_notes(plan)
    mode = uniform_recompute(plan, TARGET)
    tables: dict[str, dict[str, TomlValue]] = {
        "parallelism": _parallelism(plan),
        "training": _training(plan),
        "activation_checkpoint": _activation_checkpoint(plan, mode),
        "optimizer": {"name": _optimizer_name(plan)},
    }
    if plan.training.dtype is DType.FP8:
        tables["model"] = {"converters": ["float8"]}
    if mode is RecomputeMode.SELECTIVE:
        notes.append(
            "selective recompute: torchtitan's per-op policy keeps matmul and attention outputs "
            "(recomputing every other matmul); the plan priced Korthikanti's selective recompute"
        )
    if plan.stages:
        notes.append(
            "module_fqns_per_model_part names this model's modules (as torchtitan's llama)"
        )
    lines = header(plan, TARGET) + [f"# note: {note}" for note in notes]
    for name, table in tables.items():
        lines += ["", f"[{name}]"] + [f"{key} = {_toml(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def _check_data_parallel(plan: Plan) -> None:
    strategy = plan.strategy
    if strategy.zero == 0 and strategy.cp > 1:
        raise refuse(
            TARGET,
            "strategy.zero",
            0,
            f"torchtitan shards the weights over dp_shard x cp whenever cp ({strategy.cp}) > 1, "
            "so replicated weights cannot be expressed",
            "re-plan with --zero 1, 2 or 3",
        )
    others = strategy.tp * strategy.pp * strategy.cp
    if strategy.zero == 0 and strategy.dp > 1 and others > 1:
        raise refuse(
            TARGET,
            "strategy.zero",
            0,
            f"torchtitan's DDP (data_parallel_replicate_degree = {strategy.dp} without "
            f"sharding) runs only on a one-dimensional mesh, and tp * pp * cp = {others}",
            "re-plan with --zero 1, 2 or 3 (FSDP/HSDP)",
        )


def _fsdp_enabled(plan: Plan) -> bool:
    """Whether torchtitan applies ``fully_shard`` (a dp_shard or cp axis larger than 1)."""
    return plan.strategy.shard_degree > 1 or plan.strategy.cp > 1


def _check_precision(plan: Plan) -> None:
    strategy, dtype = plan.strategy, plan.training.dtype
    if dtype not in _PARAM_DTYPES:
        raise refuse(
            TARGET,
            "training.dtype",
            dtype,
            "training.mixed_precision_param takes only bfloat16 or float32",
            "re-plan with --dtype bf16",
        )
    kind = strategy.compression.kind
    if kind in (CompressionKind.BF16, CompressionKind.FP16):
        raise refuse(
            TARGET,
            "strategy.compression.kind",
            kind,
            "training.mixed_precision_reduce takes only float32",
            "use compression 'none' (float32 reduction), or export to megatron or deepspeed",
        )
    lowered = dtype is not DType.FP32
    if lowered and not _fsdp_enabled(plan) and (strategy.tp > 1 or strategy.pp > 1):
        raise refuse(
            TARGET,
            "training.dtype",
            dtype,
            "torchtitan applies mixed precision through FSDP when tp or pp is on, and this plan "
            f"shards over nothing (dp_shard {strategy.shard_degree}, cp {strategy.cp}): it "
            "would train in float32",
            "re-plan with --zero 1, 2 or 3 and dp_shard > 1, or --dtype fp32",
        )


def _tensor_parallel_notes(plan: Plan) -> list[str]:
    strategy = plan.strategy
    if strategy.tp == 1:
        return []
    if not strategy.sequence_parallel:
        raise refuse(
            TARGET,
            "strategy.sequence_parallel",
            False,
            "torchtitan's tensor-parallel plan always shards the norms on the sequence",
            "re-plan with --sequence-parallel",
        )
    return check_megatron_layout(plan, TARGET)


def _parallelism(plan: Plan) -> dict[str, TomlValue]:
    strategy = plan.strategy
    table: dict[str, TomlValue] = {
        "data_parallel_replicate_degree": strategy.replicate_degree,
        "data_parallel_shard_degree": strategy.shard_degree,
    }
    if _fsdp_enabled(plan):
        table["fsdp_reshard_after_forward"] = "always" if strategy.zero == 3 else "never"
    table |= {
        "tensor_parallel_degree": strategy.tp,
        "disable_loss_parallel": False,
        "enable_async_tensor_parallel": False,
        "context_parallel_degree": strategy.cp,
        "pipeline_parallel_degree": strategy.pp,
    }
    if strategy.pp > 1:
        table |= {
            "pipeline_parallel_schedule": _SCHEDULES[strategy.schedule],
            "pipeline_parallel_microbatch_size": strategy.micro_batch_size,
            "module_fqns_per_model_part": [list(chunk) for chunk in plan.stages],
        }
    return table


def _training(plan: Plan) -> dict[str, TomlValue]:
    """Batch sizes in sequences: torchtitan accumulates gradients over
    ``global / (local * dp)`` steps without pipelining and splits ``local_batch_size``
    into pipeline micro-batches with it."""
    strategy = plan.strategy
    per_rank = strategy.micro_batch_size * strategy.num_microbatches
    table: dict[str, TomlValue] = {
        "local_batch_size": per_rank if strategy.pp > 1 else strategy.micro_batch_size,
        "global_batch_size": plan.training.global_batch_size,
    }
    tokens = seq_len(plan)
    if tokens is not None:
        table["seq_len"] = tokens
    table |= {
        "max_norm": 1.0 if plan.training.grad_clip else math.inf,
        "mixed_precision_param": _PARAM_DTYPES[plan.training.dtype],
        "mixed_precision_reduce": "float32",
    }
    return table


def _activation_checkpoint(plan: Plan, mode: RecomputeMode) -> dict[str, TomlValue]:
    if mode is not RecomputeMode.NONE:
        check_recompute_blocks(plan, TARGET)
    table: dict[str, TomlValue] = {"mode": mode.value}
    if mode is RecomputeMode.SELECTIVE:
        table["selective_ac_option"] = "op"
    return table


def _optimizer_name(plan: Plan) -> str:
    optimizer = plan.training.optimizer
    if optimizer not in _OPTIMIZERS:
        raise refuse(
            TARGET,
            "training.optimizer",
            optimizer,
            "torchtitan builds Adam and AdamW only",
            "re-plan with --optimizer adamw, or export to megatron or deepspeed",
        )
    return _OPTIMIZERS[optimizer]


def _toml(value: TomlValue) -> str:
    """A TOML literal; lists of lists go one inner list per line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, (int, float, str)):
        return dumps_json(value, what="torchtitan TOML value", indent=None)
    if value and all(isinstance(item, list) for item in value):
        return "[\n" + "".join(f"  {_toml(item)},\n" for item in value) + "]"
    return "[" + ", ".join(_toml(item) for item in value) + "]"
