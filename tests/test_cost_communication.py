"""Collectives: alpha-beta with NCCL bus factors, and the link tier an axis spans."""

import pytest

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
