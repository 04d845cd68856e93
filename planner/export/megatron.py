"""Megatron-LM command-line arguments for a plan, one per line.

Argument names are those of Megatron-LM's ``megatron/training/arguments.py``
(NVIDIA/Megatron-LM at commit 000c4ac, Megatron-Core 0.14 era: ``_add_distributed_args``,
``_add_training_args``, ``_add_mixed_precision_args``, ``_add_network_size_args``,
``_add_regularization_args``, ``_add_data_args``, ``_add_tokenizer_args``) and of its
Megatron-FSDP guide (``--use-megatron-fsdp`` with ``--data-parallel-sharding-strategy``).
Pass them to ``pretrain_gpt.py``, e.g. ``torchrun ... pretrain_gpt.py $(grep -v '^#'
megatron.args) --data-path ...``.

Mapping: ``tp``/``pp``/``cp`` sizes and ``--sequence-parallel`` one to one; the data
parallel size is what is left of the world, as ours; ZeRO-1 is the distributed
optimizer (``--num-distributed-optimizer-instances`` for hybrid sharding), ZeRO-2/3
Megatron-FSDP (``optim_grads``/``optim_grads_params``); interleaving is
``--num-layers-per-virtual-pipeline-stage`` when every chunk has as many layers, an
uneven split ``--decoder-first/last-pipeline-num-layers`` or, with virtual stages,
``--pipeline-model-parallel-layout``; full recompute of the first ``k`` blocks per chunk is
``--recompute-method block --recompute-num-layers k``; bf16 gradient reduction
``--grad-reduce-in-bf16``. Refused: GPipe and zero-bubble schedules (Megatron runs
1F1B, interleaved with virtual stages), hybrid sharding with ZeRO-2/3, plain Adam
(Megatron's ``adam`` decouples weight decay), encoders, recompute modes that differ by
stage, selective recompute of some blocks only, a non-Megatron tensor-parallel layout,
stage splits Megatron cannot place, PowerSGD and local SGD.
"""

from __future__ import annotations

from planner.export.common import (
    check_hook_compression,
    check_megatron_layout,
    header,
    refuse,
    seq_len,
    uniform_recompute,
    zoo_layers_per_chunk,
)
from planner.parallel_dims import ParallelDims
from planner.spec import (
    Activation,
    CompressionKind,
    DType,
    Family,
    ModelSpec,
    Optimizer,
    Plan,
    RecomputeMode,
    Schedule,
)

__all__ = ["to_megatron"]

TARGET = "megatron"
Arg = tuple[str, ...]  # an option and its values, as one line of the export
_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}
_DTYPE_ARGS: dict[DType, list[Arg]] = {
    DType.BF16: [("--bf16",)],
    DType.FP16: [("--fp16",)],
    DType.FP8: [("--bf16",), ("--fp8-format", "hybrid")],  # e4m3 forward, e5m2 gradients
    DType.FP32: [],
}
_HALF_REDUCTION = {  # the 2-byte gradient reduction Megatron-LM offers under each dtype
    DType.BF16: CompressionKind.BF16,
    DType.FP8: CompressionKind.BF16,
    DType.FP16: CompressionKind.FP16,
}


def to_megatron(plan: Plan) -> str:
    """The plan as Megatron-LM arguments, one option (with its value) per line; raises
    :class:`~planner.errors.ExportError` for what Megatron-LM cannot express."""
    check_hook_compression(plan, TARGET)
    notes = check_megatron_layout(plan, TARGET) if plan.strategy.tp > 1 else []
    if plan.model is None:
        notes.append(
            "plan.model is empty: add --num-layers, --hidden-size, --num-attention-heads and "
            "the other network-size arguments of your model"
        )
    args = [
        *_parallel_args(plan),
        *_pipeline_args(plan),
        *_batch_args(plan),
        *(_model_args(plan.model, seq_len(plan)) if plan.model is not None else []),
        *_recompute_args(plan),
        *_data_parallel_args(plan),
        *_precision_args(plan),
        *_optimizer_args(plan),
    ]
    lines = header(plan, TARGET) + [f"# note: {note}" for note in notes]
    lines.append("# usage: torchrun ... pretrain_gpt.py $(grep -v '^#' THIS_FILE) --data-path ...")
    return "\n".join(lines + [" ".join(arg) for arg in args]) + "\n"


