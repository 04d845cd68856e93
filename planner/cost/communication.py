"""Collective communication time: the NCCL bus-bandwidth factors, per protocol and algorithm.

A collective over ``n`` ranks moving an array of ``S`` bytes takes, on one protocol and
algorithm, ``launch + steps * hop + factor * S / busbw`` where ``factor`` is
nccl-tests' bus factor (all-reduce ``2(n-1)/n``; all-gather, reduce-scatter and
all-to-all ``(n-1)/n``; send/recv and broadcast 1) and ``busbw`` is the link's line rate
times its measured bus-bandwidth efficiency, times the protocol's and the algorithm's
share of it. The bulk protocol pays the link's ``launch_us`` and ``latency_us`` per step
at the full rate; a link's low-latency ``protocols`` (NCCL's LL and LL128) start sooner
at a share of it. Ring all-gather/reduce-scatter take ``n-1`` steps; all-reduce runs as
a ring (``2(n-1)`` steps) or a tree (``2*ceil(log2 n)`` steps inside a node; across nodes
a chain inside each and ``2*ceil(log2 nodes)`` steps between them, the network carrying
``2 S``), at the link's ``tree_bandwidth_share``. A step inside a node pays the
scale-up link's latency and one between nodes the network's. As NCCL does, a
collective takes the fastest combination,
which gives the bandwidth-over-message-size curve nccl-tests prints
(``benchmarks/bench_collectives.py``). A link may run one collective at a different bus
bandwidth than its ring (NVLink SHARP all-reduces faster; gloo's reduce-scatter reaches
about a third of its all-reduce): the profile's ``collective_factors`` scale the bulk
protocol's ``busbw`` per collective (default 1), and its ``call_overhead_us`` adds a
fixed cost per call (default 0).

The link tier is the one the mesh axis spans: an axis whose ranks fit in one node
uses the scale-up link; one that crosses nodes pays the network, with the group's
members in one node sharing their NICs (``members_per_node * per-GPU network``, at
most the scale-up rate). An axis wider than an extra tier's domain (a site) also
crosses that tier: each group's ring leaves each domain once, and the groups with
members in a domain (``min(stride, domain_size)`` of them, all reducing at once) share
its uplink, so a group gets ``uplink / min(stride, domain_size)``, at most what the
node network gives it; the slowest tier crossed decides. A network slower than the
profile's (a cluster's ``inter_node_latency_us``, a tier's ``latency_us``) slows every
protocol's step across it, the low-latency ones' too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple

from planner.hardware import HardwareProfile, Link
from planner.spec import Cluster

if TYPE_CHECKING:
    from planner.parallel_dims import ParallelDims
    from planner.spec import Axis

__all__ = [
    "Collective",
    "Algorithm",
    "bus_factor",
    "ring_steps",
    "tree_steps",
    "latency_steps",
    "ProtocolModel",
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


# NCCL's NVLS tree pays 20.9 us a network step where its ring pays 14 (src/graph/tuning.cc,
# hwLatencies NET Simple): an NVLS tree step counts as that many of the link's steps.
NVLS_TREE_HOP_STEPS = 20.9 / 14


class Algorithm(StrEnum):
    RING = "ring"
    TREE = "tree"


def ring_steps(kind: Collective, n: int) -> int:
    """Sequential message steps of ``kind`` over ``n`` ranks on a ring (send/recv: one;
    broadcast: a pipelined tree's ``ceil(log2 n)``)."""
    if kind is Collective.ALL_REDUCE:
        return 2 * (n - 1)
    if kind in (Collective.SEND_RECV, Collective.BROADCAST):
        return 1 if kind is Collective.SEND_RECV else math.ceil(math.log2(n))
    return n - 1


def tree_steps(n: int) -> int:
    """Sequential message steps of a tree all-reduce over ``n`` ranks (reduce up, broadcast down)."""
    return 2 * math.ceil(math.log2(n))


def latency_steps(kind: Collective, n: int) -> int:
    """Steps of the algorithm NCCL would pick where ring and tree move data equally fast."""
    if kind is Collective.ALL_REDUCE:
        return min(ring_steps(kind, n), tree_steps(n))
    return ring_steps(kind, n)


@dataclass(frozen=True)
class ProtocolModel:
    """A wire protocol on a link: fixed cost per call, per step inside a node and per step
    between nodes (s), and its share of the link's bus bandwidth."""

    launch_s: float
    local_hop_s: float
    remote_hop_s: float
    share: float


@dataclass(frozen=True)
class LinkModel:
    """A link as a collective sees it: achieved bus bandwidth (bytes/s) and step latency (s)
    of its bulk protocol, and its low-latency ``protocols``.

    ``factors`` maps a collective's value to the bulk protocol's bus bandwidth relative
    to ``busbw_Bps`` (the ring's); missing collectives get 1. ``call_s`` is paid once per
    collective call (the profile's ``call_overhead_us``); ``launch_s`` once per call of
    the bulk protocol. ``tree_share``: the tree all-reduce's share of the bandwidth
    (None: the ring's). A group across nodes has ``members_per_node`` ranks in each
    (None: one node): its steps between nodes pay ``latency_s`` and those inside a node
    ``local_latency_s``, as NCCL's rings and trees do. ``multicast_Bps``: the all-reduce
    rate of a scale-up switch that reduces in the network (None: it does not), which
    offers the group NCCL's NVLS tree.
    """

    name: str
    busbw_Bps: float
    latency_s: float
    factors: Mapping[str, float] = field(default_factory=dict)
    call_s: float = 0.0
    launch_s: float = 0.0
    protocols: tuple[ProtocolModel, ...] = ()
    tree_share: float | None = None
    members_per_node: int | None = None
    local_latency_s: float | None = None
    multicast_Bps: float | None = None

    def busbw_for(self, kind: Collective) -> float:
        """Bulk bus bandwidth of ``kind`` on this link (bytes/s)."""
        return self.busbw_Bps * self.factors.get(kind.value, 1.0)

    def network_at_least(self, latency_s: float) -> LinkModel:
        """This link where a step between nodes takes at least ``latency_s`` on every
        protocol (a network slower than the profile's: TCP, EFA, a WAN between sites)."""
        protocols = tuple(
            replace(p, remote_hop_s=max(p.remote_hop_s, latency_s)) for p in self.protocols
        )
        return replace(self, latency_s=max(self.latency_s, latency_s), protocols=protocols)

    def bulk(self, kind: Collective) -> ProtocolModel:
        """The bulk protocol for ``kind``, its bandwidth share relative to ``busbw_Bps``."""
        local = self.latency_s if self.local_latency_s is None else self.local_latency_s
        return ProtocolModel(
            self.launch_s, local, self.latency_s, self.factors.get(kind.value, 1.0)
        )


class _Route(NamedTuple):
    """One algorithm's cost on a link: steps inside a node and between nodes (in hops),
    seconds moving data at the bulk rate, and whether only the bulk protocol runs it."""

    local_steps: float
    remote_steps: float
    data_s: float
    bulk_only: bool = False


def _algorithms(
    kind: Collective, size_bytes: float, n: int, link: LinkModel, forced: Algorithm | None
) -> list[_Route]:
    """Each algorithm ``kind`` may run with over ``n`` ranks (``forced``: only that one).

    A ring moves ``bus_factor * S``. A tree all-reduce inside one node takes ``2 log2 n``
    steps; across nodes it chains the ranks of a node (``2(ppn - 1)`` steps) and spans
    the nodes in ``2 log2 nodes``, a node's network carrying the array up and down
    (``2 S``, NCCL's tree model), each at ``tree_share`` of the bandwidth. Where the
    switch reduces (``multicast_Bps``), NCCL's NVLS tree spans the nodes in ``2 log2
    nodes`` of its slower steps on its bulk protocol at the slower of the switch's rate
    and the network's, twice the network's over two nodes (``src/graph/tuning.cc``).
    """
    per_node = min(link.members_per_node or n, n)
    nodes = n // per_node
    ring_s = bus_factor(kind, n) * size_bytes / link.busbw_Bps
    if kind in (Collective.SEND_RECV, Collective.BROADCAST):
        steps = ring_steps(kind, n)
        return [_Route(0, steps, ring_s) if nodes > 1 else _Route(steps, 0, ring_s)]
    crossings = 0 if nodes == 1 else (2 if kind is Collective.ALL_REDUCE else 1) * (nodes - 1)
    ring = _Route(ring_steps(kind, n) - crossings, crossings, ring_s)
    if kind is not Collective.ALL_REDUCE or forced is Algorithm.RING:
        return [ring]
    rings = [ring] if forced is None else []
    share = 1.0 if link.tree_share is None else link.tree_share
    if nodes == 1:
        return [_Route(tree_steps(n), 0, ring_s / share), *rings]
    tree_s = 2 * size_bytes / (link.busbw_Bps * share)
    trees = [_Route(2 * (per_node - 1), tree_steps(nodes), tree_s)]
    if link.multicast_Bps is not None and forced is None:
        rate = min(link.multicast_Bps, (2 if nodes == 2 else 1) * link.busbw_Bps)
        hops = tree_steps(nodes) * NVLS_TREE_HOP_STEPS
        trees.append(_Route(0, hops, ring_s * link.busbw_Bps / rate, bulk_only=True))
    return trees + rings


def collective_time(
    kind: Collective, size_bytes: float, n: int, link: LinkModel,
    algorithm: Algorithm | None = None,
) -> float:  # fmt: skip
    """Seconds for one ``kind`` collective of ``size_bytes`` (the whole array) over ``n``
    ranks, on the fastest protocol and algorithm (``algorithm``: as a run that forces it,
    ``NCCL_ALGO``)."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    bulk = link.bulk(kind)
    return link.call_s + min(
        p.launch_s + r.local_steps * p.local_hop_s + r.remote_steps * p.remote_hop_s
        + r.data_s / p.share
        for p in (bulk, *link.protocols)
        for r in _algorithms(kind, size_bytes, n, link, algorithm)
        if p is bulk or not r.bulk_only
    )  # fmt: skip


def _link_model(
    name: str, link: Link, busbw_Bps: float, latency_us: float,
    within: tuple[Link, LinkModel] | None = None, members_per_node: int | None = None,
) -> LinkModel:  # fmt: skip
    """``link`` as a collective sees it; a group across nodes, ``members_per_node`` in
    each, steps inside a node over ``within`` (the scale-up link and its model)."""
    local_link = within[0] if within else link
    protocols = tuple(
        ProtocolModel(
            p.launch_us * 1e-6,
            local_link.protocols.get(protocol, p).hop_us * 1e-6,
            p.hop_us * 1e-6,
            p.bandwidth_share,
        )
        for protocol, p in link.protocols.items()
    )
    return LinkModel(
        name, busbw_Bps, latency_us * 1e-6,
        factors={str(kind): factor for kind, factor in link.collective_factors.items()},
        call_s=(link.call_overhead_us or 0.0) * 1e-6, launch_s=(link.launch_us or 0.0) * 1e-6,
        protocols=protocols, tree_share=link.tree_bandwidth_share,
        members_per_node=members_per_node, local_latency_s=within[1].latency_s if within else None,
        multicast_Bps=_multicast_Bps(within),
    )  # fmt: skip


def _multicast_Bps(within: tuple[Link, LinkModel] | None) -> float | None:
    """The in-network all-reduce rate of the scale-up switch ``within`` (None: none)."""
    if within is None or not within[0].multicast:
        return None
    return within[1].busbw_for(Collective.ALL_REDUCE)


def _intra(cluster: Cluster, profile: HardwareProfile) -> LinkModel:
    link = profile.links.intra_node
    bandwidth = cluster.intra_node_GBps or link.bandwidth_GBps
    latency = (
        link.latency_us if cluster.intra_node_latency_us is None else cluster.intra_node_latency_us
    )
    return _link_model("intra_node", link, bandwidth * 1e9 * link.busbw_efficiency, latency)


def _inter(cluster: Cluster, profile: HardwareProfile, members_per_node: int) -> LinkModel:
    """The network; a cluster's own ``inter_node_latency_us`` is its bulk protocol's
    step and the least any protocol's step across it takes."""
    link = profile.links.inter_node
    bandwidth = (cluster.inter_node_GBps or link.bandwidth_GBps) * 1e9 * link.busbw_efficiency
    latency = (
        link.latency_us if cluster.inter_node_latency_us is None else cluster.inter_node_latency_us
    )
    intra = _intra(cluster, profile)
    busbw = min(members_per_node * bandwidth, intra.busbw_Bps)
    within = (profile.links.intra_node, intra)
    model = _link_model("inter_node", link, busbw, latency, within, members_per_node)
    if cluster.inter_node_latency_us is None:
        return model
    return model.network_at_least(model.latency_s)


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
    if per_node == n:  # inside one node: an all-to-all like any other collective
        return collective_time(
            Collective.ALL_TO_ALL, local / bus_factor(Collective.ALL_TO_ALL, n), n, intra
        )
    local_s = local / intra.busbw_for(Collective.ALL_TO_ALL)
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
            link = replace(link, name=tier.name, busbw_Bps=share)
            link = link.network_at_least(tier.latency_us * 1e-6)
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
