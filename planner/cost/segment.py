"""Per-segment-type pricing: compute, tensor/context-parallel communication, kept bytes.

:class:`SegmentPricer` turns one segment type's operators into a :class:`TypeCost` for
one :class:`~planner.cost.tp.ShardKey` and recompute mode: forward, backward and
recompute seconds, exposed TP/CP communication, parameters per GPU and activation
bytes kept per micro-batch. Recompute modes: ``full`` keeps each block's input and
re-runs its forward (with its communication); ``selective`` follows
:class:`~planner.cost.options.SelectivePolicy`. Either way the recomputed activations
exist again while the block's backward runs: ``recompute_peak_bytes`` is what the
block holds then beyond what it kept (the unfused attention's scores, say).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from planner.cost.communication import MeshLinks, collective_time
from planner.cost.compute import ComputeModel, OpTime, attention_elements, unfused_score_bytes
from planner.cost.context_parallel import cp_exposed_comm, cp_saved_bytes
from planner.cost.experts import ep_comm, expert_layout, held_expert_params, rank_local
from planner.cost.options import AttentionKernel, CostOptions, RecomputeModule, SelectivePolicy
from planner.cost.tp import AssignmentSource, SegmentTP, ShardKey
from planner.dtypes import FP32_BYTES
from planner.graph import OpKind, OpNode, OpRole, SegmentType
from planner.spec import Axis, RecomputeMode

__all__ = ["TypeCost", "SegmentPricer"]

# policies whose selective recompute keeps a block's input and its saved matmul outputs
_SAVE_MATMULS = (SelectivePolicy.OP, SelectivePolicy.MATMULS)


@dataclass(frozen=True)
class TypeCost:
    """Per-micro-batch cost of a segment type for one shard key and recompute mode."""

    forward_s: float
    backward_s: float
    recompute_s: float
    comm_tp_s: float
    comm_cp_s: float
    comm_ep_forward_s: float
    comm_ep_backward_s: float
    param_count: float  # dense parameters per rank (experts under EP apart)
    expert_param_count: float  # routed-expert parameters per rank under EP (else 0)
    activation_bytes: float
    recompute_peak_bytes: float
    logits_bytes: float
    # the output gradients a deferred weight-gradient step reads: the outputs of the
    # segment's weighted operators (zero-bubble holds them from input to weight gradient)
    weight_grad_bytes: float
    ep_cover_s: tuple[float, float] = (0.0, 0.0)  # compute EP overlap hides under (fwd, bwd)
    # the routed experts' GEMMs: (forward, backward, recomputed forward) seconds
    expert_gemm_s: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def comm_ep_s(self) -> float:
        """Exposed expert-parallel communication of forward and backward."""
        return self.comm_ep_forward_s + self.comm_ep_backward_s


def _expert_gemm(node: OpNode) -> bool:
    """Whether ``node`` is a routed experts' GEMM (its time depends on the experts held)."""
    return node.role is OpRole.EXPERTS and node.kind is OpKind.MATMUL