def _parallel_args(plan: Plan) -> list[Arg]:
    strategy = plan.strategy
    args: list[Arg] = [
        ("--tensor-model-parallel-size", str(strategy.tp)),
        ("--pipeline-model-parallel-size", str(strategy.pp)),
        ("--context-parallel-size", str(strategy.cp)),
    ]
    if strategy.sequence_parallel:
        args.append(("--sequence-parallel",))
    return args


def _pipeline_args(plan: Plan) -> list[Arg]:
    strategy = plan.strategy
    if strategy.pp == 1:
        return []
    if strategy.schedule in (Schedule.GPIPE, Schedule.ZERO_BUBBLE):
        raise refuse(
            TARGET,
            "strategy.schedule",
            strategy.schedule,
            "Megatron-LM runs 1F1B, interleaved when the model has virtual pipeline stages "
            "(in-flight micro-batches, so memory, differ from this schedule)",
            "re-plan with --schedule 1f1b or interleaved-1f1b",
        )
    counts = zoo_layers_per_chunk(plan, TARGET)
    if len(set(counts)) == 1:
        if strategy.virtual_stages == 1:
            return []
        return [("--num-layers-per-virtual-pipeline-stage", str(counts[0]))]
    if strategy.virtual_stages == 1 and len(set(counts[1:-1])) <= 1:
        return [
            ("--decoder-first-pipeline-num-layers", str(counts[0])),
            ("--decoder-last-pipeline-num-layers", str(counts[-1])),
        ]
    return [("--pipeline-model-parallel-layout", _layout(counts))]


def _layout(counts: list[int]) -> str:
    """Megatron's layout string: ``E`` embedding, ``t`` a layer, ``L`` the loss, ``|`` a chunk."""
    chunks = ["t" * count for count in counts]
    chunks[0] = "E" + chunks[0]
    chunks[-1] += "L"
    return "|".join(chunks)


def _batch_args(plan: Plan) -> list[Arg]:
    args: list[Arg] = [
        ("--micro-batch-size", str(plan.strategy.micro_batch_size)),
        ("--global-batch-size", str(plan.training.global_batch_size)),
    ]
    tokens = seq_len(plan)
    if tokens is not None:
        args.append(("--seq-length", str(tokens)))
    return args


def _model_args(spec: ModelSpec, tokens: int | None) -> list[Arg]:
    """Network-size arguments for Megatron's GPT model built like the zoo transformer
    (position table at least ``tokens`` long)."""
    if spec.family is Family.ENCODER:
        raise refuse(
            TARGET,
            "plan.model.family",
            spec.family,
            "Megatron-LM's GPT arguments describe decoders",
            "export an encoder plan to torchtitan or deepspeed",
        )
    args: list[Arg] = [
        ("--num-layers", str(spec.num_layers)),
        ("--hidden-size", str(spec.hidden_size)),
        ("--ffn-hidden-size", str(spec.ffn_size)),
        ("--num-attention-heads", str(spec.num_heads)),
    ]
    if spec.kv_heads != spec.num_heads:
        args += [("--group-query-attention",), ("--num-query-groups", str(spec.kv_heads))]
    args += [
        ("--max-position-embeddings", str(max(spec.seq_len, tokens or 0))),
        ("--vocab-size", str(spec.vocab_size)),
        ("--norm-epsilon", repr(spec.norm_eps)),
        ("--attention-dropout", "0.0"),
        ("--hidden-dropout", "0.0"),
    ]
    if spec.family is Family.LLAMA:
        args += [
            ("--normalization", "RMSNorm"),
            ("--position-embedding-type", "rope"),
            ("--rotary-base", _rotary_base(spec.rope_theta)),
            ("--disable-bias-linear",),
        ]
    else:
        args += [
            ("--normalization", "LayerNorm"),
            ("--position-embedding-type", "learned_absolute"),
        ]
    if spec.act is Activation.SWIGLU:
        args.append(("--swiglu",))
    if not spec.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights",))
    return args


