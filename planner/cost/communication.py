"""Collective communication time: alpha-beta with the NCCL bus-bandwidth factors.

A collective over ``n`` ranks moving an array of ``S`` bytes takes
``steps * latency + factor * S / busbw`` where ``factor`` is nccl-tests' bus factor
(all-reduce ``2(n-1)/n``; all-gather, reduce-scatter and all-to-all ``(n-1)/n``;
send/recv and broadcast 1) and ``busbw`` is the link's line rate times its measured
bus-bandwidth efficiency. Ring all-gather/reduce-scatter take ``n-1`` latency steps;
all-reduce takes the fewer of ring (``2(n-1)``) and tree (``2*ceil(log2 n)``) steps,
as NCCL picks the faster algorithm. A link may run one collective at a different bus
bandwidth than its all-reduce (gloo's reduce-scatter reaches about a third of it):
the profile's ``collective_factors`` scale ``busbw`` per collective (default 1), and
its ``call_overhead_us`` adds a fixed cost per call (default 0).

The link tier is the one the mesh axis spans: an axis whose ranks fit in one node
uses the scale-up link; one that crosses nodes pays the network, with the group's
members in one node sharing their NICs (``members_per_node * per-GPU network``, at
most the scale-up rate). An axis wider than an extra tier's domain (a site) also
crosses that tier: each group's ring leaves each domain once, and the groups with
members in a domain (``min(stride, domain_size)`` of them, all reducing at once) share
its uplink, so a group gets ``uplink / min(stride, domain_size)``, at most what the
node network gives it; the slowest tier crossed decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from planner.hardware import HardwareProfile, Link
from planner.spec import Cluster

if TYPE_CHECKING:
    from planner.parallel_dims import ParallelDims
    from planner.spec import Axis

__all__ = [
    "Collective",
    "bus_factor",
    "latency_steps",
    "LinkModel",
    "collective_time",
    "alltoall_time",
    "link_for_axis",
    "members_per_node",
    "MeshLinks",
]


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"


def bus_factor(kind: Collective, n: int) -> float:
    """nccl-tests' busbw/algbw factor for ``kind`` over ``n`` ranks."""
    if kind is Collective.ALL_REDUCE:
        return 2 * (n - 1) / n
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0


def latency_steps(kind: Collective, n: int) -> int:
    """Sequential message steps of the algorithm NCCL would pick."""
    if kind is Collective.ALL_REDUCE:
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    if kind in (Collective.SEND_RECV, Collective.BROADCAST):
        return 1 if kind is Collective.SEND_RECV else math.ceil(math.log2(n))
    return n - 1


@dataclass(frozen=True)
class LinkModel:
    """A link as a collective sees it: achieved bus bandwidth (bytes/s) and step latency (s).

    ``factors`` maps a collective's value to its bus bandwidth relative to
    ``busbw_Bps`` (the all-reduce's); missing collectives get 1. ``call_s`` is paid once
    per collective call (the profile's ``call_overhead_us``).
    """

    name: str
    busbw_Bps: float
    latency_s: float
    factors: Mapping[str, float] = field(default_factory=dict)
    call_s: float = 0.0

    def busbw_for(self, kind: Collective) -> float:
        """Achieved bus bandwidth of ``kind`` on this link (bytes/s)."""
        return self.busbw_Bps * self.factors.get(kind.value, 1.0)


