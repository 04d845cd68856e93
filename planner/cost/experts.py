"""Expert parallelism's terms: what EP changes in a mixture-of-experts segment.

With ``ep > 1`` (:class:`~planner.parallel_dims.ParallelDims` states the layout) each
MoE layer splits its tokens over the ``tp`` ranks, so the routed experts' work and
kept activations are divided by ``tp`` whatever the layout gives the rest of the
block, and a rank holds ``1 / (ep x etp)`` of the expert weights: ``1 / ep`` of the
experts, each split ``etp`` ways on its width. Per micro-batch and MoE layer a rank
then moves:

- dispatch and combine: two all-to-alls over the EP group (``ep`` ranks ``etp``
  apart) of its routed pairs, ``tokens / tp * top_k * hidden`` elements each, in
  forward and again in backward (their gradients); at the expected (balanced) load a
  fraction ``(ep - 1) / ep`` leaves the rank, the part bound for other nodes through its
  own NIC (:func:`~planner.cost.communication.alltoall_time`). The
  slowest rank receives ``expert_imbalance`` times the mean (1: balanced), which scales
  its expert GEMMs and its all-to-alls.
- with ``etp > 1`` (Megatron-Core's expert tensor parallelism): the ``etp`` consecutive
  ranks sharing the experts' width all-gather the pairs they received and
  reduce-scatter the experts' partial outputs (``etp x`` the received pairs each), in
  forward and in backward; the first expert GEMM keeps the gathered rows, ``etp`` times
  its input at ``etp = 1`` (the GEMMs' work per rank is unchanged: ``etp`` times the
  rows on ``1 / etp`` of the width).
- with ``ep_dedup`` (DeepEP, Megatron-Core's flex dispatcher) a token goes once to each
  rank holding one of its experts, not once per expert, and crosses the network once
  per other node, forwarded there over the scale-up link to the ranks it is bound for;
  how many ranks and nodes that is depends on which experts tokens take
  (``expert_choice``: drawn evenly, or contiguous as NeMo AutoModel's fake gate).
- with ``tp > 1`` and no sequence parallelism (this runtime's layout): the layer's
  tokens are replicated over ``tp`` and split there, so an all-gather of its output
  over ``tp`` in forward and of its input gradient in backward (``tokens * hidden``
  elements). Under sequence parallelism (Megatron-Core's) each tp rank already holds
  its own tokens and nothing crosses ``tp`` around the routed experts.

Full recompute re-runs the forward's all-to-alls and gathers. The all-to-all
payload a rank hands to the collective (:func:`alltoall_bytes`), averaged over the ranks,
does not depend on the routing: every routed pair is sent once, to some rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from planner.cost.communication import (
    Collective,
    MeshLinks,
    alltoall_time,
    bus_factor,
    collective_time,
    link_for_axis,
    members_per_node,
)
from planner.cost.options import ExpertChoice
from planner.cost.tp import SegmentTP, ShardKey
from planner.errors import SpecError
from planner.graph import OpGraph, OpKind, OpNode, OpRole, SegmentType
from planner.spec import Axis, Cluster, Strategy

if TYPE_CHECKING:
    from planner.cost.model import CostModel

__all__ = [
    "EPComm",
    "alltoall_bytes",
    "expert_layout",
    "expert_tradeoff",
    "ep_comm",
    "groups_hit",
    "held_expert_params",
    "rank_local",
    "local_experts",
    "routed_elements",
]


def _expert_indices(seg_type: SegmentType) -> list[int]:
    return [i for i, node in enumerate(seg_type.nodes) if node.role is OpRole.EXPERTS]


def held_expert_params(seg_type: SegmentType, key: ShardKey) -> float:
    """Routed-expert parameters one rank holds at ``key``: ``1 / (ep x etp)`` of them
    (0 without EP: experts are then ordinary parameters)."""
    if key.ep == 1:
        return 0.0
    experts = sum(seg_type.nodes[i].param_count for i in _expert_indices(seg_type))
    return experts / key.dims.expert_group


def expert_layout(
    seg_type: SegmentType, split: SegmentTP, key: ShardKey
) -> tuple[SegmentTP, float]:
    """``split`` with the routed experts as EP runs them at ``key`` (work and kept bytes
    divided by ``tp``, the first expert GEMM keeping its ``etp``-gathered rows, no
    parameters among the dense ones), and the expert parameters a rank holds
    (:func:`held_expert_params`). Unchanged, with 0, without EP or experts."""
    experts = _expert_indices(seg_type)
    if key.ep == 1 or not experts:
        return split, 0.0
    work, params = list(split.work_divisor), list(split.param_elements)
    saved: list[float] = list(split.saved_divisor)
    for index in experts:
        work[index] = saved[index] = key.tp
        params[index] = 0.0
    gemms = [i for i in experts if seg_type.nodes[i].kind is OpKind.MATMUL]
    if gemms:
        saved[gemms[0]] = key.tp / key.etp
    return replace(split, work_divisor=tuple(work), saved_divisor=tuple(saved),
                   param_elements=tuple(params)), held_expert_params(seg_type, key)  # fmt: skip


def rank_local(nodes: tuple[OpNode, ...], key: ShardKey) -> tuple[OpNode, ...]:
    """``nodes`` as one EP rank runs them: a routed experts' GEMM reads the weights of
    its ``1 / (ep x etp)`` of them (the same FLOPs over more rows each) and batches its
    ``1 / ep`` of the experts (``gemm[0]``: :func:`local_experts`)."""
    if key.ep == 1:
        return nodes
    held = 1 / key.dims.expert_group
    return tuple(
        _held(n, held, key.ep) if n.role is OpRole.EXPERTS and n.param_bytes else n
        for n in nodes
    )  # fmt: skip


def _held(node: OpNode, fraction: float, ep: int) -> OpNode:
    dropped = node.param_bytes * (1 - fraction)
    gemm = node.gemm
    if gemm is not None:
        gemm = (max(gemm[0] // ep, 1), *gemm[1:])
    return replace(
        node, param_bytes=node.param_bytes - dropped, bytes_read=node.bytes_read - dropped,
        gemm=gemm,
    )  # fmt: skip


def local_experts(node: OpNode) -> int:
    """Experts one grouped GEMM ``node`` batches on a rank (after :func:`rank_local`): the
    GEMMs a per-expert implementation launches for it. 1 for any other operator."""
    if node.role is not OpRole.EXPERTS or node.gemm is None:
        return 1
    return node.gemm[0]


def routed_elements(seg_type: SegmentType, key: ShardKey) -> float:
    """Elements of the routed pairs one rank sends in one all-to-all, per micro-batch:
    ``tokens / tp * top_k * hidden`` (0 for a segment without experts)."""
    if not seg_type.num_experts:
        return 0.0
    tokens = _traced_tokens(seg_type) * key.token_scale / key.tp
    return tokens * seg_type.top_k * seg_type.hidden_size


def _traced_tokens(seg_type: SegmentType) -> int:
    """Tokens the segment's traced (batch-1) router scores: its GEMM's rows."""
    for node in seg_type.nodes:
        if node.role is OpRole.ROUTER and node.gemm is not None:
            return node.gemm[1]
    raise SpecError(
        f"segment type {seg_type.type_id} has {seg_type.num_experts} experts but no router "
        "matmul: the trace must mark the router (OpRole.ROUTER) to price the all-to-all"
    )


@dataclass(frozen=True)
class EPComm:
    """Seconds per micro-batch of one MoE segment's EP communication (exposed)."""

    forward_s: float
    backward_s: float