class SegmentPricer:
    """Prices segment types; ``links`` gives the mesh groups' links and
    ``assignment(tp, sequence_parallel)`` the tensor-parallel layout to price."""

    def __init__(
        self, compute: ComputeModel, options: CostOptions, links: MeshLinks,
        assignment: AssignmentSource,
    ) -> None:  # fmt: skip
        self.compute = compute
        self.options = options
        self.links = links
        self.assignment = assignment
        self.element_bytes = compute.element_bytes
        # Bytes per logit the loss holds beside what it keeps, at the backward's start.
        # Eager F.cross_entropy(logits.float()): nll_loss's and log_softmax's fp32
        # gradients at once. A compiled or fused loss (validated on torchtitan's compiled
        # runs): the logits in the compute dtype and one fp32 gradient.
        self._loss_transient_bytes = (
            self.element_bytes + FP32_BYTES if options.fused_pointwise else 2 * FP32_BYTES
        )

    def layout(self, seg_type: SegmentType, key: ShardKey) -> SegmentTP:
        """How the layout at ``key`` splits ``seg_type``."""
        return self.assignment(key.tp, key.sequence_parallel).segment(seg_type.type_id)

    def price(self, seg_type: SegmentType, key: ShardKey, mode: RecomputeMode) -> TypeCost:
        """Per-micro-batch cost of ``seg_type`` under ``key`` and recompute ``mode``."""
        nodes = rank_local(seg_type.nodes, key)
        split, expert_params = expert_layout(seg_type, self.layout(seg_type, key), key)
        work = [key.token_scale / d for d in split.work_divisor]
        saved = [key.token_scale / d for d in split.saved_divisor]
        low_precision = seg_type.kind != "head"  # fp8 recipes keep the output layer in bf16
        times = self.compute.segment_times(nodes, work, low_precision=low_precision, cp=key.cp)
        times = self.compute.with_dtensor(times, split.work_divisor)
        times = self._imbalanced(nodes, times, key)
        tp_fwd, tp_bwd = self._tp_comm(split, times, key)
        cp_fwd, cp_bwd = self._cp_comm(nodes, times, work, key)
        cover = self._ep_cover(nodes, times)
        ep_fwd, ep_bwd = self._ep_comm(seg_type, key, cover)
        forward = sum(t.forward_s for t in times)
        backward = sum(t.backward_s for t in times)
        kept_all, logits = self._kept_bytes(nodes, saved, with_scores=True, cp=key.cp)
        kept_all += split.gathered_bytes * key.token_scale
        recomputed = self.recomputed_nodes(nodes, mode)
        recompute = sum(times[i].forward_s for i in recomputed)
        if any(nodes[i].kind is OpKind.ATTENTION for i in recomputed):
            recompute += cp_fwd  # the attention's K/V exchange runs again with it
        if mode is RecomputeMode.FULL:
            recompute += tp_fwd + ep_fwd
            kept = self._input_bytes(nodes, saved)
        elif mode is RecomputeMode.SELECTIVE and self.options.selective in _SAVE_MATMULS:
            kept = self._input_bytes(nodes, saved) + sum(
                nodes[i].bytes_written * saved[i] for i in range(len(nodes)) if i not in recomputed
            )
        elif mode is RecomputeMode.SELECTIVE and self.options.selective is SelectivePolicy.MODULES:
            modules = self.options.recompute_modules
            kept = self._kept_bytes(
                _module_recompute_kept(nodes, modules), saved,
                with_scores=RecomputeModule.CORE_ATTN not in modules, cp=key.cp,
            )[0]  # fmt: skip
        elif mode is RecomputeMode.SELECTIVE:
            kept = self._kept_bytes(nodes, saved, with_scores=False, cp=key.cp)[0]
        else:
            kept = kept_all
        return TypeCost(
            forward_s=forward, backward_s=backward, recompute_s=recompute,
            comm_tp_s=tp_fwd + tp_bwd, comm_cp_s=cp_fwd + cp_bwd, comm_ep_forward_s=ep_fwd, comm_ep_backward_s=ep_bwd,
            param_count=sum(split.param_elements), expert_param_count=expert_params,
            activation_bytes=kept,
            recompute_peak_bytes=max(kept_all - kept, 0.0) if recomputed else 0.0,
            logits_bytes=logits, ep_cover_s=cover,
            weight_grad_bytes=sum(
                node.bytes_written * saved[i] for i, node in enumerate(nodes) if node.param_count
            ),
            expert_gemm_s=self._expert_gemms(nodes, times, recomputed),
        )  # fmt: skip

    def with_ep(
        self, base: TypeCost, seg_type: SegmentType, key: ShardKey, mode: RecomputeMode
    ) -> TypeCost:
        """``base`` (priced at another ``ep > 1``, where all but the degree's terms are
        the same) at ``key``'s ``ep``: its all-to-alls, the experts a rank holds and the
        expert GEMMs reading them."""
        ep_fwd, ep_bwd = self._ep_comm(seg_type, key, base.ep_cover_s)
        gemms = self._expert_gemm_times(seg_type, key, mode)
        delta = [new - old for new, old in zip(gemms, base.expert_gemm_s, strict=True)]
        recompute = base.recompute_s + delta[2]
        if mode is RecomputeMode.FULL:
            recompute += ep_fwd - base.comm_ep_forward_s
        held = held_expert_params(seg_type, key)
        return replace(
            base, forward_s=base.forward_s + delta[0], backward_s=base.backward_s + delta[1],
            comm_ep_forward_s=ep_fwd, comm_ep_backward_s=ep_bwd, recompute_s=recompute,
            expert_param_count=held, expert_gemm_s=gemms,
        )  # fmt: skip

    def _expert_gemm_times(
        self, seg_type: SegmentType, key: ShardKey, mode: RecomputeMode
    ) -> tuple[float, float, float]:
        """The routed experts' GEMMs of ``seg_type`` at ``key`` (see :meth:`_expert_gemms`)."""
        nodes = rank_local(seg_type.nodes, key)
        split, _ = expert_layout(seg_type, self.layout(seg_type, key), key)
        work = [key.token_scale / d for d in split.work_divisor]
        times = [
            self.compute.segment_times([n], [w])[0] if _expert_gemm(n) else OpTime(0.0, 0.0)
            for n, w in zip(nodes, work, strict=True)
        ]
        times = self._imbalanced(nodes, times, key)
        return self._expert_gemms(nodes, times, self.recomputed_nodes(nodes, mode))

    @staticmethod
    def _expert_gemms(
        nodes: Sequence[OpNode], times: Sequence[OpTime], recomputed: set[int]
    ) -> tuple[float, float, float]:
        """(forward, backward, recomputed forward) seconds of the routed experts' GEMMs."""
        gemms = [i for i, n in enumerate(nodes) if _expert_gemm(n)]
        return (
            sum(times[i].forward_s for i in gemms),
            sum(times[i].backward_s for i in gemms),
            sum(times[i].forward_s for i in gemms if i in recomputed),
        )

    def recomputed_nodes(self, nodes: Sequence[OpNode], mode: RecomputeMode) -> set[int]:
        """Indices of the nodes whose forward runs again before backward under ``mode``."""
        if mode is RecomputeMode.NONE:
            return set()
        if mode is RecomputeMode.FULL:
            return set(range(len(nodes)))
        if self.options.selective is SelectivePolicy.ATTENTION:
            return {i for i, n in enumerate(nodes) if n.kind is OpKind.ATTENTION}
        if self.options.selective is SelectivePolicy.MODULES:
            return _module_recompute_nodes(nodes, self.options.recompute_modules)
        matmuls = [i for i, n in enumerate(nodes) if n.kind is OpKind.MATMUL]
        if self.options.selective is SelectivePolicy.MATMULS:
            return set(range(len(nodes))) - set(matmuls)
        saved = set(matmuls[::2]) | {i for i, n in enumerate(nodes) if n.kind is OpKind.ATTENTION}
        return set(range(len(nodes))) - saved

    def _kept_bytes(
        self, nodes: Sequence[OpNode], saved: Sequence[float], *, with_scores: bool, cp: int
    ) -> tuple[float, float]:
        """(activations kept for backward, of which logits/loss) per micro-batch, bytes;
        an attention under ``cp`` keeps what its implementation gathered
        (:func:`~planner.cost.context_parallel.cp_saved_bytes`)."""
        kept = logits = 0.0
        unfused = self.options.attention is AttentionKernel.UNFUSED
        for node, scale in zip(nodes, saved, strict=True):
            own = node.saved_bytes
            if node.kind is OpKind.ATTENTION:
                kv = attention_elements(node)[1]
                own += cp_saved_bytes(self.options.cp_attention, cp, kv, self.element_bytes)
            if with_scores and unfused and node.kind is OpKind.ATTENTION:
                own += unfused_score_bytes(node, self.element_bytes, self.options.dropout)
            scaled = own * scale
            kept += scaled
            if node.kind is OpKind.LOSS:  # the logits' transients besides what is kept
                elements = math.prod(node.input_shapes[0]) if node.input_shapes else 0
                transient = elements * self._loss_transient_bytes * scale
                logits += scaled + transient
                kept += transient
        return kept, logits

    @staticmethod
    def _input_bytes(nodes: Sequence[OpNode], saved: Sequence[float]) -> float:
        """The segment's input activation: all that full recompute keeps."""
        first = nodes[0]
        return first.input_bytes * saved[0]

    def _tp_comm(
        self, split: SegmentTP, times: Sequence[OpTime], key: ShardKey
    ) -> tuple[float, float]:
        """Exposed tensor-parallel (forward, backward) seconds per micro-batch.

        With ``tp_comm_overlap`` the collectives hide under the split operators' compute
        of the same pass.
        """
        if key.tp == 1 or not split.comms:
            return 0.0, 0.0
        link = self.links.group(key.tp, key.dims, Axis.TP)
        fwd = bwd = 0.0
        for comm in split.comms:
            seconds = collective_time(comm.kind, comm.bytes_for(key), key.tp, link)
            if comm.backward:
                bwd += seconds
            else:
                fwd += seconds
        if self.options.tp_comm_overlap:
            sharded = [t for t, d in zip(times, split.work_divisor, strict=True) if d > 1]
            fwd = max(fwd - sum(t.forward_s for t in sharded), 0.0)
            bwd = max(bwd - sum(t.backward_s for t in sharded), 0.0)
        return fwd, bwd

    def _imbalanced(
        self, nodes: Sequence[OpNode], times: list[OpTime], key: ShardKey
    ) -> list[OpTime]:
        """``times`` with the routed experts' scaled by the busiest EP rank's excess load."""
        factor = self.options.expert_imbalance
        if key.ep == 1 or factor == 1.0:
            return times
        return [
            OpTime(t.forward_s * factor, t.backward_s * factor) if n.role is OpRole.EXPERTS else t
            for n, t in zip(nodes, times, strict=True)
        ]

    def _ep_cover(self, nodes: Sequence[OpNode], times: Sequence[OpTime]) -> tuple[float, float]:
        """(forward, backward) seconds the all-to-alls hide under with ``ep_overlap``: the
        shared experts' and attention's compute (0 without the option)."""
        if not self.options.ep_overlap:
            return 0.0, 0.0
        cover = [
            t for n, t in zip(nodes, times, strict=True)
            if n.role is OpRole.SHARED_EXPERTS or n.kind is OpKind.ATTENTION
        ]  # fmt: skip
        return sum(t.forward_s for t in cover), sum(t.backward_s for t in cover)

    def _ep_comm(
        self, seg_type: SegmentType, key: ShardKey, cover: tuple[float, float]
    ) -> tuple[float, float]:
        """Exposed expert-parallel (forward, backward) seconds beyond ``cover``."""
        comm = ep_comm(
            seg_type, key, self.element_bytes, self.links, self.options.expert_imbalance,
            dedup=self.options.ep_dedup, choice=self.options.expert_choice,
        )  # fmt: skip
        return max(comm.forward_s - cover[0], 0.0), max(comm.backward_s - cover[1], 0.0)

    def _cp_comm(
        self, nodes: Sequence[OpNode], times: Sequence[OpTime], work: Sequence[float],
        key: ShardKey,
    ) -> tuple[float, float]:  # fmt: skip
        """Exposed context-parallel (forward, backward) seconds: each attention's K/V
        exchange (:func:`~planner.cost.context_parallel.cp_exposed_comm`)."""
        if key.cp == 1:
            return 0.0, 0.0
        link = self.links.group(key.cp, key.dims, Axis.CP)
        fwd = bwd = 0.0
        for node, time, scale in zip(nodes, times, work, strict=True):
            if node.kind is not OpKind.ATTENTION or len(node.input_shapes) < 3:
                continue
            forward, backward = cp_exposed_comm(
                self.options.cp_attention, key.cp, attention_elements(node)[1] * scale,
                self.element_bytes, (time.forward_s, time.backward_s), link,
            )  # fmt: skip
            fwd += forward
            bwd += backward
        return fwd, bwd


