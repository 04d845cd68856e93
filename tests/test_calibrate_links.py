"""The link fit (NCCL's protocol curve) on synthetic tables with known parameters, and on
the public nccl-tests rows the shipped Hopper profiles were fitted to."""

from __future__ import annotations

import numpy as np
import pytest

from planner.calibrate import CalibrationError
from planner.calibrate.links import (
    LinkSample,
    fit_link,
    price,
    table_error,
    with_link,
    with_values,
)
from planner.cost.communication import Algorithm, Collective
from planner.hardware import load_profile
from tests.benchmark_modules import load_benchmark

HOPPER = load_profile("h100-sxm-80gb")
SIZES = [float(2**k) for k in range(13, 35, 2)]  # 8 KB to 8 GB
RNG = np.random.default_rng(3)


def _table(
    profile: object, kind: Collective, ranks: int, per_node: int, noise: float = 0.01
) -> list[LinkSample]:
    """Samples of ``kind`` priced on ``profile``, each time off by about ``noise``."""
    exact = [LinkSample(kind, ranks, per_node, size, 1.0) for size in SIZES]
    return [
        LinkSample(kind, ranks, per_node, s.size_bytes,
                   price(s, profile) * (1 + noise * RNG.standard_normal()))  # type: ignore[arg-type]
        for s in exact
    ]  # fmt: skip


def test_fit_recovers_a_scale_up_links_bandwidth_launch_and_factor() -> None:
    truth_link = with_values(
        HOPPER.links.intra_node,
        {"bandwidth_GBps": 300.0, "launch_us": 30.0, "collective_factors.all_reduce": 1.5},
    )
    truth = with_link(HOPPER, "intra_node", truth_link)
    samples = _table(truth, Collective.ALL_GATHER, 8, 8) + _table(
        truth, Collective.ALL_REDUCE, 8, 8
    )
    link, fit = fit_link(samples, HOPPER, "intra_node")
    assert link.bandwidth_GBps == pytest.approx(300.0, rel=0.03)
    assert link.busbw_efficiency == 1.0  # a fitted bandwidth is the achieved one
    assert link.launch_us == pytest.approx(30.0, rel=0.15)
    assert link.collective_factors["all_reduce"] == pytest.approx(1.5, rel=0.03)
    assert fit.rms_after < 0.03 < fit.rms_before
    assert table_error(samples, with_link(HOPPER, "intra_node", link)) < 0.03


def test_fit_across_node_counts_recovers_the_networks_step_latency() -> None:
    truth_link = with_values(
        HOPPER.links.inter_node, {"bandwidth_GBps": 40.0, "latency_us": 20.0, "launch_us": 90.0}
    )
    truth = with_link(HOPPER, "inter_node", truth_link)
    samples = [
        s for ranks in (16, 64, 256)
        for s in _table(truth, Collective.ALL_REDUCE, ranks, 8, noise=0.0)
    ]  # fmt: skip
    link, _ = fit_link(samples, HOPPER, "inter_node")
    assert link.bandwidth_GBps == pytest.approx(40.0, rel=0.03)
    assert link.latency_us == pytest.approx(20.0, rel=0.1)


def test_what_the_samples_cannot_tell_apart_is_kept_from_the_profile() -> None:
    # one group size: no per-step latency; no message under 16 MB: no low-latency protocol;
    # all-reduce alone anchors the fitted bandwidth, so its factor stays
    base = HOPPER.links.intra_node
    samples = [s for s in _table(HOPPER, Collective.ALL_REDUCE, 8, 8) if s.size_bytes > 2**25]
    link, fit = fit_link(samples, HOPPER, "intra_node")
    assert link.latency_us == base.latency_us
    assert link.protocols == base.protocols
    assert link.collective_factors == base.collective_factors
    assert set(fit.values) == {"launch_us", "bandwidth_GBps", "tree_bandwidth_share"}


def test_forced_rings_leave_the_tree_share_and_a_datasheet_keeps_its_bandwidth() -> None:
    samples = [
        LinkSample(s.kind, s.ranks, s.per_node, s.size_bytes, s.seconds, Algorithm.RING)
        for s in _table(HOPPER, Collective.ALL_REDUCE, 16, 8)
    ]
    link, fit = fit_link(samples, HOPPER, "inter_node", fit_bandwidth=False)
    assert "tree_bandwidth_share" not in fit.values and "bandwidth_GBps" not in fit.values
    assert link.bandwidth_GBps == HOPPER.links.inter_node.bandwidth_GBps


def test_fit_refuses_samples_of_the_other_tier_and_too_few() -> None:
    intra = _table(HOPPER, Collective.ALL_REDUCE, 8, 8)
    with pytest.raises(CalibrationError, match="other tier"):
        fit_link(intra, HOPPER, "inter_node")
    with pytest.raises(CalibrationError, match="two or more samples"):
        fit_link(intra[:1], HOPPER, "intra_node")


def _public_rows(profile: str, ranks: int) -> list[LinkSample]:
    """The ``fit`` rows of one published nccl-tests table (``bench_collectives``'s)."""
    rows = load_benchmark("bench_collectives").load_rows()
    return [r.sample for r in rows if (r.profile, r.ranks, r.role) == (profile, ranks, "fit")]


@pytest.mark.parametrize(("tier", "ranks"), [("intra_node", 8), ("inter_node", 32)])
def test_the_shipped_hopper_links_are_what_the_fit_gives_on_their_public_rows(
    tier: str, ranks: int
) -> None:
    """``bench_collectives.py --fit`` fits the profile's links on these rows: refitting
    from the shipped values lands back on them (the fit is the profile's source)."""
    shipped = getattr(HOPPER.links, tier)
    link, _ = fit_link(_public_rows("h100-sxm-80gb", ranks), HOPPER, tier, fit_bandwidth=False)  # type: ignore[arg-type]
    assert link.launch_us == pytest.approx(shipped.launch_us, rel=0.01)
    assert link.tree_bandwidth_share == pytest.approx(shipped.tree_bandwidth_share, rel=0.01)
    for name, protocol in shipped.protocols.items():
        assert link.protocols[name].launch_us == pytest.approx(protocol.launch_us, rel=0.01)
