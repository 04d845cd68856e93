"""How many GPUs, how long, what cost: the arithmetic of ``plan scale`` (torch-free).

The search plans a model at each cluster size (:mod:`planner.scaling`); this module
turns those plans into the table. With ``T(N)`` the cluster's tokens/s at ``N`` GPUs
(the plan's tokens/s per GPU x ``N``; a step is global batch x sequence tokens), over the
sizes where a plan fits, smallest first:

- **days to train** ``tokens`` = ``tokens / T(N) / 86,400``; **GPU-hours** =
  ``days x 24 x N``; **cost** = GPU-hours x the price per GPU-hour.
- **free memory** = the GPU's memory limit - the plan's peak memory per GPU (GiB).
- **scaling efficiency** against the smallest fitting size ``N0``:
  ``(T(N) / N) / (T(N0) / N0)``; 1 is linear scaling.
- **marginal efficiency** of a size against the previous fitting one: what each added
  GPU delivers relative to what each GPU delivered before,
  ``((T(N) - T(N')) / (N - N')) / (T(N') / N')``. At a doubling it is
  ``T(N) / T(N') - 1``: 0.8 means twice the GPUs gave 1.8x the throughput.
- **the knee**: the largest size reached before the marginal efficiency first falls
  below a threshold (default :data:`KNEE_THRESHOLD`, 0.8), i.e. the last size whose
  every step up from the smallest bought at least 0.8 of a GPU's worth of throughput
  per GPU added. Past it, each added GPU-hour buys under 80% of the tokens the GPUs
  already there buy, so cost per token rises by more than a quarter on those GPUs.
  A later recovery (more GPUs freeing memory for a faster strategy) is not followed:
  the table's efficiency columns show it. With one fitting size, the knee is that size.
  Kneedle (Satopää et al., 2011) was not used: on a handful of sizes its answer moves
  with how the axes are normalised, and it names a knee even on a perfectly linear
  curve, whereas this threshold has a price meaning and names the largest size when
  scaling stays near-linear throughout.
- **deadline**: the smallest fitting size whose days to train are at most the deadline.

Sizes are given as ``A..B`` (A, 2A, 4A, ... up to B, which must be A x 2^k) or a comma
list; a size above one node must be whole nodes (the :class:`~planner.spec.Cluster`
rule), checked for every size before any is planned.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError

from planner.errors import SpecError
from planner.io import dumps_json
from planner.spec import MAX_GPUS, Cluster, Limit

__all__ = [
    "KNEE_THRESHOLD",
    "MAX_SIZES",
    "MAX_TOKENS",
    "MAX_PRICE",
    "MAX_KNEE_THRESHOLD",
    "GpuSizes",
    "SizeFit",
    "SizeMiss",
    "ScaleRow",
    "ScaleTable",
    "scale_table",
    "parse_duration_days",
    "marginal_efficiency",
    "short_reason",
]

KNEE_THRESHOLD = 0.8  # marginal efficiency below which added GPUs are past the knee
MAX_SIZES = Limit(64, "each size is a whole search; a sweep needs a dozen sizes at most")
MAX_TOKENS = Limit(1e18, "the largest published training budgets are ~4e13 tokens")
MAX_PRICE = Limit(1e4, "GPUs rent for a few units of currency per hour")
MAX_KNEE_THRESHOLD = Limit(1.0, "a marginal efficiency of 1 is linear scaling")
_SECONDS_PER_DAY = 86_400
_HOURS_PER_DAY = 24
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([dh])")
_HOURS_PER_UNIT = {"d": 24.0, "h": 1.0}
_SHORT_REASON = 160  # characters of a no-fit reason a table row shows
_ASIDE = re.compile(r" \([^()]*\)")  # " (largest terms, GiB: ...)", not "dp1(zero3)"


# ----- input: sizes and deadlines -----------------------------------------------------------


@dataclass(frozen=True)
class GpuSizes:
    """Cluster sizes to plan, smallest first, and the text that gave them (for messages)."""

    sizes: tuple[int, ...]
    text: str
    doubling: bool = False  # given as A..B

    @classmethod
    def parse(cls, text: str) -> GpuSizes:
        """``'64..1024'`` (64, 128, ..., 1024) or ``'64,128,512'``; raises :class:`SpecError`
        naming the value and the fix."""
        text = text.strip()
        if ".." in text:
            low, _, high = text.partition("..")
            first, last = _gpu_count(low, text), _gpu_count(high, text)
            return cls(_doublings(first, last, text), text, doubling=True)
        sizes = [_gpu_count(part, text) for part in text.split(",")]
        repeated = sorted({n for n in sizes if sizes.count(n) > 1})
        if repeated:
            raise SpecError(f"{text}: {repeated[0]} appears twice; list each size once")
        return cls.of(sizes, text)

    @classmethod
    def of(cls, sizes: Iterable[int], text: str = "") -> GpuSizes:
        """The sizes of a Python sequence, sorted; duplicates dropped."""
        given = list(sizes)
        ordered = tuple(sorted(set(given)))
        if not ordered or any(not isinstance(n, int) or n < 1 for n in ordered):
            raise SpecError(f"GPU sizes {given}: give positive integers, e.g. [64, 128]")
        if len(ordered) > MAX_SIZES.most:
            raise SpecError(
                f"{len(ordered)} sizes > {MAX_SIZES.most}: {MAX_SIZES.why}; give fewer sizes"
            )
        return cls(ordered, text or ",".join(map(str, ordered)))

    def clusters(self, base: Cluster) -> tuple[Cluster, ...]:
        """``base`` (its GPU, node size and links) at each size; raises :class:`SpecError`
        before anything is planned when a size cannot be a cluster of ``base``'s nodes."""
        return tuple(self._cluster(base, gpus) for gpus in self.sizes)

    def _cluster(self, base: Cluster, gpus: int) -> Cluster:
        try:
            return Cluster.model_validate(base.model_dump() | {"num_gpus": gpus})
        except ValidationError as exc:
            why = "; ".join(str(e.get("ctx", {}).get("error", e["msg"])) for e in exc.errors())
            raise SpecError(f"--gpus {self.text}: {why}; {self._fix(base)}") from None

    def _fix(self, base: Cluster) -> str:
        node = base.gpus_per_node
        if self.doubling:
            last = node * 2 ** (len(self.sizes) - 1)
            return f"start the range at a multiple of the node size, {node} (e.g. {node}..{last})"
        return f"use sizes of at most one node ({node} GPUs) or multiples of {node}"


