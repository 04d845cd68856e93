"""plan calibrate's probe plans: what the runtime's wrappers and training loop cost beyond
a DDP step (DTensor dispatch, FSDP2 hooks, the loop, the pipeline schedule), priced
where the runtime pays it and fitted back from runs."""

from __future__ import annotations

import pytest

from planner.calibrate import CalibrationError, measured_run_options, predict_plan
from planner.calibrate.probes import probe_plans, probe_strategies, refit_to_probe_runs
from planner.calibrate.refit import with_parameters
from planner.compare import compare_measured
from planner.hardware import HardwareProfile
from planner.measured import MeasuredProfile, Provenance, plan_fingerprint
from planner.spec import Plan, Prediction
from planner.validate import validate_plan_for_world
from tests.test_calibrate_fit import _cpu_profile

TRUTH = {
    "dtensor_op_overhead_us": 300.0, "dtensor_param_overhead_us": 100.0,
    "fsdp_call_overhead_us": 1500.0, "step_overhead_us": 2000.0,
    "pipeline_step_overhead_us": 4000.0,
}  # fmt: skip


def _predict(plan: Plan, profile: HardwareProfile) -> Prediction:
    return predict_plan(plan, profile, measured_run_options(profile))


def _measured(plan: Plan, prediction: Prediction) -> MeasuredProfile:
    seconds = prediction.step_time_s
    return MeasuredProfile(
        model_name=plan.model_name, model_fingerprint=plan.model_fingerprint,
        plan_fingerprint=plan_fingerprint(plan), plan=plan, world_size=2, warmup_steps=1,
        step_times_s=(seconds,), step_time_median_s=seconds, step_time_p10_s=seconds,
        step_time_p90_s=seconds, phases_s={"optimizer": prediction.breakdown_s["optimizer"]},
        provenance=Provenance(host="test", date="2026-01-01", torch_version="x", device="cpu",
                              method="synthetic"),
    )  # fmt: skip


def test_the_probe_covers_every_way_the_runtime_splits_a_model_over_the_ranks() -> None:
    assert list(probe_strategies(2)) == ["DP", "FSDP", "TP", "TP+SP", "PP", "PP ZB x1"]
    assert list(probe_strategies(3)) == ["DP", "FSDP"]  # no pairs to split a model over
    for world in (2, 3, 4, 8):
        for plan in probe_plans(world, 8, "my-cpu"):
            s = plan.strategy
            assert s.dp * s.tp * s.pp == world
            assert plan.training.global_batch_size == 4 * world  # 4 sequences a rank
            assert plan.cluster.gpu == "my-cpu"
            validate_plan_for_world(plan, world)  # what plan measure checks first


def test_each_overhead_is_paid_by_the_plans_whose_runtime_pays_it() -> None:
    bare = _cpu_profile()
    plans = dict(zip(probe_strategies(2), probe_plans(2, 2, "synthetic-cpu"), strict=True))
    before = {name: _predict(plan, bare) for name, plan in plans.items()}

    def grown(field: str, value: float) -> dict[str, dict[str, float]]:
        profile = with_parameters(bare, {field: value}, "test")
        after = {name: _predict(plan, profile) for name, plan in plans.items()}
        return {
            name: {k: v - before[name].breakdown_s.get(k, 0.0)
                   for k, v in after[name].breakdown_s.items() if v > before[name].breakdown_s.get(k, 0.0)}
            for name in plans
        }  # fmt: skip

    dtensor_ops = grown("dtensor_op_overhead_us", 300.0)
    assert {n for n, d in dtensor_ops.items() if d} == {"TP", "TP+SP"}
    assert set(dtensor_ops["TP"]) == {"compute"}
    assert dtensor_ops["TP+SP"]["compute"] > dtensor_ops["TP"]["compute"]  # norms sharded too
    fsdp = grown("fsdp_call_overhead_us", 1500.0)
    assert {n for n, d in fsdp.items() if d} == {"FSDP"}
    # 4 blocks and the root: each gathers forward and backward and reduce-scatters (the
    # reduce-scatters, longer now, no longer hide under the backward: comm_dp grows too)
    assert fsdp["FSDP"]["comm_fsdp"] == pytest.approx(15 * 1500e-6)
    assert set(fsdp["FSDP"]) == {"comm_fsdp", "comm_dp"}
    params = grown("dtensor_param_overhead_us", 100.0)
    assert {n for n, d in params.items() if d} == {"FSDP", "TP", "TP+SP"}
    assert set(params["FSDP"]) == {"optimizer"}
    loop = grown("step_overhead_us", 2000.0)
    assert all(d == {"framework": pytest.approx(2e-3)} for d in loop.values())
    pipeline = grown("pipeline_step_overhead_us", 4000.0)
    assert {n for n, d in pipeline.items() if d} == {"PP", "PP ZB x1"}
    assert pipeline["PP"] == {"framework": pytest.approx(4e-3)}


