"""``plan scale``: the table arithmetic, the knee and the deadline on synthetic rows
(torch-free), the sizes and durations the CLI accepts, and the command end to end on
small zoo models."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

import planner
from planner.cli import main
from planner.errors import SpecError
from planner.plots import plot_scale
from planner.scale_math import (
    GpuSizes,
    ScaleRow,
    SizeFit,
    SizeMiss,
    marginal_efficiency,
    parse_duration_days,
    scale_table,
    short_reason,
)
from planner.spec import Cluster, Training

BASE = 1.0e6  # tokens/s of the smallest synthetic size


def _fit(gpus: int, tokens_per_s: float, *, peak: float = 60.0) -> SizeFit:
    return SizeFit(gpus=gpus, strategy=f"dp{gpus}", step_time_s=4e6 / tokens_per_s,
                   tokens_per_s=tokens_per_s, mfu=0.4, peak_memory_gib=peak,
                   memory_limit_gib=79.0)  # fmt: skip


def _curve(ratios: list[float], first: int = 64) -> list[SizeFit]:
    """Sizes first, 2 first, ...; each throughput ``ratio`` x the previous."""
    fits, throughput = [_fit(first, BASE)], BASE
    for index, ratio in enumerate(ratios, start=1):
        throughput *= ratio
        fits.append(_fit(first * 2**index, throughput))
    return fits


# ----- arithmetic ---------------------------------------------------------------------------


def test_days_gpu_hours_cost_and_headroom_follow_their_definitions():
    table = scale_table([_fit(64, 2.0e6, peak=70.5)], tokens=15e12, price_per_gpu_hour=2.5)
    (row,) = table.rows
    assert isinstance(row, ScaleRow)
    days = 15e12 / 2.0e6 / 86_400  # 86.8 days
    assert row.days == pytest.approx(days)
    assert row.gpu_hours == pytest.approx(days * 24 * 64)
    assert row.cost == pytest.approx(days * 24 * 64 * 2.5)
    assert row.free_gib == pytest.approx(79.0 - 70.5)
    assert row.efficiency == 1.0 and row.marginal_efficiency is None


def test_no_price_no_cost():
    (row,) = scale_table([_fit(8, BASE)], tokens=1e12).rows
    assert isinstance(row, ScaleRow) and row.cost is None


def test_efficiency_is_per_gpu_throughput_against_the_smallest_size():
    table = scale_table(_curve([2.0, 1.5]), tokens=1e12)
    assert [r.efficiency for r in table.fitting] == pytest.approx([1.0, 1.0, 0.75])


def test_marginal_efficiency_at_a_doubling_is_the_throughput_ratio_minus_one():
    assert marginal_efficiency(64, BASE, 128, 1.8 * BASE) == pytest.approx(0.8)
    # not a doubling: 64 -> 96 GPUs adding 0.25 BASE is 0.25 / 32 per GPU against 1/64
    assert marginal_efficiency(64, BASE, 96, 1.25 * BASE) == pytest.approx(0.5)


# ----- the knee -------------------------------------------------------------------------------


def test_the_knee_is_the_last_size_before_marginal_efficiency_falls_below_the_threshold():
    # marginal efficiencies 1.0, 0.95, 0.79, 0.5: the fall comes going from 256 to 512
    table = scale_table(_curve([2.0, 1.95, 1.79, 1.5]), tokens=1e12)
    margins = [r.marginal_efficiency for r in table.fitting[1:]]
    assert margins == pytest.approx([1.0, 0.95, 0.79, 0.5])
    assert table.knee is not None and table.knee.gpus == 256


def test_the_threshold_moves_the_knee():
    fits = _curve([2.0, 1.95, 1.79, 1.5])
    knee = scale_table(fits, tokens=1e12, knee_threshold=0.7).knee
    assert knee is not None and knee.gpus == 512


def test_linear_scaling_puts_the_knee_at_the_largest_size():
    knee = scale_table(_curve([2.0, 2.0, 2.0]), tokens=1e12).knee
    assert knee is not None and knee.gpus == 512


def test_a_fall_at_the_first_step_puts_the_knee_at_the_smallest_size():
    knee = scale_table(_curve([1.2, 2.0]), tokens=1e12).knee
    assert knee is not None and knee.gpus == 64


def test_a_recovery_after_the_fall_is_not_followed():
    knee = scale_table(_curve([1.5, 2.2]), tokens=1e12).knee  # 0.5, then 1.2
    assert knee is not None and knee.gpus == 64


def test_sizes_without_a_plan_are_skipped_by_efficiency_and_knee():
    outcomes = [SizeMiss(32, "no strategy fits"), *_curve([2.0, 1.5])]
    table = scale_table(outcomes, tokens=1e12)
    assert [r.gpus for r in table.rows] == [32, 64, 128, 256]
    assert not table.rows[0].fits
    assert table.fitting[0].efficiency == 1.0  # against the smallest size that fits
    assert table.knee is not None and table.knee.gpus == 128


def test_nothing_fits_means_no_knee_and_no_deadline_answer():
    table = scale_table([SizeMiss(8, "no")], tokens=1e12, deadline_days=30)
    assert table.knee is None and table.meets_deadline is None and table.fastest is None


# ----- the deadline ---------------------------------------------------------------------------


def test_the_deadline_picks_the_smallest_size_that_meets_it():
    fits = _curve([2.0, 2.0, 2.0])  # 64..512 GPUs
    days = [scale_table(fits, tokens=1e13).fitting[i].days for i in range(4)]
    table = scale_table(fits, tokens=1e13, deadline_days=(days[1] + days[2]) / 2)
    assert table.meets_deadline is not None and table.meets_deadline.gpus == 256
    exact = scale_table(fits, tokens=1e13, deadline_days=days[1])
    assert exact.meets_deadline is not None and exact.meets_deadline.gpus == 128


def test_no_size_meets_the_deadline_names_the_fastest():
    table = scale_table(_curve([2.0, 0.9]), tokens=1e13, deadline_days=1.0)
    assert table.meets_deadline is None
    assert table.fastest is not None and table.fastest.gpus == 128  # 256 GPUs is slower


def test_the_table_json_has_every_row_the_knee_and_the_deadline():
    outcomes = [SizeMiss(32, "no strategy fits: too big"), *_curve([2.0, 1.5])]
    data = json.loads(scale_table(outcomes, tokens=1e12, deadline_days=30).to_json())
    assert [row["gpus"] for row in data["rows"]] == [32, 64, 128, 256]
    assert data["rows"][0] == {"gpus": 32, "reason": "no strategy fits: too big", "fits": False}
    assert data["rows"][1]["fits"] and data["rows"][1]["cost"] is None
    assert data["knee"] == {"gpus": 128, "threshold": 0.8}
    assert data["deadline"]["days"] == 30


@pytest.mark.parametrize(
    ("field", "value"),
    [("tokens", 0.0), ("tokens", math.inf), ("tokens", 1e30), ("price_per_gpu_hour", -1.0),
     ("deadline_days", math.nan), ("knee_threshold", 1.5)],
)  # fmt: skip
def test_the_table_refuses_numbers_out_of_range(field, value):
    arguments = {"tokens": 1e12, field: value}
    with pytest.raises(SpecError, match=field):
        scale_table([_fit(8, BASE)], **arguments)


def test_a_short_reason_is_the_first_sentence_without_asides():
    reason = (
        "no strategy fits: the closest, dp1(zero3) cp8 mb1x64 recompute=full, needs 161.8 GiB "
        "per GPU (largest terms, GiB: optimizer 65.7) but a h100 has 79 GiB. To fit: more GPUs"
    )
    assert short_reason(reason) == (
        "no strategy fits: the closest, dp1(zero3) cp8 mb1x64 recompute=full, needs 161.8 GiB "
        "per GPU but a h100 has 79 GiB"
    )
    assert len(short_reason("x" * 500)) == 160


# ----- sizes and durations --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "sizes"),
    [("64..1024", (64, 128, 256, 512, 1024)), ("8..8", (8,)), ("3..12", (3, 6, 12)),
     ("512,64,128", (64, 128, 512)), (" 16 ", (16,))],
)  # fmt: skip
def test_sizes_parse_as_doublings_or_a_list(text, sizes):
    assert GpuSizes.parse(text).sizes == sizes


@pytest.mark.parametrize(
    ("text", "message"),
    [("64..1000", "1000 is not 64 times a power of two; end the range at 512 or 1024"),
     ("1024..64", "the range runs upwards; write 64..1024"),
     ("64..", "expected A..B"), ("lots", "expected A..B"), ("0..8", "0 GPUs"),
     ("64,64", "64 appears twice"), ("1..1099511627776", "> 1048576"),
     ("1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,"
      "32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,"
      "60,61,62,63,64,65", "65 sizes > 64")],
)  # fmt: skip
def test_bad_sizes_name_the_value_and_the_fix(text, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        GpuSizes.parse(text)


def test_sizes_above_a_node_must_be_whole_nodes():
    base = Cluster(gpu="h100-sxm-80gb", num_gpus=8)
    assert [c.num_gpus for c in GpuSizes.parse("2..64").clusters(base)] == [2, 4, 8, 16, 32, 64]
    with pytest.raises(
        SpecError,
        match=r"--gpus 12\.\.96: num_gpus \(12\) must be a multiple"
        r".*start the range at a multiple of the node size, 8 \(e\.g\. 8\.\.64\)",
    ):
        GpuSizes.parse("12..96").clusters(base)  # fmt: skip
    with pytest.raises(SpecError, match=r"use sizes of at most one node \(8 GPUs\)"):
        GpuSizes.parse("8,20").clusters(base)


def test_a_cluster_profile_keeps_its_links_at_every_size():
    base = Cluster(gpu="h100-sxm-80gb", num_gpus=512, inter_node_GBps=12.5, name="slow")
    small, big = GpuSizes.of([64, 1024]).clusters(base)
    assert (small.num_gpus, big.num_gpus) == (64, 1024)
    assert small.inter_node_GBps == big.inter_node_GBps == 12.5 and big.name == "slow"


@pytest.mark.parametrize(("text", "days"), [("30d", 30.0), ("12h", 0.5), ("1.5d", 1.5)])
def test_durations_are_days_or_hours(text, days):
    assert parse_duration_days(text) == pytest.approx(days)


@pytest.mark.parametrize("text", ["30", "0d", "-1d", "30m", "nand", "infd", "", "d"])
def test_bad_durations_are_refused(text):
    with pytest.raises(SpecError, match=r"expected a positive duration such as 30d or 12h"):
        parse_duration_days(text)


# ----- the picture ------------------------------------------------------------------------------


def test_plot_marks_the_knee_and_the_sizes_without_a_plan(tmp_path: Path):
    outcomes = [SizeMiss(32, "no"), *_curve([2.0, 1.5, 1.2])]
    path = tmp_path / "scale.png"
    figure = plot_scale(scale_table(outcomes, tokens=1e12, deadline_days=5), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    throughput, days = figure.axes
    for axes in (throughput, days):
        labels = axes.get_legend_handles_labels()[1]
        assert "knee: 128 GPUs" in labels and "no plan fits" in labels
    assert "deadline 5 days" in days.get_legend_handles_labels()[1]


def test_plot_refuses_a_table_where_nothing_fits(tmp_path: Path):
    with pytest.raises(SpecError, match="no size has a plan that fits"):
        plot_scale(scale_table([SizeMiss(8, "no")], tokens=1e12), tmp_path / "x.png")


# ----- the command and the Python API -------------------------------------------------------


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as exc:
        status = int(exc.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_plan_scale_prints_a_row_per_size_and_writes_the_table_and_plot(tmp_path, capsys):
    table, picture = tmp_path / "scale.json", tmp_path / "scale.png"
    argv = ["scale", "--model", "gpt2", "--gpus", "8..32", "--global-batch", "64",
            "--tokens", "1e11", "--price-per-gpu-hour", "2", "--deadline", "12h",
            "-o", str(table), "--plot", str(picture)]  # fmt: skip
    status, out, err = _run(argv, capsys)
    assert status == 0, err
    rows = json.loads(table.read_text())["rows"]
    assert [row["gpus"] for row in rows] == [8, 16, 32] and all(row["fits"] for row in rows)
    assert all(row["cost"] == pytest.approx(row["gpu_hours"] * 2) for row in rows)
    for row in rows:
        assert re.search(rf"^ *{row['gpus']}( \*)? +dp", out, re.M), out
    assert re.search(r"^\* knee: \d+ GPUs", out, re.M)
    assert re.search(r"^deadline 0\.5 days: ", out, re.M)
    assert f"wrote {picture}" in out and picture.read_bytes()[:4] == b"\x89PNG"


def test_a_size_where_nothing_fits_is_a_row_with_the_reason(capsys):
    argv = ["scale", "--model", "gpt3-13b", "--cluster", "a100-sxm-40gb", "--gpus", "1,8",
            "--global-batch", "8", "--tokens", "1e12", "--json"]  # fmt: skip
    status, out, err = _run(argv, capsys)
    assert status == 0, err
    missing, fitting = json.loads(out)["rows"]
    assert missing["gpus"] == 1 and not missing["fits"]
    assert missing["reason"].startswith("no strategy fits: the closest")
    assert fitting["gpus"] == 8 and fitting["fits"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--gpus", "64..1000"], "argument --gpus: 64..1000: 1000 is not 64 times a power of two"),
     (["--gpus", "12..96"], "--gpus 12..96: num_gpus (12) must be a multiple of gpus_per_node"),
     (["--gpus", "8", "--deadline", "30"], "argument --deadline: expected a positive duration"),
     (["--gpus", "8", "--deadline", "2w"], "argument --deadline: expected a positive duration"),
     (["--gpus", "8", "--tokens", "0"], "argument --tokens: expected a positive finite number"),
     (["--gpus", "8", "-o", "/no/such/dir/t.json"], "directory /no/such/dir does not exist")],
)  # fmt: skip
def test_bad_input_is_one_error_line_and_status_2(extra, message, capsys):
    argv = ["scale", "--model", "gpt2", "--global-batch", "8", "--tokens", "1e12", *extra]
    status, _, err = _run(argv, capsys)
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert message in err


def test_scale_plans_is_exported_lazily_and_returns_the_table():
    table = planner.scale_plans(
        planner.resolve_model("gpt2"), Cluster(gpu="h100-sxm-80gb", num_gpus=8),
        Training(global_batch_size=64), [8, 16], tokens=1e11, deadline_days=1000,
    )  # fmt: skip
    assert isinstance(table, planner.ScaleTable)
    assert [row.gpus for row in table.fitting] == [8, 16]
    assert table.meets_deadline is not None and table.meets_deadline.gpus == 8
