"""Throughput of a priced step: FLOPs per step, MFU/HFU, tokens/s and the fit verdict.

FLOPs follow :data:`~planner.cost.flops.FLOP_CONVENTION`: matmul, convolution and
attention FLOPs of the graph (forward and backward) per sequence, times the global
batch; recomputed forward FLOPs count towards HFU only. MFU and HFU are against the
dense peak of the training dtype (fp8: the fp8 peak), so MFU <= 1: no operator is
priced faster than that peak on the FLOPs counted for it
(:class:`~planner.cost.compute.ComputeModel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from planner.cost.error_band import error_band
from planner.cost.flops import FLOP_CONVENTION
from planner.cost.memory import GIB, PIPELINED_FSDP_NOTE
from planner.graph import OpGraph, OpKind, OpNode, SegmentType
from planner.hardware import HardwareProfile
from planner.parallel_dims import ParallelDims
from planner.spec import Prediction, RecomputeMode, Strategy, Training

__all__ = ["Throughput"]

_COUNTED = (OpKind.MATMUL, OpKind.ATTENTION, OpKind.CONV)  # FLOPs that MFU/HFU count


@dataclass(eq=False)
class Throughput:
    """Turns a step's seconds and bytes into a :class:`Prediction` for ``graph`` trained
    as ``training`` on ``profile``'s GPUs; ``recomputed_nodes(nodes, mode)`` says which
    nodes' forward runs again under a recompute mode."""

    graph: OpGraph
    training: Training
    profile: HardwareProfile
    recomputed_nodes: Callable[[Sequence[OpNode], RecomputeMode], set[int]]
    _step_flops: dict[tuple[RecomputeMode, ...], tuple[float, float]] = field(
        default_factory=dict, init=False, repr=False
    )
    _recompute_flops: dict[tuple[str, RecomputeMode], float] = field(
        default_factory=dict, init=False, repr=False
    )

    def prediction(
        self, strategy: Strategy, step: float, breakdown: dict[str, float],
        memory: dict[str, float], modes: list[RecomputeMode],
    ) -> Prediction:  # fmt: skip
        """The prediction for a step of ``step`` seconds (``breakdown`` in s, ``memory``
        in bytes by term) with recompute ``modes`` per segment."""
        gpus = strategy.world_size
        dtype = self.training.dtype
        peak = self.profile.peak_flops(dtype)
        model_flops, recomputed = self.flops_per_step(modes)
        tokens = self.training.global_batch_size * self.graph.seq_len
        limit = self.profile.memory_capacity_gib
        memory_gib = {k: v / GIB for k, v in memory.items()}
        peak_gib = sum(memory_gib.values())
        fits = peak_gib <= limit
        reason = "" if fits else _not_fitting_reason(memory_gib, peak_gib, limit)
        if ParallelDims.of(strategy).gathered_under_pipeline:
            reason = f"{reason}; {PIPELINED_FSDP_NOTE}" if reason else PIPELINED_FSDP_NOTE
        return Prediction(
            step_time_s=step,
            tokens_per_s_per_gpu=tokens / step / gpus,
            model_tflops_per_gpu=model_flops / step / gpus / 1e12,
            mfu=model_flops / step / gpus / peak,
            hfu=(model_flops + recomputed) / step / gpus / peak,
            flop_convention=FLOP_CONVENTION,
            peak_memory_gib=peak_gib,
            memory_limit_gib=limit,
            fits=fits,
            breakdown_s=breakdown,
            memory_gib=memory_gib,
            reason=reason,
            error_band=error_band(
                moe=bool(self.graph.num_experts), dtype=dtype,
                device_kind=self.profile.device_kind, breakdown_s=breakdown, step_time_s=step,
            ),
        )  # fmt: skip

    def flops_per_step(self, modes: Sequence[RecomputeMode]) -> tuple[float, float]:
        """(model FLOPs, recomputed FLOPs) per optimizer step, whole cluster (cached)."""
        key = tuple(modes)
        if key not in self._step_flops:
            self._step_flops[key] = self._count_step_flops(modes)
        return self._step_flops[key]

    def _count_step_flops(self, modes: Sequence[RecomputeMode]) -> tuple[float, float]:
        recomputed = 0.0
        for segment, mode in zip(self.graph.segments, modes, strict=True):
            seg_type = self.graph.segment_type(segment)
            if seg_type.kind == "block" and mode is not RecomputeMode.NONE:
                recomputed += self._recomputed_flops(seg_type, mode)
        sequences = self.training.global_batch_size
        return self._model_flops_per_sequence * sequences, recomputed * sequences

    @cached_property
    def _model_flops_per_sequence(self) -> float:
        total = 0.0
        for segment in self.graph.segments:
            nodes = self.graph.segment_type(segment).nodes
            total += sum(n.flops_fwd + n.flops_bwd for n in nodes if n.kind in _COUNTED)
        return total

    def _recomputed_flops(self, seg_type: SegmentType, mode: RecomputeMode) -> float:
        """Forward FLOPs run again per sequence in one segment of ``seg_type`` (cached)."""
        cache_key = (seg_type.type_id, mode)
        if cache_key not in self._recompute_flops:
            nodes = seg_type.nodes
            again = self.recomputed_nodes(nodes, mode)
            self._recompute_flops[cache_key] = sum(
                nodes[i].flops_fwd for i in again if nodes[i].kind in _COUNTED
            )
        return self._recompute_flops[cache_key]


def _not_fitting_reason(memory_gib: dict[str, float], peak: float, limit: float) -> str:
    dominant = max(memory_gib, key=lambda k: memory_gib[k])
    return (
        f"needs {peak:.1f} GiB per GPU, {peak - limit:.1f} GiB over the {limit:.1f} GiB limit; "
        f"largest term: {dominant} {memory_gib[dominant]:.1f} GiB"
    )