def ep_comm(
    seg_type: SegmentType, key: ShardKey, element_bytes: int, links: MeshLinks,
    imbalance: float, *, dedup: bool = False, choice: ExpertChoice = ExpertChoice.RANDOM,
) -> EPComm:  # fmt: skip
    """The dispatch/combine all-to-alls, the expert-tensor-parallel gather and scatter
    and the tp gathers of ``seg_type`` at ``key`` (``dedup``: a token goes once to each
    rank and node it is bound for, which ``choice`` decides)."""
    if key.ep == 1 or not seg_type.num_experts:
        return EPComm(0.0, 0.0)
    dims = key.dims
    pairs = routed_elements(seg_type, key) * element_bytes
    cluster, profile = links.cluster, links.profile
    sent = _deduplicated(seg_type, key, pairs, cluster, choice) if dedup else None
    alltoall = alltoall_time(pairs, key.ep, cluster, profile, sent, stride=key.etp)
    exchanged = 2 * imbalance * alltoall
    if key.etp > 1:
        etp_link = link_for_axis(key.etp, 1, cluster, profile)
        gathered = imbalance * pairs * key.etp  # the ETP group's received pairs
        exchanged += collective_time(Collective.ALL_GATHER, gathered, key.etp, etp_link)
        exchanged += collective_time(Collective.REDUCE_SCATTER, gathered, key.etp, etp_link)
    gather = 0.0
    if key.tp > 1 and not key.sequence_parallel:
        tokens = pairs / seg_type.top_k * key.tp  # the layer's whole output
        tp_link = links.group(key.tp, dims, Axis.TP)
        gather = collective_time(Collective.ALL_GATHER, tokens, key.tp, tp_link)
    return EPComm(exchanged + gather, exchanged + gather)


