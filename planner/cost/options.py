"""Software facts the cost model cannot read from the graph or the hardware profile.

These describe the training *implementation* (which attention kernel, what overlaps
what, which dtype gradients are reduced in), not the hardware, so one hardware profile
serves every framework. Defaults describe a current PyTorch/Megatron stack on GPUs;
:func:`device_options` gives what a device's own runtime does where no options are
given (a CPU has no GPU workspace, no caching allocator's slack and no streams).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.parallel_dims import ParallelDims
from planner.spec import Strategy

__all__ = [
    "AttentionKernel",
    "CpAttention",
    "FlashImpl",
    "SelectivePolicy",
    "RecomputeModule",
    "ExpertChoice",
    "Fp8Linear",
    "Fp8Scaling",
    "OptimizerImpl",
    "GradAccumulation",
    "ZeroAccumulation",
    "ExpertGemm",
    "CostOptions",
    "DDP_BUCKET_MIB",
    "device_options",
]

DDP_BUCKET_MIB = 25.0  # torch.nn.parallel.DistributedDataParallel bucket_cap_mb default


class AttentionKernel(StrEnum):
    FLASH = "flash"  # fused kernel; scores never reach memory; causal skips half the work
    UNFUSED = "unfused"  # scores materialised: batched GEMMs + softmax + dropout in memory


class FlashImpl(StrEnum):
    """Which fused attention kernel a flash run calls (the profile prices each)."""

    # FlashAttention-2, as PyTorch SDPA's flash backend and flash-attn 2 run it
    SDPA = "sdpa"
    # cuDNN fused attention, which Transformer Engine prefers on Hopper and later
    # (Megatron-Core, NeMo): of the FlashAttention-3 class there
    CUDNN = "cudnn"


class CpAttention(StrEnum):
    """How context-parallel attention meets the other ranks' keys and values
    (:mod:`planner.cost.context_parallel` prices each)."""

    ALL_GATHER = "all-gather"  # gathered whole, masked SDPA per chunk (this runtime)
    RING = "ring"  # cp causal-balanced steps, fp32 merges (torch context_parallel, TE)


class SelectivePolicy(StrEnum):
    ATTENTION = "attention"  # recompute the attention core (Korthikanti et al., Megatron)
    OP = "op"  # save every other matmul output and attention; recompute the rest (torchtitan)
    # save every matmul output; recompute the rest, attention included (this runtime:
    # strategies.checkpointing)
    MATMULS = "matmuls"
    MODULES = "modules"  # Megatron-Core's --recompute-modules: the ones in recompute_modules


class RecomputeModule(StrEnum):
    """Megatron-Core's fine-grained recompute modules (``--recompute-modules``)."""

    CORE_ATTN = "core_attn"  # the attention core
    LAYERNORM = "layernorm"  # the block's norms: each keeps only its input
    MOE_ACT = "moe_act"  # the experts' activation: the second expert GEMM's input is not kept
    # latent attention's up-projections, norms and rotary: attention keeps no queries,
    # keys or values (made again from the latents before its backward)
    MLA_UP_PROJ = "mla_up_proj"
    # checkpointed whole, each keeping only its input: a dense block's feed-forward (none
    # in a block with experts) and the shared experts
    MLP = "mlp"
    SHARED_EXPERTS = "shared_experts"


class ExpertChoice(StrEnum):
    """Where a token's ``top_k`` experts lie among the ``num_experts`` (what a
    deduplicating dispatcher's traffic depends on)."""

    # drawn evenly without replacement: learned routing near balance, and Megatron-Core's
    # --moe-router-force-load-balancing (random router logits)
    RANDOM = "random"
    # token t takes experts t*top_k .. t*top_k + top_k - 1 (mod num_experts): NeMo
    # AutoModel's FakeBalancedGate (components/moe/layers.py), used in its benchmarks
    CONTIGUOUS = "contiguous"


class Fp8Linear(StrEnum):
    """Whose fp8 linear layers a run uses: what they cast, when, and what they keep."""

    # torchao's Float8Linear (torchtitan): every GEMM of every micro-batch casts its input
    # and weight (forward), and its output gradient, input and weight (backward); it
    # keeps the bf16 input for backward
    TORCHAO = "torchao"
    # Transformer Engine's Linear (Megatron-Core, NeMo): a GEMM casts its input once, with
    # the transpose its weight gradient needs, and keeps that fp8 copy for backward; the
    # output gradient is cast and transposed once; weights are cast once per step (the
    # first micro-batch's, cached for the rest)
    TRANSFORMER_ENGINE = "te"


