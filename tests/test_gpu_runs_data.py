"""The H200 runs of this runtime (benchmarks/data/h200, ``bench_gpu_loop.py``) are whole,
and the cost model prices the dense ones within its targets on the datasheet profile."""

from pathlib import Path

import pytest

from planner.calibrate import measured_run_options, predict_plan
from planner.hardware import load_profile
from planner.measured import MeasuredProfile, plan_fingerprint
from planner.spec import DType, Plan, load_document
from tests.benchmark_modules import load_benchmark

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "h200"
BENCH = load_benchmark("bench_gpu_loop")
DENSE = [name for name, entry in BENCH.GPU_PLANS.items() if entry[0] != "olmoe-1b-7b"]


def _files(name: str) -> tuple[Plan, Path]:
    plan_path = DATA / f"plan-{BENCH._slug(name)}.json"
    return load_document(Plan, plan_path), BENCH._measured_path(plan_path)


@pytest.mark.parametrize("name", list(BENCH.GPU_PLANS))
def test_every_plan_was_measured_or_ran_out_of_memory(name):
    plan, measured = _files(name)
    if not measured.is_file():
        assert measured.with_suffix(".oom").read_text().startswith("CUDA out of memory")
        return
    run = load_document(MeasuredProfile, measured)
    assert run.plan_fingerprint == plan_fingerprint(plan)
    assert "H200" in run.provenance.device


@pytest.mark.parametrize("name", [n for n in DENSE if _files(n)[1].is_file()])
def test_dense_runs_are_priced_within_15_percent_and_memory_within_10(name):
    plan, measured = _files(name)
    run = load_document(MeasuredProfile, measured)
    profile = load_profile("h200-sxm-141gb")
    predicted = predict_plan(plan, profile, measured_run_options(profile))
    assert predicted.step_time_s == pytest.approx(run.step_time_median_s, rel=0.15)
    assert predicted.peak_memory_gib == pytest.approx(run.peak_memory_max_gib, rel=0.10)


@pytest.mark.parametrize("name", [n for n in DENSE if _files(n)[1].is_file()])
def test_a_gemm_fit_on_transformer_shapes_prices_the_dense_runs_within_8_percent(name):
    """What ``plan calibrate`` fits on GPUs now (GPU_MATMUL_SHAPES, timed in gemm.csv):
    the profile calibrated on square products priced these runs 6-16% too fast."""
    plan, measured = _files(name)
    run = load_document(MeasuredProfile, measured)
    calibrated = load_profile(str(DATA / "calibrated.json"))
    refit = BENCH._gemm_refit(calibrated, BENCH._gemm_rows(DATA / "gemm.csv"), DType.BF16)
    predicted = predict_plan(plan, refit, measured_run_options(refit))
    assert predicted.step_time_s == pytest.approx(run.step_time_median_s, rel=0.08)


@pytest.mark.parametrize("name", ["h200-sxm-141gb", "h100-sxm-80gb", "h100-96gb"])
def test_the_hopper_profiles_price_fp8_gemms_as_the_h200_sweep_fits_them(name):
    """The ratio each Hopper profile cites is what ``bench_gpu_loop --reuse`` fits."""
    rows = BENCH._gemm_rows(DATA / "gemm.csv")
    refit = BENCH._gemm_refit(load_profile(str(DATA / "calibrated.json")), rows, DType.BF16)
    assert load_profile(name).fp8_matmul_ratio == pytest.approx(refit.fp8_matmul_ratio, abs=5e-4)
