"""Megatron-LM command-line arguments for a plan, one per line.

Valid for Megatron-Core 0.14.0 through 0.16.1 (``megatron==0.14``, ``0.15``, ``0.16``):
argument names and checks are those of Megatron-LM's ``megatron/training/arguments.py``
at the release tags ``core_v0.14.0``, ``core_v0.15.3`` and ``core_v0.16.1``
(``parse_args``, ``validate_args``, ``core_transformer_config_from_args``; that file is
not in the ``megatron-core`` wheel), and every export was run through them
(``benchmarks/bench_exports.py``). The same arguments serve all three: Megatron-FSDP
(``--use-megatron-fsdp``, ``--ckpt-format fsdp_dtensor``) arrived in 0.14.0, and from
0.14.0 on ``megatron/core/distributed/fsdp/mcore_fsdp_adapter.py`` runs hybrid sharding
when ``--num-distributed-optimizer-instances`` exceeds one (0.16 adds
``--outer-dp-sharding-strategy``, default ``no_shard``: replicated across instances, as
our dp_replicate). Pass them to ``pretrain_gpt.py``, e.g. ``torchrun ... pretrain_gpt.py
$(grep -v '^#' megatron.args) --data-path ...``.

Launch environment (the ``# env:`` header lines): ``validate_args`` asserts
``CUDA_DEVICE_MAX_CONNECTIONS=1`` for tensor or context parallelism on GPUs before
Blackwell (compute capability < 10) unless Megatron-FSDP is on, and asserts the opposite
(not 1) under Megatron-FSDP.

Mapping: ``tp``/``pp``/``cp`` sizes and ``--sequence-parallel`` one to one; the data
parallel size is what is left of the world, as ours; ZeRO-1 is the distributed
optimizer, ZeRO-2/3 Megatron-FSDP (``optim_grads``/``optim_grads_params``), hybrid
sharding ``--num-distributed-optimizer-instances`` = dp_replicate with either;
interleaving is ``--num-layers-per-virtual-pipeline-stage`` when every chunk has as many
layers, an uneven split ``--decoder-first/last-pipeline-num-layers`` or, with virtual
stages, ``--pipeline-model-parallel-layout``; full recompute of the first ``k`` blocks
per chunk is ``--recompute-method block --recompute-num-layers k``; bf16 gradient
reduction ``--grad-reduce-in-bf16``; the vocabulary stays the size priced
(``--make-vocab-size-divisible-by`` lowered where 128 x tp does not divide it, which
Megatron-LM would pad to). What Megatron-LM cannot run is refused by
:mod:`planner.frameworks`; here, a non-Megatron tensor-parallel layout and stage splits
Megatron cannot place.
"""

from __future__ import annotations

from planner.export.common import (
    check_megatron_layout,
    check_target,
    described_model,
    header,
    selective_recompute_note,
    seq_len,
    zoo_layers_per_chunk,
)
from planner.frameworks import (
    MEGATRON_VOCAB_MULTIPLE,
    Framework,
    Target,
    megatron_vocab_multiple,
    parse_target,
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
)

__all__ = ["DTYPE_ARGS", "SHARDING", "to_megatron"]

TARGET = "megatron"
Arg = tuple[str, ...]  # an option and its values, as one line of the export
SHARDING = {2: "optim_grads", 3: "optim_grads_params"}
DTYPE_ARGS: dict[DType, list[Arg]] = {
    DType.BF16: [("--bf16",)],
    DType.FP16: [("--fp16",)],
    DType.FP8: [("--bf16",), ("--fp8-format", "hybrid")],  # e4m3 forward, e5m2 gradients
    DType.FP32: [],
}


def to_megatron(plan: Plan, target: Target | None = None) -> str:
    """The plan as Megatron-LM arguments, one option (with its value) per line; raises
    :class:`~planner.errors.ExportError` for what Megatron-LM cannot express."""
    target = target or parse_target(TARGET)
    check_target(plan, target)
    notes = check_megatron_layout(plan, TARGET) if plan.strategy.tp > 1 else []
    notes += selective_recompute_note(
        plan, Framework.MEGATRON,
        "Megatron-LM's --recompute-granularity selective recomputes core attention alone",
    )  # fmt: skip
    if described_model(plan).moe:
        notes.append(MOE_BALANCING_NOTE)
    args = [
        *_parallel_args(plan),
        *_pipeline_args(plan),
        *_batch_args(plan),
        *_model_args(described_model(plan), seq_len(plan), plan.strategy.tp),
        *_recompute_args(plan),
        *_data_parallel_args(plan),
        *_precision_args(plan),
        *_optimizer_args(plan),
    ]
    form = "pretrain_gpt.py arguments; torchrun ... pretrain_gpt.py $(grep -v '^#' FILE) --data-path ..."
    lines = header(plan, target, form, _environment(plan)) + [f"# note: {note}" for note in notes]
    return "\n".join(lines + [" ".join(arg) for arg in args]) + "\n"


