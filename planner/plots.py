"""Pictures of a plan search and of a prediction against a measurement (PNG files).

- :func:`plot_plan` (``plan search --plot``): where the step time goes for the chosen
  plan and its runners-up (stacked bars, seconds or milliseconds per step), and every
  candidate the search priced as throughput (tokens/s per GPU) against peak memory per
  GPU (GiB), with the Pareto front of the fitting ones and the GPU memory limit.
- :func:`plot_comparison` (``plan compare --plot``): predicted and measured time per
  component (seconds or milliseconds per step), with the error of each prediction.
- :func:`plot_scale` (``plan scale --plot``): the cluster's throughput (tokens/s, with
  linear scaling from the smallest size) and the days to train the token budget against
  the number of GPUs, the knee and the deadline marked.

Figures are drawn with matplotlib's Agg canvas (no display, no pyplot state); matplotlib
is imported only when a picture is asked for. Files are written atomically.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from planner.errors import SpecError
from planner.io import write_bytes_atomic
from planner.spec import Plan, Prediction, Strategy

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from planner.compare import Comparison, Row
    from planner.planning import PlanSearch
    from planner.scale_math import ScaleTable

__all__ = [
    "check_plot_path",
    "pareto_front",
    "plot_comparison",
    "plot_plan",
    "plot_scale",
    "term_name",
]

_DPI = 120
# Step-time terms in stacking order: key in Prediction.breakdown_s, legend name, colour.
_TERMS = (
    ("compute", "compute (forward + backward)", "#4c72b0"),
    ("recompute", "activation recompute", "#8fb0de"),
    ("grad_accumulation", "gradient accumulation", "#a6cee3"),
    ("comm_tp", "tensor-parallel comm.", "#dd8452"),
    ("comm_cp", "context-parallel comm.", "#e8b04a"),
    ("comm_pp", "pipeline send/recv", "#937860"),
    ("bubble", "pipeline bubble", "#c9b79c"),
    ("comm_fsdp", "FSDP weight gathers", "#55a868"),
    ("comm_dp", "data-parallel grad. reduce", "#8c8c8c"),
    ("compression", "gradient compression", "#da8bc3"),
    ("optimizer", "optimizer step", "#c44e52"),
    ("framework", "training loop per step", "#7f7f7f"),
)
_SPARE_COLOURS = ("#64b5cd", "#8172b3", "#ccb974", "#17becf", "#bcbd22")
_LABEL_WIDTH = 30  # characters per line of a strategy label
_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds"}


# ----- files -------------------------------------------------------------------------------


def check_plot_path(path: Path) -> None:
    """Raise :class:`SpecError` unless ``path`` names a PNG file in an existing directory."""
    if path.suffix.lower() != ".png":
        raise SpecError(
            f"cannot write plot {path}: plots are PNG images, name the file *.png "
            f"(e.g. {path.with_suffix('.png')})"
        )
    if not path.parent.is_dir():
        raise SpecError(f"cannot write plot {path}: directory {path.parent} does not exist")


def _save_png_atomic(figure: Figure, path: Path) -> None:
    """Render ``figure`` as PNG and write it through a temporary file and a rename."""
    check_plot_path(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    write_bytes_atomic(path, buffer.getvalue())


def _new_figure(width_in: float, height_in: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), dpi=_DPI, layout="constrained")


# ----- plan search -------------------------------------------------------------------------


def plot_plan(search: PlanSearch, path: str | Path, *, yours: Prediction | None = None) -> Figure:
    """Write the step-time breakdown and the Pareto front of ``search`` to ``path`` (PNG),
    with ``yours`` (the run of the config ``plan --from`` read) marked beside the plan.

    Needs a search run with ``pareto=True`` for the full front. Returns the figure:
    axes 0 the breakdown, axes 1 the Pareto scatter.
    """
    path = Path(path)
    check_plot_path(path)
    plan = search.plan
    chosen = _prediction_of(plan)
    figure = _new_figure(15.0, 6.8)
    left, right = figure.subplots(1, 2)
    _draw_breakdown(left, plan, chosen)
    _draw_pareto(right, [s.prediction for s in search.costed], plan, chosen, yours)
    figure.suptitle(_plan_title(plan), fontsize=12)
    _save_png_atomic(figure, path)
    return figure


def _prediction_of(plan: Plan) -> Prediction:
    if plan.prediction is None:
        raise SpecError(f"plan for {plan.model_name} carries no prediction: nothing to plot")
    return plan.prediction


def _plan_title(plan: Plan) -> str:
    cluster, training = plan.cluster, plan.training
    nodes = max(1, cluster.num_gpus // cluster.gpus_per_node)
    seq_len = plan.seq_len
    seq = f" x {seq_len} tokens" if seq_len else ""
    return (
        f"{plan.model_name} on {cluster.num_gpus} x {cluster.gpu} ({nodes} node"
        f"{'s' if nodes > 1 else ''} of {min(cluster.gpus_per_node, cluster.num_gpus)}), "
        f"global batch {training.global_batch_size} sequences{seq}"
    )


def term_name(key: str) -> str:
    """Readable legend name of a step-time term (``'comm_tp'`` -> tensor-parallel comm.)."""
    for term, name, _ in _TERMS:
        if term == key:
            return name
    return key.replace("_", " ")


def _term_order(breakdowns: Sequence[dict[str, float]]) -> list[tuple[str, str]]:
    """(key, colour) of every term that is non-zero in some breakdown, in stacking order.

    Known terms keep their colour in every picture; other terms follow in name order
    with spare colours.
    """
    used = {key for breakdown in breakdowns for key, value in breakdown.items() if value != 0}
    known = [(key, colour) for key, _, colour in _TERMS if key in used]
    names = {key for key, _, _ in _TERMS}
    extra = sorted(used - names)
    return known + [(key, _SPARE_COLOURS[i % len(_SPARE_COLOURS)]) for i, key in enumerate(extra)]


def _strategy_label(strategy: Strategy) -> str:
    return textwrap.fill(strategy.describe(), width=_LABEL_WIDTH, break_on_hyphens=False)


def _draw_breakdown(axes: Axes, plan: Plan, chosen: Prediction) -> None:
    """Stacked horizontal bars per step: the chosen plan on top, runners-up below."""
    rows = [(plan.strategy, chosen)] + [(c.strategy, c.prediction) for c in plan.runners_up]
    scale, unit = _time_unit(max(p.step_time_s for _, p in rows))
    positions = list(range(len(rows)))
    lefts = [0.0] * len(rows)
    for key, colour in _term_order([p.breakdown_s for _, p in rows]):
        widths = [p.breakdown_s.get(key, 0.0) * scale for _, p in rows]
        axes.barh(positions, widths, left=lefts, height=0.62, color=colour,
                  label=term_name(key), edgecolor="white", linewidth=0.5)  # fmt: skip
        lefts = [a + b for a, b in zip(lefts, widths, strict=True)]
    axes.barh(0, chosen.step_time_s * scale, height=0.74, fill=False, edgecolor="black",
              linewidth=1.6)  # fmt: skip
    for position, (_, prediction) in enumerate(rows):
        axes.text(prediction.step_time_s * scale, position,
                  "  " + _total_label(prediction, chosen, scale, unit), va="center", ha="left",
                  fontsize=9, fontweight="bold" if position == 0 else "normal")  # fmt: skip
    axes.set_yticks(positions, [_strategy_label(s) for s, _ in rows], fontsize=8)
    axes.get_yticklabels()[0].set_fontweight("bold")
    axes.invert_yaxis()  # chosen plan on top
    axes.set_xlim(0, max(p.step_time_s for _, p in rows) * scale * 1.28)  # room for totals
    axes.set_xlabel(f"{_UNIT_NAMES[unit]} per step")
    axes.set_title("Where the step time goes: chosen plan (framed) and runners-up", fontsize=10)
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8,
                frameon=False)  # fmt: skip


def _time_unit(longest_s: float) -> tuple[float, str]:
    """(factor from seconds, symbol): seconds from one second up, else milliseconds."""
    return (1.0, "s") if longest_s >= 1.0 else (1e3, "ms")


def _total_label(prediction: Prediction, chosen: Prediction, scale: float, unit: str) -> str:
    total = f"{prediction.step_time_s * scale:.3g} {unit}"
    if prediction is chosen:
        return f"{total}  chosen"
    return f"{total}  ({prediction.step_time_s / chosen.step_time_s - 1:+.1%})"


def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, throughput) points no other point beats on both, by memory.

    A point is dominated when another needs no more memory and gives at least its
    throughput, and is better in one of them.
    """
    front: list[tuple[float, float]] = []
    for memory, throughput in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or throughput > front[-1][1]:
            front.append((memory, throughput))
    return front