def test_calibrate_recovers_the_runtime_overheads_from_the_probe_runs() -> None:
    truth = _cpu_profile(op_overhead_us=15.0, **TRUTH)  # as the eager step measured it
    plans = probe_plans(2, 2, "synthetic-cpu")
    runs = [_measured(plan, _predict(plan, truth)) for plan in plans]
    start = _cpu_profile(op_overhead_us=15.0)
    fitted, fit = refit_to_probe_runs(start, runs, "measured today")
    for field, value in TRUTH.items():
        assert getattr(fitted, field) == pytest.approx(value, rel=0.05), field
        assert fit.values[field] == pytest.approx(value, rel=0.05)
    assert fit.rms_after < 0.02 < fit.rms_before
    assert fit.samples == len(plans) and fit.at_bounds == ()
    assert fitted.sources["fsdp_call_overhead_us"].startswith("measured today: probe plans")
    assert "optimizer phase" in fitted.sources["dtensor_param_overhead_us"]
    # what the sweeps measured stays
    assert fitted.links.intra_node.latency_us == start.links.intra_node.latency_us
    assert fitted.op_overhead_us == pytest.approx(15.0, rel=0.05)


def test_compare_sets_the_training_loops_time_against_what_the_profiler_calls_other() -> None:
    profile = _cpu_profile(step_overhead_us=2000.0)
    plan = probe_plans(2, 2, "synthetic-cpu")[0]
    prediction = _predict(plan, profile)
    run = _measured(plan, prediction).model_copy(update={"phases_s": {"other": 3e-3}})
    other = next(row for row in compare_measured(plan, run, prediction).rows if row.name == "other")
    assert (other.predicted, other.measured) == (pytest.approx(2e-3), 3e-3)


def test_probe_runs_the_overheads_cannot_explain_are_refused_naming_the_way_out() -> None:
    profile = _cpu_profile(op_overhead_us=15.0)
    plans = probe_plans(2, 2, "synthetic-cpu")
    runs = [_measured(plan, _predict(plan, profile)) for plan in plans]
    runs[0] = runs[0].model_copy(update={"step_time_median_s": 100 * runs[0].step_time_median_s})
    with pytest.raises(
        CalibrationError, match=r"the probe plans \(dp2 mb4x1.*did not converge.*--no-probe-runs"
    ):
        refit_to_probe_runs(profile, runs, "today")


def test_an_odd_world_fits_only_what_its_probes_show(caplog: pytest.LogCaptureFixture) -> None:
    truth = _cpu_profile(op_overhead_us=15.0, **TRUTH)
    plans = probe_plans(3, 3, "synthetic-cpu")  # DP and FSDP: no pairs to split over
    runs = [_measured(plan, _predict(plan, truth)) for plan in plans]
    fitted, fit = refit_to_probe_runs(_cpu_profile(op_overhead_us=15.0), runs, "today")
    # two runs for three fitted values (the priors hold the third): the runs repriced
    assert fit.rms_after < 0.02 < fit.rms_before
    assert fitted.fsdp_call_overhead_us == pytest.approx(1500.0, rel=0.15)
    assert fitted.step_overhead_us == pytest.approx(2000.0, rel=0.15)
    assert fitted.dtensor_param_overhead_us == pytest.approx(100.0, rel=0.05)  # FSDP2's
    # no run shows DTensor dispatch or a pipeline: left as they were, and no warning
    assert fitted.dtensor_op_overhead_us is None and fitted.pipeline_step_overhead_us is None
    assert "dtensor_op_overhead_us" not in fit.values and fit.at_bounds == ()
    assert "bound" not in caplog.text
