"""Refit a profile's physical parameters to measured runs (``plan calibrate --from``).

Each :class:`~planner.measured.MeasuredProfile` carries its plan, so the cost model
re-prices it under trial parameters; ``scipy.optimize.least_squares`` minimises the log
ratio of predicted to measured step time over all runs, plus a weak pull of every
parameter towards the microbenchmarks' value (a parameter the runs cannot see stays
where the microbenchmarks put it).

The parameters are few, physical and bounded around the microbenchmarks
(:data:`REFIT_PARAMETERS`): the framework overhead of every operator (``op_overhead_us``:
Python, dispatch and autograd, which a bare kernel call does not pay; ``plan calibrate``
measures a first value on CPUs), the link's bus bandwidth
and per-step latency, and a fixed cost per collective call (dispatch, and the wait for
the slowest rank that a training step adds). The sweeps' own measurements are not
refitted: the GEMM and attention efficiencies and the streaming memory bandwidth are
measured directly, while in step times an efficiency trades off against every
per-operator and per-collective cost (a fit then slows every plan's compute to make up
for what only some plans pay, such as DTensor dispatch), and the only phase that shows
the memory bandwidth, the optimizer, would pull it towards whatever compensates the
optimizer's implementation (extra passes, temporaries). Pass ``parameters`` to refit
others, e.g. ``RefitParameter("compute", ("matmul_efficiency",), "scale", 0.5, 1.5,
cap=1.0)``. A fit that ends on a bound says so (a warning and
:attr:`RefitReport.at_bound`): the runs ask for a value beyond the physical range, so
the model misses something there (or the runs were noisy). A fit that does not
converge raises :class:`~planner.calibrate.fit.CalibrationError`; nothing is written.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import least_squares

from planner.calibrate.fit import MAX_RMS_LOG_ERROR, CalibrationError
from planner.cost import CostOptions
from planner.cost.build import stage_indices
from planner.cost.tp import ShardKey
from planner.errors import SpecError
from planner.graph import OpKind
from planner.hardware import HardwareProfile
from planner.measured import MeasuredProfile
from planner.priced_plan import PricedPlan
from planner.spec import Plan, Prediction

__all__ = [
    "REFIT_PARAMETERS",
    "RefitParameter",
    "RunError",
    "RefitReport",
    "with_parameters",
    "parameters_shown",
    "predict_plan",
    "predict_op_classes",
    "stage_indices",
    "refit_profile",
]

log = logging.getLogger(__name__)

PRIOR_WEIGHT = 0.05  # residual per unit (log multiplier, or overhead / its bound) of a change


@dataclass(frozen=True)
class RefitParameter:
    """One refitted quantity applied to one or more profile fields (dotted paths).

    ``mode`` "scale" multiplies the fields' starting values by a factor in
    [``low``, ``high``] (each field at most ``cap``); "add" adds an amount in
    [``low``, ``high``] (the fields' unit) to each.
    """

    name: str
    fields: tuple[str, ...]
    mode: Literal["scale", "add"]
    low: float
    high: float
    cap: float | None = None

    def limits(self, starts: Sequence[float]) -> tuple[float, float]:
        """The fit variable's range: log multipliers for "scale", the value for "add"."""
        if self.mode == "add":
            return self.low, self.high
        high = self.high
        if self.cap is not None:
            high = min(high, self.cap / max(starts))
        return math.log(self.low), math.log(max(high, self.low))

    def apply(self, variable: float, starts: Sequence[float]) -> list[float]:
        """The fields' values for the fit variable ``variable``."""
        if self.mode == "add":
            return [start + variable for start in starts]
        return [start * math.exp(variable) for start in starts]

    def value(self, variable: float) -> float:
        """The parameter as reported: the multiplier, or the added amount."""
        return math.exp(variable) if self.mode == "scale" else variable

    def prior(self, variable: float) -> float:
        """A change in comparable units: the log multiplier, or the share of the range."""
        return variable if self.mode == "scale" else variable / self.high


REFIT_PARAMETERS: tuple[RefitParameter, ...] = (
    RefitParameter("framework overhead per operator", ("op_overhead_us",), "add", 0.0, 100.0),
    # down to a quarter: the sweep times an otherwise idle link at its lower quartile; in
    # training the transport shares the cores with compute (gloo on 2 cores: ~0.35x)
    RefitParameter("link bandwidth scale", ("links.intra_node.bandwidth_GBps",), "scale",
                   0.25, 2.0),
    RefitParameter("link latency scale", ("links.intra_node.latency_us",), "scale", 0.5, 4.0),
    # 0 to 10 ms per blocking collective: in training a collective also waits out the
    # other ranks' scheduling jitter after milliseconds of compute, which the back-to-back
    # sweep does not see (2 ranks on a 2-core machine: a 1 KB all-reduce after a few ms
    # of compute averaged 2-4 ms, against 0.3 ms back to back)
    RefitParameter("collective call overhead (us)", ("links.intra_node.call_overhead_us",),
                   "add", 0.0, 10_000.0),
)  # fmt: skip


@dataclass(frozen=True)
class RunError:
    """One run's predicted against measured step time (seconds) under one profile."""

    label: str
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """Relative error of the prediction (positive: predicted too slow)."""
        return self.predicted_s / self.measured_s - 1


@dataclass(frozen=True)
class RefitReport:
    """Per-run errors before and after the refit, the profile fields' values before
    (``start``) and after (``fitted``), each parameter's value (a multiplier, or the
    added amount) and the parameters that ended on a bound of their physical range."""

    before: list[RunError]
    after: list[RunError]
    start: dict[str, float]
    fitted: dict[str, float]
    parameters: dict[str, float]
    at_bound: tuple[str, ...]


def _get(profile: HardwareProfile, path: str) -> float:
    """A profile field by dotted path; an optional field left out (None) reads 0."""
    value: Any = profile
    for part in path.split("."):
        value = getattr(value, part)
    return float(value or 0.0)


def with_parameters(
    profile: HardwareProfile, values: dict[str, float], source: str
) -> HardwareProfile:
    """A copy of ``profile`` with dotted-path fields set to ``values``, sourced ``source``."""
    data = profile.model_dump(mode="json")
    for path, value in values.items():
        target = data
        *parents, leaf = path.split(".")
        for part in parents:
            target = target[part]
        if leaf not in target:
            raise SpecError(f"profile has no field {path!r}")
        target[leaf] = value
        data["sources"][path] = source
    return HardwareProfile.model_validate(data)


def parameters_shown(
    parameters: Sequence[RefitParameter], profile: HardwareProfile,
    runs: Sequence[MeasuredProfile], options: CostOptions,
) -> tuple[RefitParameter, ...]:  # fmt: skip
    """The ``parameters`` some run's priced step time depends on (halfway up its range):
    a fit cannot place what no run shows (no tensor-parallel run, no DTensor dispatch)."""
    priced = [PricedPlan(run.plan, options) for run in runs]
    base = [plan.estimate(profile).step_time_s for plan in priced]

    def moves(parameter: RefitParameter) -> bool:
        starts = [_get(profile, path) for path in parameter.fields]
        nudged = parameter.apply(parameter.limits(starts)[1] / 2, starts)
        trial = with_parameters(profile, dict(zip(parameter.fields, nudged, strict=True)), "")
        return any(p.estimate(trial).step_time_s != t for p, t in zip(priced, base, strict=True))

    return tuple(parameter for parameter in parameters if moves(parameter))


def predict_plan(plan: Plan, profile: HardwareProfile, options: CostOptions) -> Prediction:
    """The cost model's prediction for ``plan`` (its own stages) under ``profile``."""
    return PricedPlan(plan, options).estimate(profile)


def predict_op_classes(
    plan: Plan, profile: HardwareProfile, options: CostOptions
) -> dict[str, float]:
    """Predicted compute seconds per step per rank by operator class.

    Classes: "matmul" (GEMMs, convolutions), "attention", "memory-bound" (the rest);
    forward plus backward of every micro-batch, the model's work divided evenly over the
    pipeline ranks; recomputation is not included.
    """
    priced = PricedPlan(plan, options)
    graph = priced.graph
    model = priced.cost_model(profile)
    s = plan.strategy
    key = ShardKey.of(s)
    layout = model.tp_layout(s.tp, s.sequence_parallel)
    totals = {"matmul": 0.0, "attention": 0.0, "memory-bound": 0.0}
    for segment in graph.segments:
        seg_type = graph.segment_type(segment)
        nodes = seg_type.nodes
        scales = [key.token_scale / d for d in layout.segment(seg_type.type_id).work_divisor]
        times = model.compute.segment_times(nodes, scales, cp=s.cp)
        for node, time in zip(nodes, times, strict=True):
            totals[_op_class(node.kind)] += time.forward_s + time.backward_s
    return {name: value * s.num_microbatches / s.pp for name, value in totals.items()}


def _op_class(kind: OpKind) -> str:
    if kind in (OpKind.MATMUL, OpKind.CONV):
        return "matmul"
    return "attention" if kind is OpKind.ATTENTION else "memory-bound"


def _errors(runs: Sequence[MeasuredProfile], predictions: Sequence[Prediction]) -> list[RunError]:
    return [
        RunError(
            f"{run.model_name}: {run.plan.strategy.describe()}",
            prediction.step_time_s,
            run.step_time_median_s,
        )
        for run, prediction in zip(runs, predictions, strict=True)
    ]


def refit_profile(
    profile: HardwareProfile,
    runs: Sequence[MeasuredProfile],
    *,
    options: CostOptions,
    stamp: str,
    parameters: Sequence[RefitParameter] = REFIT_PARAMETERS,
    prior_weight: float = PRIOR_WEIGHT,
) -> tuple[HardwareProfile, RefitReport]:
    """Fit ``parameters`` of ``profile`` to the step times of ``runs``, within their bounds.

    ``prior_weight`` is the residual per unit change of a parameter (0: trust the runs
    alone). Raises :class:`CalibrationError` when the fit does not converge; a
    parameter that ends on a bound is reported in :attr:`RefitReport.at_bound` and
    logged. ``profile`` itself is never modified.
    """
    if not runs:
        raise CalibrationError("calibrate --from: give at least one measured profile")
    priced = [PricedPlan(run.plan, options) for run in runs]

    def predict(trial: HardwareProfile) -> list[Prediction]:
        return [plan.estimate(trial) for plan in priced]

    measured = np.array([run.step_time_median_s for run in runs])
    starts = [[_get(profile, path) for path in p.fields] for p in parameters]
    limits = [p.limits(s) for p, s in zip(parameters, starts, strict=True)]
    source = f"{stamp}: refitted to {len(runs)} measured run(s), bounded least squares"

    def fields(x: NDArray[np.float64]) -> dict[str, float]:
        values: dict[str, float] = {}
        for param, start, variable in zip(parameters, starts, x, strict=True):
            values.update(zip(param.fields, param.apply(float(variable), start), strict=True))
        return values

    def residuals(x: NDArray[np.float64]) -> NDArray[np.float64]:
        predictions = predict(with_parameters(profile, fields(x), source))
        predicted = np.array([p.step_time_s for p in predictions])
        prior = [prior_weight * p.prior(float(v)) for p, v in zip(parameters, x, strict=True)]
        return np.concatenate([np.log(predicted / measured), prior])

    x = _bounded_fit(residuals, limits)
    fitted = with_parameters(profile, fields(x), source)
    at_bound = _at_bound(parameters, x, limits)
    report = RefitReport(
        before=_errors(runs, predict(profile)),
        after=_errors(runs, predict(fitted)),
        start={path: _get(profile, path) for p in parameters for path in p.fields},
        fitted={path: _get(fitted, path) for p in parameters for path in p.fields},
        parameters={p.name: p.value(float(v)) for p, v in zip(parameters, x, strict=True)},
        at_bound=at_bound,
    )
    return fitted, report


_AT_BOUND = 1e-3  # within this share of its range from a bound, a parameter is "on" it


def _at_bound(
    parameters: Sequence[RefitParameter],
    x: NDArray[np.float64],
    limits: Sequence[tuple[float, float]],
) -> tuple[str, ...]:
    """ "<name> (lower|upper bound)" for every parameter on a bound, each logged as a warning."""
    found = []
    for param, value, (low, high) in zip(parameters, x, limits, strict=True):
        if min(value - low, high - value) > _AT_BOUND * max(high - low, 1e-12):
            continue
        side = "lower" if value - low < high - value else "upper"
        log.warning(
            "refit: %s ended on the %s bound of its physical range: the runs ask for a "
            "value beyond it, so the model misses something there (or the runs were noisy)",
            param.name, side,
        )  # fmt: skip
        found.append(f"{param.name} ({side} bound)")
    return tuple(found)


def _bounded_fit(
    residuals: Callable[[NDArray[np.float64]], NDArray[np.float64]],
    limits: Sequence[tuple[float, float]],
) -> NDArray[np.float64]:
    """Bounded least squares from the microbenchmarks' values (0 multiplier, least add)."""
    low = np.array([a for a, _ in limits])
    high = np.array([b for _, b in limits])
    margin = 1e-6 * (high - low)  # trf starts strictly inside the bounds
    start = np.clip(np.zeros(len(limits)), low + margin, high - margin)
    result = least_squares(
        residuals, start, bounds=(low, high), method="trf", loss="soft_l1", f_scale=0.3,
        max_nfev=200,
    )  # fmt: skip
    after = residuals(result.x)
    rms = float(np.sqrt(np.mean(np.square(after))))
    hint = "check that the runs were measured on this machine, or re-measure on an idle one"
    if not result.success or not np.all(np.isfinite(after)):
        raise CalibrationError(
            f"refit to measured runs: the fit did not converge ({result.message}); {hint}"
        )
    if rms > MAX_RMS_LOG_ERROR:
        raise CalibrationError(
            f"refit to measured runs: the fit did not converge to the data (RMS log error "
            f"{rms:.2f} > {MAX_RMS_LOG_ERROR:.2f}, i.e. typically off by x{math.exp(rms):.2f}) "
            f"with every parameter in its physical range; {hint}"
        )
    return np.asarray(result.x, dtype=np.float64)