# --- Megatron-Core's fine-grained recompute (--recompute-modules) ------------------------


def _block_norms(nodes: Sequence[OpNode]) -> set[int]:
    """The block's own norms (module at the block's top level: ``attention_norm``,
    ``input_layernorm``), not the per-head norms inside attention."""
    return {i for i, n in enumerate(nodes) if n.kind is OpKind.NORM and "." not in n.module}


def _expert_activation(nodes: Sequence[OpNode]) -> tuple[set[int], set[int]]:
    """The routed experts' activation operators (between their GEMMs) and the GEMMs that
    read it (whose saved input is the activation's output)."""
    gemms = [i for i, n in enumerate(nodes) if _expert_gemm(n)]
    if len(gemms) < 2:
        return set(), set()
    between = {
        i for i in range(gemms[0] + 1, gemms[-1])
        if nodes[i].role is OpRole.EXPERTS and not _expert_gemm(nodes[i])
    }  # fmt: skip
    return between, set(gemms[1:])


def _module_recompute_nodes(
    nodes: Sequence[OpNode], modules: Sequence[RecomputeModule]
) -> set[int]:
    """Indices of the operators Megatron-Core's recompute of ``modules`` runs again."""
    again: set[int] = set()
    if RecomputeModule.CORE_ATTN in modules:
        again |= {i for i, n in enumerate(nodes) if n.kind is OpKind.ATTENTION}
    if RecomputeModule.LAYERNORM in modules:
        again |= _block_norms(nodes)
    if RecomputeModule.MOE_ACT in modules:
        again |= _expert_activation(nodes)[0]
    if RecomputeModule.MLA_UP_PROJ in modules:
        again |= _latent_up(nodes)
    for module, members in _CHECKPOINTED.items():
        if module in modules:
            again |= members(nodes)
    return again