def collective_time(kind: Collective, size_bytes: float, n: int, link: LinkModel) -> float:
    """Seconds for one ``kind`` collective of ``size_bytes`` (the whole array) over ``n`` ranks."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    steps = latency_steps(kind, n)
    moved = bus_factor(kind, n) * size_bytes / link.busbw_for(kind)
    return link.call_s + steps * link.latency_s + moved


def _factors(link: Link) -> dict[str, float]:
    return {str(kind): factor for kind, factor in link.collective_factors.items()}


def _call_s(link: Link) -> float:
    return (link.call_overhead_us or 0.0) * 1e-6


def _intra(cluster: Cluster, profile: HardwareProfile) -> LinkModel:
    link = profile.links.intra_node
    bandwidth = cluster.intra_node_GBps or link.bandwidth_GBps
    latency = (
        link.latency_us if cluster.intra_node_latency_us is None else cluster.intra_node_latency_us
    )
    return LinkModel(
        "intra_node", bandwidth * 1e9 * link.busbw_efficiency, latency * 1e-6,
        _factors(link), _call_s(link),
    )  # fmt: skip


def _inter(cluster: Cluster, profile: HardwareProfile, members_per_node: int) -> LinkModel:
    link = profile.links.inter_node
    bandwidth = (cluster.inter_node_GBps or link.bandwidth_GBps) * 1e9 * link.busbw_efficiency
    latency = (
        link.latency_us if cluster.inter_node_latency_us is None else cluster.inter_node_latency_us
    )
    intra = _intra(cluster, profile)
    return LinkModel(
        "inter_node", min(members_per_node * bandwidth, intra.busbw_Bps), latency * 1e-6,
        _factors(link), _call_s(link),
    )  # fmt: skip


def alltoall_time(
    size_bytes: float, n: int, cluster: Cluster, profile: HardwareProfile,
    sent: tuple[float, float] | None = None, *, stride: int = 1,
) -> float:  # fmt: skip
    """An all-to-all of ``size_bytes`` per rank over ``n`` ranks ``stride`` apart (each
    sends ``1/n`` of it to every other). ``sent``: the (scale-up, network) bytes a rank
    really sends where a dispatcher deduplicates (default: ``size_bytes`` spread evenly,
    ``(members per node - 1) / n`` of it to its own node's ranks, the rest to other
    nodes). The network share leaves through the rank's own NIC (no sharing: every rank
    sends at once) while the rest crosses the scale-up link, and the slower part decides."""
    per_node = min(members_per_node(cluster, stride), n)
    if n <= 1 or size_bytes <= 0:
        return 0.0
    local, remote = sent or (size_bytes * (per_node - 1) / n, size_bytes * (n - per_node) / n)
    intra = _intra(cluster, profile)
    local_s = local / intra.busbw_for(Collective.ALL_TO_ALL)
    if per_node == n:
        return intra.call_s + latency_steps(Collective.ALL_TO_ALL, n) * intra.latency_s + local_s
    inter = _inter(cluster, profile, 1)
    remote_s = remote / inter.busbw_for(Collective.ALL_TO_ALL)
    return inter.call_s + inter.latency_s + max(local_s, remote_s)


def members_per_node(cluster: Cluster, stride: int) -> int:
    """Members of a group whose ranks sit ``stride`` apart that one node holds (at least
    one; at most the group's size is the caller's to cap)."""
    return max(1, min(cluster.gpus_per_node, cluster.num_gpus) // stride)


def link_for_axis(size: int, stride: int, cluster: Cluster, profile: HardwareProfile) -> LinkModel:
    """The link a mesh axis of ``size`` ranks, ``stride`` ranks apart, communicates over."""
    span = size * stride
    if span <= min(cluster.gpus_per_node, cluster.num_gpus):
        return _intra(cluster, profile)
    link = _inter(cluster, profile, members_per_node(cluster, stride))
    for tier in cluster.extra_tiers:
        if span <= tier.domain_size:
            continue
        share = tier.uplink_GBps * 1e9 / min(stride, tier.domain_size)
        if share < link.busbw_Bps:
            latency = max(link.latency_s, tier.latency_us * 1e-6)
            link = LinkModel(tier.name, share, latency, link.factors, link.call_s)
    return link


@dataclass(frozen=True)
class MeshLinks:
    """The links a strategy's mesh groups use on ``cluster``; where a group's ranks lie
    is :meth:`~planner.parallel_dims.ParallelDims.stride`'s to say."""

    cluster: Cluster
    profile: HardwareProfile

    def group(self, size: int, dims: ParallelDims, innermost: Axis) -> LinkModel:
        """The link of ``size`` ranks of ``dims``'s mesh whose innermost axis is ``innermost``."""
        return link_for_axis(size, dims.stride(innermost), self.cluster, self.profile)
