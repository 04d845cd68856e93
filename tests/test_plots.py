"""Pictures: the plan-search figure (breakdown bars, Pareto scatter) and the compare chart."""

from __future__ import annotations

import struct
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from planner.calibrate import measured_run_options, predict_plan
from planner.cli import main
from planner.compare import compare_measured
from planner.errors import SpecError
from planner.hardware import load_profile
from planner.models import resolve_model
from planner.planning import PlanSearch, search_plan
from planner.plots import check_plot_path, pareto_front, plot_comparison, plot_plan, term_name
from planner.spec import Cluster, Training
from tests.test_measure import fake_measured, make_plan

_SEARCH_ARGS = ["--model", "tiny-gpt", "--cluster", "a100-sxm-80gb", "--gpus", "8",
                "--global-batch", "32"]  # fmt: skip


@pytest.fixture(scope="module")
def search() -> PlanSearch:
    """gpt3-1.3b on 16 A100s, global batch 64, with the whole Pareto front priced."""
    return search_plan(
        resolve_model("gpt3-1.3b"),
        Cluster(gpu="a100-sxm-80gb", num_gpus=16),
        Training(global_batch_size=64),
        pareto=True,
    )


@pytest.fixture(scope="module")
def figure(search: PlanSearch, tmp_path_factory: pytest.TempPathFactory) -> Figure:
    return plot_plan(search, tmp_path_factory.mktemp("plots") / "plan.png")


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's header; fails on anything but a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _bar_totals(axes: Axes) -> dict[float, float]:
    """Sum of the filled bar widths at each bar centre (y)."""
    totals: dict[float, float] = defaultdict(float)
    for patch in axes.patches:
        if isinstance(patch, Rectangle) and patch.get_fill():
            totals[round(patch.get_y() + patch.get_height() / 2, 6)] += patch.get_width()
    return dict(totals)


def _line_with_label(axes: Axes, label: str) -> Line2D:
    return next(line for line in axes.get_lines() if line.get_label() == label)


def test_plan_png_is_written_at_a_readable_size(search: PlanSearch, tmp_path: Path) -> None:
    path = tmp_path / "out.png"
    plot_plan(search, path)
    width, height = _png_size(path)
    assert width >= 1200 and 500 <= height <= width
    assert path.stat().st_size > 20_000  # two panels of data, not an empty canvas
    assert [p.name for p in tmp_path.iterdir()] == ["out.png"]  # no temporary file left


def test_breakdown_has_one_stacked_bar_per_plan(search: PlanSearch, figure: Figure) -> None:
    bars = figure.axes[0]
    plan = search.plan
    assert plan.prediction is not None and plan.runners_up
    assert bars.get_xlabel() == "milliseconds per step"  # 0.36 s steps
    labels = [tick.get_text() for tick in bars.get_yticklabels()]
    assert len(labels) == 1 + len(plan.runners_up)
    assert labels[0] == textwrap.fill(plan.strategy.describe(), width=30, break_on_hyphens=False)
    assert labels[0].replace("\n", " ") == plan.strategy.describe()
    totals = sorted(_bar_totals(bars).items())  # chosen plan at y=0, then the runners-up
    expected = [plan.prediction.step_time_s] + [c.prediction.step_time_s for c in plan.runners_up]
    assert [total / 1e3 for _, total in totals] == pytest.approx(expected, rel=1e-9)


def test_breakdown_legend_names_every_term_that_takes_time(
    search: PlanSearch, figure: Figure
) -> None:
    plan = search.plan
    assert plan.prediction is not None
    predictions = [plan.prediction] + [c.prediction for c in plan.runners_up]
    used = {k for p in predictions for k, v in p.breakdown_s.items() if v != 0}
    legend = figure.axes[0].get_legend()
    assert legend is not None
    assert {t.get_text() for t in legend.get_texts()} == {term_name(k) for k in used}
    assert term_name("comm_tp") == "tensor-parallel comm."
    assert term_name("local_sgd_sync") == "local sgd sync"  # a term the table does not know


def test_pareto_panel_axes_limit_and_chosen_plan(search: PlanSearch, figure: Figure) -> None:
    scatter = figure.axes[1]
    chosen = search.plan.prediction
    assert chosen is not None
    assert scatter.get_xlabel() == "peak memory per GPU (GiB)"
    assert scatter.get_ylabel() == "throughput (tokens/s per GPU)"
    assert scatter.get_xscale() == "log"  # 2 to 80 GiB here
    limit = [line for line in scatter.get_lines() if line.get_linestyle() == "--"]
    assert len(limit) == 1 and list(limit[0].get_xdata()) == [chosen.memory_limit_gib] * 2
    texts = [t.get_text() for t in scatter.texts]
    assert f"HBM limit {chosen.memory_limit_gib:.0f} GiB" in texts
    assert any(t.startswith(f"chosen: {chosen.tokens_per_s_per_gpu:,.0f} tokens/s") for t in texts)
    star = next(c for c in scatter.collections if c.get_label() == "chosen plan")
    assert star.get_offsets().tolist() == [[chosen.peak_memory_gib, chosen.tokens_per_s_per_gpu]]