def _gpu_count(part: str, text: str) -> int:
    try:
        value = int(part)
    except ValueError:
        raise SpecError(
            f"{text!r}: expected A..B (e.g. 64..1024) or a comma list (e.g. 64,128,512)"
        ) from None
    if value < 1:
        raise SpecError(f"{text}: {value} GPUs; sizes are positive integers")
    if value > MAX_GPUS.most:
        raise SpecError(f"{text}: {value} > {MAX_GPUS.most}: {MAX_GPUS.why}")
    return value


def _doublings(first: int, last: int, text: str) -> tuple[int, ...]:
    """``first, 2 first, 4 first, ..., last``; ``last`` must be ``first x 2^k``."""
    if last < first:
        raise SpecError(f"{text}: the range runs upwards; write {last}..{first}")
    steps = math.floor(math.log2(last / first))
    if first * 2**steps != last:
        below, above = first * 2**steps, first * 2 ** (steps + 1)
        raise SpecError(
            f"{text}: {last} is not {first} times a power of two; end the range at "
            f"{below} or {above}, or list the sizes (e.g. {first},{last})"
        )
    if steps + 1 > MAX_SIZES.most:
        raise SpecError(f"{text}: {steps + 1} sizes > {MAX_SIZES.most}: {MAX_SIZES.why}")
    return tuple(first * 2**k for k in range(steps + 1))