class Fp8Scaling(StrEnum):
    """Where an fp8 cast's scale comes from."""

    # the tensor's own amax, read in a pass of its own before the cast: torchao's
    # default, Transformer Engine's current scaling (Megatron's --fp8-recipe tensorwise)
    DYNAMIC = "dynamic"
    # the amax history of earlier steps: no extra pass (Transformer Engine's
    # DelayedScaling, Megatron's default --fp8-recipe delayed)
    DELAYED = "delayed"


class OptimizerImpl(StrEnum):
    """How the optimizer step runs (torch.optim's implementations, torchtitan's
    ``optimizer.implementation``): ``fused`` reads every state once in one kernel (torch
    ``fused=True``, Apex/Transformer Engine FusedAdam); ``foreach`` and ``for-loop`` run the
    update's element-wise operators one after another, over all tensors at once or one
    tensor at a time (each paying the eager per-tensor overhead)."""

    FOR_LOOP = "for-loop"
    FOREACH = "foreach"
    FUSED = "fused"


class GradAccumulation(StrEnum):
    """How a step of several micro-batches sums each parameter's gradients."""

    # autograd's AccumulateGrad: from the second micro-batch on, each parameter's new
    # gradient is added in place to the one kept (a memory-bound pass reading both and
    # writing one): PyTorch DDP under no_sync, FSDP2 into its shards (and unsharded
    # under torch.distributed.pipelining), Megatron-LM before 2022
    AUTOGRAD = "autograd"
    # the weight-gradient GEMM adds into the kept gradient (beta = 1): Megatron's
    # --gradient-accumulation-fusion, on by default (bf16 since Megatron-LM 83b1e42f30,
    # 2022-02; fp16 since 07916bf245, 2022-09), Megatron-FSDP's buffers included (its
    # gradient hook skips what Transformer Engine added: grad_added_to_main_grad)
    FUSED = "fused"


class ZeroAccumulation(StrEnum):
    """How ZeRO-1/2 without a pipeline runs a step of several micro-batches."""

    # FSDP2 (torchtitan, this runtime): each micro-batch gathers the weights in its
    # forward, reduce-scatters its gradients into the shards in its backward and reshards
    # (reshard_after_backward); HSDP all-reduces over the replicas in the last one only
    MICROBATCH = "micro-batch"
    # the weights stay whole; ZeRO-1 accumulates the gradients whole in its buffer and
    # reduce-scatters them once, in the last micro-batch's backward, ZeRO-2 reduces every
    # micro-batch's into its partitions; the weights are gathered once after the optimizer
    # step (Megatron-Core's distributed optimizer and Megatron-FSDP's optim_grads, whose
    # no_sync "in grads shard mode" still reduces: megatron_fsdp.py; DeepSpeed ZeRO-1/2,
    # stage_1_and_2.py's reduce_ready_partitions_and_remove_grads)
    PARTITIONED = "partitioned"


class ExpertGemm(StrEnum):
    """How a rank's routed experts run their GEMMs: what each launch costs once."""

    # one kernel for every local expert: torch.bmm (the zoo), torch._grouped_mm
    # (torchtitan, transformers), CUTLASS grouped GEMMs
    GROUPED = "grouped"
    # one cuBLAS GEMM per local expert: Transformer Engine's GroupedLinear, which
    # Megatron-Core's TEGroupedMLP runs (multi_stream_cublas_gemm in
    # transformer_engine/common/gemm/cublaslt_gemm.cu launches each over 4 streams)
    PER_EXPERT = "per-expert"