def test_pareto_line_is_the_front_of_the_fitting_candidates(
    search: PlanSearch, figure: Figure
) -> None:
    line = _line_with_label(figure.axes[1], "Pareto front (fitting plans)")
    front = list(zip(line.get_xdata(), line.get_ydata(), strict=True))
    fitting = [(s.prediction.peak_memory_gib, s.prediction.tokens_per_s_per_gpu)
               for s in search.costed if s.prediction.fits]  # fmt: skip
    assert len(front) >= 3
    for memory, throughput in front:  # nobody beats a front point on both axes
        assert not any(m <= memory and t > throughput for m, t in fitting)
    for memory, throughput in fitting:  # every candidate sits on or under the front
        assert any(m <= memory and t >= throughput for m, t in front)


def test_pareto_front_keeps_only_undominated_points() -> None:
    points = [(10.0, 5.0), (20.0, 5.0), (5.0, 1.0), (5.0, 2.0), (30.0, 9.0), (25.0, 4.0)]
    assert pareto_front(points) == [(5.0, 2.0), (10.0, 5.0), (30.0, 9.0)]
    assert pareto_front([]) == []


def test_memory_in_a_narrow_range_gets_a_linear_axis(search: PlanSearch, tmp_path: Path) -> None:
    chosen = search.plan.prediction
    assert chosen is not None
    near = tuple(s for s in search.costed if s.prediction.peak_memory_gib > 15)
    figure = plot_plan(PlanSearch(search.plan, near), tmp_path / "narrow.png")
    scatter = figure.axes[1]
    assert scatter.get_xscale() == "linear"
    low, high = scatter.get_xlim()
    assert low <= min(s.prediction.peak_memory_gib for s in near)
    assert high >= chosen.memory_limit_gib  # the limit stays in view


def test_a_plan_alone_still_draws(search: PlanSearch, tmp_path: Path) -> None:
    alone = search.plan.model_copy(update={"runners_up": ()})
    figure = plot_plan(PlanSearch(alone, ()), tmp_path / "alone.png")
    assert len(figure.axes[0].get_yticklabels()) == 1
    front = _line_with_label(figure.axes[1], "Pareto front (fitting plans)")
    assert len(front.get_xdata()) == 1  # the chosen plan is its own front


def test_bad_plot_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"name the file \*\.png .*out\.png"):
        check_plot_path(tmp_path / "out.jpg")
    with pytest.raises(SpecError, match=r"directory .*missing does not exist"):
        check_plot_path(tmp_path / "missing" / "out.png")


def test_cli_search_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "search.png"
    assert main([*_SEARCH_ARGS, "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert _png_size(png)[0] >= 1200


def test_cli_search_rejects_a_bad_plot_path_before_searching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "nowhere" / "search.png"
    assert main(["search", *_SEARCH_ARGS, "--plot", str(bad)]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err


def _comparison_files(tmp_path: Path) -> tuple[Path, Path]:
    plan = make_plan()
    profile = load_profile("a100-sxm-80gb")
    prediction = predict_plan(plan, profile, measured_run_options(profile))
    plan_path, measured_path = tmp_path / "plan.json", tmp_path / "measured.json"
    plan_path.write_text(plan.model_copy(update={"prediction": prediction}).to_json())
    measured = fake_measured(plan, seconds=2 * prediction.step_time_s)
    measured_path.write_text(measured.model_dump_json())
    return plan_path, measured_path


def test_comparison_plot_has_a_bar_pair_per_time_component(tmp_path: Path) -> None:
    plan = make_plan()
    profile = load_profile("a100-sxm-80gb")
    prediction = predict_plan(plan, profile, measured_run_options(profile))
    comparison = compare_measured(plan, fake_measured(plan, seconds=0.5), prediction)
    png = tmp_path / "compare.png"
    axes = plot_comparison(comparison, png).axes[0]
    timed = [row for row in comparison.rows if row.unit == "s"]
    assert len(axes.patches) == 2 * len(timed)  # predicted and measured per component
    assert axes.get_ylabel() == "time per step (ms)"
    assert [t.get_text().split("\n")[0] for t in axes.get_xticklabels()] == [r.name for r in timed]
    assert axes.patches[len(timed)].get_height() == pytest.approx(500.0)  # measured step, ms
    assert _png_size(png)[0] >= 800


@pytest.mark.parametrize("option", ["--plot", "--png"])
def test_cli_compare_plot_option_and_its_old_name(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_path, measured_path = _comparison_files(tmp_path)
    png = tmp_path / "chart.png"
    assert main(["compare", str(plan_path), str(measured_path), option, str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert _png_size(png)[0] >= 800


def test_the_config_plan_from_read_is_marked_beside_the_plan(
    search: PlanSearch, tmp_path: Path
) -> None:
    """``plan --from FILE --plot``: the config's own run is a point of its own."""
    assert search.plan.prediction is not None
    yours = search.plan.prediction.model_copy(
        update={"peak_memory_gib": 200.0, "tokens_per_s_per_gpu": 10.0}
    )
    figure = plot_plan(search, tmp_path / "yours.png", yours=yours)
    scatter = figure.axes[1]
    (marked,) = [c for c in scatter.collections if c.get_label() == "your config"]
    assert marked.get_offsets().tolist() == [[200.0, 10.0]]
    assert scatter.get_xlim()[1] > 200.0  # the axis reaches it, past the memory limit
