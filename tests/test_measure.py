"""Measured profiles: schema, fingerprints, and 'plan measure' on one and on two ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _plan_run import run_to_completion

from planner.assemble import assemble_plan
from planner.errors import PlanMismatchError, SpecError
from planner.measured import (
    MeasuredProfile,
    Provenance,
    check_same_plan,
    plan_fingerprint,
    step_statistics,
)
from planner.models import resolve_model
from planner.spec import Cluster, Plan, Strategy, Training, load_document


def make_plan(model: str = "tiny-gpt", gpus: int = 1, **strategy: object) -> Plan:
    training = Training(global_batch_size=4, dtype="fp32")
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=gpus, gpus_per_node=max(gpus, 1))
    fields = {"micro_batch_size": 4, **strategy}
    return assemble_plan(resolve_model(model), cluster, training, Strategy(**fields))


def fake_measured(plan: Plan, seconds: float = 0.1, **changes: object) -> MeasuredProfile:
    data = {
        "model_name": plan.model_name, "model_fingerprint": plan.model_fingerprint,
        "plan_fingerprint": plan_fingerprint(plan), "plan": plan,
        "world_size": plan.strategy.world_size, "warmup_steps": 1,
        "step_times_s": (seconds,), "step_time_median_s": seconds, "step_time_p10_s": seconds,
        "step_time_p90_s": seconds,
        "phases_s": {"forward": 0.3 * seconds, "backward": 0.6 * seconds,
                     "optimizer": 0.1 * seconds},
        "peak_memory_gib": (0.01,) * plan.strategy.world_size,
        "provenance": Provenance(host="h", date="2026-01-01", torch_version="t",
                                 device="cpu", method="synthetic"),
        **changes,
    }  # fmt: skip
    return MeasuredProfile.model_validate(data)


def test_step_statistics_median_and_spread() -> None:
    median, p10, p90 = step_statistics([1.0, 2.0, 3.0, 4.0, 100.0])
    assert median == 3.0
    assert p10 < 2.0 < 4.0 < p90


def test_plan_fingerprint_ignores_the_prediction_but_not_the_strategy() -> None:
    plan = make_plan()
    from_search = plan.model_copy(
        update={"solver": plan.solver.model_copy(update={"ilp_status": "x"})}
    )
    assert plan_fingerprint(plan) == plan_fingerprint(from_search)
    assert plan_fingerprint(plan) != plan_fingerprint(make_plan(recompute="full"))


def test_measurement_of_another_plan_is_rejected() -> None:
    measured = fake_measured(make_plan())
    with pytest.raises(PlanMismatchError, match="measure this plan"):
        check_same_plan(make_plan(recompute="full"), measured)
    with pytest.raises(PlanMismatchError, match="measured on model 'tiny-gpt'"):
        check_same_plan(make_plan("tiny-llama"), measured)


def test_edited_measured_profile_fails_validation(tmp_path: Path) -> None:
    data = json.loads(fake_measured(make_plan()).model_dump_json())
    data["plan"]["strategy"]["recompute"] = "full"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"plan_fingerprint .* does not match"):
        load_document(MeasuredProfile, path)


def test_measure_one_process_records_phases_and_memory(tmp_path: Path) -> None:
    from strategies.measure import measure_plan

    plan = make_plan()
    measured = measure_plan(plan, steps=2, warmup=1)
    assert len(measured.step_times_s) == 2
    assert {"forward", "backward", "optimizer"} <= set(measured.phases_s)
    assert sum(measured.phases_s.values()) == pytest.approx(measured.step_time_median_s, rel=0.01)
    params = sum(p.numel() for p in resolve_model("tiny-gpt").module.parameters())
    states = params * 4 * 4  # fp32 weights, gradients, two Adam moments
    assert measured.peak_memory_gib[0] * 2**30 > states


@pytest.mark.distributed
def test_plan_measure_under_torchrun_writes_a_profile(tmp_path: Path) -> None:
    plan = make_plan(gpus=2, dp=2, micro_batch_size=2)
    measured, stdout = _measure_on_two_ranks(plan, tmp_path, steps=2)
    assert measured.world_size == 2 and len(measured.peak_memory_gib) == 2
    assert measured.plan_fingerprint == plan_fingerprint(plan)
    assert "comm_dp_replicate" in measured.phases_s
    assert "step time: median" in stdout


def _measure_on_two_ranks(plan: Plan, tmp_path: Path, steps: int) -> tuple[MeasuredProfile, str]:
    """``plan measure`` of ``plan`` under torchrun on 2 gloo ranks: the profile it wrote
    and what it printed."""
    plan_path, out = tmp_path / "plan.json", tmp_path / "measured.json"
    plan_path.write_text(plan.to_json())
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "-m", "planner", "measure", str(plan_path), "-o", str(out), "--steps", str(steps),
               "--warmup", "1"]  # fmt: skip
    result = run_to_completion(command, f"wrote {out}")
    assert "profiler_start" not in result.stderr  # the profiled step says nothing of itself
    return load_document(MeasuredProfile, out), result.stdout


def test_the_memory_tracker_counts_each_storage_at_its_current_size() -> None:
    """FSDP2 frees and re-allocates its unsharded parameters by resizing their storages,
    made before the tracker and filled through operators; in-place writes allocate
    nothing."""
    import torch

    from strategies.measure import TensorMemoryTracker

    kept = torch.zeros(1024)  # 4 KiB
    outside = torch.zeros(2048)  # 8 KiB, freed by resizing
    outside.untyped_storage().resize_(0)
    tracker = TensorMemoryTracker()
    tracker.add(kept)
    with tracker:
        kept.add_(1)
        assert tracker.current == 4096
        outside.untyped_storage().resize_(8192)
        torch.add(kept, 1, out=outside[:1024])
        assert tracker.current == 4096 + 8192
        outside.untyped_storage().resize_(0)
        assert tracker.current == 4096
    assert tracker.peak == 4096 + 8192


def test_the_memory_tracker_reads_while_another_thread_frees_storages() -> None:
    """Gloo's and the autograd engine's threads free storages while the step's thread
    sums them: the sum must not fail ("dictionary changed size during iteration", seen
    in plan measure of ZeRO-2 on a loaded machine)."""
    import threading
    import time

    import torch

    from strategies.measure import TensorMemoryTracker

    tracker = TensorMemoryTracker()
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for tensor in [torch.empty(16) for _ in range(200)]:
                tracker.add(tensor)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        kept = [torch.empty(16) for _ in range(2000)]
        for tensor in kept:
            tracker.add(tensor)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert tracker.current >= 2000 * 16 * 4
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_the_optimizer_steps_temporaries_are_what_the_memory_model_prices(impl: str) -> None:
    """torch's AdamW step, counted by the tracker of ``plan measure``, allocates what
    :func:`planner.cost.optimizer_step.step_temporary_elements` says (fp32 states)."""
    import torch

    from planner.cost.optimizer_step import step_temporary_elements
    from planner.cost.options import OptimizerImpl
    from planner.spec import Optimizer
    from strategies.measure import TensorMemoryTracker

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 512))
    flags = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags[impl])
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()  # the moments exist from here
    model(torch.randn(4, 256)).sum().backward()
    tracker = TensorMemoryTracker()
    for param in model.parameters():
        tracker.add(param)
        tracker.add(param.grad)
        for state in optimizer.state[param].values():
            tracker.add(state)
    before = tracker.current
    tracker.peak = before
    with tracker:
        optimizer.step()
    sizes = [p.numel() for p in model.parameters()]
    priced = step_temporary_elements(OptimizerImpl(impl), Optimizer.ADAMW, sum(sizes), max(sizes))
    # for-loop: the previous tensor's quotient is still referenced (its bias: 1 KB more)
    assert tracker.peak - before == pytest.approx(4 * priced, rel=0.01, abs=0)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_a_pipelines_measured_peak_memory_is_what_its_schedule_was_priced_at(
    schedule: str, tmp_path: Path
) -> None:
    """torch's zero-bubble order keeps each micro-batch's activations until its deferred
    weight gradient (and the output gradients it reads): its last stage peaks near twice
    1F1B's here, and the plan says so (priced as 1F1B's, it was 23% short)."""
    import planner
    from tests.test_compare import _cpu_profile

    training = Training(global_batch_size=8, seq_len=32, dtype="fp32")
    cluster = Cluster(gpu=str(_cpu_profile(tmp_path)), num_gpus=2, gpus_per_node=2)
    pins = planner.Pins(pp=2, micro_batch_size=2, schedule=schedule, recompute="none")
    plan = planner.make_plan(resolve_model("tiny-llama"), cluster, training, pins=pins)
    assert plan.strategy.schedule == schedule and plan.strategy.num_microbatches == 4
    assert plan.prediction is not None
    measured, _ = _measure_on_two_ranks(plan, tmp_path, steps=1)
    assert plan.prediction.peak_memory_gib == pytest.approx(max(measured.peak_memory_gib), rel=0.1)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_gradient_accumulations_measured_peak_memory_is_what_was_priced(
    zero: int, tmp_path: Path
) -> None:
    """Four micro-batches per step: FSDP2 reduce-scatters each one's gradients into the
    shards (no rank holds a whole unsharded gradient between them: 12-24% more than
    priced when it did), ZeRO-2's gathered weights are freed after each backward, and
    DDP under ``no_sync`` holds the accumulated gradients beside its buckets (priced
    twice)."""
    import planner
    from tests.test_compare import _cpu_profile

    training = Training(global_batch_size=8, seq_len=32, dtype="fp32")
    cluster = Cluster(gpu=str(_cpu_profile(tmp_path)), num_gpus=2, gpus_per_node=2)
    pins = planner.Pins(dp=2, zero=zero, micro_batch_size=1, recompute="none")
    spec = tmp_path / "gpt-4x512.json"  # wide enough that gradients weigh: 14M parameters
    spec.write_text(json.dumps({"name": "gpt-4x512", "family": "gpt", "num_layers": 4,
                                "hidden_size": 512, "num_heads": 8, "vocab_size": 2048, "seq_len": 32}))  # fmt: skip
    plan = planner.make_plan(resolve_model(str(spec)), cluster, training, pins=pins)
    assert plan.strategy.num_microbatches == 4 and plan.prediction is not None
    measured, _ = _measure_on_two_ranks(plan, tmp_path, steps=1)
    peak = max(measured.peak_memory_gib)
    print(f"ZeRO-{zero}, 4 micro-batches: peak {plan.prediction.peak_memory_gib * 1024:.1f} MiB "
          f"predicted, {peak * 1024:.1f} measured ({plan.prediction.peak_memory_gib / peak - 1:+.1%})")  # fmt: skip
    assert plan.prediction.peak_memory_gib == pytest.approx(peak, rel=0.1)
