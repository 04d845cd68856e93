"""Fit one link tier's collective curve to measured collective times.

The curve is the one :mod:`planner.cost.communication` prices with (NCCL's protocols
and algorithms: a bulk protocol's per-call launch and bus bandwidth, a tree's share of
it, the low-latency protocols' launch and share), so a fitted number means what the
profile field means. Samples come from nccl-tests output
(:mod:`~planner.calibrate.nccl_tests`), the ``plan calibrate`` sweep, or published
tables (``benchmarks/bench_collectives.py``).

What the samples can tell apart is fitted; the rest is kept from the profile:

- ``launch_us`` always;
- the achieved ``bandwidth_GBps`` (with ``busbw_efficiency`` 1) when asked to;
- ``collective_factors`` of the collectives measured on the scale-up tier (where a
  switch may reduce in the network), less one whose factor is kept to anchor the
  bandwidth when that is fitted too; across nodes every collective moves at the ring's
  rate;
- ``tree_bandwidth_share`` when all-reduces ran on NCCL's own choice of algorithm;
- ``latency_us`` (per step) only when the samples span several group sizes (at one
  size a per-step latency and a per-call launch cannot be told apart);
- each low-latency protocol's launch and bandwidth share when at least
  :data:`SMALL_SAMPLES` messages are under :data:`SMALL_BYTES`; its per-step hop stays
  the profile's (NCCL's ``tuning.cc``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from planner.calibrate.fit import Array, Bound, CalibrationError, FitResult, fit_within
from planner.cost.communication import (
    Algorithm,
    Collective,
    alltoall_time,
    collective_time,
    link_for_axis,
)
from planner.hardware import HardwareProfile, Link, numbers
from planner.spec import Cluster

__all__ = [
    "Tier",
    "LinkSample",
    "SMALL_BYTES",
    "price",
    "with_link",
    "with_values",
    "fit_link",
    "fit_tier",
    "table_error",
]

Tier = Literal["intra_node", "inter_node"]
SMALL_BYTES = 16 << 20  # messages where the low-latency protocols may win
SMALL_SAMPLES = 2
# Kept to anchor a fitted bandwidth: the first of these the samples measured
_ANCHORS = (
    Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL,
    Collective.SEND_RECV, Collective.BROADCAST, Collective.ALL_REDUCE,
)  # fmt: skip
# Highest launch (us) and bandwidth share a low-latency protocol may fit to
_PROTOCOL_CAPS = {"LL": (50.0, 0.5), "LL128": (100.0, 120 / 128)}


@dataclass(frozen=True)
class LinkSample:
    """``size_bytes`` (the whole array) of ``kind`` over ``ranks`` GPUs, ``per_node`` to a
    node, took ``seconds``; ``algorithm``: the one the run forced (``NCCL_ALGO``);
    ``network_GBps`` and ``network_latency_us``: a node's network per GPU and its step
    latency where they differ from the profile's (a cluster profile's, as AWS EFA's)."""

    kind: Collective
    ranks: int
    per_node: int
    size_bytes: float
    seconds: float
    algorithm: Algorithm | None = None
    network_GBps: float | None = None
    network_latency_us: float | None = None

    @property
    def tier(self) -> Tier:
        return "intra_node" if self.ranks <= self.per_node else "inter_node"


def price(sample: LinkSample, profile: HardwareProfile) -> float:
    """Seconds the cost model gives ``sample``'s collective on ``profile`` (an all-to-all
    as expert parallelism prices it: ``size_bytes`` sent by each rank)."""
    cluster = Cluster(
        gpu=profile.name, num_gpus=sample.ranks, gpus_per_node=sample.per_node,
        inter_node_GBps=sample.network_GBps, inter_node_latency_us=sample.network_latency_us,
    )  # fmt: skip
    if sample.kind is Collective.ALL_TO_ALL:
        return alltoall_time(sample.size_bytes, sample.ranks, cluster, profile)
    link = link_for_axis(sample.ranks, 1, cluster, profile)
    return collective_time(sample.kind, sample.size_bytes, sample.ranks, link, sample.algorithm)


def with_link(profile: HardwareProfile, tier: Tier, link: Link) -> HardwareProfile:
    """``profile`` with ``tier``'s link replaced."""
    links = profile.links.model_copy(update={tier: link})
    return profile.model_copy(update={"links": links})


