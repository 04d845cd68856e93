"""Refit a profile's physical parameters to measured runs (``plan calibrate --from``).

Each :class:`~planner.measured.MeasuredProfile` carries its plan, so the cost model
re-prices it under trial parameters; ``scipy.optimize.least_squares`` minimises the log
ratio of predicted to measured step time over all runs, the same for the optimizer
phase where it was measured (at half weight: it is what separates memory bandwidth
from per-kernel overheads), plus a weak pull of every
parameter towards its starting value (so a parameter the runs cannot see stays where
the microbenchmarks put it). The parameters are few and physical -- efficiencies,
per-kernel overheads, bandwidths and the link latency -- so a fit on some runs
predicts others.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from planner.calibrate.fit import Bound, CalibrationError, fit_parameters
from planner.cost import CostModel, CostOptions
from planner.cost.sharding import ShardKey
from planner.errors import SpecError
from planner.graph import OpGraph, OpKind
from planner.hardware import HardwareProfile
from planner.measured import MeasuredProfile
from planner.models import ModelHandle, build
from planner.solve.make_plan import cost_graph
from planner.spec import Plan, Prediction

__all__ = [
    "REFIT_BOUNDS",
    "RunError",
    "RefitReport",
    "with_parameters",
    "predict_plan",
    "predict_op_classes",
    "stage_indices",
    "refit_profile",
]

log = logging.getLogger(__name__)

# The refitted parameters (dotted profile paths) and their physical ranges. Attention
# efficiency is not among them: the SDPA sweep measures it directly, while in step times
# it trades off against matmul efficiency (both grow with the model), so runs of a few
# sizes cannot tell the two apart.
REFIT_BOUNDS: tuple[Bound, ...] = (
    Bound("matmul_efficiency", 1e-3, 1.0),
    Bound("matmul_overhead_us", 0.0, 1e5, " us"),
    Bound("memory_bandwidth_GBps", 1e-3, 1e5, " GB/s"),
    Bound("kernel_overhead_us", 0.0, 1e5, " us"),
    Bound("links.intra_node.bandwidth_GBps", 1e-3, 1e5, " GB/s"),
    Bound("links.intra_node.latency_us", 0.0, 1e6, " us"),
)
PRIOR_WEIGHT = 0.05  # residual per unit log deviation of a parameter from its start
OPTIMIZER_WEIGHT = 0.5  # the optimizer phase pins the memory bandwidth (a step-time share)


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
    """Per-run errors before and after the refit, and the parameter values."""

    before: list[RunError]
    after: list[RunError]
    start: dict[str, float]
    fitted: dict[str, float]


def _get(profile: HardwareProfile, path: str) -> float:
    value: Any = profile
    for part in path.split("."):
        value = getattr(value, part)
    return float(value)


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


def _handle(plan: Plan) -> ModelHandle:
    if plan.model is None:
        raise SpecError(
            f"plan for {plan.model_name!r} has no model spec: calibration re-prices zoo or "
            "spec-file transformers only"
        )
    spec = plan.model
    module: nn.Module = build(spec)

    def tokens(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        return (torch.empty(batch_size, seq_len, dtype=torch.long, device="meta"),)

    return ModelHandle(spec.name, plan.model_source, module, tokens, spec)


def stage_indices(graph: OpGraph, plan: Plan) -> list[list[int]] | None:
    """The plan's FQN stages as segment-index chunks for :meth:`CostModel.estimate`."""
    if not plan.stages:
        return None
    owner = {fqn: index for index, chunk in enumerate(plan.stages) for fqn in chunk}
    chunks: list[list[int]] = [[] for _ in plan.stages]
    for index, segment in enumerate(graph.segments):
        homes = {owner[m] for m in segment.modules if m in owner}
        if len(homes) != 1:
            raise SpecError(
                f"segment {segment.fqn!r} (modules {list(segment.modules)}) is not in exactly "
                "one of the plan's stages: re-plan the model"
            )
        chunks[homes.pop()].append(index)
    return chunks