def _module_recompute_kept(
    nodes: Sequence[OpNode], modules: Sequence[RecomputeModule]
) -> list[OpNode]:
    """``nodes`` with the saved bytes left under Megatron-Core's recompute of ``modules``:
    a recomputed norm keeps only its input (the checkpoint's); the GEMM after a recomputed
    expert activation keeps no input (the activation's output is made again)."""
    kept = list(nodes)
    if RecomputeModule.LAYERNORM in modules:
        _keep_norm_inputs(nodes, _block_norms(nodes), kept)
    if RecomputeModule.MOE_ACT in modules:
        for i in _expert_activation(nodes)[1]:
            kept[i] = replace(nodes[i], saved_bytes=0.0)
    if RecomputeModule.MLA_UP_PROJ in modules:
        up = _latent_up(nodes)
        for i in up:
            kept[i] = replace(nodes[i], saved_bytes=0.0)
        _keep_norm_inputs(nodes, {i for i in up if nodes[i].kind is OpKind.NORM}, kept)
        for i, node in enumerate(nodes):  # queries, keys and values are made again
            if node.kind is OpKind.ATTENTION:
                kept[i] = replace(node, saved_bytes=0.0)
    for module, members in _CHECKPOINTED.items():
        if module in modules:
            _keep_checkpoint_input(nodes, members(nodes), kept)
    return kept