def _draw_pareto(
    axes: Axes, costed: Sequence[Prediction], plan: Plan, chosen: Prediction,
    yours: Prediction | None = None,
) -> None:  # fmt: skip
    """Throughput against peak memory for every priced candidate, front and memory limit
    (and ``yours``, the config ``plan --from`` read)."""
    from matplotlib.ticker import FuncFormatter

    fitting = [p for p in costed if p.fits]
    over = [p for p in costed if not p.fits]
    axes.scatter(*_xy(fitting), s=9, color="#4c72b0", alpha=0.35, linewidths=0,
                 label=f"fits ({len(fitting):,} candidates)")  # fmt: skip
    if over:
        axes.scatter(*_xy(over), s=12, color="#999999", marker="x", alpha=0.5, linewidths=0.8,
                     label=f"over the memory limit ({len(over):,})")  # fmt: skip
    front = pareto_front(zip(*_xy([*fitting, chosen]), strict=True))
    axes.step([m for m, _ in front], [t for _, t in front], where="post", color="black",
              linewidth=1.4, marker="o", markersize=3, zorder=3,
              label="Pareto front (fitting plans)")  # fmt: skip
    runners = [c.prediction for c in plan.runners_up]
    if runners:
        axes.scatter(*_xy(runners), s=46, facecolors="none", edgecolors="#dd8452",
                     linewidths=1.3, label="runners-up", zorder=4)  # fmt: skip
    axes.scatter(*_xy([chosen]), s=190, marker="*",
                 color="#c44e52", edgecolors="black", linewidths=0.6, zorder=5,
                 label="chosen plan")  # fmt: skip
    if yours is not None:
        axes.scatter(*_xy([yours]), s=90, marker="D", color="#55a868", edgecolors="black",
                     linewidths=0.6, zorder=5, label="your config")  # fmt: skip
    shown = [*costed, *([yours] if yours is not None else [])]
    _draw_memory_limit(axes, chosen.memory_limit_gib, [p.peak_memory_gib for p in shown])
    _annotate_chosen(axes, chosen)
    axes.set_xlabel("peak memory per GPU (GiB)")
    axes.set_ylabel("throughput (tokens/s per GPU)")
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    axes.set_title("Every priced candidate: throughput against memory", fontsize=10)
    axes.set_ylim(bottom=0, top=max(p.tokens_per_s_per_gpu for p in (*shown, chosen)) * 1.12)
    axes.grid(alpha=0.3)
    axes.set_axisbelow(True)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8,
                frameon=False)  # fmt: skip


