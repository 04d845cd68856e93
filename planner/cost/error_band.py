"""The error band of a prediction: how far the cost model has been from published
training runs in the prediction's regime.

A regime is the model family (dense or mixture-of-experts), the precision class, the
device kind and the share of the step spent in exposed communication (below 15%,
15-30%, 30% and more): the features along which the validation residuals differ
(``python benchmarks/bench_accuracy.py`` lists each run's error). The band of a regime is
the mean and largest absolute step-time error and the mean signed error of the
published runs priced in it, and the peak-memory error of the runs of its family and
device kind that report one. :func:`fit_error_bands` measures them (``python
benchmarks/bench_accuracy.py --write-error-bands`` writes the shipped table,
``profiles/validation/error_bands.json``); :func:`error_band` hands each prediction
its regime's band. With fewer than :data:`MIN_RUNS` runs a regime has no band: the
prediction is unvalidated there, and the text says to calibrate first.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

from planner.spec import (
    DType,
    ErrorBand,
    ErrorBandTable,
    MemoryBand,
    Prediction,
    communication_s,
    load_document,
)

__all__ = [
    "COMMAND",
    "MIN_RUNS",
    "Residual",
    "comm_share_bin",
    "describe_band",
    "error_band",
    "fit_error_bands",
    "shipped_table",
]

MIN_RUNS = 3  # published runs a regime needs before its band is stated
COMM_BINS = ((0.15, "<15%"), (0.30, "15-30%"), (float("inf"), ">=30%"))
COMMAND = "python benchmarks/bench_accuracy.py --write-error-bands"
TABLE = "validation/error_bands.json"  # in the profiles package

_Key = tuple[str, str, str, str]  # family, precision, device kind, communication bin


def comm_share_bin(breakdown_s: Mapping[str, float], step_time_s: float) -> str:
    """The communication bin of a step: exposed ``comm_*`` seconds over the step."""
    share = communication_s(breakdown_s) / step_time_s if step_time_s > 0 else 0.0
    return next(name for limit, name in COMM_BINS if share < limit)


def _precision(dtype: DType) -> str:
    return {DType.FP8: "fp8", DType.FP32: "fp32"}.get(dtype, "bf16/fp16")


def error_band(
    *, moe: bool, dtype: DType, device_kind: str, breakdown_s: Mapping[str, float],
    step_time_s: float,
) -> ErrorBand:  # fmt: skip
    """The shipped band of a prediction's regime (one object per regime, shared)."""
    key = (
        "moe" if moe else "dense", _precision(dtype), device_kind,
        comm_share_bin(breakdown_s, step_time_s),
    )  # fmt: skip
    return _band(key)


@cache
def shipped_table() -> ErrorBandTable:
    """The table in the ``profiles`` package (read once)."""
    path = resources.files("profiles").joinpath(TABLE)
    return load_document(ErrorBandTable, path.read_text(encoding="utf-8"), str(path))


@cache
def _band(key: _Key) -> ErrorBand:
    """The stated band of ``key`` (or one without step figures), with its family's memory."""
    table = shipped_table()
    family, precision, kind, comm = key
    band = next((b for b in table.step if _key(b) == key), None) or ErrorBand.model_validate(
        {"family": family, "precision": precision, "device_kind": kind, "comm_share": comm}
    )
    held = next((m for m in table.memory if (m.family, m.device_kind) == (family, kind)), None)
    if held is None:
        return band
    return band.model_copy(
        update={"memory_runs": held.runs, "memory_mean_abs": held.mean_abs,
                "memory_max_abs": held.max_abs}
    )  # fmt: skip


def _key(band: ErrorBand) -> _Key:
    return band.family, band.precision, band.device_kind, band.comm_share


@dataclass(frozen=True)
class Residual:
    """One published run priced: the prediction, what was measured and on which GPU."""

    prediction: Prediction
    measured_step_s: float
    measured_memory_gib: float | None
    device: str  # the GPU profile it was priced on


def fit_error_bands(residuals: Sequence[Residual]) -> ErrorBandTable:
    """The bands of ``residuals`` (each prediction's ``error_band`` names its regime)."""
    by_regime: dict[_Key, list[Residual]] = defaultdict(list)
    memory: dict[tuple[str, str], list[float]] = defaultdict(list)
    for residual in residuals:
        band = residual.prediction.error_band
        assert band is not None, "every prediction carries its regime"
        by_regime[_key(band)].append(residual)
        if residual.measured_memory_gib:
            error = residual.prediction.peak_memory_gib / residual.measured_memory_gib - 1
            memory[band.family, band.device_kind].append(error)
    return ErrorBandTable(
        command=COMMAND,
        step=tuple(_step_band(key, group) for key, group in sorted(by_regime.items())),
        memory=tuple(
            MemoryBand.model_validate({"family": family, "device_kind": kind,
                                       "runs": len(errors), "mean_abs": _mean_abs(errors),
                                       "max_abs": max(map(abs, errors))})
            for (family, kind), errors in sorted(memory.items())
        ),
    )  # fmt: skip


def _step_band(key: _Key, group: list[Residual]) -> ErrorBand:
    family, precision, kind, comm = key
    fields: dict[str, object] = {
        "family": family, "precision": precision, "device_kind": kind, "comm_share": comm,
        "runs": len(group), "devices": tuple(sorted({r.device for r in group})),
    }  # fmt: skip
    if len(group) >= MIN_RUNS:
        errors = [r.prediction.step_time_s / r.measured_step_s - 1 for r in group]
        fields |= {
            "step_mean_abs": _mean_abs(errors), "step_max_abs": max(map(abs, errors)),
            "step_bias": statistics.fmean(errors),
        }  # fmt: skip
    return ErrorBand.model_validate(fields)


def _mean_abs(errors: Sequence[float]) -> float:
    return statistics.fmean(abs(e) for e in errors)


def describe_band(band: ErrorBand, gpu: str) -> str:
    """One line for a user: the step-time band of the regime (or that there is none),
    whether ``gpu``'s profile is among its runs', and the family's memory band."""
    if band.step_mean_abs is None or band.step_max_abs is None or band.step_bias is None:
        first = (
            "plan measure and plan compare show this machine's error"
            if band.device_kind == "cpu"
            else "calibrate on your cluster (plan calibrate) and check with plan compare "
            "before relying on it"
        )
        step = (
            f"step time not validated: {band.runs} published run{'s' if band.runs != 1 else ''} "
            f"in this regime ({band.regime}), {MIN_RUNS} needed; {first}"
        )
    else:
        missing = "" if gpu in band.devices else f"; none on {gpu}"
        step = (
            f"step time {band.step_mean_abs:.1%} mean, {band.step_max_abs:.1%} worst, bias "
            f"{band.step_bias:+.1%} over {band.runs} published runs ({band.regime}) on "
            f"{', '.join(band.devices)}{missing}"
        )
    if band.memory_mean_abs is None or band.memory_max_abs is None:
        return f"{step}; peak memory not validated for {band.family} models on {band.device_kind}"
    return (
        f"{step}; peak memory {band.memory_mean_abs:.1%} mean, {band.memory_max_abs:.1%} worst "
        f"over {band.memory_runs} runs"
    )
