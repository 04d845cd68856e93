"""Every prediction carries the cost model's measured error in its regime: the shipped
bands are what the benchmark measures, a regime without enough published runs says to
calibrate first, and the band travels in plans and prints with estimates."""

import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.cost import estimate_run
from planner.cost.error_band import (
    COMMAND,
    MIN_RUNS,
    comm_share_bin,
    describe_band,
    error_band,
    shipped_table,
)
from planner.spec import DType, Plan
from tests.benchmark_modules import load_benchmark

DENSE_RUN = {
    "model": {"preset": "llama3-8b"},
    "cluster": {"gpu": "h100-sxm-80gb", "num_gpus": 8},
    "training": {"global_batch_size": 32, "micro_batch_size": 1, "dtype": "bf16"},
    "strategy": {"dp": 8, "zero": 3},
}  # fmt: skip


def _rounded(data):
    """``data`` with every float to 9 significant digits (sums in another order agree)."""
    if isinstance(data, dict):
        return {key: _rounded(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [_rounded(value) for value in data]
    return float(f"{data:.9g}") if isinstance(data, float) else data


def test_the_shipped_bands_are_what_the_benchmark_measures_now():
    bench = load_benchmark("bench_accuracy")
    if not bench.DEFAULT_CSV.is_file():
        pytest.skip(f"published runs CSV not present at {bench.DEFAULT_CSV}")
    from planner.cost.error_band import fit_error_bands

    measured = fit_error_bands(bench.residuals(bench.DEFAULT_CSV, bench.MOE_CSV, bench.DENSE_CSV))
    stale = f"the cost model or the data changed: re-measure the bands with `{COMMAND}`"
    assert _rounded(measured.model_dump()) == _rounded(shipped_table().model_dump()), stale
    assert sum(b.runs for b in measured.step) >= 60  # every priced dense and MoE row


@pytest.mark.parametrize(
    ("comm", "expected"),
    [(0.0, "<15%"), (0.149, "<15%"), (0.15, "15-30%"), (0.299, "15-30%"), (0.3, ">=30%"),
     (1.0, ">=30%")],
)  # fmt: skip
def test_the_communication_bins(comm, expected):
    breakdown = {"compute": 1 - comm, "comm_tp": comm / 2, "comm_fsdp": comm / 2, "bubble": 0.5}
    assert comm_share_bin(breakdown, 1.0) == expected


def test_a_prediction_carries_its_regimes_band():
    prediction = estimate_run(DENSE_RUN)
    band = prediction.error_band
    assert band is not None
    assert (band.family, band.precision, band.device_kind) == ("dense", "bf16/fp16", "gpu")
    assert band.comm_share == comm_share_bin(prediction.breakdown_s, prediction.step_time_s)
    stated = next(
        b for b in shipped_table().step
        if (b.family, b.precision, b.device_kind, b.comm_share)
        == (band.family, band.precision, band.device_kind, band.comm_share)
    )  # fmt: skip
    assert stated.runs >= MIN_RUNS and band.step_mean_abs == stated.step_mean_abs
    memory = next(
        m for m in shipped_table().memory if (m.family, m.device_kind) == ("dense", "gpu")
    )
    assert (band.memory_runs, band.memory_mean_abs) == (memory.runs, memory.mean_abs)
    text = describe_band(band, "h100-sxm-80gb")
    assert f"{stated.step_mean_abs:.1%} mean" in text and "none on" not in text
    assert "none on h200-sxm-141gb" in describe_band(band, "h200-sxm-141gb")


def test_a_regime_without_published_runs_says_to_calibrate_first():
    band = error_band(
        moe=False, dtype=DType.FP32, device_kind="cpu", breakdown_s={"compute": 1.0},
        step_time_s=1.0,
    )  # fmt: skip
    assert band.runs == 0 and band.step_mean_abs is None
    text = describe_band(band, "my-cpu.json")
    assert "not validated: 0 published runs" in text and "plan compare" in text
    assert band.memory_mean_abs is None  # the published peaks are GPU runs
    assert "peak memory not validated for dense models on cpu" in text
    comm_bound = error_band(
        moe=False, dtype=DType.BF16, device_kind="gpu", breakdown_s={"comm_tp": 0.5},
        step_time_s=1.0,
    )  # fmt: skip
    assert comm_bound.runs < MIN_RUNS and comm_bound.step_mean_abs is None
    assert "calibrate on your cluster (plan calibrate)" in describe_band(comm_bound, "h100")


def test_a_moe_prediction_is_banded_apart_from_dense_ones():
    run = {
        "model": {"preset": "mixtral-8x7b"},
        "cluster": {"gpu": "h100-sxm-80gb", "num_gpus": 64},
        "training": {"global_batch_size": 256, "micro_batch_size": 1, "dtype": "bf16"},
        "strategy": {"dp": 16, "pp": 4, "ep": 8, "zero": 1, "schedule": "1f1b"},
    }  # fmt: skip
    band = estimate_run(run).error_band
    assert band is not None and band.family == "moe"
    assert band.memory_mean_abs is None  # no MoE run in the data reports its peak memory
    assert "peak memory not validated for moe models on gpu" in describe_band(band, "h100-sxm-80gb")


def test_the_band_travels_in_the_plan_and_prints(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["--model", "llama3-8b", "--cluster", "h100-sxm-80gb", "--gpus", "8",
                 "--global-batch", "32", "-o", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "expected error" in printed
    plan = Plan.from_json(out.read_text())
    assert plan.prediction is not None and plan.prediction.error_band is not None
    assert json.loads(out.read_text())["prediction"]["error_band"]["family"] == "dense"
    assert main(["estimate", "--plan", str(out)]) == 0
    estimated = capsys.readouterr().out
    assert "expected error   step time" in estimated and "plan's own       the same" in estimated
    assert main(["explain", str(out)]) == 0
    assert "expected error" in capsys.readouterr().out


def test_the_readme_shows_the_shipped_bands(capsys):
    """The README's table of bands is what the benchmark prints for the shipped ones."""
    load_benchmark("bench_accuracy").print_bands(shipped_table())
    printed = capsys.readouterr().out.splitlines()[2:]  # after the blank line and title
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    shown = readme.split("--write-error-bands` prints them", 1)[1].split("```", 2)[1]
    assert shown.strip().splitlines() == printed, f"paste into the README:\n{chr(10).join(printed)}"