class _Pricer:
    """Re-prices fixed plans under trial profiles; graphs are built once per plan."""

    def __init__(self, plans: Sequence[Plan], options: CostOptions) -> None:
        self.plans = list(plans)
        self.options = options
        self.graphs = [cost_graph(_handle(p), p.training) for p in self.plans]

    def predict(self, profile: HardwareProfile) -> list[Prediction]:
        return [
            _estimate(plan, graph, profile, self.options)
            for plan, graph in zip(self.plans, self.graphs, strict=True)
        ]


def _estimate(
    plan: Plan, graph: OpGraph, profile: HardwareProfile, options: CostOptions
) -> Prediction:
    training = plan.training.model_copy(update={"seq_len": None})
    model = CostModel(graph, plan.cluster, training, profile=profile, options=options)
    return model.estimate(plan.strategy, stages=stage_indices(graph, plan))


def predict_plan(plan: Plan, profile: HardwareProfile, options: CostOptions) -> Prediction:
    """The cost model's prediction for ``plan`` (its own stages) under ``profile``."""
    graph = cost_graph(_handle(plan), plan.training)
    return _estimate(plan, graph, profile, options)


def predict_op_classes(
    plan: Plan, profile: HardwareProfile, options: CostOptions
) -> dict[str, float]:
    """Predicted compute seconds per step per rank by operator class.

    Classes: "matmul" (GEMMs, convolutions), "attention", "memory-bound" (the rest);
    forward plus backward of every micro-batch, the model's work divided evenly over the
    pipeline ranks; recomputation is not included.
    """
    graph = cost_graph(_handle(plan), plan.training)
    training = plan.training.model_copy(update={"seq_len": None})
    model = CostModel(graph, plan.cluster, training, profile=profile, options=options)
    s = plan.strategy
    key = ShardKey(s.tp, s.cp, s.sequence_parallel, s.micro_batch_size)
    totals = {"matmul": 0.0, "attention": 0.0, "memory-bound": 0.0}
    for segment in graph.segments:
        nodes = graph.segment_type(segment).nodes
        for node, time in zip(nodes, model.compute.segment_times(nodes, key), strict=True):
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
    bounds: Sequence[Bound] = REFIT_BOUNDS,
    prior_weight: float = PRIOR_WEIGHT,
) -> tuple[HardwareProfile, RefitReport]:
    """Fit ``bounds``' parameters of ``profile`` to the step times of ``runs``.

    ``prior_weight`` is the residual per unit log deviation of a parameter from its
    starting value (0: trust the runs alone).

    Raises :class:`CalibrationError` when the fit does not converge or a parameter
    leaves its physical range; ``profile`` itself is never modified.
    """
    if not runs:
        raise CalibrationError("calibrate --from: give at least one measured profile")
    pricer = _Pricer([run.plan for run in runs], options)
    measured = np.array([run.step_time_median_s for run in runs])
    measured_opt = np.array([run.phases_s.get("optimizer", 0.0) for run in runs])
    seen = measured_opt > 0
    names = [b.name for b in bounds]
    start = [max(_get(profile, name), 1e-3) for name in names]
    source = f"{stamp}: refitted to {len(runs)} measured run(s), least squares"

    def trial(x: NDArray[np.float64]) -> HardwareProfile:
        values = {name: float(min(v, b.high)) if b.high is not None else float(v)
                  for name, v, b in zip(names, x, bounds, strict=True)}  # fmt: skip
        return with_parameters(profile, values, source)

    def residuals(x: NDArray[np.float64]) -> NDArray[np.float64]:
        predictions = pricer.predict(trial(x))
        predicted = np.array([p.step_time_s for p in predictions])
        optimizer = np.array([p.breakdown_s.get("optimizer", 0.0) for p in predictions])
        prior = prior_weight * np.log(x / np.asarray(start))
        phase = OPTIMIZER_WEIGHT * np.log(np.maximum(optimizer[seen], 1e-12) / measured_opt[seen])
        return np.concatenate([np.log(predicted / measured), phase, prior])

    before = _errors(runs, pricer.predict(profile))
    fit = fit_parameters(
        residuals, start, bounds, what="refit to measured runs",
        hint="check that the runs were measured on this machine, or refit fewer parameters",
    )  # fmt: skip
    fitted = with_parameters(profile, fit.values, source)
    after = _errors(runs, pricer.predict(fitted))
    return fitted, RefitReport(before, after, dict(zip(names, start, strict=True)), fit.values)