def _parameters(
    samples: Sequence[LinkSample], link: Link, tier: Tier, fit_bandwidth: bool
) -> list[tuple[Bound, float]]:
    """The (bound, start) of each parameter ``samples`` can tell apart (module docstring);
    names are the link's dotted field paths, starts the link's own values where it has
    them (a fit from a fitted profile stays where it was) and NCCL-like ones where not."""
    free = [(Bound("launch_us", 0.0, 500.0, " us"), link.launch_us or 20.0)]
    if fit_bandwidth:
        achieved = link.bandwidth_GBps * link.busbw_efficiency
        free.append((Bound("bandwidth_GBps", 1e-3, 1e5, " GB/s"), achieved))
    kinds = {s.kind for s in samples}
    if tier == "intra_node":
        anchor = next(k for k in _ANCHORS if k in kinds) if fit_bandwidth else None
        for kind in sorted(kinds - {anchor}):
            start = link.collective_factors.get(kind.value, 1.0)
            free.append((Bound(f"collective_factors.{kind.value}", 0.5, 2.0), start))
    if any(s.kind is Collective.ALL_REDUCE and s.algorithm is None for s in samples):
        free.append((Bound("tree_bandwidth_share", 0.3, 1.0), link.tree_bandwidth_share or 0.9))
    if len({s.ranks for s in samples}) > 1:
        free.append((Bound("latency_us", 0.0, 1e3, " us"), link.latency_us))
    if sum(s.size_bytes < SMALL_BYTES for s in samples) >= SMALL_SAMPLES:
        for name, protocol in link.protocols.items():
            # LL carries 8 bytes of data in 16, LL128 120 in 128 (NCCL's src/graph/tuning.cc)
            launch_high, share_high = _PROTOCOL_CAPS.get(name, (100.0, 1.0))
            path = f"protocols.{name}"
            free.append((Bound(f"{path}.launch_us", 0.0, launch_high, " us"), protocol.launch_us))
            free.append(
                (Bound(f"{path}.bandwidth_share", 0.05, share_high), protocol.bandwidth_share)
            )
    return free


def _set(data: dict[str, Any], path: str, value: float) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[leaf] = value


def with_values(link: Link, values: dict[str, float]) -> Link:
    """``link`` with fitted ``values`` by dotted field path; a fitted ``bandwidth_GBps`` is
    the achieved bus bandwidth (efficiency 1)."""
    data = link.model_dump()
    for path, value in values.items():
        _set(data, path, value)
    if "bandwidth_GBps" in values:
        data["busbw_efficiency"] = 1.0
    return Link.model_validate(data)


def fit_link(
    samples: Sequence[LinkSample], profile: HardwareProfile, tier: Tier,
    *, fit_bandwidth: bool = True,
) -> tuple[Link, FitResult]:  # fmt: skip
    """Least-squares fit (in log time) of ``tier``'s link on ``profile`` to ``samples``
    (all of that tier); the other tier prices steps inside a node as the profile has it.
    ``fit_bandwidth=False`` keeps the profile's line rate and efficiency (a datasheet)."""
    wrong = [s for s in samples if s.tier != tier]
    if wrong:
        raise CalibrationError(
            f"{tier} fit: {len(wrong)} samples ran on the other tier (e.g. {wrong[0].ranks} "
            f"ranks, {wrong[0].per_node} to a node); fit each tier on its own samples"
        )
    if len(samples) < 2 or any(s.seconds <= 0 or s.size_bytes <= 0 for s in samples):
        raise CalibrationError(
            f"{tier} fit: need two or more samples with positive sizes and times, got "
            f"{len(samples)}"
        )
    base = getattr(profile.links, tier)
    free = _parameters(samples, base, tier, fit_bandwidth)
    names = [bound.name for bound, _ in free]

    def fitted_link(x: Array) -> Link:
        return with_values(base, dict(zip(names, (float(v) for v in x), strict=True)))

    def residuals(x: Array) -> Array:
        fitted = with_link(profile, tier, fitted_link(x))
        return np.array([math.log(price(s, fitted) / s.seconds) for s in samples])

    result = fit_within(
        residuals, [start for _, start in free], [bound for bound, _ in free],
        what=f"{tier} collective fit",
        hint="check that the tables are of one cluster and re-run them on an idle one",
    )  # fmt: skip
    return fitted_link(np.array([result.values[n] for n in names])), result


def fit_tier(
    profile: HardwareProfile, samples: Sequence[LinkSample], tier: Tier, how: str
) -> tuple[HardwareProfile, FitResult, dict[str, tuple[float, float]]]:
    """``profile`` with ``tier``'s link fitted to ``samples`` (:func:`fit_link`), each
    field the fit changed sourced ``how``; the fit, and the changed fields' (before,
    after) by dotted profile path."""
    before = getattr(profile.links, tier)
    link, fit = fit_link(samples, profile, tier)
    changed = {
        f"links.{tier}.{path}": change for path, change in _fitted_fields(before, link).items()
    }
    sources = {**profile.sources, **dict.fromkeys(changed, how)}
    fitted = with_link(profile, tier, link).model_copy(update={"sources": sources})
    return fitted, fit, changed


def table_error(samples: Sequence[LinkSample], profile: HardwareProfile) -> float:
    """Mean |relative error| of ``profile``'s prices on ``samples``."""
    return sum(abs(price(s, profile) / s.seconds - 1) for s in samples) / len(samples)


def _fitted_fields(before: Link, after: Link) -> dict[str, tuple[float, float]]:
    """The link's numbers that the fit changed, by dotted path: (before, after)."""
    old, new = dict(numbers(before.model_dump())), dict(numbers(after.model_dump()))
    return {
        path: (old.get(path, math.nan), value)
        for path, value in new.items()
        if not math.isclose(old.get(path, math.nan), value)
    }
