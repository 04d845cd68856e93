"""Per-segment-type pricing: compute, tensor/context-parallel communication, kept bytes.

:class:`SegmentPricer` turns one segment type's operators into a :class:`TypeCost` for
one :class:`~planner.cost.sharding.ShardKey` and recompute mode: forward, backward and
recompute seconds, exposed TP/CP communication, parameters per GPU and activation
bytes kept per micro-batch. Recompute modes: ``full`` keeps each block's input and
re-runs its forward (with its communication); ``selective`` follows
:class:`~planner.cost.options.SelectivePolicy`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.cost.communication import Collective, LinkModel, collective_time
from planner.cost.compute import ComputeModel, OpTime, unfused_score_bytes
from planner.cost.options import AttentionKernel, CostOptions, SelectivePolicy
from planner.cost.sharding import ShardKey, param_divisor, split_runs, tp_shard, work_divisor
from planner.graph import OpKind, OpNode, SegmentType
from planner.spec import RecomputeMode

__all__ = ["TypeCost", "SegmentPricer"]


@dataclass(frozen=True)
class TypeCost:
    """Per-micro-batch cost of a segment type for one shard key and recompute mode."""

    forward_s: float
    backward_s: float
    recompute_s: float
    comm_tp_s: float
    comm_cp_s: float
    param_count: float
    activation_bytes: float
    recompute_peak_bytes: float
    logits_bytes: float


class SegmentPricer:
    """Prices segment types; ``axis_link(size, stride)`` gives a mesh axis's link."""

    def __init__(
        self, compute: ComputeModel, options: CostOptions,
        axis_link: Callable[[int, int], LinkModel],
    ) -> None:  # fmt: skip
        self.compute = compute
        self.options = options
        self.axis_link = axis_link
        self.element_bytes = compute.element_bytes

    def price(self, seg_type: SegmentType, key: ShardKey, mode: RecomputeMode) -> TypeCost:
        """Per-micro-batch cost of ``seg_type`` under ``key`` and recompute ``mode``."""
        nodes = seg_type.nodes
        times = self.compute.segment_times(nodes, key)
        tp_fwd, tp_bwd = self._tp_comm(nodes, times, key)
        cp_fwd, cp_bwd = self._cp_comm(nodes, times, key)
        forward = sum(t.forward_s for t in times)
        backward = sum(t.backward_s for t in times)
        kept_all, logits = self._kept_bytes(nodes, key, with_scores=True)
        kept_all += self._gathered_inputs(nodes, key)
        recomputed = self.recomputed_nodes(nodes, mode)
        recompute = sum(times[i].forward_s for i in recomputed)
        if mode is RecomputeMode.FULL:
            recompute += tp_fwd + cp_fwd
            kept = self._input_bytes(nodes, key)
        elif mode is RecomputeMode.SELECTIVE and self.options.selective is SelectivePolicy.OP:
            kept = self._input_bytes(nodes, key) + sum(
                nodes[i].bytes_written * self._scale(nodes[i], key)
                for i in range(len(nodes)) if i not in recomputed
            )  # fmt: skip
        elif mode is RecomputeMode.SELECTIVE:
            kept = self._kept_bytes(nodes, key, with_scores=False)[0]
        else:
            kept = kept_all
        params = sum(n.param_count / param_divisor(tp_shard(n), key) for n in nodes)
        return TypeCost(
            forward_s=forward, backward_s=backward, recompute_s=recompute,
            comm_tp_s=tp_fwd + tp_bwd, comm_cp_s=cp_fwd + cp_bwd, param_count=params,
            activation_bytes=kept,
            recompute_peak_bytes=kept_all if mode is RecomputeMode.FULL else 0.0,
            logits_bytes=logits,
        )  # fmt: skip

    def recomputed_nodes(self, nodes: Sequence[OpNode], mode: RecomputeMode) -> set[int]:
        """Indices of the nodes whose forward runs again before backward under ``mode``."""
        if mode is RecomputeMode.NONE:
            return set()
        if mode is RecomputeMode.FULL:
            return set(range(len(nodes)))
        if self.options.selective is SelectivePolicy.ATTENTION:
            return {i for i, n in enumerate(nodes) if n.kind is OpKind.ATTENTION}
        matmuls = [i for i, n in enumerate(nodes) if n.kind is OpKind.MATMUL]
        saved = set(matmuls[::2]) | {i for i, n in enumerate(nodes) if n.kind is OpKind.ATTENTION}
        return set(range(len(nodes))) - saved

    def _scale(self, node: OpNode, key: ShardKey) -> float:
        return key.token_scale / work_divisor(tp_shard(node), key)

    def _kept_bytes(
        self, nodes: Sequence[OpNode], key: ShardKey, *, with_scores: bool
    ) -> tuple[float, float]:
        """(activations kept for backward, of which logits/loss) per micro-batch, bytes."""
        kept = logits = 0.0
        unfused = self.options.attention is AttentionKernel.UNFUSED
        for node in nodes:
            saved = node.saved_bytes
            if with_scores and unfused and node.kind is OpKind.ATTENTION:
                saved += unfused_score_bytes(node, self.element_bytes, self.options.dropout)
            scaled = saved * self._scale(node, key)
            kept += scaled
            if node.kind is OpKind.LOSS:  # logits and their fp32 gradient live alongside
                elements = math.prod(node.input_shapes[0]) if node.input_shapes else 0
                transient = elements * (self.element_bytes + 4) * self._scale(node, key)
                logits += scaled + transient
                kept += transient
        return kept, logits

    def _gathered_inputs(self, nodes: Sequence[OpNode], key: ShardKey) -> float:
        """Extra bytes kept when sequence-parallel linears save their all-gathered input.

        Megatron re-gathers in backward (keeps the 1/tp shard); DTensor sequence
        parallelism (torchtitan) keeps the gathered, full-sequence input per sublayer.
        """
        if not key.sequence_parallel or self.options.sp_regather_input:
            return 0.0
        extra = 0.0
        for run in split_runs(nodes):
            first = nodes[run[0]]
            if first.kind is not OpKind.EMBEDDING:
                full = max(first.bytes_read - first.param_bytes, 0.0) * key.token_scale
                extra += full * (1 - 1 / key.tp)
        return extra

    def _input_bytes(self, nodes: Sequence[OpNode], key: ShardKey) -> float:
        """The segment's input activation: all that full recompute keeps."""
        first = nodes[0]
        return max(first.bytes_read - first.param_bytes, 0.0) * self._scale(first, key)

    def _tp_comm(
        self, nodes: Sequence[OpNode], times: Sequence[OpTime], key: ShardKey
    ) -> tuple[float, float]:
        """Exposed tensor-parallel (forward, backward) seconds per micro-batch."""
        if key.tp == 1:
            return 0.0, 0.0
        link = self.axis_link(key.tp, 1)
        fwd = bwd = 0.0
        for run in split_runs(nodes):
            first, last = nodes[run[0]], nodes[run[-1]]
            entry = 0.0 if first.kind is OpKind.EMBEDDING else (
                max(first.bytes_read - first.param_bytes, 0.0) * key.token_scale
            )  # fmt: skip
            run_fwd, run_bwd = self._run_collectives(entry, last, key, link)
            overlap_fwd = overlap_bwd = 0.0
            if self.options.tp_comm_overlap:
                overlap_fwd = sum(times[i].forward_s for i in run)
                overlap_bwd = sum(times[i].backward_s for i in run)
            fwd += max(run_fwd - overlap_fwd, 0.0)
            bwd += max(run_bwd - overlap_bwd, 0.0)
        return fwd, bwd

    def _run_collectives(
        self, entry: float, last: OpNode, key: ShardKey, link: LinkModel
    ) -> tuple[float, float]:
        """(forward, backward) collective seconds around one tensor-parallel sublayer."""
        tp = key.tp
        if last.kind is OpKind.LOSS:  # vocab-parallel cross entropy: max, sum-exp, target
            tokens = last.output_shape[1] * key.token_scale if len(last.output_shape) > 1 else 1
            small = 3 * collective_time(Collective.ALL_REDUCE, 4 * tokens, tp, link)
            exit_fwd = exit_bwd = small / 2
        else:
            out = last.bytes_written * key.token_scale
            if key.sequence_parallel:
                exit_fwd = collective_time(Collective.REDUCE_SCATTER, out, tp, link)
                exit_bwd = collective_time(Collective.ALL_GATHER, out, tp, link)
            else:
                exit_fwd, exit_bwd = collective_time(Collective.ALL_REDUCE, out, tp, link), 0.0
        if key.sequence_parallel:
            gather = collective_time(Collective.ALL_GATHER, entry, tp, link)
            regather = gather if self.options.sp_regather_input else 0.0
            entry_fwd = gather
            entry_bwd = collective_time(Collective.REDUCE_SCATTER, entry, tp, link) + regather
        else:
            entry_fwd, entry_bwd = 0.0, collective_time(Collective.ALL_REDUCE, entry, tp, link)
        return entry_fwd + exit_fwd, entry_bwd + exit_bwd

    def _cp_comm(
        self, nodes: Sequence[OpNode], times: Sequence[OpTime], key: ShardKey
    ) -> tuple[float, float]:
        """Exposed context-parallel (forward, backward) seconds: K/V exchange under attention."""
        if key.cp == 1:
            return 0.0, 0.0
        link = self.axis_link(key.cp, key.tp)
        fwd = bwd = 0.0
        for node, time in zip(nodes, times, strict=True):
            if node.kind is not OpKind.ATTENTION or len(node.input_shapes) < 3:
                continue
            kv = sum(math.prod(shape) for shape in node.input_shapes[1:3]) * self.element_bytes
            full = kv * key.micro_batch_size / key.tp  # whole sequence's K and V per rank
            gather = collective_time(Collective.ALL_GATHER, full, key.cp, link)
            scatter = collective_time(Collective.REDUCE_SCATTER, full, key.cp, link)
            fwd += max(gather - time.forward_s, 0.0)
            bwd += max(gather + scatter - time.backward_s, 0.0)
        return fwd, bwd