def _keep_checkpoint_input(
    nodes: Sequence[OpNode], checkpointed: set[int], kept: list[OpNode]
) -> None:
    """A module checkpointed whole in ``kept``: its first operator keeps the module's
    input (the checkpoint's), its operators nothing else."""
    for i in checkpointed:
        kept[i] = replace(nodes[i], saved_bytes=0.0)
    if checkpointed:
        first = min(checkpointed)
        kept[first] = replace(nodes[first], saved_bytes=nodes[first].input_bytes)


def _dense_feed_forward(nodes: Sequence[OpNode]) -> set[int]:
    """A dense block's feed-forward (``feed_forward`` and its submodules); none in a block
    with experts (Megatron-Core's ``mlp`` recompute is the dense MLP's)."""
    if any(n.role is OpRole.EXPERTS for n in nodes):
        return set()
    return {
        i for i, n in enumerate(nodes)
        if n.module == _FEED_FORWARD or n.module.startswith(f"{_FEED_FORWARD}.")
    }  # fmt: skip


def _shared_experts(nodes: Sequence[OpNode]) -> set[int]:
    return {i for i, n in enumerate(nodes) if n.role is OpRole.SHARED_EXPERTS}


_FEED_FORWARD = "feed_forward"  # the formula graphs' (and the zoo's) feed-forward module
# Megatron-Core's recompute modules under normal checkpointing: the operators of each
_CHECKPOINTED: dict[RecomputeModule, Callable[[Sequence[OpNode]], set[int]]] = {
    RecomputeModule.MLP: _dense_feed_forward,
    RecomputeModule.SHARED_EXPERTS: _shared_experts,
}


def _keep_norm_inputs(nodes: Sequence[OpNode], norms: set[int], kept: list[OpNode]) -> None:
    """Recomputed norms in ``kept``: each norm module keeps only its input (the
    checkpoint's), its other operators nothing."""
    by_module: dict[str, list[int]] = {}
    for i in sorted(norms):
        by_module.setdefault(nodes[i].module, []).append(i)
    for run in by_module.values():
        for i in run:
            kept[i] = replace(nodes[i], saved_bytes=0.0)
        kept[run[0]] = replace(nodes[run[0]], saved_bytes=nodes[run[0]].input_bytes)


def _latent_up(nodes: Sequence[OpNode]) -> set[int]:
    """Latent attention's up-projections, their norms and rotary (``OpRole.LATENT_UP``)."""
    return {i for i, n in enumerate(nodes) if n.role is OpRole.LATENT_UP}