def parse_duration_days(text: str) -> float:
    """``'30d'`` -> 30.0, ``'12h'`` -> 0.5: a positive duration in days (units d, h)."""
    match = _DURATION.fullmatch(text.strip())
    value = float(match.group(1)) if match else 0.0
    if match is None or value <= 0:
        raise SpecError(
            f"expected a positive duration such as 30d or 12h (units: d, h), got {text!r}"
        )
    return value * _HOURS_PER_UNIT[match.group(2)] / _HOURS_PER_DAY


# ----- the table -------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeFit:
    """What the search planned at one size: the figures the table is computed from."""

    gpus: int
    strategy: str  # Strategy.describe()
    step_time_s: float
    tokens_per_s: float  # the whole cluster's
    mfu: float  # fraction of peak
    peak_memory_gib: float  # per GPU
    memory_limit_gib: float  # per GPU


@dataclass(frozen=True)
class SizeMiss:
    """A size where no plan fits, and the search's reason."""

    gpus: int
    reason: str

    fits = False


@dataclass(frozen=True)
class ScaleRow:
    """One fitting size of the table (definitions in the module docstring)."""

    gpus: int
    strategy: str
    step_time_s: float
    mfu: float  # fraction
    tokens_per_s: float  # cluster
    days: float
    gpu_hours: float
    cost: float | None  # None: no price given
    free_gib: float  # memory limit - peak, per GPU
    efficiency: float  # against the smallest fitting size; 1 is linear
    marginal_efficiency: float | None  # against the previous fitting size; None for the first

    fits = True


@dataclass(frozen=True)
class ScaleTable:
    """Rows (fitting or not) smallest size first, the knee and the deadline's answer."""

    model: str
    cluster: str  # its profile name, or its GPU's
    tokens: float
    price_per_gpu_hour: float | None
    knee_threshold: float
    deadline_days: float | None
    rows: tuple[ScaleRow | SizeMiss, ...]

    @property
    def fitting(self) -> tuple[ScaleRow, ...]:
        return tuple(row for row in self.rows if isinstance(row, ScaleRow))

    @property
    def knee(self) -> ScaleRow | None:
        """The last fitting size before the marginal efficiency first falls below the
        threshold (the module docstring's definition); None when nothing fits."""
        fitting = self.fitting
        for index, row in enumerate(fitting[1:], start=1):
            assert row.marginal_efficiency is not None
            if row.marginal_efficiency < self.knee_threshold:
                return fitting[index - 1]
        return fitting[-1] if fitting else None

    @property
    def fastest(self) -> ScaleRow | None:
        """The fitting size that trains the budget in the fewest days."""
        return min(self.fitting, key=lambda row: row.days, default=None)

    @property
    def meets_deadline(self) -> ScaleRow | None:
        """The smallest fitting size that trains the budget within the deadline."""
        if self.deadline_days is None:
            return None
        return next((r for r in self.fitting if r.days <= self.deadline_days), None)

    def to_dict(self) -> dict[str, Any]:
        knee, met, fastest = self.knee, self.meets_deadline, self.fastest
        rows = [asdict(row) | {"fits": row.fits} for row in self.rows]
        return {
            "model": self.model, "cluster": self.cluster, "tokens": self.tokens,
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "knee": {"gpus": knee.gpus if knee else None, "threshold": self.knee_threshold},
            "deadline": None if self.deadline_days is None else {
                "days": self.deadline_days, "gpus": met.gpus if met else None,
                "fastest_gpus": fastest.gpus if fastest else None,
                "fastest_days": fastest.days if fastest else None,
            },
            "rows": rows,
        }  # fmt: skip

    def to_json(self) -> str:
        return dumps_json(self.to_dict(), what="scale table")