def _environment(plan: Plan) -> list[str]:
    """What ``validate_args`` asserts about ``CUDA_DEVICE_MAX_CONNECTIONS``."""
    strategy = plan.strategy
    if strategy.zero >= 2:
        return [
            "CUDA_DEVICE_MAX_CONNECTIONS unset or above 1 (validate_args: Megatron-FSDP "
            "requires it)"
        ]
    if strategy.tp > 1 or strategy.cp > 1:
        return [
            "CUDA_DEVICE_MAX_CONNECTIONS=1 (validate_args requires it for tensor or context "
            "parallelism before Blackwell)"
        ]
    return []


def _parallel_args(plan: Plan) -> list[Arg]:
    strategy = plan.strategy
    args: list[Arg] = [
        ("--tensor-model-parallel-size", str(strategy.tp)),
        ("--pipeline-model-parallel-size", str(strategy.pp)),
        ("--context-parallel-size", str(strategy.cp)),
    ]
    if strategy.sequence_parallel:
        args.append(("--sequence-parallel",))
    if described_model(plan).moe:
        # Always written: Megatron's default is the dense tp, the plan's may differ.
        args += [
            ("--expert-model-parallel-size", str(strategy.ep)),
            ("--expert-tensor-parallel-size", str(strategy.etp)),
        ]
    return args


def _pipeline_args(plan: Plan) -> list[Arg]:
    strategy = plan.strategy
    if strategy.pp == 1:
        return []
    counts = zoo_layers_per_chunk(plan, TARGET)
    if len(set(counts)) == 1:
        if strategy.virtual_stages == 1:
            return []
        return [("--num-layers-per-virtual-pipeline-stage", str(counts[0]))]
    # a chunk without layers (the embedding or head alone) only the layout can say
    if strategy.virtual_stages == 1 and len(set(counts[1:-1])) <= 1 and min(counts) > 0:
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


