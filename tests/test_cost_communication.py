"""Collectives: NCCL bus factors, protocols and algorithms, and the link tier an axis spans."""

import itertools

import pytest

from planner.clusters import resolve_cluster
from planner.cost.communication import (
    Collective,
    LinkModel,
    bus_factor,
    collective_time,
    latency_steps,
    link_for_axis,
)
from planner.hardware import load_profile
from planner.spec import Cluster, LinkTier

LINK = LinkModel("test", busbw_Bps=100e9, latency_s=0.0)
A100 = load_profile("a100-sxm-80gb")


def test_all_reduce_moves_2_n_minus_1_over_n():
    assert collective_time(Collective.ALL_REDUCE, 1e9, 8, LINK) == pytest.approx(2 * 7 / 8 * 1e-2)


@pytest.mark.parametrize("kind", [Collective.ALL_GATHER, Collective.REDUCE_SCATTER])
def test_all_gather_and_reduce_scatter_move_n_minus_1_over_n(kind):
    assert collective_time(kind, 1e9, 4, LINK) == pytest.approx(3 / 4 * 1e-2)


def test_send_recv_and_single_rank():
    assert bus_factor(Collective.SEND_RECV, 2) == 1.0
    assert collective_time(Collective.ALL_REDUCE, 1e9, 1, LINK) == 0.0


def test_latency_steps_ring_versus_tree():
    assert latency_steps(Collective.ALL_REDUCE, 2) == 2  # ring 2(n-1) = tree 2 log2 n
    assert latency_steps(Collective.ALL_REDUCE, 64) == 12  # tree beats ring's 126
    assert latency_steps(Collective.ALL_GATHER, 8) == 7
    slow = LinkModel("lat", busbw_Bps=1e30, latency_s=1e-5)
    assert collective_time(Collective.ALL_GATHER, 1.0, 8, slow) == pytest.approx(7e-5)


def test_axis_inside_a_node_uses_nvlink():
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=16, gpus_per_node=8)
    link = link_for_axis(8, 1, cluster, A100)
    assert link.name == "intra_node"
    assert link.busbw_Bps == pytest.approx(300e9 * 0.68)


def test_axis_across_nodes_pays_the_network():
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=16, gpus_per_node=8)
    one_per_node = link_for_axis(2, 8, cluster, A100)  # e.g. dp across tp=8 nodes
    assert one_per_node.name == "inter_node"
    assert one_per_node.busbw_Bps == pytest.approx(25e9 * 0.9)
    eight_per_node = link_for_axis(16, 1, cluster, A100)  # members share the node's NICs
    assert eight_per_node.busbw_Bps == pytest.approx(8 * 25e9 * 0.9)


def test_cluster_overrides_and_extra_tiers():
    cluster = Cluster(
        gpu="a100-sxm-80gb", num_gpus=64, gpus_per_node=8, inter_node_GBps=50,
        extra_tiers=(LinkTier(name="site", domain_size=32, uplink_GBps=40, latency_us=100),),
    )  # fmt: skip
    assert link_for_axis(2, 8, cluster, A100).busbw_Bps == pytest.approx(50e9 * 0.9)
    crossing = link_for_axis(8, 8, cluster, A100)  # spans 64 GPUs > the 32-GPU site
    assert crossing.name == "site"
    assert crossing.busbw_Bps == pytest.approx(40e9 / 8)  # 8 groups share the uplink
    assert crossing.latency_s == pytest.approx(100e-6)
    whole_site = link_for_axis(2, 32, cluster, A100)  # pp across sites: 32 pairs share it
    assert whole_site.busbw_Bps == pytest.approx(40e9 / 32)
    one_group = link_for_axis(64, 1, cluster, A100)  # one ring leaves the site
    assert one_group.busbw_Bps == pytest.approx(40e9)  # the whole uplink


