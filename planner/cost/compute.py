"""Operator compute time: a roofline with the profile's calibrated efficiencies.

- Matmuls (and convolutions): ``max(F / (peak * matmul_efficiency), bytes / bw) +
  matmul_overhead`` per GEMM; the fixed overhead makes efficiency saturate with size.
  A rank's routed experts are one grouped GEMM, launched once, or once per local expert
  (``CostOptions.expert_gemm``: Transformer Engine's), each launch paying the overhead.
  Backward runs two GEMMs of the forward's size. fp8 training uses the fp8 peak for
  matmuls only, at the profile's fp8 efficiency
  (:meth:`~planner.hardware.HardwareProfile.matmul_efficiency_for`), and pays its
  linear layers' casts as memory traffic (:class:`~planner.cost.options.Fp8Linear`:
  torchao's per GEMM and micro-batch, Transformer Engine's once per tensor, its weights'
  once per step in the optimizer's term); the output layer's GEMM stays in bf16.
- Fused (flash) attention: ``F / (peak * attention_efficiency)`` (cuDNN's kernel at the
  profile's ``cudnn_attention_efficiency``: :func:`flash_efficiency`), half the work when
  causal (masked blocks are skipped, unless the model hands the kernel a mask tensor:
  ``CostOptions.masked_attention_share`` of the calls); its backward does 2.5x the forward's work. The
  FLOP convention counts causal attention whole (3x the forward), so a causal kernel's
  efficiency is held at 7/12 (3.5 x half / 3 x whole) at most: counted FLOPs never
  outrun the peak (MFU <= 1; of the profiles only the A100s' 0.6 is above it).
  Under context parallelism the kernels, their work and the traffic beside them are the
  implementation's (:func:`~planner.cost.context_parallel.cp_kernels`).
  Unfused attention: two batched GEMMs plus the scores' trips through memory
  (scale-mask-softmax, dropout), as Megatron ran in 2021-22.
- Everything else is memory-bound: ``bytes / (bandwidth * memory_efficiency) +
  kernel_overhead``; backward moves about twice the forward's bytes. With
  ``fused_pointwise`` a run of consecutive memory-bound operators is one kernel that reads
  the run's first input and writes its last output.
- Every operator also pays the profile's eager ``op_overhead_us`` once forward and twice
  backward (0 unless a calibrated CPU profile measured it), and one a tensor-parallel
  layout shards its ``dtensor_op_overhead_us`` as well (:meth:`ComputeModel.with_dtensor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost.context_parallel import cp_kernels
from planner.cost.experts import local_experts
from planner.cost.options import (
    AttentionKernel,
    CostOptions,
    ExpertGemm,
    FlashImpl,
    Fp8Linear,
    Fp8Scaling,
)
from planner.dtypes import ELEMENT_BYTES
from planner.graph import OpKind, OpNode
from planner.hardware import HardwareProfile
from planner.spec import DType

__all__ = [
    "OpTime", "ComputeModel", "attention_elements", "unfused_score_bytes", "fp8_weight_cast_bytes",
    "flash_efficiency",
]  # fmt: skip

_MATMUL_KINDS = (OpKind.MATMUL, OpKind.CONV)
# FlashAttention's backward recomputes the scores: 5 GEMM-sized products against the
# forward's 2, i.e. 2.5x the forward's FLOPs (Dao 2023, FlashAttention-2 section 3).
_FLASH_BACKWARD_WORK = 2.5
_CAUSAL_WORK = 0.5  # a causal kernel skips the masked half
# A causal kernel runs (1 + 2.5) * 0.5 = 1.75 forward-FLOPs of work where the convention
# counts 3 (forward + 2x backward, whole): at an efficiency above 1.75 / 3 = 7/12 the
# counted FLOPs would outrun the peak (MFU > 1), so it is priced at 7/12 at most.
_CAUSAL_EFFICIENCY_CAP = (1 + _FLASH_BACKWARD_WORK) * _CAUSAL_WORK / 3


@dataclass(frozen=True)
class OpTime:
    """Seconds for one operator on one GPU per micro-batch."""

    forward_s: float
    backward_s: float


def unfused_score_bytes(node: OpNode, element_bytes: int, dropout: bool) -> float:
    """Bytes of attention scores an unfused kernel keeps: softmax output, dropout mask and output."""
    if node.gemm is None:
        return 0.0
    batch_heads, seq_q, seq_k, _ = node.gemm
    per_score = element_bytes + ((ELEMENT_BYTES["bool"] + element_bytes) if dropout else 0)
    return float(batch_heads * seq_q * seq_k * per_score)


def attention_elements(node: OpNode) -> tuple[float, float]:
    """An attention's (query, key + value) elements as traced (0 where not recorded)."""
    shapes = node.input_shapes
    query = math.prod(shapes[0]) if shapes else 0
    return float(query), float(sum(math.prod(shape) for shape in shapes[1:3]))