def groups_hit(num_experts: int, top_k: int, group_experts: int, choice: ExpertChoice) -> float:
    """Expected number of groups of ``group_experts`` consecutive experts (a rank's, a
    node's) holding at least one of a token's ``top_k`` experts."""
    if choice is ExpertChoice.RANDOM:
        missed = math.comb(num_experts - group_experts, top_k) / math.comb(num_experts, top_k)
        return num_experts // group_experts * (1 - missed)
    starts = [t * top_k % num_experts for t in range(num_experts // math.gcd(num_experts, top_k))]
    hit = [len({(s + i) % num_experts // group_experts for i in range(top_k)}) for s in starts]
    return sum(hit) / len(hit)


def _deduplicated(
    seg_type: SegmentType, key: ShardKey, pairs_bytes: float, cluster: Cluster,
    choice: ExpertChoice,
) -> tuple[float, float]:  # fmt: skip
    """(scale-up, network) bytes a rank sends when each token goes once to every rank
    holding one of its experts and once to every other node (DeepEP, Megatron-Core's flex
    dispatcher): on its own node to the ranks hit there; to other nodes once each, where
    the receiving rank forwards it to the node's other ranks hit. Every rank and node is
    alike, so a rank's own node holds ``1 / nodes`` of the hits."""
    per_node = min(members_per_node(cluster, key.etp), key.ep)  # EP ranks on one node
    nodes = key.ep // per_node
    experts, k = seg_type.num_experts, seg_type.top_k
    token = pairs_bytes / k
    ranks = groups_hit(experts, k, experts // key.ep, choice)
    node_hits = groups_hit(experts, k, experts // nodes, choice)
    remote = token * node_hits * (nodes - 1) / nodes
    own_node = token * ranks * (per_node - 1) / key.ep
    forwarded = remote * ranks / node_hits * (per_node - 1) / per_node
    return own_node + forwarded, remote


def alltoall_bytes(graph: OpGraph, strategy: Strategy, element_bytes: int) -> float:
    """Bytes a rank hands to ``all_to_all_single`` per micro-batch, forward and backward,
    over every MoE layer of the model (``element_bytes`` per element), averaged over the
    ranks: four all-to-alls of its routed pairs per layer. The dispatch's forward input
    does not depend on the routing (every pair is sent once, to some rank, itself
    included); the rows a rank receives back do, so only their mean over ranks equals
    this. A pipeline rank moves its stages' share; full recompute runs the forward's two
    again. 0 without EP."""
    if strategy.ep == 1:
        return 0.0
    key = ShardKey.of(strategy)
    per_layer = [routed_elements(graph.segment_type(s), key) for s in graph.segments]
    return 4 * element_bytes * sum(per_layer)


def expert_tradeoff(model: CostModel, strategy: Strategy) -> str:
    """What ``strategy``'s expert parallelism buys and costs, in one sentence with the
    model's figures: where the all-to-all goes and the model states it saves."""
    if strategy.ep == 1:
        return ""
    experts, ep, etp = model.graph.num_experts, strategy.ep, strategy.etp
    link = link_for_axis(ep, etp, model.cluster, model.profile)
    with_ep = model.estimate(strategy)
    without = model.estimate(strategy.model_copy(update={"ep": 1, "etp": 1}))
    states = ("weights", "gradients", "optimizer")
    after = sum(with_ep.memory_gib.get(k, 0.0) for k in states)
    before = sum(without.memory_gib.get(k, 0.0) for k in states)
    moved = alltoall_bytes(model.graph, strategy, model.compute.element_bytes)
    per_step = moved * strategy.num_microbatches / strategy.pp
    group = f"{ep} consecutive ranks" if etp == 1 else f"{ep} ranks {etp} apart"
    split = "" if etp == 1 else (
        f", each split over {etp} consecutive ranks (expert tensor parallelism: they "
        f"gather the tokens they receive and reduce-scatter the experts' outputs on the "
        f"{link_for_axis(etp, 1, model.cluster, model.profile).name} link)"
    )  # fmt: skip
    return (
        f"ep{ep}: {experts // ep} of {experts} experts per rank{split}; the "
        f"dispatch and combine all-to-alls run over {group} on the "
        f"{link.name} link ({_figure(per_step / 1e9, 2)} GB per rank per step handed to "
        f"them, {_figure(per_step * bus_factor(Collective.ALL_TO_ALL, ep) / 1e9, 2)} GB of "
        "it to other ranks at a "
        "balanced load, "
        f"{with_ep.breakdown_s.get('comm_ep', 0.0):.3f} s exposed); model states "
        f"{_figure(after, 1)} GiB per GPU instead of {_figure(before, 1)} at ep 1"
    )


def _figure(value: float, decimals: int) -> str:
    """``value`` to ``decimals`` places, or to two significant digits where that would
    round it to nothing (a small model's states)."""
    if value == 0 or abs(value) >= 10**-decimals:
        return f"{value:.{decimals}f}"
    return f"{value:.2g}"
