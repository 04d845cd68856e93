"""Predicted against measured: one table per plan (``plan compare``; the bar chart is
:func:`planner.plots.plot_comparison`).

The measured side is a :class:`~planner.measured.MeasuredProfile` (``plan measure``),
or a ``torch.profiler`` Chrome/Kineto trace (``export_chrome_trace``) from any run: its
kernels (GPU) or operators (CPU) are matched to the plan's operator classes -- matmul,
attention, memory-bound, communication, optimizer -- and compared with the cost
model's time for each class. Times are seconds per optimizer step per rank.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import SpecError
from planner.io import read_json
from planner.measured import MeasuredProfile, check_same_plan
from planner.spec import Plan, Prediction, communication_s, compute_s, load_document

__all__ = [
    "Row",
    "Comparison",
    "TraceSummary",
    "compare_measured",
    "compare_trace",
    "read_trace",
    "load_measured_side",
    "format_comparison",
]

_GIB = 2**30

MAX_TRACE_BYTES = 2**30  # torch.profiler traces of a few steps run to hundreds of MiB


@dataclass(frozen=True)
class Row:
    """One component: predicted and measured value (seconds, or GiB for memory)."""

    name: str
    predicted: float
    measured: float
    unit: str = "s"

    @property
    def error(self) -> float | None:
        """Relative error of the prediction; None when nothing was measured."""
        return self.predicted / self.measured - 1 if self.measured > 0 else None


@dataclass(frozen=True)
class Comparison:
    """A titled list of rows; the first row is the step time."""

    title: str
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = ()


def _band_note(plan: Plan, prediction: Prediction) -> tuple[str, ...]:
    """The cost model's expected error in the prediction's regime, to read the rows by."""
    from planner.cost.error_band import describe_band

    if prediction.error_band is None:
        return ()
    return (f"expected error: {describe_band(prediction.error_band, plan.cluster.gpu)}",)


def compare_measured(plan: Plan, measured: MeasuredProfile, prediction: Prediction) -> Comparison:
    """Rows for a measured profile of ``plan`` (fingerprints are checked first).

    Compute is forward + backward (+ recompute, gradient accumulation); communication
    includes the pipeline bubble, which a measured pipeline spends waiting in receives.
    """
    check_same_plan(plan, measured)
    pred, meas = prediction.breakdown_s, measured.phases_s
    bubble = pred.get("bubble", 0.0)
    rows = [
        Row("step", prediction.step_time_s, measured.step_time_median_s),
        Row("compute", compute_s(pred),
            meas.get("forward", 0.0) + meas.get("backward", 0.0)),
        Row("communication + bubble" if bubble else "communication",
            communication_s(pred) + bubble, communication_s(meas)),
        Row("optimizer", pred.get("optimizer", 0.0), meas.get("optimizer", 0.0)),
        Row("other", pred.get("framework", 0.0), meas.get("other", 0.0)),
        Row("peak memory", prediction.peak_memory_gib, measured.peak_memory_max_gib, "GiB"),
    ]  # fmt: skip
    notes = (
        f"measured on {measured.provenance.device}, {measured.provenance.date}",
        f"step time spread p10-p90: {measured.step_time_p10_s * 1e3:.1f}-"
        f"{measured.step_time_p90_s * 1e3:.1f} ms over {len(measured.step_times_s)} steps",
        *_band_note(plan, prediction),
    )
    return Comparison(f"{plan.model_name}: {plan.strategy.describe()}", tuple(rows), notes)


# ----- torch.profiler traces ---------------------------------------------------------------

OP_CLASSES = ("matmul", "attention", "memory-bound", "communication", "optimizer")
_CLASS_PATTERNS = (
    ("communication", re.compile(r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|"
                                 r"all_?to_?all|broadcast|send|recv", re.IGNORECASE)),
    ("optimizer", re.compile(r"^Optimizer\.|multi_tensor_apply|adam", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient_attention", re.IGNORECASE)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|cublas|aten::(mm|addmm|bmm|baddbmm|matmul|linear)$|"
                          r"^(s|h|bf16|)gemm|wgmma|sm\d+_", re.IGNORECASE)),
)  # fmt: skip
_STEP = re.compile(r"^ProfilerStep#\d+$")


@dataclass(frozen=True)
class TraceSummary:
    """Mean seconds per step by operator class, median and mean step time, and the source."""

    steps: int
    step_time_s: float  # median over the profiled steps
    mean_step_time_s: float
    class_s: dict[str, float]
    source: str  # "kernels" (GPU) or "cpu operators"


def _classify(name: str) -> str:
    for op_class, pattern in _CLASS_PATTERNS:
        if pattern.search(name):
            return op_class
    return "memory-bound"


def _events(path: Path) -> list[dict[str, Any]]:
    data = read_json(path, what="torch.profiler trace", max_bytes=MAX_TRACE_BYTES)
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise SpecError(
            f"{path} has no 'traceEvents' list: not a torch.profiler Chrome/Kineto trace "
            "(write one with torch.profiler.profile(...).export_chrome_trace(path))"
        )
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]
    if not complete:
        raise SpecError(f"trace {path} has no complete ('X') events: nothing was recorded")
    return complete


def _exclusive_us(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float, str | None]]:
    """(event, exclusive microseconds, enclosing optimizer/communication class) per event.

    Nesting is time containment on the same thread, as the trace viewer draws it.
    """
    result: list[tuple[dict[str, Any], float, str | None]] = []
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for event in events:
        by_thread.setdefault((event.get("pid"), event.get("tid")), []).append(event)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list[Any]] = []  # [event, child time, inherited class]
        for event in thread:
            start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
            while stack and float(stack[-1][0]["ts"]) + float(stack[-1][0]["dur"]) <= start:
                done = stack.pop()
                result.append((done[0], float(done[0]["dur"]) - done[1], done[2]))
            if stack:
                stack[-1][1] += (
                    min(end, float(stack[-1][0]["ts"]) + float(stack[-1][0]["dur"])) - start
                )
            own = _classify(str(event.get("name", "")))
            parent = stack[-1][2] if stack else None
            inherited = parent or (own if own in ("optimizer", "communication") else None)
            stack.append([event, 0.0, inherited])
        result.extend((e, float(e["dur"]) - child, cls) for e, child, cls in reversed(stack))
    return result


def read_trace(path: Path) -> TraceSummary:
    """Summarise a Chrome/Kineto trace: GPU kernels when it has them, else CPU operators."""
    events = _events(path)
    steps = [e for e in events if _STEP.match(str(e.get("name", "")))]
    kernels = [e for e in events if str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy")]
    source = "kernels" if kernels else "cpu operators"
    timed = kernels or [
        e for e in events
        if str(e.get("cat", "")).lower() in ("cpu_op", "user_annotation", "")
        and not _STEP.match(str(e.get("name", "")))
    ]  # fmt: skip
    if steps:  # only what ran inside the profiled steps
        first = min(float(e["ts"]) for e in steps)
        last = max(float(e["ts"]) + float(e["dur"]) for e in steps)
        timed = [e for e in timed if first <= float(e["ts"]) <= last]
    if not timed:
        raise SpecError(f"trace {path} has no kernels or CPU operators to match to the plan")
    totals = dict.fromkeys(OP_CLASSES, 0.0)
    for event, exclusive, inherited in _exclusive_us(timed):
        totals[inherited or _classify(str(event.get("name", "")))] += exclusive * 1e-6
    count = max(1, len(steps))
    if steps:
        durations = [float(e["dur"]) * 1e-6 for e in steps]
        median, mean = statistics.median(durations), statistics.fmean(durations)
    else:
        end = max(float(e["ts"]) + float(e["dur"]) for e in timed)
        median = mean = (end - min(float(e["ts"]) for e in timed)) * 1e-6
    per_step = {k: v / count for k, v in totals.items()}
    return TraceSummary(count, median, mean, per_step, source)


def compare_trace(
    plan: Plan, trace: TraceSummary, prediction: Prediction, predicted_classes: dict[str, float]
) -> Comparison:
    """Rows per operator class for a trace of ``plan`` (traces carry no fingerprint)."""
    rows = [Row("step", prediction.step_time_s, trace.step_time_s)]
    pred = dict(predicted_classes)
    pred["communication"] = communication_s(prediction.breakdown_s) + prediction.breakdown_s.get(
        "bubble", 0.0
    )
    pred["optimizer"] = prediction.breakdown_s.get("optimizer", 0.0)
    rows += [Row(name, pred.get(name, 0.0), trace.class_s.get(name, 0.0)) for name in OP_CLASSES]
    notes = (
        f"trace: {trace.steps} step(s), {trace.source}; a trace carries no plan fingerprint, "
        "so make sure it ran this plan",
        *_band_note(plan, prediction),
    )
    return Comparison(f"{plan.model_name}: {plan.strategy.describe()} (trace)", tuple(rows), notes)


def load_measured_side(path: Path) -> MeasuredProfile | TraceSummary:
    """A measured profile or a trace, told apart by their contents."""
    if path.suffix == ".gz":
        raise SpecError(f"{path}: decompress the trace first (gunzip)")
    head = read_json(path, what="measured profile or trace", max_bytes=MAX_TRACE_BYTES)
    if isinstance(head, dict) and "traceEvents" in head:
        return read_trace(path)
    if isinstance(head, dict) and "plan_fingerprint" in head:
        return load_document(MeasuredProfile, path)
    raise SpecError(
        f"{path} is neither a measured profile ('plan measure' output) nor a torch.profiler "
        "trace (a JSON object with 'traceEvents')"
    )


# ----- output ------------------------------------------------------------------------------


def _value(value: float, unit: str) -> str:
    return f"{value:.3f} GiB" if unit == "GiB" else f"{value * 1e3:.1f} ms"


def format_comparison(comparison: Comparison) -> str:
    """A fixed-width table: component, predicted, measured, error."""
    width = max(15, *(len(row.name) for row in comparison.rows))
    header = f"{'component':<{width}} {'predicted':>12} {'measured':>12} {'error':>8}"
    lines = [comparison.title, header]
    for row in comparison.rows:
        error = "-" if row.error is None else f"{row.error:+.1%}"
        lines.append(f"{row.name:<{width}} {_value(row.predicted, row.unit):>12} "
                     f"{_value(row.measured, row.unit):>12} {error:>8}")  # fmt: skip
    lines += [f"  {note}" for note in comparison.notes]
    return "\n".join(lines)