def fp8_weight_cast_bytes(params: float, options: CostOptions, dtype: DType) -> float:
    """Bytes of one step's weight casts outside the GEMMs' per-micro-batch ones: under
    Transformer Engine fp8, each of the rank's ``params`` read in bf16 and written with its
    transpose in fp8, once per step (with ``fp8_param_gather`` the weights are fp8
    already, written so by the optimizer: their transpose only); none otherwise."""
    if dtype is not DType.FP8 or options.fp8_linear is not Fp8Linear.TRANSFORMER_ENGINE:
        return 0.0
    fp8 = ELEMENT_BYTES["fp8"]
    if options.fp8_param_gather:
        return params * 2 * fp8
    return params * (dtype.activation_bytes + 2 * fp8)


def flash_efficiency(profile: HardwareProfile, impl: FlashImpl) -> float:
    """The fraction of peak ``impl``'s fused attention reaches, forward and backward:
    cuDNN's where the profile gives it, else FlashAttention-2's."""
    if impl is FlashImpl.CUDNN and profile.cudnn_attention_efficiency is not None:
        return profile.cudnn_attention_efficiency
    return profile.attention_efficiency


class ComputeModel:
    """Prices operators; ``scale`` is the node's work on one GPU relative to the traced
    batch-1 node (micro-batch tokens over the context- and tensor-parallel split)."""

    def __init__(self, profile: HardwareProfile, dtype: DType, options: CostOptions) -> None:
        self.profile = profile
        self.options = options
        self.element_bytes = dtype.activation_bytes
        self.fp8 = dtype is DType.FP8
        self.matmul_peak = profile.peak_flops(dtype)
        self.matmul_efficiency = profile.matmul_efficiency_for(dtype)
        half = DType.BF16 if self.fp8 else dtype  # attention and the output layer
        self.half_matmul_rate = profile.peak_flops(half) * profile.matmul_efficiency_for(half)
        self.attention_peak = profile.peak_flops(half)
        self._flash_efficiency = flash_efficiency(profile, options.flash_impl)
        self.bandwidth = profile.memory_bandwidth_GBps * 1e9 * profile.memory_efficiency
        self.kernel_s = profile.kernel_overhead_us * 1e-6
        self.gemm_s = profile.matmul_overhead_us * 1e-6
        self.op_s = (profile.op_overhead_us or 0.0) * 1e-6  # eager framework, per operator
        self.param_s = (profile.param_overhead_us or 0.0) * 1e-6  # eager, per parameter tensor
        self.dtensor_op_s = (profile.dtensor_op_overhead_us or 0.0) * 1e-6
        self.dtensor_param_s = (profile.dtensor_param_overhead_us or 0.0) * 1e-6
        self.fsdp_call_s = (profile.fsdp_call_overhead_us or 0.0) * 1e-6

    def memory_time(self, nbytes: float) -> float:
        """Seconds for one memory-bound kernel moving ``nbytes``."""
        return nbytes / self.bandwidth + self.kernel_s

    def gemm_time(
        self, flops: float, nbytes: float, *, low_precision: bool = True, launches: int = 1
    ) -> float:
        """Seconds for ``launches`` GEMM kernels doing ``flops`` and touching ``nbytes`` in
        all (``low_precision=False``: in bf16 where the training runs its linear layers in
        fp8); each launch pays the per-GEMM overhead."""
        rate = self.matmul_peak * self.matmul_efficiency if low_precision else self.half_matmul_rate
        return max(flops / rate, nbytes / self.bandwidth) + launches * self.gemm_s

    def _launches(self, node: OpNode) -> int:
        """GEMM kernels ``node`` runs as: one per local expert where the experts' grouped
        GEMM is run per expert (:class:`~planner.cost.options.ExpertGemm`), else one."""
        if self.options.expert_gemm is ExpertGemm.PER_EXPERT:
            return local_experts(node)
        return 1

    def segment_times(
        self, nodes: Sequence[OpNode], scales: Sequence[float], *, low_precision: bool = True,
        cp: int = 1,
    ) -> list[OpTime]:  # fmt: skip
        """Per-node forward and backward seconds, with compiled fusion applied;
        ``low_precision=False``: the GEMMs stay in bf16 under fp8 training (the output
        layer); ``cp``: the context-parallel degree attention runs under."""
        times = [
            self.node_time(node, scale, low_precision=low_precision, cp=cp)
            for node, scale in zip(nodes, scales, strict=True)
        ]
        if self.options.fused_pointwise:
            times = self._fuse_memory_bound(nodes, times, scales)
        if not self.op_s:
            return times
        return [OpTime(t.forward_s + self.op_s, t.backward_s + 2 * self.op_s) for t in times]

    def with_dtensor(self, times: list[OpTime], work_divisor: Sequence[int]) -> list[OpTime]:
        """``times`` with DTensor's dispatch added to every operator a tensor-parallel
        layout shards (``work_divisor > 1``), once forward and twice backward."""
        extra = self.dtensor_op_s
        if not extra:
            return times
        return [
            OpTime(t.forward_s + extra, t.backward_s + 2 * extra) if divisor > 1 else t
            for t, divisor in zip(times, work_divisor, strict=True)
        ]

    def node_time(
        self, node: OpNode, scale: float, *, low_precision: bool = True, cp: int = 1
    ) -> OpTime:
        """Forward and backward seconds of ``node`` at ``scale`` (see :meth:`segment_times`)."""
        if node.kind in _MATMUL_KINDS:
            flops, nbytes = node.flops_fwd * scale, (node.bytes_read + node.bytes_written) * scale
            launches = self._launches(node)
            gemm = self.gemm_time(flops, nbytes, low_precision=low_precision, launches=launches)
            forward, backward = gemm, 2 * gemm
            if self.fp8 and low_precision:
                forward += self.memory_time(self._fp8_cast_bytes(node, scale, forward=True))
                backward += self.memory_time(self._fp8_cast_bytes(node, scale, forward=False))
            return OpTime(forward, backward)
        if node.kind is OpKind.ATTENTION:
            return self._attention_time(node, scale, cp)
        nbytes = (node.bytes_read + node.bytes_written) * scale
        if nbytes == 0 and node.flops_fwd == 0:
            return OpTime(0.0, 0.0)
        return OpTime(self.memory_time(nbytes), self.memory_time(2 * nbytes))

    def _fp8_cast_bytes(self, node: OpNode, scale: float, *, forward: bool) -> float:
        """Bytes one GEMM's fp8 casts move in one micro-batch's forward or backward.

        A cast reads the tensor (twice under dynamic scaling: its amax first) and writes
        it in fp8. torchao casts the input and the weight forward, the output gradient and
        the transposed input and weight backward. Transformer Engine writes a tensor and
        its transpose at once: the input forward, the output gradient backward (weights
        once per step: :func:`fp8_weight_cast_bytes`).
        """
        e, fp8 = self.element_bytes, ELEMENT_BYTES["fp8"]
        read = 2 * e if self.options.fp8_scaling is Fp8Scaling.DYNAMIC else e
        inputs = node.input_bytes / e * scale
        outputs = node.bytes_written / e * scale
        if self.options.fp8_linear is Fp8Linear.TRANSFORMER_ENGINE:
            return (inputs if forward else outputs) * (read + 2 * fp8)
        weight = node.param_bytes / e
        elements = inputs + weight if forward else outputs + inputs + weight
        return elements * (read + fp8)

    def _attention_time(self, node: OpNode, scale: float, cp: int) -> OpTime:
        if self.options.attention is AttentionKernel.FLASH:
            share = self.options.masked_attention_share
            if share in (0.0, 1.0):
                return self._flash_time(node, scale, cp, masked=share == 1.0)
            plain, masked = (self._flash_time(node, scale, cp, masked=m) for m in (False, True))
            return OpTime(
                (1 - share) * plain.forward_s + share * masked.forward_s,
                (1 - share) * plain.backward_s + share * masked.backward_s,
            )
        flops = node.flops_fwd * scale
        scores = unfused_score_bytes(node, self.element_bytes, dropout=False) * scale
        kept = unfused_score_bytes(node, self.element_bytes, self.options.dropout) * scale
        io = (node.bytes_read + node.bytes_written) * scale
        gemms = 2 * self._bmm_time(flops / 2, io / 2 + scores)  # QK^T writes, PV reads scores
        softmax = self.memory_time(2 * scores)
        dropout = self.memory_time(scores + kept) if self.options.dropout else 0.0
        forward = gemms + softmax + dropout
        backward = 2 * gemms + self.memory_time(3 * scores) + (2 * dropout if dropout else 0.0)
        return OpTime(forward, backward)

    def _flash_time(self, node: OpNode, scale: float, cp: int, *, masked: bool) -> OpTime:
        """One fused attention call's time, ``masked``: handed a mask tensor."""
        q, kv = attention_elements(node)
        kernels = cp_kernels(
            self.options.cp_attention, cp, self.options.causal, q * scale, kv * scale,
            self.element_bytes, masked=masked,
        )  # fmt: skip
        work = node.flops_fwd * scale * kernels.work_fraction
        efficiency = self._flash_efficiency
        if kernels.causal_kernel:
            efficiency = min(efficiency, _CAUSAL_EFFICIENCY_CAP)
        rate = self.attention_peak * efficiency
        beside = kernels.eager_ops * (self.kernel_s + self.op_s)
        forward = work / rate + kernels.calls * self.gemm_s
        forward += kernels.forward_bytes / self.bandwidth + beside
        backward = _FLASH_BACKWARD_WORK * work / rate + 2 * kernels.calls * self.gemm_s
        backward += kernels.backward_bytes / self.bandwidth + 2 * beside
        return OpTime(forward, backward)

    def _bmm_time(self, flops: float, nbytes: float) -> float:
        rate = self.attention_peak * self.profile.matmul_efficiency
        return max(flops / rate, nbytes / self.bandwidth) + self.gemm_s

    def _fuse_memory_bound(
        self, nodes: Sequence[OpNode], times: list[OpTime], scales: Sequence[float]
    ) -> list[OpTime]:
        fused = list(times)
        run: list[int] = []
        for index, node in enumerate([*nodes, None]):
            if node is not None and node.kind not in (*_MATMUL_KINDS, OpKind.ATTENTION):
                run.append(index)
                continue
            if len(run) > 1:
                first, last = nodes[run[0]], nodes[run[-1]]
                nbytes = first.bytes_read * scales[run[0]] + last.bytes_written * scales[run[-1]]
                for position in run:
                    fused[position] = OpTime(0.0, 0.0)
                fused[run[0]] = OpTime(self.memory_time(nbytes), self.memory_time(2 * nbytes))
            run = []
        return fused