def marginal_efficiency(
    previous_gpus: int, previous_tokens_per_s: float, gpus: int, tokens_per_s: float
) -> float:
    """Throughput per added GPU over throughput per GPU at the previous size."""
    added = (tokens_per_s - previous_tokens_per_s) / (gpus - previous_gpus)
    return added / (previous_tokens_per_s / previous_gpus)


def scale_table(
    outcomes: Sequence[SizeFit | SizeMiss],
    *,
    tokens: float,
    price_per_gpu_hour: float | None = None,
    deadline_days: float | None = None,
    knee_threshold: float = KNEE_THRESHOLD,
    model: str = "",
    cluster: str = "",
) -> ScaleTable:
    """The table of ``outcomes`` (one per size) for a budget of ``tokens`` tokens, at
    ``price_per_gpu_hour`` (any currency) and against ``deadline_days`` when given."""
    _check_positive("tokens", tokens, MAX_TOKENS)
    for name, value in (
        ("price_per_gpu_hour", price_per_gpu_hour),
        ("deadline_days", deadline_days),
    ):
        if value is not None:
            _check_positive(name, value)
    _check_positive("knee_threshold", knee_threshold, MAX_KNEE_THRESHOLD)
    ordered = sorted(outcomes, key=lambda outcome: outcome.gpus)
    gpus = [outcome.gpus for outcome in ordered]
    if len(set(gpus)) != len(gpus):
        raise SpecError(f"sizes {gpus}: each size may appear once")
    fits = [outcome for outcome in ordered if isinstance(outcome, SizeFit)]
    rows: dict[int, ScaleRow | SizeMiss] = {o.gpus: o for o in ordered if isinstance(o, SizeMiss)}
    for index, fit in enumerate(fits):
        rows[fit.gpus] = _row(fit, fits[0], fits[index - 1] if index else None, tokens,
                              price_per_gpu_hour)  # fmt: skip
    return ScaleTable(
        model=model, cluster=cluster, tokens=tokens, price_per_gpu_hour=price_per_gpu_hour,
        knee_threshold=knee_threshold, deadline_days=deadline_days,
        rows=tuple(rows[n] for n in gpus),
    )  # fmt: skip


def _row(
    fit: SizeFit, smallest: SizeFit, previous: SizeFit | None, tokens: float, price: float | None
) -> ScaleRow:
    days = tokens / fit.tokens_per_s / _SECONDS_PER_DAY
    gpu_hours = days * _HOURS_PER_DAY * fit.gpus
    per_gpu, smallest_per_gpu = fit.tokens_per_s / fit.gpus, smallest.tokens_per_s / smallest.gpus
    marginal = None
    if previous is not None:
        marginal = marginal_efficiency(
            previous.gpus, previous.tokens_per_s, fit.gpus, fit.tokens_per_s
        )
    return ScaleRow(
        gpus=fit.gpus, strategy=fit.strategy, step_time_s=fit.step_time_s, mfu=fit.mfu,
        tokens_per_s=fit.tokens_per_s, days=days, gpu_hours=gpu_hours,
        cost=None if price is None else gpu_hours * price,
        free_gib=fit.memory_limit_gib - fit.peak_memory_gib,
        efficiency=per_gpu / smallest_per_gpu, marginal_efficiency=marginal,
    )  # fmt: skip


def _check_positive(name: str, value: float, limit: Limit | None = None) -> None:
    if not math.isfinite(value) or value <= 0:
        raise SpecError(f"{name} = {value}: give a positive finite number")
    if limit is not None and value > limit.most:
        raise SpecError(f"{name} = {value:g} > {limit.most:g}: {limit.why}")


def short_reason(reason: str) -> str:
    """A no-fit message cut to what a table cell shows: its first sentence up to the
    first ``;``, without parenthesised asides, at most 160 characters."""
    first = reason.split(". ", 1)[0].split("; ", 1)[0].rstrip(".")
    first = _ASIDE.sub("", first)
    return first if len(first) <= _SHORT_REASON else first[: _SHORT_REASON - 3] + "..."