def _rotary_base(theta: float) -> str:
    if not theta.is_integer():
        raise refuse(
            TARGET,
            "plan.model.rope_theta",
            theta,
            "--rotary-base takes an integer",
            "use an integral rope_theta",
        )
    return str(int(theta))


def _recompute_args(plan: Plan) -> list[Arg]:
    mode = uniform_recompute(plan, TARGET)
    limit = plan.strategy.recompute_blocks
    if mode is RecomputeMode.NONE:
        return []
    if mode is RecomputeMode.SELECTIVE:
        if limit is not None:
            raise refuse(
                TARGET,
                "strategy.recompute_blocks",
                limit,
                "Megatron-LM's selective recompute covers every layer",
                "drop recompute_blocks, or use recompute 'full'",
            )
        return [("--recompute-granularity", "selective")]
    method = ("--recompute-method", "uniform") if limit is None else ("--recompute-method", "block")
    layers = "1" if limit is None else str(limit)
    return [("--recompute-granularity", "full"), method, ("--recompute-num-layers", layers)]


def _data_parallel_args(plan: Plan) -> list[Arg]:
    strategy = plan.strategy
    if strategy.zero == 0:
        return []
    hybrid = ParallelDims.of(strategy).hybrid_sharding
    if strategy.zero == 1:
        args: list[Arg] = [("--use-distributed-optimizer",)]
        if hybrid:
            args.append(("--num-distributed-optimizer-instances", str(strategy.replicate_degree)))
        return args
    if hybrid:
        raise refuse(
            TARGET,
            "strategy.dp_shard",
            strategy.shard_degree,
            f"Megatron-FSDP (ZeRO-{strategy.zero}) shards over the whole data-parallel group "
            f"({strategy.dp}), not groups of {strategy.shard_degree}",
            "re-plan with --dp-shard equal to --dp, or --zero 1",
        )
    return [
        ("--use-megatron-fsdp",),
        ("--data-parallel-sharding-strategy", _SHARDING[strategy.zero]),
        ("--no-gradient-accumulation-fusion",),
        ("--use-distributed-optimizer",),
        ("--ckpt-format", "fsdp_dtensor"),
    ]


def _precision_args(plan: Plan) -> list[Arg]:
    """``--bf16``/``--fp16`` and the gradient-reduction dtype (Megatron reduces in fp32
    under bf16, in fp16 under fp16 unless told otherwise)."""
    dtype, kind = plan.training.dtype, plan.strategy.compression.kind
    args = _DTYPE_ARGS[dtype]
    reduce_dtype = _HALF_REDUCTION.get(dtype)
    if kind is CompressionKind.NONE:
        return args + ([("--accumulate-allreduce-grads-in-fp32",)] if dtype is DType.FP16 else [])
    if kind is not reduce_dtype:
        raise refuse(
            TARGET,
            "strategy.compression.kind",
            kind,
            f"Megatron-LM reduces gradients in fp32 or in the training dtype ({dtype.value}), "
            f"not in {kind.value}",
            "use compression 'none'" + (f" or '{reduce_dtype.value}'" if reduce_dtype else ""),
        )
    return args + ([("--grad-reduce-in-bf16",)] if kind is CompressionKind.BF16 else [])


def _optimizer_args(plan: Plan) -> list[Arg]:
    optimizer = plan.training.optimizer
    if optimizer is Optimizer.ADAM:
        raise refuse(
            TARGET,
            "training.optimizer",
            optimizer,
            "Megatron-LM's 'adam' decouples weight decay (AdamW)",
            "re-plan with --optimizer adamw",
        )
    name = "sgd" if optimizer is Optimizer.SGD else "adam"
    clip = "1.0" if plan.training.grad_clip else "0.0"
    return [("--optimizer", name), ("--clip-grad", clip)]
