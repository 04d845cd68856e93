"""The training frameworks a plan can target, and what each release can run.

One home for "can framework X (release V) run this strategy?": the search restricts
itself with :func:`strategy_refusal` (``plan --for megatron``), and the exporters
refuse with the same :class:`Refusal` (:mod:`planner.export`), so a plan searched for a
target always exports to it. Rules here read the strategy, the training set-up and the
model's spec; what depends on a finished plan (its stage split, its tensor-parallel
layout) stays with the exporter, which the search satisfies by construction for zoo and
spec models (contiguous stages, Megatron-LM's layout).

A target is written ``framework`` or ``framework==version`` (``torchtitan==0.2``,
``megatron==0.16``, ``deepspeed==0.19.6``); without a version it is the newest release
listed in :data:`RELEASES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from planner.errors import SpecError
from planner.parallel_dims import ParallelDims
from planner.spec import (
    Activation,
    CompressionKind,
    DType,
    Family,
    ModelSpec,
    Optimizer,
    RecomputeMode,
    Schedule,
    Strategy,
    Training,
)

if TYPE_CHECKING:
    from planner.cost.options import CostOptions

__all__ = [
    "KERNELS",
    "framework_options",
    "RELEASES",
    "torchtitan_model",
    "Framework",
    "Refusal",
    "Target",
    "PLANNER",
    "experts_beside_sequence_parallel_refusal",
    "expert_tensor_parallel_refusal",
    "compressed_experts_refusal",
    "blockless_chunk_refusal",
    "ddp_blocker",
    "model_refusal",
    "parse_target",
    "pipeline_refusal",
    "context_parallel_refusal",
    "run_refusal",
    "config_refusal",
    "strategy_refusal",
    "training_refusal",
]


class Framework(StrEnum):
    PLANNER = "planner"  # this project's runtime (plan run, planner.parallelize)
    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"


Version = tuple[int, ...]

# Releases whose settings the exporters write, oldest first (major, minor[, patch]).
RELEASES: dict[Framework, tuple[Version, ...]] = {
    Framework.PLANNER: ((0, 1),),
    Framework.TORCHTITAN: ((0, 2), (0, 3)),
    Framework.MEGATRON: ((0, 14), (0, 15), (0, 16)),
    Framework.DEEPSPEED: ((0, 18), (0, 19, 6), (0, 19, 8)),
}
MICS_REMOVED: Version = (0, 19, 7)  # DeepSpeed drops MiCS (mics_shard_size) here

# What each framework's kernels and buffers keep, as CostOptions fields (unlisted: the
# defaults, eager PyTorch; framework_options applies them). This runtime's selective
# recompute keeps every matmul output and recomputes the rest, attention included
# (strategies.checkpointing). Megatron-Core
# on Transformer Engine (its default --transformer-impl) fuses norms and SwiGLU and reads
# grouped K/V as they are; since v0.13 its experts multiply the routing probabilities
# into their activation (experts.py, activation_func_with_probs); in fp8 its linear
# layers are Transformer Engine's (CostOptions.fp8_linear), delayed-scaled unless
# --fp8-recipe says otherwise; its gradients
# accumulate in a main_grad buffer of the reduction's dtype (bf16 under
# --grad-reduce-in-bf16: param_and_grad_buffer.py, group_params_for_buffers), kept
# across steps like DeepSpeed ZeRO's contiguous gradient partitions (grads_persist), and
# under ZeRO-1 are reduce-scattered once per step, not per micro-batch as FSDP2 does,
# and under ZeRO-2 (Megatron-FSDP's optim_grads, as DeepSpeed's) into the partitions
# every micro-batch without gathering the weights again (zero_accumulation);
# DeepSpeed reduces them through buckets of its own (separate_grad_buckets), and without
# ZeRO its engine all-reduces them after backward (ddp_overlap off). torchtitan's
# selective recompute is its per-op policy (selective_ac_option "op"). Optimizer
# steps: this runtime's torch.optim for-loop (strategies.runner, foreach=False),
# torchtitan's default fused AdamW, Megatron-Core's and DeepSpeed's FusedAdam. Context
# parallel attention: this runtime gathers keys and values whole
# (strategies.context_parallel); torchtitan (torch's context_parallel) and Megatron-Core
# (Transformer Engine) pass them around a ring, CostOptions' default. Fused attention:
# PyTorch SDPA's FlashAttention-2, except Megatron-Core's Transformer Engine, which prefers
# cuDNN's kernel on Hopper and later (NVIDIA/NeMo PR 9188, memory_optimizations.rst: "when
# both implementations are applicable, Transformer Engine prefers cuDNN flash attention on
# Hopper+ architectures"). Routed experts: one grouped kernel (torch.bmm, torch._grouped_mm),
# except Megatron-Core's TEGroupedMLP, whose Transformer Engine GroupedLinear launches one
# cuBLAS GEMM per local expert (CostOptions.expert_gemm).
KERNELS: dict[Framework, dict[str, bool | str]] = {
    Framework.PLANNER: {
        "selective": "matmuls", "optimizer_impl": "for-loop", "cp_attention": "all-gather",
    },
    Framework.TORCHTITAN: {"selective": "op", "optimizer_impl": "fused", "ddp_no_sync": False},
    Framework.MEGATRON: {
        "fused_norm_swiglu": True, "gqa_native": True, "moe_probs_in_activation": True,
        "fp8_linear": "te", "fp8_scaling": "delayed", "grads_in_reduce_dtype": True,
        "grads_persist": True, "optimizer_impl": "fused", "flash_impl": "cudnn",
        "expert_gemm": "per-expert", "grad_accumulation": "fused",
        "zero_accumulation": "partitioned",
    },
    Framework.DEEPSPEED: {
        "grads_persist": True, "separate_grad_buckets": True, "optimizer_impl": "fused",
        "ddp_overlap": False, "zero_accumulation": "partitioned",
    },
}  # fmt: skip


def framework_options(framework: Framework, options: CostOptions) -> CostOptions:
    """``options`` with ``framework``'s kernels (:data:`KERNELS`) where they leave them
    unset."""
    kernels = {
        name: value for name, value in KERNELS.get(framework, {}).items()
        if name not in options.model_fields_set
    }  # fmt: skip
    if not kernels:
        return options
    return type(options).model_validate({**options.model_dump(exclude_unset=True), **kernels})


def _show_version(version: Version) -> str:
    return ".".join(str(part) for part in version)


@dataclass(frozen=True)
class Target:
    """A framework and the release its rules and settings describe."""

    framework: Framework
    version: Version

    def __str__(self) -> str:
        if self.framework is Framework.PLANNER:
            return self.framework.value
        return f"{self.framework.value}=={_show_version(self.version)}"

    def at_least(self, version: Version) -> bool:
        return self.version >= version

    @property
    def is_planner(self) -> bool:
        return self.framework is Framework.PLANNER


def parse_target(text: str, *, field: str = "--for") -> Target:
    """``framework`` or ``framework==version`` as a :class:`Target`.

    A version a listed release prefixes keeps its detail (``torchtitan==0.2.2``); one that
    prefixes listed releases means the newest of them (``deepspeed==0.19`` is 0.19.8);
    another between the oldest and the newest listed release is taken as given.
    """
    name, _, wanted = text.strip().partition("==")
    try:
        framework = Framework(name.strip().lower())
    except ValueError:
        known = ", ".join(f.value for f in Framework)
        raise SpecError(
            f"{field} = {text!r}: unknown framework {name.strip()!r}; use one of {known}"
        ) from None
    releases = RELEASES[framework]
    if not wanted:
        return Target(framework, releases[-1])
    version = _parse_version(wanted, text, field)
    newer = [r for r in releases if r[: len(version)] == version]
    if newer:
        return Target(framework, newer[-1])
    if releases[0] <= version <= releases[-1] + (999,):
        return Target(framework, version)
    listed = ", ".join(_show_version(r) for r in releases)
    raise SpecError(
        f"{field} = {text!r}: {framework.value} {wanted} is outside the releases the planner "
        f"writes settings for ({listed}); use one of those"
    )


def _parse_version(wanted: str, text: str, field: str) -> Version:
    try:
        version = tuple(int(part) for part in wanted.strip().split("."))
    except ValueError:
        raise SpecError(
            f"{field} = {text!r}: version {wanted!r} is not dotted numbers; write e.g. "
            "'torchtitan==0.3'"
        ) from None
    if not version or len(version) > 3:
        raise SpecError(f"{field} = {text!r}: write the version as MAJOR.MINOR[.PATCH]")
    return version


@dataclass(frozen=True)
class Refusal:
    """Why a target cannot run something: the field, its value, why, and what to change."""

    field: str
    value: object
    why: str
    fix: str

    def describe(self) -> str:
        value = self.value.value if isinstance(self.value, StrEnum) else self.value
        return f"{self.field} = {value!r}: {self.why}"


Rule = Callable[[Target, Strategy, Training], Refusal | None]


PLANNER = Target(Framework.PLANNER, RELEASES[Framework.PLANNER][-1])  # this runtime


def experts_beside_sequence_parallel_refusal(
    target: Target, *, ep: int, sequence_parallel: bool, traced: bool = False
) -> Refusal | None:
    """Why ``target`` cannot run expert parallelism beside sequence parallelism, or
    ``None``. Megatron-Core routes each rank's sequence shard as it is (the layout the
    cost model prices: no tp collective around the routed experts). This runtime's
    experts take the tokens replicated over tp and split them there; torchtitan gathers
    the MoE layer's input over tp and reduce-scatters its output, which is not priced.
    The fix names Megatron-LM where it builds the model (``traced``: a traced module)."""
    if ep == 1 or not sequence_parallel or target.framework is Framework.MEGATRON:
        return None
    why = {
        Framework.PLANNER: "this runtime's experts take their tokens replicated over the tp "
        "ranks and split them there",
        Framework.TORCHTITAN: "torchtitan gathers the MoE layer's input over tp and "
        "reduce-scatters its output, a layout this planner does not price",
    }.get(target.framework, f"{target.framework.value} runs no expert parallelism")
    megatron = Target(Framework.MEGATRON, RELEASES[Framework.MEGATRON][-1])
    builds = not traced or model_refusal(megatron, None) is None
    return Refusal(
        "strategy.sequence_parallel", True, f"beside ep({ep}) > 1: {why}",
        "turn sequence parallelism off" + (", or target megatron" if builds else ""),
    )  # fmt: skip


def _experts_beside_sequence_parallel(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    return experts_beside_sequence_parallel_refusal(
        target, ep=strategy.ep, sequence_parallel=strategy.sequence_parallel
    )


def expert_tensor_parallel_refusal(target: Target, *, ep: int, etp: int, tp: int) -> Refusal | None:
    """Why ``target`` cannot split each expert over ``etp`` ranks beside ``ep``, or
    ``None``. The cost model prices Megatron-Core's expert tensor parallelism (any
    ``etp``; :class:`~planner.parallel_dims.ParallelDims` states the layout)."""
    if etp == 1 or target.framework is Framework.MEGATRON:
        return None
    why = {
        Framework.PLANNER: "this runtime keeps each expert whole on the rank that holds it",
        Framework.TORCHTITAN: (
            "torchtitan 0.3 has no expert tensor parallelism, and 0.2's (etp = tp only) "
            "shards the experts with DTensor over the tp mesh, a layout this planner does "
            "not price"
            if etp == tp
            else f"torchtitan runs expert tensor parallelism only at etp = tp ({tp}) or 1"
        ),
    }.get(target.framework, f"{target.framework.value} runs no expert tensor parallelism")
    return Refusal(
        "strategy.etp", etp, f"beside ep({ep}): {why}", "re-plan with --etp 1, or target megatron"
    )


def compressed_experts_refusal(target: Target, *, ep: int, kind: CompressionKind) -> Refusal | None:
    """Why ``target`` cannot reduce expert gradients (``ep > 1``) with compression
    ``kind``, or ``None``: this planner's runtime reduces them as they are; Megatron-Core
    reduces them in its main_grad buffer's dtype, as it does the dense ones (torchtitan
    reduces in fp32 only, DeepSpeed exports no EP: their own rules say so)."""
    if ep == 1 or not kind.lossy or target.framework is not Framework.PLANNER:
        return None
    return Refusal(
        "strategy.compression.kind",
        kind,
        f"with ep({ep}) > 1, this planner's expert-parallel runtime reduces the expert "
        "gradients uncompressed",
        "use compression 'none' or ep = 1, or target megatron (bf16 reduction)",
    )


def _runner(target: Target) -> str:
    return "this runtime" if target.is_planner else str(target)


def blockless_chunk_refusal(target: Target) -> Refusal | None:
    """Why ``target`` cannot run a pipeline chunk that holds no transformer block (the
    embedding or the final norm and head alone), or ``None``. Megatron-LM lays one out
    (``--pipeline-model-parallel-layout``, or ``--account-for-embedding/loss-in-pipeline-
    split``) and torchtitan builds one from ``module_fqns_per_model_part``; this runtime
    starts and ends each stage at a block (:func:`planner.staging.install_stage_forward`)."""
    if target.framework in (Framework.MEGATRON, Framework.TORCHTITAN):
        return None
    return Refusal(
        "plan.stages",
        "a chunk without a block",
        f"{_runner(target)} starts and ends each pipeline stage at a transformer block",
        "give every chunk a block (fewer pp x virtual_stages: a plan for this runtime), or "
        "run the plan with megatron or torchtitan",
    )


def ddp_blocker(target: Target, dims: ParallelDims, *, tied: bool) -> str | None:
    """Why plain data parallelism (ZeRO-0) cannot replicate ``dims`` for ``target``, or
    ``None``: this runtime's DDP rule (:meth:`ParallelDims.ddp_blocker`); the frameworks
    run their own plain data parallelism (Megatron-LM's under a pipeline too)."""
    return dims.ddp_blocker(tied=tied) if target.is_planner else None


def _expert_tensor_parallel(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    return expert_tensor_parallel_refusal(target, ep=strategy.ep, etp=strategy.etp, tp=strategy.tp)


def strategy_refusal(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    """The first reason ``target`` cannot run ``strategy`` with ``training``, or ``None``."""
    for rule in _RULES[target.framework]:
        refusal = rule(target, strategy, training)
        if refusal is not None:
            return refusal
    return None


def other_takers(
    target: Target, spec: ModelSpec | None, strategy: Strategy, training: Training
) -> list[Framework]:
    """The other frameworks whose latest release builds the model (``spec``: None for a
    traced module) and runs ``strategy`` with ``training`` as it is, this runtime last."""
    order = (Framework.TORCHTITAN, Framework.MEGATRON, Framework.DEEPSPEED, Framework.PLANNER)
    return [
        framework for framework in order
        if framework is not target.framework
        and _takes(Target(framework, RELEASES[framework][-1]), spec, strategy, training)
    ]  # fmt: skip


def _takes(target: Target, spec: ModelSpec | None, strategy: Strategy, training: Training) -> bool:
    return run_refusal(target, spec, strategy, training) is None


def run_refusal(
    target: Target, spec: ModelSpec | None, strategy: Strategy, training: Training
) -> Refusal | None:
    """The first reason ``target`` cannot build the model or run ``strategy`` with
    ``training`` (:func:`model_refusal`, :func:`pipeline_refusal`, :func:`strategy_refusal`)."""
    return (
        model_refusal(target, spec)
        or pipeline_refusal(target, spec, strategy.pp)
        or context_parallel_refusal(target, spec, strategy.cp)
        or strategy_refusal(target, strategy, training)
    )


def config_refusal(
    target: Target | Framework, spec: ModelSpec | None, strategy: Strategy, training: Training
) -> Refusal | None:
    """Why a config of ``target`` describes a run it refuses (:func:`run_refusal`), or
    ``None``; a :class:`Framework` alone (its release unknown, as in a Megatron-LM command
    or a DeepSpeed config): only a run every listed release refuses, the newest's reason."""
    if isinstance(target, Target):
        return run_refusal(target, spec, strategy, training)
    refusals = [
        run_refusal(Target(target, version), spec, strategy, training)
        for version in RELEASES[target]
    ]
    return refusals[-1] if all(refusals) else None


def model_refusal(target: Target, spec: ModelSpec | None) -> Refusal | None:
    """Why ``target`` cannot build the model (``spec``: None for a traced module)."""
    if target.framework in (Framework.TORCHTITAN, Framework.MEGATRON) and spec is None:
        return Refusal(
            "model",
            "a traced module",
            f"{target.framework.value} builds its own transformer from a model description, "
            "and this model has none (zoo presets and ModelSpec files have one; a module or "
            "a Hugging Face config is traced)",
            "plan a zoo preset or a ModelSpec file of the same shape, or target planner or "
            "deepspeed",
        )
    if target.framework is Framework.TORCHTITAN and spec is not None:
        return _torchtitan_model(spec)
    if target.framework is Framework.MEGATRON and spec is not None:
        if spec.top_k == 1:
            return Refusal(
                "plan.model.top_k",
                spec.top_k,
                "Megatron-LM routes one expert per token only with --moe-router-pre-softmax "
                "(the weight is the expert's probability), while the zoo renormalises it to 1",
                "use top_k >= 2, or target torchtitan or planner",
            )
        if spec.family is Family.ENCODER:
            return Refusal(
                "plan.model.family",
                spec.family,
                "Megatron-LM's GPT arguments describe decoders",
                "target deepspeed or planner for an encoder",
            )
        if not spec.rope_theta.is_integer():
            return Refusal(
                "plan.model.rope_theta",
                spec.rope_theta,
                "--rotary-base takes an integer",
                "use an integral rope_theta",
            )
    return None


def pipeline_refusal(target: Target, spec: ModelSpec | None, pp: int) -> Refusal | None:
    """Why ``target`` cannot cut ``spec``'s model into ``pp`` pipeline stages, or ``None``.
    torchtitan 0.2's ``qwen3`` has no pipelining (its TrainSpec's ``pipelining_fn`` is
    None: ``train.py`` stops at pp > 1); 0.3's has one. A traced model's pipeline is this
    runtime's (:func:`planner.modules.pipeline_blocker`)."""
    if pp == 1 or target.framework is not Framework.TORCHTITAN or target.at_least((0, 3)):
        return None
    if spec is None or torchtitan_model(spec) != "qwen3":
        return None
    return Refusal(
        "strategy.pp",
        pp,
        f"{target} builds this model as its qwen3 (routed experts, query/key norms, a "
        "head dim other than hidden / heads or a tied head), which has no pipelining "
        "(TrainSpec pipelining_fn=None)",
        "use pp = 1, or target torchtitan==0.3",
    )


def context_parallel_refusal(target: Target, spec: ModelSpec | None, cp: int) -> Refusal | None:
    """Why ``target`` cannot split ``spec``'s sequences over ``cp`` ranks, or ``None``.
    torchtitan 0.2's context parallelism takes SDPA attention only, and its deepseek_v3
    flavors of real size (16B, 236B, 671B) run FlexAttention (``attn_type="flex"``;
    ``parallelize_deepseekv3`` raises at cp > 1); 0.3's takes FlexAttention too."""
    if cp == 1 or target.framework is not Framework.TORCHTITAN or target.at_least((0, 3)):
        return None
    if spec is None or torchtitan_model(spec) != "deepseek_v3":
        return None
    return Refusal(
        "strategy.cp", cp,
        f"{target} builds this model as its deepseek_v3, whose flavors run FlexAttention, "
        "and its context parallelism takes SDPA attention only (parallelize_deepseekv3)",
        "use cp = 1, or target torchtitan==0.3",
    )  # fmt: skip


def torchtitan_model(spec: ModelSpec) -> str:
    """torchtitan's model (its ``models/`` package, 0.2 and 0.3) built like ``spec``:
    ``deepseek_v3`` for latent attention (with shared experts and leading dense blocks);
    ``qwen3`` for grouped-query attention with routed experts, per-head query/key norms,
    a head dim other than hidden / heads or a head tied to the embedding (its
    ``head_dim``, ``qk_norm`` and ``enable_weight_tying``); else ``llama3``."""
    if spec.latent_attention:
        return "deepseek_v3"
    wide_heads = spec.head_size * spec.num_heads != spec.hidden_size
    if spec.moe or spec.qk_norm or wide_heads or spec.tied_embeddings:
        return "qwen3"
    return "llama3"


def _torchtitan_model(spec: ModelSpec) -> Refusal | None:
    for name, shown, llama_style in (
        ("plan.model.family", spec.family, spec.family is Family.LLAMA),
        ("plan.model.activation", spec.act, spec.act is Activation.SWIGLU),
    ):
        if not llama_style:
            return Refusal(
                name,
                shown,
                "torchtitan's models are Llama-style decoders (RMSNorm, SwiGLU, rotary "
                "positions, no biases: llama3, qwen3, deepseek_v3)",
                "target megatron (decoders), deepspeed or planner",
            )
    if torchtitan_model(spec) != "qwen3":
        return None
    for field, value in (
        ("plan.model.num_shared_experts", spec.num_shared_experts),
        ("plan.model.dense_layers", spec.dense_layers),
    ):
        if value:
            return Refusal(
                field,
                value,
                "torchtitan's MoE model with grouped-query attention (qwen3) has neither "
                "shared experts nor leading dense blocks, and the one with them "
                "(deepseek_v3) has latent attention",
                "target megatron or planner",
            )
    return None


def training_refusal(target: Target, training: Training) -> Refusal | None:
    """Why ``target`` cannot train ``training`` whatever the strategy, or ``None``. Pure
    bf16 training (``training.param_dtype = bf16``) is torchtitan's ``training.dtype =
    "bfloat16"``; the others keep an fp32 copy. This runtime computes in bf16 or fp32
    only: it has no fp8 GEMMs (an fp8 plan would run in fp32) and no loss scaling (fp16
    gradients underflow without it)."""
    if target.is_planner and training.dtype in _NOT_RUN_HERE:
        return Refusal(
            "training.dtype", training.dtype,
            f"this runtime {_NOT_RUN_HERE[training.dtype]}",
            "re-plan with --dtype bf16 (or fp32), or plan for a framework that runs it "
            f"(--for {_RUN_ELSEWHERE[training.dtype]})",
        )  # fmt: skip
    if training.param_dtype is DType.FP32 or target.framework is Framework.TORCHTITAN:
        return None
    why = {
        Framework.PLANNER: "this runtime keeps fp32 parameters and optimizer states and "
        "computes in the training dtype (FSDP2's MixedPrecisionPolicy, torch.autocast)",
        Framework.MEGATRON: "Megatron-LM keeps fp32 main parameters and gradients beside "
        "its --bf16 compute",
        Framework.DEEPSPEED: "DeepSpeed's bf16 mode keeps fp32 master weights and optimizer "
        "states in ZeRO's optimizer",
    }[target.framework]
    return Refusal(
        "training.param_dtype", training.param_dtype, f"pure bf16 training: {why}",
        "re-plan with --param-dtype fp32, or target torchtitan",
    )  # fmt: skip


_RUN_ELSEWHERE = {  # torchtitan and Megatron-LM build the model: a zoo preset or ModelSpec
    DType.FP8: "torchtitan==0.2 or megatron, with a zoo preset or ModelSpec file",
    DType.FP16: "deepspeed, or megatron with a zoo preset or ModelSpec file",
}
_NOT_RUN_HERE = {
    DType.FP8: "has no fp8 GEMMs (torchao's Float8Linear is not applied): the plan would run "
    "in fp32, unlike what was priced",
    DType.FP16: "has no loss scaling, without which fp16 gradients underflow and the model "
    "trains wrong",
}


def _kept_precision(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    return training_refusal(target, training)


def _zero_bubble_sharded_weights(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    """This runtime's zero-bubble schedule (torch's ScheduleInterleavedZeroBubble, backward
    split into input- and weight-gradient passes) over FSDP2 stages that reshard their
    weights (ZeRO-3) trains wrong: 3 steps of tiny-llama at pp 2 x dp 2 differed from one
    process by 2.5e-2 in loss, while ZeRO-2 matched. Under a pipeline ZeRO-2 costs what
    ZeRO-3 does (weights stay gathered between micro-batches)."""
    if strategy.pp == 1 or strategy.schedule is not Schedule.ZERO_BUBBLE or strategy.zero < 3:
        return None
    return Refusal(
        "strategy.zero", 3,
        "this runtime's zero-bubble schedule over ZeRO-3 stages trains wrong (the weight-"
        "gradient pass runs after FSDP2 resharded the weights)",
        "use --zero 2 (the same cost under a pipeline), or --schedule 1f1b or interleaved-1f1b",
    )  # fmt: skip


def _uncompressed_experts(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    return compressed_experts_refusal(target, ep=strategy.ep, kind=strategy.compression.kind)


# Rules every foreign framework shares.


def _hook_compression(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    """PowerSGD, local SGD (DDP hooks) and the int8 reduce-scatter (an FSDP2 custom
    reduce-scatter) run only as this planner's communication hooks."""
    compression = strategy.compression
    if compression.kind not in (
        CompressionKind.POWERSGD, CompressionKind.LOCAL_SGD, CompressionKind.INT8
    ):  # fmt: skip
        return None
    return Refusal(
        "strategy.compression.kind",
        compression.kind,
        f"{compression.describe()} changes the gradients the optimizer sees and runs only as "
        f"this planner's communication hook, which {target.framework.value} has no setting for",
        "use compression 'none', 'bf16' or 'fp16', or run the plan with 'plan run'",
    )


def _uniform_recompute(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    modes = {strategy.recompute_for_stage(stage) for stage in range(strategy.pp)}
    if len(modes) == 1:
        return None
    return Refusal(
        "strategy.recompute_per_stage",
        strategy.recompute_per_stage,
        f"{target.framework.value} applies one recompute mode to every pipeline stage",
        "re-plan with one --recompute mode for all stages",
    )


# torchtitan (0.2: torchtitan/config/job_config.py; 0.3: torchtitan/config/configs.py,
# torchtitan/trainer.py; both: torchtitan/distributed/parallel_dims.py).

TORCHTITAN_OVERRIDES: Version = (0, 3)  # config by Python function + tyro overrides, no TOML
TORCHTITAN_PARAM_DTYPES = {DType.BF16: "bfloat16", DType.FP8: "bfloat16", DType.FP32: "float32"}


def torchtitan_shards(strategy: Strategy) -> bool:
    """Whether torchtitan applies ``fully_shard`` (a dp_shard or cp axis larger than 1)."""
    return strategy.shard_degree > 1 or strategy.cp > 1


def _torchtitan_data_parallel(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    if strategy.zero == 0 and strategy.cp > 1:
        return Refusal(
            "strategy.zero",
            0,
            f"torchtitan shards the weights over dp_shard x cp whenever cp ({strategy.cp}) > 1, "
            "so replicated weights cannot be expressed",
            "re-plan with --zero 1, 2 or 3",
        )
    if strategy.zero == 1 and torchtitan_shards(strategy):
        return Refusal(
            "strategy.zero",
            1,
            "torchtitan has no ZeRO-1: FSDP without resharding (fsdp_reshard_after_forward = "
            "'never') still reduce-scatters the gradients every micro-batch and keeps them "
            "sharded, which is ZeRO-2 (less gradient memory, a reduction per micro-batch)",
            "re-plan with --zero 2 (what torchtitan runs) or 3",
        )
    others = strategy.tp * strategy.pp * strategy.cp
    if strategy.zero == 0 and strategy.dp > 1 and others > 1:
        return Refusal(
            "strategy.zero",
            0,
            f"torchtitan's DDP (data_parallel_replicate_degree = {strategy.dp} without "
            f"sharding) runs only on a one-dimensional mesh, and tp * pp * cp = {others}",
            "re-plan with --zero 1, 2 or 3 (FSDP/HSDP)",
        )
    return None


def _torchtitan_precision(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    dtype = training.dtype
    if dtype is DType.FP8 and target.at_least(TORCHTITAN_OVERRIDES):
        return Refusal(
            "training.dtype",
            dtype,
            f"torchtitan {_show_version(target.version)} converts Linear layers to fp8 in the "
            "--config function's model_spec (Float8LinearConverter), which command-line "
            "overrides cannot set",
            "target torchtitan==0.2, or re-plan with --dtype bf16 and run it under a --config "
            "whose model_spec has Float8LinearConverter",
        )
    if dtype not in TORCHTITAN_PARAM_DTYPES:
        return Refusal(
            "training.dtype",
            dtype,
            "training.mixed_precision_param takes only bfloat16 or float32",
            "re-plan with --dtype bf16",
        )
    kind = strategy.compression.kind
    if kind in (CompressionKind.BF16, CompressionKind.FP16):
        return Refusal(
            "strategy.compression.kind",
            kind,
            "training.mixed_precision_reduce takes only float32",
            "use compression 'none' (float32 reduction), or export to megatron or deepspeed",
        )
    lowered = training.master_copy  # pure bf16 keeps its parameters in bf16 throughout
    if lowered and not torchtitan_shards(strategy) and (strategy.tp > 1 or strategy.pp > 1):
        return Refusal(
            "training.dtype",
            dtype,
            "torchtitan applies mixed precision through FSDP when tp or pp is on, and this plan "
            f"shards over nothing (dp_shard {strategy.shard_degree}, cp {strategy.cp}): it "
            "would train in float32",
            "re-plan with --zero 1, 2 or 3 and dp_shard > 1, or --dtype fp32",
        )
    return None


def _torchtitan_tensor_parallel(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    """0.2 always shards the norms on the sequence; 0.3 has
    ``parallelism.enable_sequence_parallel``."""
    if strategy.tp == 1 or strategy.sequence_parallel or target.at_least(TORCHTITAN_OVERRIDES):
        return None
    return Refusal(
        "strategy.sequence_parallel",
        False,
        f"torchtitan {_show_version(target.version)}'s tensor-parallel plan always shards the "
        "norms on the sequence",
        "re-plan with --sequence-parallel, or target torchtitan==0.3"
        if strategy.ep == 1  # experts beside sequence parallelism: Megatron-LM only
        else "target torchtitan==0.3, or re-plan with tp 1 beside the experts",
    )


def _torchtitan_expert_parallel(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    """torchtitan carves EP groups from its FSDP region (``efsdp = dp_shard * cp * tp /
    ep``, ``parallel_dims.py``), so experts need ZeRO's sharding, as our layout under
    ZeRO >= 1; :meth:`ParallelDims.expert_blocker` checks the divisibility."""
    if strategy.ep == 1 or strategy.zero >= 1:
        return None
    return Refusal(
        "strategy.zero",
        0,
        f"torchtitan splits experts (ep = {strategy.ep}) over the ranks FSDP shards over "
        "(dp_shard x cp x tp), and replicated (DDP) weights shard over none",
        "re-plan with --zero 1, 2 or 3",
    )


def _torchtitan_optimizer(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    if training.optimizer in (Optimizer.ADAMW, Optimizer.ADAM):
        return None
    return Refusal(
        "training.optimizer",
        training.optimizer,
        "torchtitan builds Adam and AdamW only",
        "re-plan with --optimizer adamw, or export to megatron or deepspeed",
    )


# Megatron-LM (megatron/training/arguments.py).

MEGATRON_VOCAB_MULTIPLE = 128  # --make-vocab-size-divisible-by's default


def megatron_padded_vocab(size: int, divisible_by: int, tp: int) -> int:
    """The vocabulary Megatron-LM builds for ``--vocab-size size``: padded to a multiple of
    ``--make-vocab-size-divisible-by x tp`` (``_vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return -(-size // multiple) * multiple


def megatron_vocab_multiple(size: int, tp: int) -> int:
    """The largest ``--make-vocab-size-divisible-by`` up to the default under which
    Megatron-LM builds ``size`` tokens unpadded at ``tp`` (``tp`` divides ``size``, as the
    search requires): the vocabulary the plan priced."""
    return math.gcd(size // tp, MEGATRON_VOCAB_MULTIPLE)


MEGATRON_HALF_REDUCTION = {  # the 2-byte gradient reduction Megatron-LM offers under each dtype
    DType.BF16: CompressionKind.BF16,
    DType.FP8: CompressionKind.BF16,
    DType.FP16: CompressionKind.FP16,
}


def _megatron_schedule(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    if strategy.pp == 1 or strategy.schedule not in (Schedule.GPIPE, Schedule.ZERO_BUBBLE):
        return None
    return Refusal(
        "strategy.schedule",
        strategy.schedule,
        "Megatron-LM runs 1F1B, interleaved when the model has virtual pipeline stages "
        "(in-flight micro-batches, so memory, differ from this schedule)",
        "re-plan with --schedule 1f1b or interleaved-1f1b",
    )


def _megatron_expert_parallel(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    if strategy.ep == 1 or strategy.tp == 1 or strategy.sequence_parallel:
        return None
    return Refusal(
        "strategy.sequence_parallel",
        False,
        f"Megatron-LM's MoE layer refuses to train with tp({strategy.tp}) > 1 but no "
        "sequence parallelism (moe_layer.py)",
        "re-plan with --sequence-parallel, or --tp 1",
    )


def _megatron_interleaving(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    """Megatron-Core's interleaved schedule takes micro-batches in groups of pp
    (microbatch_group_size_per_vp_stage, default pp) and raises on a remainder
    (forward_backward_pipelining_with_interleaving): the search's rule."""
    if strategy.schedule is not Schedule.INTERLEAVED_1F1B:
        return None
    blocker = ParallelDims(pp=strategy.pp).schedule_blocker(
        strategy.schedule, strategy.num_microbatches
    )
    if blocker is None:
        return None
    return Refusal(
        "strategy.num_microbatches", strategy.num_microbatches,
        f"Megatron-LM's interleaved schedule runs micro-batches in groups of pp({strategy.pp}) "
        "and raises on fewer or a remainder",
        f"use a multiple of pp({strategy.pp}) micro-batches (the global batch over micro-batch "
        "x dp), or no virtual pipeline stages",
    )  # fmt: skip


def _megatron_expert_precision(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    if strategy.ep == 1 or training.dtype is not DType.FP16:
        return None
    return Refusal(
        "training.dtype", training.dtype,
        f"Megatron-LM refuses expert parallelism (ep {strategy.ep}) with fp16 training "
        "(validate_args)",
        "train in bf16, or use ep = 1",
    )  # fmt: skip


def _megatron_recompute(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    if strategy.recompute is RecomputeMode.SELECTIVE and strategy.recompute_blocks is not None:
        return Refusal(
            "strategy.recompute_blocks",
            strategy.recompute_blocks,
            "Megatron-LM's selective recompute covers every layer",
            "drop recompute_blocks, or use recompute 'full'",
        )
    return None


def _megatron_precision(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    dtype, kind = training.dtype, strategy.compression.kind
    reduce_dtype = MEGATRON_HALF_REDUCTION.get(dtype)
    if kind in (CompressionKind.NONE, reduce_dtype):
        return None
    return Refusal(
        "strategy.compression.kind",
        kind,
        f"Megatron-LM reduces gradients in fp32 or in the training dtype ({dtype.value}), "
        f"not in {kind.value}",
        "use compression 'none'" + (f" or '{reduce_dtype.value}'" if reduce_dtype else ""),
    )


def _megatron_optimizer(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    if training.optimizer is not Optimizer.ADAM:
        return None
    return Refusal(
        "training.optimizer",
        training.optimizer,
        "Megatron-LM's 'adam' decouples weight decay (AdamW)",
        "re-plan with --optimizer adamw",
    )


# DeepSpeed (deepspeed/runtime/config.py, deepspeed/runtime/zero/config.py).


def _deepspeed_model_parallel(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    ways = {
        "strategy.tp": (strategy.tp, "tensor parallelism (AutoTP is set up in code and shards "
                        "only linear layers)"),
        "strategy.pp": (strategy.pp, "pipeline parallelism (PipelineModule is built in code)"),
        "strategy.cp": (strategy.cp, "context parallelism (Ulysses is set up in code)"),
    }  # fmt: skip
    for field, (size, what) in ways.items():
        if size > 1:
            return Refusal(
                field,
                size,
                f"a DeepSpeed config cannot express {what}",
                "re-plan with --tp 1 --pp 1 --cp 1",
            )
    return None


def _deepspeed_expert_parallel(
    target: Target, strategy: Strategy, training: Training
) -> Refusal | None:
    if strategy.ep == 1:
        return None
    return Refusal(
        "strategy.ep",
        strategy.ep,
        "DeepSpeed-MoE takes ep_size in model code (deepspeed.moe.layer.MoE(ep_size=...)), "
        "and the config's expert_parallel section (AutoEP, 0.19.6 on) swaps in its own MoE "
        "layers found by module-name presets, which this export does not map the plan onto",
        "re-plan with --ep 1",
    )


def _deepspeed_recompute(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    if strategy.recompute is RecomputeMode.NONE:
        return None
    return Refusal(
        "strategy.recompute",
        strategy.recompute,
        "a DeepSpeed config cannot switch recompute on (activation_checkpointing only "
        "configures deepspeed.checkpointing.checkpoint, which the model code must call)",
        "re-plan with --recompute none",
    )


def _deepspeed_precision(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    if training.dtype is not DType.FP8:
        return None
    return Refusal(
        "training.dtype",
        training.dtype,
        "the DeepSpeed config has no fp8 training switch",
        "re-plan with --dtype bf16",
    )


def _deepspeed_sharding(target: Target, strategy: Strategy, training: Training) -> Refusal | None:
    if not ParallelDims.of(strategy).hybrid_sharding:
        return None
    if target.at_least(MICS_REMOVED):
        return Refusal(
            "strategy.dp_shard",
            strategy.shard_degree,
            f"DeepSpeed {_show_version(target.version)} partitions over all {strategy.dp} "
            f"data-parallel ranks (MiCS, which sharded in groups, was removed in "
            f"{_show_version(MICS_REMOVED)})",
            "re-plan with --dp-shard equal to --dp, or target deepspeed==0.19.6",
        )
    if strategy.zero < 3:
        return Refusal(
            "strategy.dp_shard",
            strategy.shard_degree,
            f"DeepSpeed ZeRO-{strategy.zero} partitions over all {strategy.dp} data-parallel "
            "ranks (MiCS groups, mics_shard_size, need ZeRO-3)",
            "re-plan with --dp-shard equal to --dp, or --zero 3",
        )
    return None


_COMMON: tuple[Rule, ...] = (_hook_compression, _uniform_recompute)
_RULES: dict[Framework, tuple[Rule, ...]] = {
    Framework.PLANNER: (  # strategies.apply asks
        _kept_precision, _experts_beside_sequence_parallel, _expert_tensor_parallel,
        _uncompressed_experts, _zero_bubble_sharded_weights,
    ),
    Framework.TORCHTITAN: (
        *_COMMON, _torchtitan_data_parallel, _torchtitan_precision, _torchtitan_tensor_parallel,
        _torchtitan_expert_parallel, _experts_beside_sequence_parallel, _expert_tensor_parallel,
        _torchtitan_optimizer,
    ),
    Framework.MEGATRON: (
        *_COMMON, _kept_precision, _megatron_schedule, _megatron_interleaving,
        _megatron_expert_parallel, _megatron_expert_precision, _megatron_recompute,
        _megatron_precision, _megatron_optimizer,
    ),
    Framework.DEEPSPEED: (
        *_COMMON, _kept_precision, _deepspeed_model_parallel, _deepspeed_expert_parallel, _deepspeed_recompute, _deepspeed_precision,
        _deepspeed_sharding,
    ),
}  # fmt: skip