class CostOptions(BaseModel):
    """How the run is implemented; every field is a documented software behaviour."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    attention: AttentionKernel = AttentionKernel.FLASH
    flash_impl: FlashImpl = FlashImpl.SDPA  # the fused kernel a flash run calls
    # decoder attention (flash kernels skip the masked half); build_cost_model sets it
    # from the model (an encoder's is bidirectional) for the search and plan estimate alike
    causal: bool = True
    # the share of the model's attention calls that hand the kernel a mask tensor (a
    # sliding window, a mask of its own): those compute every block, causal or not;
    # build_cost_model sets it from the trace (OpGraph.masked_attention_share)
    masked_attention_share: float = Field(default=0.0, ge=0.0, le=1.0)
    dropout: bool = False  # dropout after attention and MLP (masks kept for backward)
    cp_attention: CpAttention = CpAttention.RING  # torch's context_parallel
    overlap_grad_reduce: bool = True  # data-parallel reduction runs during backward
    ddp_overlap: bool = True  # ZeRO-0's all-reduce too (DeepSpeed: after backward)
    # ZeRO-0 all-reduces once per step, the micro-batches before the last under no_sync
    # (this runtime, Megatron-Core, DeepSpeed's boundary); torchtitan's replicate has no
    # no_sync and all-reduces every micro-batch's gradients (train.py's accumulation loop)
    ddp_no_sync: bool = True
    overlap_param_gather: bool = True  # ZeRO/FSDP all-gathers prefetched under compute
    overlap_powersgd: bool = True  # PowerSGD's bucket reductions run during backward (not when the hook waits, as on gloo)
    tp_comm_overlap: bool = False  # tensor-parallel collectives overlapped with GEMMs
    selective: SelectivePolicy = SelectivePolicy.ATTENTION  # what "selective" recompute means
    recompute_modules: tuple[RecomputeModule, ...] = (RecomputeModule.CORE_ATTN,)  # for "modules"
    fused_pointwise: bool = False  # chains of memory-bound ops run as one kernel (torch.compile, Apex/Megatron fused kernels)
    # norms and SwiGLU are library kernels (Apex, Transformer Engine, Megatron-Core) that
    # keep only their inputs and outputs for backward, not eager intermediates (formula
    # graphs; what torch.compile keeps is its partitioner's choice, not modelled)
    fused_norm_swiglu: bool = False
    # attention reads K/V at their own head count (FlashAttention 2+, Transformer Engine,
    # cuDNN) instead of repeated to every query head (the zoo's eager code), on formula graphs
    gqa_native: bool = False
    # fp8 training's linear layers (the output layer stays bf16 in both: torchtitan's
    # float8 converter skips it, Megatron's is not a Transformer Engine layer)
    fp8_linear: Fp8Linear = Fp8Linear.TORCHAO
    fp8_scaling: Fp8Scaling = Fp8Scaling.DYNAMIC
    # fp8 training: the weights the GEMMs read are kept, and ZeRO/FSDP-gathered, in fp8,
    # 1 byte, the optimizer writing them in fp8 (Megatron-Core's --fp8-param-gather,
    # NeMo's fp8_params) instead of bf16
    fp8_param_gather: bool = False
    grad_reduce_bytes: Literal[2, 4] = 4  # bytes per gradient element in DP reductions
    # gradients accumulate in a buffer of the reduction's dtype (Megatron-Core's main_grad:
    # bf16 under --grad-reduce-in-bf16, param_and_grad_buffer.py); PyTorch DDP and FSDP2
    # keep each parameter's .grad in its own dtype (fp32 under mixed precision)
    grads_in_reduce_dtype: bool = False
    # gradients live in buffers kept across steps (Megatron-Core's param_and_grad_buffer,
    # DeepSpeed's contiguous gradient partitions); PyTorch's optimizers free every .grad at
    # zero_grad (set_to_none, the default since 2.0), so a step of one micro-batch starts
    # its backward holding none (torchtitan, FSDP2, this runtime)
    grads_persist: bool = False
    optimizer_impl: OptimizerImpl = OptimizerImpl.FOREACH  # torch.optim's default on GPUs
    grad_accumulation: GradAccumulation = GradAccumulation.AUTOGRAD
    zero_accumulation: ZeroAccumulation = ZeroAccumulation.MICROBATCH
    # the data-parallel reduction copies gradients into buckets of dp_bucket_mib, two in
    # flight (DeepSpeed's IPG buckets); PyTorch DDP (with gradient_as_bucket_view, as this
    # runtime runs it: the gradients are its buckets), FSDP2 and Megatron-Core's bucketed
    # gradient buffer reduce the gradients where they lie
    separate_grad_buckets: bool = False
    # SP backward all-gathers a linear's input again (Megatron), on zoo formula graphs;
    # traced layouts price what the DTensor runtime does (it keeps the gathered input)
    sp_regather_input: bool = True
    dp_bucket_mib: float = Field(default=40.0, gt=0)  # size of one gradient bucket
    # PyTorch caching allocator: reserved exceeds allocated by ~5-15% in LLM training
    allocator_margin: float = Field(default=0.10, ge=0, lt=1)
    workspace_gib: float = Field(default=0.5, ge=0)  # cuBLAS/NCCL workspaces, CUDA graphs
    # micro-batches one pipeline schedule runs: a step's others run in further rounds, each
    # filling and draining the pipeline and gathering and reducing the stage's FSDP shards
    # (torchtitan and NeMo AutoModel run local_batch_size / the pipeline micro-batch size
    # per gradient-accumulation step); None: the whole step in one schedule (Megatron-LM,
    # DeepSpeed, this runtime)
    pipeline_round_microbatches: int | None = Field(default=None, ge=1)
    # Mixture of experts: tokens the busiest EP rank receives over the mean (1: balanced,
    # as a dropless router with a load-balancing loss approaches); scales its expert
    # GEMMs and all-to-alls. ep_overlap: the dispatch/combine all-to-alls hide under the
    # shared experts' and attention's compute of another micro-batch (DeepSeek's
    # DualPipe, Megatron-Core's EP overlap); off in torch's eager runtime.
    expert_imbalance: float = Field(default=1.0, ge=1)
    ep_overlap: bool = False
    # ep_dedup: a token goes once to each rank holding one of its experts, and crosses the
    # network once per node, forwarded there over the scale-up link (DeepEP, Megatron-Core's
    # flex dispatcher); torch's all_to_all sends every (token, expert) pair.
    # expert_choice says which experts a token takes, which decides how many ranks and
    # nodes that is.
    ep_dedup: bool = False
    expert_choice: ExpertChoice = ExpertChoice.RANDOM
    expert_gemm: ExpertGemm = ExpertGemm.GROUPED  # each launch pays the per-GEMM overhead
    # moe_probs_in_activation: the routing probabilities multiply the experts' activation
    # (Megatron-Core), so the combine keeps no expert output; transformers and the zoo
    # weight the experts' outputs (formula graphs)
    moe_probs_in_activation: bool = False

    @property
    def dp_bucket_bytes(self) -> float:
        """Bytes of one gradient bucket."""
        return self.dp_bucket_mib * 2**20

    def fsdp_per_microbatch(self, strategy: Strategy) -> bool:
        """Whether each micro-batch gathers the weights and frees them after its backward
        (no pipeline: ZeRO-3, and ZeRO-1/2 under :attr:`ZeroAccumulation.MICROBATCH`)."""
        if not ParallelDims.of(strategy).sharded_per_microbatch:
            return False
        return strategy.zero >= 3 or self.zero_accumulation is ZeroAccumulation.MICROBATCH

    def reduces_every_microbatch(self, strategy: Strategy) -> bool:
        """Whether each micro-batch reduce-scatters its gradients into the ZeRO shards
        (no pipeline): :meth:`fsdp_per_microbatch`, and ZeRO-2 under
        :attr:`ZeroAccumulation.PARTITIONED`."""
        partitioned = self.zero_accumulation is ZeroAccumulation.PARTITIONED
        if partitioned and strategy.zero == 2 and ParallelDims.of(strategy).sharded_per_microbatch:
            return True
        return self.fsdp_per_microbatch(strategy)


def device_options(device_kind: Literal["gpu", "cpu"]) -> CostOptions:
    """The options a run on ``device_kind`` gets when none are given.

    GPUs: :class:`CostOptions`' defaults. CPUs (a calibrated CPU profile; the runtime
    in ``strategies/`` on gloo): no GPU workspace and no allocator slack (tensors are
    allocated as they are), DDP's default buckets, gloo reducing DDP buckets on its own
    thread during the backward, but no streams to prefetch FSDP's all-gathers on, a
    PowerSGD hook that waits for each bucket (``ordered_powersgd_hook``) and sequence
    parallel keeping the gathered input (DTensor).
    """
    if device_kind == "gpu":
        return CostOptions()
    return CostOptions(
        overlap_grad_reduce=True,
        overlap_param_gather=False,
        overlap_powersgd=False,
        sp_regather_input=False,
        dp_bucket_mib=DDP_BUCKET_MIB,
        allocator_margin=0.0,
        workspace_gib=0.0,
    )
