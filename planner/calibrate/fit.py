"""Least-squares fits of the profile's physical parameters (``scipy.optimize.least_squares``).

Three closed forms, each the cost model's own formula, so a fitted number means what
the profile field means:

- GEMM: ``t = F / (peak * efficiency) + overhead`` (seconds; ``F`` FLOPs);
- memory-bound kernel: ``t = B / (bandwidth * efficiency) + overhead`` (``B`` bytes);
- collective: ``t = steps * latency + factor * S / busbw`` (alpha-beta with the
  nccl-tests bus factor; ``S`` bytes of the whole array).

Residuals are log ratios (``log(t_model / t_measured)``), so small and large problems
weigh alike and too fast counts as much as too slow. A fit that does not converge, or whose parameters leave their physical
range (an efficiency above 1, a negative overhead), raises :class:`CalibrationError`
and nothing is written.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import OptimizeResult, least_squares

from planner.cost.communication import Collective, bus_factor, latency_steps
from planner.errors import PlannerError
from planner.hardware import MAX_FACTOR

__all__ = [
    "Sample",
    "StepSample",
    "rms",
    "CalibrationError",
    "Bound",
    "FitResult",
    "fit_parameters",
    "fit_within",
    "fit_matmul",
    "fit_memory",
    "fit_streaming",
    "fit_alpha_beta",
]

log = logging.getLogger(__name__)

Array = NDArray[np.float64]
# A fit is "converged" when scipy says so and the RMS log error is this small (within a
# factor e on typical samples: shared machines are noisy, a wrong model is off by far more).
MAX_RMS_LOG_ERROR = 1.0


@dataclass(frozen=True)
class Sample:
    """One timed problem: its work (FLOPs or bytes), median seconds and a label."""

    label: str
    work: float
    seconds: float


@dataclass(frozen=True)
class StepSample:
    """An eager training step of ``model`` (a zoo preset, fp32) at ``micro_batch``
    sequences of its ``seq_len`` a rank, data-parallel (DDP) over ``ranks`` processes:
    median seconds of its forward and backward (with DDP's gradient all-reduce), and of
    its optimizer step (clipping, AdamW one tensor at a time, zeroing)."""

    model: str
    micro_batch: int
    forward_backward_s: float
    optimizer_s: float
    ranks: int = 1


class CalibrationError(PlannerError):
    """A calibration fit failed or left physical bounds; the existing profile is untouched."""


@dataclass(frozen=True)
class Bound:
    """Physical range of one parameter, inclusive (``high=None``: unbounded above)."""

    name: str
    low: float
    high: float | None = None
    unit: str = ""

    def check(self, value: float, hint: str) -> None:
        if value < self.low or (self.high is not None and value > self.high):
            upper = "inf" if self.high is None else f"{self.high:g}"
            raise CalibrationError(
                f"fitted {self.name} = {value:.4g}{self.unit} is outside its physical range "
                f"[{self.low:g}, {upper}]: {hint}"
            )


@dataclass(frozen=True)
class FitResult:
    """Fitted parameters by name and the fit's RMS log error (~relative) before and after;
    ``at_bounds``: parameters a bounded fit left on an edge of their range (what the
    samples pushed beyond what the model allows)."""

    values: dict[str, float]
    rms_before: float
    rms_after: float
    samples: int
    at_bounds: tuple[str, ...] = ()

    def describe_error(self) -> str:
        """``RMS log error 0.56 -> 0.29``; where the RMS grew, why: the fit is robust
        (soft L1), weighing outlying samples less than a least-squares fit would."""
        said = f"RMS log error {self.rms_before:.2f} -> {self.rms_after:.2f}"
        if self.rms_after > self.rms_before:
            said += " (a robust fit: outlying samples weigh less)"
        return said


def rms(residuals: Array) -> float:
    """Root mean square of ``residuals`` (0 for none)."""
    return float(np.sqrt(np.mean(np.square(residuals)))) if residuals.size else 0.0


def fit_parameters(
    residuals: Callable[[Array], Array],
    start: Sequence[float],
    bounds: Sequence[Bound],
    *,
    what: str,
    hint: str,
    max_rms: float = MAX_RMS_LOG_ERROR,
) -> FitResult:
    """Minimise ``residuals(x)`` over positive ``x`` (fitted in log space) and check bounds.

    ``start`` are initial values (all > 0); ``bounds`` the physical range of each;
    ``what`` names the fit and ``hint`` says what to change when it fails.
    """
    x0 = np.log(np.asarray(start, dtype=float))
    if not np.all(np.isfinite(x0)):
        raise CalibrationError(f"{what}: start values must be positive, got {list(start)}")

    def in_log(z: Array) -> Array:
        return residuals(np.exp(z))

    before = in_log(x0)
    # soft-L1: a few samples disturbed by other processes do not drag the fit
    result = least_squares(
        in_log, x0, method="trf", x_scale="jac", loss="soft_l1", f_scale=0.3, max_nfev=400
    )
    after = _converged(result, in_log(result.x), what, hint, max_rms)
    values = dict(zip((b.name for b in bounds), np.exp(result.x).tolist(), strict=True))
    for bound in bounds:
        bound.check(values[bound.name], hint)
    log.info("%s: RMS log error %.3f -> %.3f", what, rms(before), rms(after))
    return FitResult(values, rms(before), rms(after), len(after))


def fit_within(
    residuals: Callable[[Array], Array],
    start: Sequence[float],
    bounds: Sequence[Bound],
    *,
    what: str,
    hint: str,
    max_rms: float = MAX_RMS_LOG_ERROR,
) -> FitResult:
    """Minimise ``residuals(x)`` with every parameter held inside its bound (each needs a
    ``high``): for parameters whose range is a known cap (a protocol's share of the
    wire) rather than a sanity check. Soft-L1 at 0.1 keeps a few odd lines from
    dragging the fit."""
    low = [b.low for b in bounds]
    high = [b.high if b.high is not None else np.inf for b in bounds]
    x0 = np.clip(np.asarray(start, dtype=float), low, high)
    before = residuals(x0)
    result = least_squares(residuals, x0, bounds=(low, high), loss="soft_l1", f_scale=0.1)
    after = _converged(result, residuals(result.x), what, hint, max_rms)
    values = dict(zip((b.name for b in bounds), result.x.tolist(), strict=True))
    edges = tuple(
        b.name for b in bounds
        if math.isclose(values[b.name], b.low, rel_tol=1e-6, abs_tol=1e-9)
        or (b.high is not None and math.isclose(values[b.name], b.high, rel_tol=1e-6))
    )  # fmt: skip
    log.info("%s: RMS log error %.3f -> %.3f", what, rms(before), rms(after))
    return FitResult(values, rms(before), rms(after), len(after), edges)


def _converged(result: OptimizeResult, after: Array, what: str, hint: str, max_rms: float) -> Array:
    """``after`` (the fitted residuals) once the fit converged to the data; raises otherwise."""
    error = rms(after)
    if not result.success or not np.all(np.isfinite(after)):
        raise CalibrationError(f"{what}: the fit did not converge ({result.message}); {hint}")
    if error > max_rms:
        raise CalibrationError(
            f"{what}: the fit did not converge to the data (RMS log error {error:.2f} > "
            f"{max_rms:.2f}, i.e. typically off by x{np.exp(error):.2f}); {hint}"
        )
    return after


def _arrays(work: Sequence[float], seconds: Sequence[float], what: str) -> tuple[Array, Array]:
    x, t = np.asarray(work, dtype=float), np.asarray(seconds, dtype=float)
    if x.shape != t.shape or x.size < 2:
        raise CalibrationError(
            f"{what}: need at least two (size, seconds) samples of equal length, got "
            f"{x.size} sizes and {t.size} times"
        )
    if np.any(t <= 0) or np.any(x <= 0):
        raise CalibrationError(f"{what}: sizes and times must be positive")
    return x, t


def _start_rate_overhead(x: Array, t: Array) -> tuple[float, float]:
    """Initial (rate, overhead) from the largest sample and the smallest time."""
    overhead = max(0.5 * float(t.min()), 1e-9)
    largest = int(np.argmax(x))
    rate = float(x[largest]) / max(float(t[largest]) - overhead, 1e-12)
    return rate, overhead


def _fit_efficiency(
    x: Array, t: Array, peak: float, names: tuple[str, str], what: str, hint: str
) -> FitResult:
    """Fit ``t = x / (peak * efficiency) + overhead_us * 1e-6`` on log ratios."""
    rate, overhead = _start_rate_overhead(x, t)

    def residuals(p: Array) -> Array:
        return np.log((x / (peak * p[0]) + p[1] * 1e-6) / t)

    return fit_parameters(
        residuals, [min(rate / peak, 1.0), overhead * 1e6],
        [Bound(names[0], 1e-3, 1.0), Bound(names[1], 0.0, 1e5, " us")],
        what=what, hint=hint,
    )  # fmt: skip


def fit_matmul(flops: Sequence[float], seconds: Sequence[float], peak_flops: float) -> FitResult:
    """Fit ``matmul_efficiency`` (fraction of ``peak_flops``) and ``matmul_overhead_us``."""
    x, t = _arrays(flops, seconds, "matmul fit")
    return _fit_efficiency(
        x, t, peak_flops, ("matmul_efficiency", "matmul_overhead_us"), "matmul fit",
        "raise peak_tflops if GEMMs ran faster than peak, or re-run on an idle machine",
    )  # fmt: skip


def fit_memory(nbytes: Sequence[float], seconds: Sequence[float], bandwidth: float) -> FitResult:
    """Fit ``memory_efficiency`` (fraction of ``bandwidth`` bytes/s) and ``kernel_overhead_us``."""
    x, t = _arrays(nbytes, seconds, "memory-bound fit")
    return _fit_efficiency(
        x, t, bandwidth, ("memory_efficiency", "kernel_overhead_us"), "memory-bound fit",
        "raise memory_bandwidth_GBps if kernels ran faster, or re-run on an idle machine",
    )  # fmt: skip


def fit_streaming(nbytes: Sequence[float], seconds: Sequence[float]) -> FitResult:
    """Fit the achieved ``memory_bandwidth_GBps`` and ``kernel_overhead_us`` (no datasheet)."""
    x, t = _arrays(nbytes, seconds, "memory-bound fit")
    rate, overhead = _start_rate_overhead(x, t)

    def residuals(p: Array) -> Array:
        return np.log((x / (p[0] * 1e9) + p[1] * 1e-6) / t)

    return fit_parameters(
        residuals, [rate / 1e9, overhead * 1e6],
        [Bound("memory_bandwidth_GBps", 1e-3, 1e5, " GB/s"),
         Bound("kernel_overhead_us", 0.0, 1e5, " us")],
        what="memory-bound fit",
        hint="re-run on an idle machine with larger --memory sizes",
    )  # fmt: skip


def fit_alpha_beta(
    samples: Sequence[tuple[Collective, int, float, float]], *, factors: bool = False
) -> FitResult:
    """Fit one link's ``latency_us`` and ``busbw_GBps`` to (kind, ranks, bytes, seconds) samples.

    Without ``factors`` every collective shares the two parameters. With ``factors`` the
    all-reduce samples set ``busbw_GBps`` and every other collective measured gets its own
    bus-bandwidth factor against it (``factor.<kind>``, the profile's
    ``collective_factors``); the latency stays shared.
    """
    if len(samples) < 2:
        raise CalibrationError(f"collective fit: need at least two samples, got {len(samples)}")
    kinds = [k for k, *_ in samples]
    steps = np.array([latency_steps(k, n) for k, n, _, _ in samples], dtype=float)
    moved = np.array([bus_factor(k, n) * s for k, n, s, _ in samples], dtype=float)
    t = np.array([sec for *_, sec in samples], dtype=float)
    if np.any(t <= 0) or np.any(moved <= 0):
        raise CalibrationError("collective fit: sizes and times must be positive (ranks >= 2)")
    others = sorted({k for k in kinds if k is not Collective.ALL_REDUCE}) if factors else []
    if others and kinds.count(Collective.ALL_REDUCE) < 2:
        raise CalibrationError(
            "collective fit: per-collective factors are relative to all-reduce; measure "
            "all_reduce at two or more sizes"
        )
    # column j + 2 of the parameter vector scales the bandwidth of samples of others[j]
    column = np.array([others.index(k) + 2 if k in others else -1 for k in kinds])
    rate, latency = _start_rate_overhead(moved, t)

    def residuals(p: Array) -> Array:
        scale = np.where(column >= 0, p[np.maximum(column, 0)], 1.0)
        return np.log((steps * p[0] * 1e-6 + moved / (p[1] * 1e9 * scale)) / t)

    bounds = [Bound("latency_us", 0.0, 1e6, " us"), Bound("busbw_GBps", 1e-4, 1e5, " GB/s")]
    bounds += [Bound(f"factor.{k.value}", 1 / MAX_FACTOR, MAX_FACTOR) for k in others]
    start = [latency * 1e6 / max(float(steps.min()), 1.0), rate / 1e9] + [1.0] * len(others)
    return fit_parameters(
        residuals, start, bounds,
        what="collective fit",
        hint="check that every rank ran the same collectives, or re-run on an idle machine",
    )  # fmt: skip