def _model_args(spec: ModelSpec, tokens: int | None, tp: int) -> list[Arg]:
    """Network-size arguments for Megatron's GPT model built like the zoo transformer
    (position table at least ``tokens`` long, vocabulary unpadded at ``tp``)."""
    args: list[Arg] = [
        ("--num-layers", str(spec.num_layers)),
        ("--hidden-size", str(spec.hidden_size)),
        ("--ffn-hidden-size", str(spec.ffn_size)),
        ("--num-attention-heads", str(spec.num_heads)),
    ]
    if spec.latent_attention:
        args += _latent_attention_args(spec)
    elif spec.kv_heads != spec.num_heads:
        args += [("--group-query-attention",), ("--num-query-groups", str(spec.kv_heads))]
    if spec.head_dim is not None:  # heads not hidden / heads wide (Qwen3)
        args.append(("--kv-channels", str(spec.head_size)))
    if spec.qk_norm:  # per-head RMSNorm of queries and keys
        args.append(("--qk-layernorm",))
    args += [
        ("--max-position-embeddings", str(max(spec.seq_len, tokens or 0))),
        ("--vocab-size", str(spec.vocab_size)),
        *_vocab_multiple_args(spec.vocab_size, tp),
        ("--norm-epsilon", repr(spec.norm_eps)),
        ("--attention-dropout", "0.0"),
        ("--hidden-dropout", "0.0"),
    ]
    if spec.family is Family.LLAMA:
        args += [
            ("--normalization", "RMSNorm"),
            ("--position-embedding-type", "rope"),
            ("--rotary-base", str(int(spec.rope_theta))),
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
    return args + (_moe_args(spec) if spec.moe else [])


def _vocab_multiple_args(size: int, tp: int) -> list[Arg]:
    """``--make-vocab-size-divisible-by`` where Megatron-LM's default would pad the
    vocabulary past the ``size`` the plan priced."""
    multiple = megatron_vocab_multiple(size, tp)
    if multiple == MEGATRON_VOCAB_MULTIPLE:
        return []
    return [("--make-vocab-size-divisible-by", str(multiple))]


def _latent_attention_args(spec: ModelSpec) -> list[Arg]:
    """Multi-head latent attention (DeepSeek-V3's layout; plain RoPE, not Megatron's
    default YaRN)."""
    args: list[Arg] = [
        ("--multi-latent-attention",),
        ("--kv-lora-rank", str(spec.kv_lora_rank)),
        ("--qk-head-dim", str(spec.qk_nope_head_dim)),
        ("--qk-pos-emb-head-dim", str(spec.qk_rope_head_dim)),
        ("--v-head-dim", str(spec.v_head_dim)),
        ("--rope-type", "rope"),
    ]
    if spec.q_lora_rank is not None:
        args.insert(1, ("--q-lora-rank", str(spec.q_lora_rank)))
    return args


MOE_BALANCING_NOTE = (
    "the routers' load balancing is not set here: keep your script's "
    "--moe-router-load-balancing-type and --moe-aux-loss-coeff (Megatron-LM's defaults, "
    "aux_loss at coefficient 0.0, balance nothing); the planner prices every choice alike"
)


def _moe_args(spec: ModelSpec) -> list[Arg]:
    """The zoo's MoE: softmax over the top-k logits (Megatron's default order, the same
    weights as renormalised top-k softmax probabilities), dropless (no capacity factor),
    grouped GEMM experts and all-to-all dispatch. The router's load balancing is left to
    the training script (:data:`MOE_BALANCING_NOTE`): priced alike, it is a training
    choice, and a value here would override the script's when merged."""
    args: list[Arg] = [
        ("--num-experts", str(spec.num_experts)),
        ("--moe-router-topk", str(spec.top_k)),
        ("--moe-ffn-hidden-size", str(spec.expert_ffn_size)),
    ]
    if spec.num_shared_experts:
        width = spec.num_shared_experts * spec.expert_ffn_size
        args.append(("--moe-shared-expert-intermediate-size", str(width)))
    if spec.dense_layers:
        moe_layers = spec.num_layers - spec.dense_layers
        args.append(("--moe-layer-freq", f"([0]*{spec.dense_layers}+[1]*{moe_layers})"))
    return [
        *args,
        ("--moe-router-score-function", "softmax"),
        ("--moe-grouped-gemm",),
        ("--moe-token-dispatcher-type", "alltoall"),
    ]


def _recompute_args(plan: Plan) -> list[Arg]:
    mode = plan.strategy.recompute
    limit = plan.strategy.recompute_blocks
    if mode is RecomputeMode.NONE:
        return []
    if mode is RecomputeMode.SELECTIVE:
        return [("--recompute-granularity", "selective")]
    method = ("--recompute-method", "uniform") if limit is None else ("--recompute-method", "block")
    layers = "1" if limit is None else str(limit)
    return [("--recompute-granularity", "full"), method, ("--recompute-num-layers", layers)]


def _data_parallel_args(plan: Plan) -> list[Arg]:
    """Sharding, and the overlap the plan was priced with (gradient reduction during
    backward, ZeRO's weight gathers prefetched: Megatron-LM overlaps only when asked)."""
    strategy = plan.strategy
    dims = ParallelDims.of(strategy)
    overlap: list[Arg] = [("--overlap-grad-reduce",)] if dims.replicas > 1 else []
    if strategy.zero == 0:
        return overlap
    if dims.replicas > 1:
        overlap.append(("--overlap-param-gather",))
    args: list[Arg] = [("--use-distributed-optimizer",), *overlap]
    if dims.hybrid_sharding:
        args.append(("--num-distributed-optimizer-instances", str(strategy.replicate_degree)))
    if strategy.zero == 1:
        return args
    return [
        ("--use-megatron-fsdp",),
        ("--data-parallel-sharding-strategy", SHARDING[strategy.zero]),
        *args,
        ("--ckpt-format", "fsdp_dtensor"),
    ]


def _precision_args(plan: Plan) -> list[Arg]:
    """``--bf16``/``--fp16`` and the gradient-reduction dtype (Megatron reduces in fp32
    under bf16, in fp16 under fp16 unless told otherwise)."""
    dtype, kind = plan.training.dtype, plan.strategy.compression.kind
    args = DTYPE_ARGS[dtype]
    if kind is CompressionKind.NONE:
        return args + ([("--accumulate-allreduce-grads-in-fp32",)] if dtype is DType.FP16 else [])
    return args + ([("--grad-reduce-in-bf16",)] if kind is CompressionKind.BF16 else [])


def _optimizer_args(plan: Plan) -> list[Arg]:
    optimizer = plan.training.optimizer
    name = "sgd" if optimizer is Optimizer.SGD else "adam"
    clip = "1.0" if plan.training.grad_clip else "0.0"
    return [("--optimizer", name), ("--clip-grad", clip)]
