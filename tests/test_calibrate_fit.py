"""Calibration fits on synthetic data with known parameters (recovered within 5%)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from planner.assemble import assemble_plan
from planner.calibrate import CalibrationError, measured_run_options, predict_plan
from planner.calibrate.fit import (
    FitResult,
    fit_alpha_beta,
    fit_matmul,
    fit_memory,
    fit_streaming,
)
from planner.calibrate.refit import (
    REFIT_PARAMETERS,
    RefitParameter,
    refit_profile,
    with_parameters,
)
from planner.cost.communication import Collective, bus_factor, latency_steps
from planner.hardware import HardwareProfile, save_profile
from planner.measured import MeasuredProfile, Provenance, plan_fingerprint
from planner.models import resolve_model
from planner.spec import Cluster, Plan, Strategy, Training

RNG = np.random.default_rng(0)
PEAK = 2e11  # FLOP/s


def _noisy(values: np.ndarray, level: float = 0.01) -> list[float]:
    return (values * (1 + level * RNG.standard_normal(values.shape))).tolist()


def test_matmul_fit_recovers_efficiency_and_overhead() -> None:
    flops = np.geomspace(1e5, 1e10, 12)
    seconds = flops / (PEAK * 0.42) + 7e-6
    fit = fit_matmul(flops.tolist(), _noisy(seconds), PEAK)
    assert fit.values["matmul_efficiency"] == pytest.approx(0.42, rel=0.05)
    assert fit.values["matmul_overhead_us"] == pytest.approx(7.0, rel=0.05)
    assert fit.rms_after < fit.rms_before


def test_memory_fits_recover_bandwidth_and_overhead() -> None:
    nbytes = np.geomspace(1e3, 1e9, 10)
    seconds = nbytes / 12e9 + 4e-6
    streaming = fit_streaming(nbytes.tolist(), _noisy(seconds))
    assert streaming.values["memory_bandwidth_GBps"] == pytest.approx(12.0, rel=0.05)
    assert streaming.values["kernel_overhead_us"] == pytest.approx(4.0, rel=0.05)
    relative = fit_memory(nbytes.tolist(), _noisy(seconds), 20e9)
    assert relative.values["memory_efficiency"] == pytest.approx(0.6, rel=0.05)


def test_alpha_beta_fit_recovers_latency_and_bus_bandwidth() -> None:
    samples = []
    for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.SEND_RECV):
        for n in (2, 4, 8):
            for size in np.geomspace(1e3, 1e8, 6):
                t = latency_steps(kind, n) * 30e-6 + bus_factor(kind, n) * size / 2.5e9
                samples.append((kind, n, float(size), _noisy(np.array([t]))[0]))
    fit = fit_alpha_beta(samples)
    assert fit.values["latency_us"] == pytest.approx(30.0, rel=0.05)
    assert fit.values["busbw_GBps"] == pytest.approx(2.5, rel=0.05)


def test_per_collective_factors_are_recovered_against_all_reduce() -> None:
    factors = {Collective.ALL_REDUCE: 1.0, Collective.REDUCE_SCATTER: 0.55,
               Collective.SEND_RECV: 1.9}  # fmt: skip
    samples = []
    for kind, factor in factors.items():
        for size in np.geomspace(1e3, 1e8, 7):
            t = latency_steps(kind, 2) * 200e-6 + bus_factor(kind, 2) * size / (1.2e9 * factor)
            samples.append((kind, 2, float(size), _noisy(np.array([t]))[0]))
    fit = fit_alpha_beta(samples, factors=True)
    assert fit.values["latency_us"] == pytest.approx(200.0, rel=0.05)
    assert fit.values["busbw_GBps"] == pytest.approx(1.2, rel=0.05)
    assert fit.values["factor.reduce_scatter"] == pytest.approx(0.55, rel=0.05)
    assert fit.values["factor.send_recv"] == pytest.approx(1.9, rel=0.05)
    shared = fit_alpha_beta(samples)  # one bandwidth for all cannot follow the data as well
    assert shared.rms_after > 2 * fit.rms_after


def test_per_collective_factors_need_all_reduce_samples() -> None:
    samples = [(Collective.ALL_GATHER, 2, s, s / 1e9) for s in (1e3, 1e6, 1e8)]
    with pytest.raises(CalibrationError, match="measure all_reduce"):
        fit_alpha_beta(samples, factors=True)


def test_faster_than_peak_leaves_physical_bounds() -> None:
    flops = np.geomspace(1e6, 1e10, 8)
    with pytest.raises(CalibrationError, match=r"matmul_efficiency .* outside its physical range"):
        fit_matmul(flops.tolist(), (flops / (PEAK * 3.0)).tolist(), PEAK)


def test_data_the_model_cannot_follow_does_not_converge() -> None:
    flops = np.geomspace(1e6, 1e10, 8)
    scattered = np.where(np.arange(8) % 2, 1.0, 1e-6)  # time jumps up and down with size
    with pytest.raises(CalibrationError, match="did not converge"):
        fit_matmul(flops.tolist(), scattered.tolist(), PEAK)


def test_too_few_samples_is_a_clear_error() -> None:
    with pytest.raises(CalibrationError, match="at least two"):
        fit_matmul([1e9], [1.0], PEAK)


# ----- refit to measured runs ---------------------------------------------------------------


def _cpu_profile(**changes: float) -> HardwareProfile:
    link = {"bandwidth_GBps": 1.5, "latency_us": 100.0, "busbw_efficiency": 1.0}
    data = {
        "name": "synthetic-cpu", "device_kind": "cpu", "peak_tflops": {"fp32": 0.2},
        "matmul_efficiency": 0.4, "matmul_overhead_us": 5.0, "attention_efficiency": 0.1,
        "memory_capacity_gib": 8.0, "memory_bandwidth_GBps": 10.0, "memory_efficiency": 1.0,
        "kernel_overhead_us": 8.0, "gpus_per_node": 2,
        "links": {"intra_node": link, "inter_node": link}, "sources": {},
    }  # fmt: skip
    data["sources"] = dict.fromkeys(_number_paths(data), "synthetic")
    profile = HardwareProfile.model_validate(data)
    return with_parameters(profile, changes, "synthetic truth") if changes else profile


def _number_paths(data: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and key != "sources":
            paths += _number_paths(value, path + ".")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            paths.append(path)
    return paths


def _plan(model: str, **strategy: object) -> Plan:
    handle = resolve_model(model)
    training = Training(global_batch_size=4, dtype="fp32")
    cluster = Cluster(gpu="synthetic-cpu", num_gpus=2, gpus_per_node=2)
    return assemble_plan(handle, cluster, training, Strategy(**strategy))


def _measured(plan: Plan, seconds: float) -> MeasuredProfile:
    return MeasuredProfile(
        model_name=plan.model_name, model_fingerprint=plan.model_fingerprint,
        plan_fingerprint=plan_fingerprint(plan), plan=plan, world_size=2, warmup_steps=1,
        step_times_s=(seconds,), step_time_median_s=seconds, step_time_p10_s=seconds,
        step_time_p90_s=seconds,
        provenance=Provenance(host="test", date="2026-01-01", torch_version="x", device="cpu",
                              method="synthetic"),
    )  # fmt: skip


PLANS = (
    ("tiny-gpt", {"dp": 2, "micro_batch_size": 2}),
    ("tiny-gpt", {"tp": 2, "micro_batch_size": 4}),
    ("tiny-gpt", {"pp": 2, "micro_batch_size": 1, "num_microbatches": 4}),
    ("tiny-llama", {"dp": 2, "micro_batch_size": 1, "num_microbatches": 2}),
    ("tiny-llama", {"dp": 2, "zero": 3, "micro_batch_size": 2}),
)


def _runs(truth: HardwareProfile) -> list[MeasuredProfile]:
    options = measured_run_options(truth)
    runs = []
    for model, strategy in PLANS:
        plan = _plan(model, **strategy)
        runs.append(_measured(plan, predict_plan(plan, truth, options).step_time_s))
    return runs


def test_refit_recovers_known_parameters_from_synthetic_runs() -> None:
    # truth: 20 us framework overhead per operator, a 0.8x link bandwidth, a 1.5x slower
    # link latency, 500 us more per collective call
    truth = _cpu_profile(op_overhead_us=20.0, **{
        "links.intra_node.bandwidth_GBps": 1.2, "links.intra_node.latency_us": 150.0,
        "links.intra_node.call_overhead_us": 500.0})  # fmt: skip
    start = _cpu_profile()
    fitted, report = refit_profile(
        start, _runs(truth), options=measured_run_options(start), stamp="test", prior_weight=0.0
    )
    assert report.parameters["framework overhead per operator"] == pytest.approx(20.0, rel=0.05)
    assert fitted.links.intra_node.bandwidth_GBps == pytest.approx(1.2, rel=0.05)
    assert fitted.links.intra_node.latency_us == pytest.approx(150.0, rel=0.05)
    assert fitted.links.intra_node.call_overhead_us == pytest.approx(500.0, rel=0.05)
    assert fitted.matmul_efficiency == start.matmul_efficiency  # measured by the sweep
    assert report.at_bound == ()
    assert max(abs(e.error) for e in report.after) < 0.02 < max(abs(e.error) for e in report.before)
    assert start.matmul_overhead_us == 5.0  # the input profile is not modified
    assert fitted.memory_bandwidth_GBps == start.memory_bandwidth_GBps  # measured, not refitted
    assert "bounded least squares" in fitted.sources["op_overhead_us"]
    assert fitted.matmul_overhead_us == start.matmul_overhead_us  # the sweep's, kept


def test_refit_stays_in_physical_bounds_and_says_which_it_hit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    truth = _cpu_profile(**{"links.intra_node.latency_us": 3000.0})  # 30x the microbenchmark
    start = _cpu_profile()
    fitted, report = refit_profile(
        start, _runs(truth), options=measured_run_options(start), stamp="test"
    )
    assert "link latency scale (upper bound)" in report.at_bound
    assert fitted.links.intra_node.latency_us == pytest.approx(400.0, rel=1e-3)  # 4x at most
    assert "link latency scale ended on the upper bound" in caplog.text
    assert set(report.parameters) == {p.name for p in REFIT_PARAMETERS}


def test_a_refitted_efficiency_stays_at_most_one() -> None:
    scale = RefitParameter("compute", ("matmul_efficiency", "attention_efficiency"), "scale",
                           0.5, 1.5, cap=1.0)  # fmt: skip
    assert scale.limits([0.4, 0.1])[1] == pytest.approx(np.log(1.5))
    assert scale.limits([0.9, 0.1])[1] == pytest.approx(np.log(1 / 0.9))
    truth = _cpu_profile(matmul_efficiency=0.3, attention_efficiency=0.075)
    start = _cpu_profile()
    fitted, report = refit_profile(
        start, _runs(truth), options=measured_run_options(start), stamp="test",
        parameters=[scale], prior_weight=0.0,
    )  # fmt: skip
    assert report.parameters["compute"] == pytest.approx(0.75, rel=0.02)  # 0.4 -> 0.3
    assert fitted.attention_efficiency == pytest.approx(0.075, rel=0.02)


@pytest.mark.slow  # a subprocess that imports torch
def test_failed_refit_leaves_the_profile_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "cpu.json"
    save_profile(_cpu_profile(), path)
    before = path.read_text()
    plan = _plan("tiny-gpt", dp=2, micro_batch_size=2)
    impossible = tmp_path / "m.json"
    impossible.write_text(_measured(plan, 1e-9).model_dump_json())  # faster than any machine
    result = subprocess.run(
        [sys.executable, "-m", "planner", "calibrate", "--profile", str(path), "--from",
         str(impossible), "-o", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "error: refit to measured runs" in result.stderr
    assert "physical range" in result.stderr or "did not converge" in result.stderr
    assert path.read_text() == before
    assert json.loads(before)["name"] == "synthetic-cpu"


def test_a_fit_whose_rms_grew_says_it_is_robust() -> None:
    """The fits are soft-L1: a few outlying samples can leave the plain RMS above the
    start's, which the report says rather than print as a worse fit."""
    assert FitResult({}, 0.56, 0.29, 10).describe_error() == "RMS log error 0.56 -> 0.29"
    assert FitResult({}, 0.32, 0.33, 10).describe_error() == (
        "RMS log error 0.32 -> 0.33 (a robust fit: outlying samples weigh less)"
    )