def _xy(predictions: Sequence[Prediction]) -> tuple[list[float], list[float]]:
    """Peak memory (GiB per GPU) and throughput (tokens/s per GPU) of each prediction."""
    return (
        [p.peak_memory_gib for p in predictions],
        [p.tokens_per_s_per_gpu for p in predictions],
    )


def _draw_memory_limit(axes: Axes, limit_gib: float, memories: Sequence[float]) -> None:
    """The limit as a labelled vertical line, the region past it shaded; log x over decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    low = min([*memories, limit_gib])
    high = max([*memories, limit_gib])
    if high / max(low, 1e-9) > 10:
        axes.set_xscale("log")
        axes.set_xlim(low / 1.25, high * 1.25)
        axes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.xaxis.set_minor_formatter(NullFormatter())
    else:
        span = high - low or 1.0
        axes.set_xlim(max(0.0, low - 0.05 * span), high + 0.05 * span)
    axes.axvspan(limit_gib, axes.get_xlim()[1], color="#999999", alpha=0.08, linewidth=0)
    axes.axvline(limit_gib, color="#c44e52", linestyle="--", linewidth=1.4)
    axes.annotate(f"HBM limit {limit_gib:.0f} GiB", xy=(limit_gib, 0.0),
                  xycoords=("data", "axes fraction"), xytext=(4, 6),
                  textcoords="offset points", rotation=90, ha="left", va="bottom",
                  fontsize=9, color="#c44e52",
                  bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none",
                        "alpha": 0.8})  # fmt: skip


def _annotate_chosen(axes: Axes, chosen: Prediction) -> None:
    """A note in the top-left corner, which no candidate can reach: a point there would
    beat the whole front (more throughput on less memory)."""
    text = (
        f"chosen: {chosen.tokens_per_s_per_gpu:,.0f} tokens/s/GPU\n"
        f"{chosen.peak_memory_gib:.1f} GiB, MFU {chosen.mfu:.0%}"
    )
    axes.annotate(text, xy=(chosen.peak_memory_gib, chosen.tokens_per_s_per_gpu),
                  xytext=(0.03, 0.97), textcoords="axes fraction", ha="left", va="top",
                  fontsize=9, arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8},
                  bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#bbbbbb"})  # fmt: skip


# ----- predicted against measured ----------------------------------------------------------


def plot_comparison(comparison: Comparison, path: str | Path) -> Figure:
    """Grouped bars (predicted, measured) per time component, seconds or milliseconds per
    step, to ``path`` (PNG). Returns the figure (one axes)."""
    path = Path(path)
    check_plot_path(path)
    rows = [r for r in comparison.rows if r.unit == "s"]
    scale, unit = _time_unit(max(max(r.predicted, r.measured) for r in rows))
    positions = list(range(len(rows)))
    width = 0.38
    figure = _new_figure(8.0, 4.5)
    axes = figure.subplots()
    predicted = axes.bar([p - width / 2 for p in positions], [r.predicted * scale for r in rows],
                         width, label="predicted", color="#4c72b0")  # fmt: skip
    measured = axes.bar([p + width / 2 for p in positions], [r.measured * scale for r in rows],
                        width, label="measured", color="#dd8452")  # fmt: skip
    for bars in (predicted, measured):
        axes.bar_label(bars, fmt="{:.3g}", fontsize=8, padding=2)
    axes.set_xticks(positions, [_comparison_label(r) for r in rows])
    axes.set_ylabel(f"time per step ({unit})")
    axes.set_xlabel("component (error of the prediction)")
    axes.set_title(comparison.title, fontsize=10)
    axes.legend()
    axes.margins(y=0.15)
    _save_png_atomic(figure, path)
    return figure


def _comparison_label(row: Row) -> str:
    return row.name if row.error is None else f"{row.name}\n({row.error:+.0%})"


# ----- scaling -----------------------------------------------------------------------------


def plot_scale(table: ScaleTable, path: Path) -> Figure:
    """Cluster tokens/s and days to train against GPUs (log-log) to ``path`` (PNG), the
    knee (:mod:`planner.scale_math`) as a dotted line, sizes where no plan fits as crosses
    on the x axis. Returns the figure: axes 0 throughput, axes 1 days."""
    check_plot_path(path)
    fitting = table.fitting
    if not fitting:
        raise SpecError("cannot plot the scaling: no size has a plan that fits")
    figure = _new_figure(12.0, 4.8)
    left, right = figure.subplots(1, 2)
    gpus = [row.gpus for row in fitting]
    smallest = fitting[0]
    left.plot(gpus, [row.tokens_per_s for row in fitting], marker="o", color="#4c72b0",
              label="predicted")  # fmt: skip
    left.plot(gpus, [smallest.tokens_per_s * n / smallest.gpus for n in gpus], linestyle="--",
              color="#8c8c8c", label=f"linear from {smallest.gpus} GPUs")  # fmt: skip
    left.set_ylabel("throughput (tokens/s, whole cluster)")
    left.set_title("Throughput", fontsize=10)
    right.plot(gpus, [row.days for row in fitting], marker="o", color="#dd8452",
               label="predicted")  # fmt: skip
    right.set_ylabel(f"days to train {table.tokens:.3g} tokens")
    right.set_title("Time to train", fontsize=10)
    if table.deadline_days is not None:
        right.axhline(table.deadline_days, color="#c44e52", linestyle="--", linewidth=1.2,
                      label=f"deadline {table.deadline_days:g} days")  # fmt: skip
    for axes in (left, right):
        _scale_axes(axes, table)
    figure.suptitle(f"{table.model} on {table.cluster}", fontsize=12)
    _save_png_atomic(figure, path)
    return figure


def _scale_axes(axes: Axes, table: ScaleTable) -> None:
    """Log-log axes over the sizes, the knee line, the sizes without a plan, the legend."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    sizes = [row.gpus for row in table.rows]
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.xaxis.set_major_locator(FixedLocator(sizes))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    knee = table.knee
    if knee is not None:
        axes.axvline(knee.gpus, color="#55a868", linestyle=":", linewidth=1.8,
                     label=f"knee: {knee.gpus} GPUs")  # fmt: skip
    missing = [row.gpus for row in table.rows if not row.fits]
    if missing:
        axes.scatter(missing, [0.0] * len(missing), marker="x", color="#999999", clip_on=False,
                     transform=axes.get_xaxis_transform(), zorder=5,
                     label="no plan fits")  # fmt: skip
    axes.set_xlim(min(sizes) / 1.3, max(sizes) * 1.3)
    axes.set_xlabel("GPUs")
    axes.grid(alpha=0.3, which="both")
    axes.set_axisbelow(True)
    axes.legend(fontsize=8)