def test_a_slow_network_slows_every_protocol_not_only_the_bulk_one():
    """A network slower than the profile's (TCP, EFA, a WAN between sites) makes every
    step that crosses it slow: the low-latency protocols' too, not only the bulk one's."""
    h100 = load_profile("h100-sxm-80gb")
    tcp = Cluster(gpu="h100-sxm-80gb", num_gpus=16, inter_node_latency_us=30)
    over_tcp = link_for_axis(16, 1, tcp, h100)
    assert over_tcp.latency_s == pytest.approx(30e-6)
    assert all(p.remote_hop_s == pytest.approx(30e-6) for p in over_tcp.protocols)
    small = collective_time(Collective.ALL_REDUCE, 8e3, 16, over_tcp)
    assert small > 2 * 30e-6  # a tree over 2 nodes crosses the network up and down
    sites = Cluster(
        gpu="h100-sxm-80gb", num_gpus=64,
        extra_tiers=(LinkTier(name="wan", domain_size=16, uplink_GBps=1.25, latency_us=10e3),),
    )  # fmt: skip
    over_wan = link_for_axis(2, 32, sites, h100)  # a pipeline hop between sites
    assert all(p.remote_hop_s == pytest.approx(10e-3) for p in over_wan.protocols)
    assert collective_time(Collective.SEND_RECV, 8e3, 2, over_wan) > 10e-3
    fast = link_for_axis(16, 1, Cluster(gpu="h100-sxm-80gb", num_gpus=16), h100)
    assert [p.remote_hop_s for p in fast.protocols] == [
        p.hop_us * 1e-6 for p in h100.links.inter_node.protocols.values()
    ]  # the profile's own network keeps its protocols' hops


def test_aws_efa_slows_small_collectives_across_nodes_not_large_ones():
    """``aws-p5``'s EFA steps take 23 us (aws-ofi-nccl's model) where InfiniBand's take
    2.7-8: a small all-reduce over two nodes is slower, a large one as fast."""
    h100 = load_profile("h100-sxm-80gb")
    efa = resolve_cluster("aws-p5", num_gpus=16)
    infiniband = Cluster(gpu="h100-sxm-80gb", num_gpus=16)

    def all_reduce(cluster: Cluster, size: float) -> float:
        return collective_time(Collective.ALL_REDUCE, size, 16, link_for_axis(16, 1, cluster, h100))

    assert all_reduce(efa, 8e3) > all_reduce(infiniband, 8e3) + 2 * (23 - 8) * 1e-6
    assert all_reduce(efa, 8e9) == pytest.approx(all_reduce(infiniband, 8e9), rel=0.01)
    inside = link_for_axis(8, 1, efa, h100)  # NVLink inside a p5 node, as in a DGX
    assert inside == link_for_axis(8, 1, infiniband, h100)


# --- protocols, algorithms and the nccl-tests curve ---------------------------------------

from planner.cost.communication import Algorithm, ProtocolModel  # noqa: E402
from tests.benchmark_modules import load_benchmark  # noqa: E402

PROTOCOL_LINK = LinkModel(
    "nvlink", busbw_Bps=100e9, latency_s=2e-6, launch_s=50e-6,
    protocols=(ProtocolModel(5e-6, 0.5e-6, 0.5e-6, 0.5),),
)  # fmt: skip


def test_a_small_message_takes_the_low_latency_protocol_and_a_large_one_the_bulk():
    small = collective_time(Collective.ALL_GATHER, 8e3, 8, PROTOCOL_LINK)
    assert small == pytest.approx(5e-6 + 7 * 0.5e-6 + 7 / 8 * 8e3 / 50e9)
    large = collective_time(Collective.ALL_GATHER, 8e9, 8, PROTOCOL_LINK)
    assert large == pytest.approx(50e-6 + 7 * 2e-6 + 7 / 8 * 8e9 / 100e9)


def test_bus_bandwidth_saturates_with_message_size():
    """nccl-tests' shape: busbw rises with size and approaches the link's, never above."""
    h100 = load_profile("h100-sxm-80gb")
    link = link_for_axis(8, 1, Cluster(gpu="h100-sxm-80gb", num_gpus=8), h100)
    sizes = [2**k for k in range(13, 34)]
    busbw = [bus_factor(Collective.ALL_REDUCE, 8) * s / collective_time(
        Collective.ALL_REDUCE, s, 8, link) for s in sizes]  # fmt: skip
    assert all(a < b for a, b in itertools.pairwise(busbw))
    assert busbw[-1] < link.busbw_for(Collective.ALL_REDUCE) < 1.1 * busbw[-1]
    assert busbw[0] < 0.01 * busbw[-1]


