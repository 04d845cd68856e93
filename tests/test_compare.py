"""'plan compare': measured profiles, self-recorded torch.profiler traces, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from planner.calibrate import measured_run_options, predict_plan
from planner.calibrate.refit import predict_op_classes
from planner.compare import (
    Comparison,
    Row,
    compare_measured,
    compare_trace,
    format_comparison,
    load_measured_side,
    read_trace,
)
from planner.errors import PlanMismatchError, SpecError
from planner.hardware import load_profile
from planner.models import build
from planner.plots import plot_comparison
from tests.test_measure import fake_measured, make_plan


def _record_trace(path: Path, steps: int = 3) -> None:
    """Train tiny-gpt for ``steps`` profiled steps on CPU and export a Chrome trace."""
    plan = make_plan()
    assert plan.model is not None
    model = build(plan.model, device="cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, plan.model.vocab_size, (4, plan.model.seq_len))
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(steps + 1):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    _record_trace(path)
    return path


def test_trace_operators_are_matched_to_operator_classes(trace_path: Path) -> None:
    summary = read_trace(trace_path)
    assert summary.steps == 3
    assert summary.source == "cpu operators"
    assert summary.class_s["matmul"] > 0 and summary.class_s["optimizer"] > 0
    assert summary.class_s["attention"] > 0 and summary.class_s["communication"] == 0
    # operator classes are disjoint parts of a step (their share depends on the load)
    assert 0 < sum(summary.class_s.values()) <= summary.mean_step_time_s


def test_compare_trace_rows_cover_every_class(trace_path: Path) -> None:
    plan = make_plan()
    profile = load_profile("a100-sxm-80gb")
    options = measured_run_options(profile)
    comparison = compare_trace(
        plan, read_trace(trace_path), predict_plan(plan, profile, options),
        predict_op_classes(plan, profile, options),
    )  # fmt: skip
    names = [row.name for row in comparison.rows]
    assert names == ["step", "matmul", "attention", "memory-bound", "communication", "optimizer"]
    assert comparison.rows[1].predicted > 0 and comparison.rows[1].measured > 0


def test_truncated_trace_is_a_clear_error(trace_path: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "cut.json"
    text = trace_path.read_text()
    truncated.write_text(text[: len(text) // 2])
    with pytest.raises(SpecError, match=r"not valid JSON .* truncated"):
        load_measured_side(truncated)


def test_foreign_json_is_a_clear_error(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"hello": "world"}))
    with pytest.raises(
        SpecError, match=r"neither a measured profile .* nor a torch.profiler trace"
    ):
        load_measured_side(foreign)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name"}]}))
    with pytest.raises(SpecError, match="no complete"):
        load_measured_side(empty)


def test_compare_measured_rows_and_errors() -> None:
    plan = make_plan()
    assert plan.model is not None
    profile = load_profile("a100-sxm-80gb")
    prediction = predict_plan(plan, profile, measured_run_options(profile))
    measured = fake_measured(plan, seconds=2 * prediction.step_time_s)
    comparison = compare_measured(plan, measured, prediction)
    step = comparison.rows[0]
    assert step.name == "step" and step.error == pytest.approx(-0.5)
    assert "peak memory" in format_comparison(comparison)
    assert "expected error: step time" in format_comparison(comparison)  # the regime's band
    with pytest.raises(PlanMismatchError):
        compare_measured(make_plan(recompute="full"), measured, prediction)


def test_the_compute_row_holds_what_the_backward_spends_summing_micro_batches() -> None:
    """A measured backward includes autograd's gradient accumulation: the compute row
    compares it with compute, recompute and ``grad_accumulation`` together."""
    plan = make_plan(micro_batch_size=1, num_microbatches=4)
    profile = load_profile("a100-sxm-80gb")
    prediction = predict_plan(plan, profile, measured_run_options(profile))
    terms = prediction.breakdown_s
    assert terms["grad_accumulation"] > 0
    comparison = compare_measured(plan, fake_measured(plan), prediction)
    compute = next(row for row in comparison.rows if row.name == "compute")
    expected = terms["compute"] + terms["recompute"] + terms["grad_accumulation"]
    assert compute.predicted == pytest.approx(expected)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    plan = make_plan()
    profile = load_profile("a100-sxm-80gb")
    prediction = predict_plan(plan, profile, measured_run_options(profile))
    comparison = compare_measured(plan, fake_measured(plan), prediction)
    png = tmp_path / "c.png"
    plot_comparison(comparison, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a subprocess that imports torch
def test_cli_compare_with_a_trace_and_a_mismatched_profile(
    trace_path: Path, tmp_path: Path
) -> None:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(make_plan().to_json())
    png = tmp_path / "out.png"
    ok = subprocess.run(
        [sys.executable, "-m", "planner", "compare", str(plan_path), str(trace_path),
         "--profile", "a100-sxm-80gb", "--png", str(png)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "matmul" in ok.stdout and png.is_file()
    other = tmp_path / "measured.json"
    other.write_text(fake_measured(make_plan(recompute="full")).model_dump_json())
    bad = subprocess.run(
        [sys.executable, "-m", "planner", "compare", str(plan_path), str(other)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "measure this plan" in bad.stderr


def _cpu_profile(tmp_path: Path) -> Path:
    """A calibrated-looking CPU profile (device_kind "cpu") as a file."""
    data = load_profile("a100-sxm-80gb").model_dump(mode="json")
    data.update(name="cpu-gloo", device_kind="cpu", peak_tflops={"fp32": 0.2}, gpus_per_node=2)
    data["sources"] = {k: "measured today" for k in data["sources"]}
    data["sources"]["peak_tflops.fp32"] = "measured today"
    path = tmp_path / "cpu-gloo.json"
    path.write_text(json.dumps(data))
    return path


def test_a_plan_made_on_a_cpu_profile_prices_what_its_runtime_runs(tmp_path: Path) -> None:
    """``plan`` on a CPU profile searches with the CPU's own options (no GPU workspace,
    no allocator slack, no streams): the plan's prediction is what ``plan compare
    --profile`` re-prices, and small models are predicted small."""
    import planner
    from planner.cost.options import device_options
    from planner.frameworks import Framework, framework_options
    from planner.spec import Cluster, Training

    profile_path = _cpu_profile(tmp_path)
    cluster = Cluster(gpu=str(profile_path), num_gpus=2, gpus_per_node=2)
    training = Training(global_batch_size=8, seq_len=32, dtype="fp32")
    plan = planner.make_plan(planner.resolve_model("tiny-llama"), cluster, training)
    profile = load_profile(str(profile_path))
    assert measured_run_options(profile) == framework_options(
        Framework.PLANNER, device_options("cpu")
    )
    repriced = predict_plan(plan, profile, measured_run_options(profile))
    assert plan.prediction is not None
    assert plan.prediction.step_time_s == repriced.step_time_s
    assert plan.prediction.peak_memory_gib == repriced.peak_memory_gib
    assert plan.prediction.memory_gib.get("allocator_margin", 0.0) == 0.0
    assert plan.prediction.peak_memory_gib < 0.01  # no 0.5 GiB of GPU workspace
    gpu = Cluster(gpu="a100-sxm-80gb", num_gpus=2, gpus_per_node=2)
    on_gpu = planner.make_plan(planner.resolve_model("tiny-llama"), gpu, training)
    assert on_gpu.prediction is not None and on_gpu.prediction.peak_memory_gib > 0.5


def test_a_run_config_on_a_cpu_profile_fills_options_from_the_cpu(tmp_path: Path) -> None:
    """Options a run document leaves out are the device's own; those it gives stay."""
    from planner.cost.run import RunConfig

    run = RunConfig.from_dict({
        "model": {"preset": "tiny-llama"},
        "cluster": {"gpu": str(_cpu_profile(tmp_path)), "num_gpus": 2, "gpus_per_node": 2},
        "training": {"global_batch_size": 8, "dtype": "fp32"},
        "strategy": {"dp": 2},
        "options": {"overlap_param_gather": True},
    })  # fmt: skip
    assert run.options.workspace_gib == 0.0 and run.options.allocator_margin == 0.0
    assert run.options.overlap_param_gather  # given


def test_the_table_keeps_its_columns_for_a_long_component_name() -> None:
    """A pipeline's 'communication + bubble' row is wider than the name column was: every
    value still ends in the same column."""
    rows = (Row("step", 0.01, 0.02), Row("communication + bubble", 0.001, 0.002),
            Row("peak memory", 1.0, 1.1, unit="GiB"))  # fmt: skip
    lines = format_comparison(Comparison("pp2", rows)).splitlines()[1:]
    assert len({len(line) for line in lines}) == 1