def test_a_ring_across_nodes_pays_the_network_only_where_it_leaves_a_node():
    link = LinkModel(
        "net", busbw_Bps=1e30, latency_s=10e-6, members_per_node=8, local_latency_s=1e-6
    )
    # 16 ranks on 2 nodes: 14 of the ring's 15 all-gather steps stay inside a node
    assert collective_time(Collective.ALL_GATHER, 1.0, 16, link) == pytest.approx(
        14 * 1e-6 + 1 * 10e-6
    )


def test_a_forced_ring_pays_every_step_at_scale_and_the_default_takes_the_tree():
    link = LinkModel("net", busbw_Bps=45e9, latency_s=8e-6, members_per_node=8,
                     local_latency_s=2e-6, tree_share=0.8)  # fmt: skip
    ring = collective_time(Collective.ALL_REDUCE, 1e6, 1024, link, Algorithm.RING)
    assert ring == pytest.approx(
        2 * (1023 - 127) * 2e-6 + 2 * 127 * 8e-6 + 2 * 1023 / 1024 * 1e6 / 45e9
    )
    default = collective_time(Collective.ALL_REDUCE, 1e6, 1024, link)
    tree = 2 * 7 * 2e-6 + 2 * 7 * 8e-6 + 2 * 1e6 / (0.8 * 45e9)  # a chain of 8 in a node
    assert default == pytest.approx(tree)
    assert default < ring


def test_collective_factors_scale_the_bulk_protocol_only():
    link = LinkModel("nvls", busbw_Bps=100e9, latency_s=0.0, factors={"all_reduce": 2.0},
                     protocols=(ProtocolModel(0.0, 0.0, 0.0, 0.5),))  # fmt: skip
    big = collective_time(Collective.ALL_REDUCE, 1e9, 2, link)
    assert big == pytest.approx(1e9 / 200e9)  # bulk at 2x beats the protocol at 0.5x


def test_the_public_nccl_tests_rows_are_priced_within_their_band():
    """The shipped profiles against benchmarks/data/nccl_tests.csv (fails if a profile's
    link parameters drift from the fit the benchmark prints)."""
    bench = load_benchmark("bench_collectives")
    rows = bench.load_rows()
    profiles = {name: load_profile(name) for name in {r.profile for r in rows}}
    fit_errors = [
        abs(e) for r, e in zip(rows, bench.errors(rows, profiles), strict=True) if r.role == "fit"
    ]
    assert sum(fit_errors) / len(fit_errors) < 0.05
    held = [r for r in rows if r.role == "held-out"]
    held_errors = [abs(e) for e in bench.errors(held, profiles)]
    assert sum(held_errors) / len(held_errors) < 0.125
    efa = [r for r in held if r.shown == "aws-p5"]  # EFA: its latency, not InfiniBand's
    efa_errors = [abs(e) for e in bench.errors(efa, profiles)]
    assert len(efa) == 22 and sum(efa_errors) / len(efa_errors) < 0.15


def test_an_nvls_tree_over_two_nodes_outruns_the_nics_and_over_more_does_not():
    """NCCL's NVLS tree (the switch reduces inside each node): over two nodes a node's
    NICs carry the array once each way, so it runs at up to twice the network's rate,
    capped by the switch's; over more nodes at the network's (src/graph/tuning.cc)."""
    link = LinkModel("net", busbw_Bps=360e9, latency_s=0.0, members_per_node=8,
                     local_latency_s=0.0, tree_share=0.3, multicast_Bps=474e9)  # fmt: skip
    size = 8e9
    two = collective_time(Collective.ALL_REDUCE, size, 16, link)
    assert two == pytest.approx(2 * 15 / 16 * size / 474e9)  # the switch caps 720
    four = collective_time(Collective.ALL_REDUCE, size, 32, link)
    assert four == pytest.approx(2 * 31 / 32 * size / 360e9)  # as fast as the ring
    plain = LinkModel("net", busbw_Bps=360e9, latency_s=0.0, members_per_node=8,
                      local_latency_s=0.0, tree_share=0.3)  # fmt: skip
    assert collective_time(Collective.ALL_REDUCE, size, 16, plain) > two


def test_only_hopper_switches_reduce_in_the_network():
    for name in ("h100-sxm-80gb", "h200-sxm-141gb"):
        assert load_profile(name).links.intra_node.multicast
    assert not A100.links.intra_node.multicast
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=16, gpus_per_node=8)
    assert link_for_axis(16, 1, cluster, A100).multicast_Bps is None
