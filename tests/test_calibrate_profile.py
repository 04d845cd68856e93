"""Calibrated profiles: per-collective factors, the streaming sweep, CPU run options."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from planner.calibrate import measured_run_options, predict_plan
from planner.calibrate.microbench import Sample, last_level_cache_bytes, memory_sweep
from planner.calibrate.profile import Measurements, build_profile, cpu_peak_tflops
from planner.cost.communication import Collective, LinkModel, collective_time, latency_steps
from planner.hardware import Link, load_profile
from planner.spec import DType
from tests.test_calibrate_fit import _cpu_profile, _plan


def _samples(factors: dict[Collective, float]) -> list[tuple[Collective, int, float, float]]:
    samples = []
    for kind, factor in factors.items():
        for size in np.geomspace(1e3, 1e8, 6):
            link = LinkModel("truth", 1.2e9 * factor, 150e-6)
            steps_s = latency_steps(kind, 2) * link.latency_s
            seconds = collective_time(kind, float(size), 2, LinkModel("t", 1.2e9, 0.0))
            samples.append((kind, 2, float(size), steps_s + seconds / factor))
    return samples


def _measurements(collectives: list[tuple[Collective, int, float, float]]) -> Measurements:
    flops = np.geomspace(1e5, 1e10, 6)
    nbytes = np.array([1e3, 4e3, 1e8, 4e8])
    return Measurements(
        dtype=DType.FP32,
        matmul=[Sample("mm", f, f / 1e11 + 3e-6) for f in flops],
        memory=[Sample("mul", b, b / 20e9 + 2e-6) for b in nbytes],
        attention=[Sample("sdpa", f, f / 2e10 + 9e-6) for f in flops[2:]],
        collectives=collectives,
        ranks_per_node=2,
    )


def test_a_cpu_profile_carries_measured_collective_factors_with_sources() -> None:
    measured = _measurements(
        _samples({Collective.ALL_REDUCE: 1.0, Collective.REDUCE_SCATTER: 0.5,
                  Collective.SEND_RECV: 2.0})
    )  # fmt: skip
    profile, report = build_profile(
        measured, name="cpu", stamp="measured today", device_kind="cpu", base=None,
        peak_tflops=0.2, peak_source="given", memory_capacity_gib=8.0,
    )  # fmt: skip
    factors = profile.links.intra_node.collective_factors
    assert factors["reduce_scatter"] == pytest.approx(0.5, rel=0.01)
    assert factors["send_recv"] == pytest.approx(2.0, rel=0.01)
    assert "all_reduce" not in factors  # the reference
    assert profile.links.inter_node.collective_factors == factors  # one host: a copy
    source = profile.sources["links.intra_node.collective_factors.reduce_scatter"]
    assert "reduce_scatter over all-reduce" in source
    assert "copy of intra_node" in profile.sources["links.inter_node.collective_factors.send_recv"]
    assert profile.memory_bandwidth_GBps == pytest.approx(20.0, rel=0.01)
    assert set(report.fits) == {"matmul", "attention", "memory", "collectives"}


def test_a_narrow_gemm_gives_the_width_powersgd_products_are_priced_at() -> None:
    """A rank-4 product timed as slowly as a 52-column one at the fitted GEMM rate (as
    torch's CPU build runs them): the profile says 52, and PowerSGD's rank-2 to rank-8
    products are priced at that width, rank 1 (a GEMV) at its own."""
    from dataclasses import replace

    from planner.cost.compression import narrow_product_width

    measured = _measurements(_samples({Collective.ALL_REDUCE: 1.0}))
    kwargs = dict(name="cpu", stamp="measured today", device_kind="cpu", base=None,
                  peak_tflops=0.2, peak_source="given", memory_capacity_gib=8.0)  # fmt: skip
    plain, _ = build_profile(measured, **kwargs)  # type: ignore[arg-type]
    assert plain.narrow_matmul_width is None
    rate = 0.2e12 * plain.matmul_efficiency
    per_column = 2.0 * 1024 * 1024
    seconds = 52 * per_column / rate + plain.matmul_overhead_us * 1e-6
    narrow = Sample("mm 1024x1024x4", per_column, seconds)
    profile, _ = build_profile(replace(measured, narrow_matmul=narrow), **kwargs)  # type: ignore[arg-type]
    assert profile.narrow_matmul_width == pytest.approx(52, abs=0.1)
    assert "1024x1024x4 GEMM" in profile.sources["narrow_matmul_width"]
    assert [narrow_product_width(profile, r) for r in (1, 2, 4, 64)] == [1, 52, 52, 64]
    assert narrow_product_width(plain, 4) == 4


def test_collective_factors_scale_only_their_collective() -> None:
    link = LinkModel("gloo", 1e9, 0.0, {"reduce_scatter": 0.5})
    size = 1e8
    assert collective_time(Collective.REDUCE_SCATTER, size, 2, link) == pytest.approx(0.1)
    assert collective_time(Collective.ALL_GATHER, size, 2, link) == pytest.approx(0.05)
    shipped = load_profile("h100-sxm-80gb").links.intra_node
    assert set(shipped.collective_factors) == {"all_reduce"}  # NVLink SHARP; the rest alike


def test_a_call_overhead_is_paid_once_per_collective_call() -> None:
    link = LinkModel("gloo", 1e9, 100e-6, call_s=2e-3)
    assert collective_time(Collective.ALL_REDUCE, 1e6, 2, link) == pytest.approx(2e-3 + 2e-4 + 1e-3)
    assert collective_time(Collective.ALL_GATHER, 1e6, 2, link) == pytest.approx(2e-3 + 1e-4 + 5e-4)
    assert collective_time(Collective.ALL_GATHER, 1e6, 1, link) == 0.0  # no call at all
    shipped = load_profile("a100-sxm-80gb")
    assert shipped.links.intra_node.call_overhead_us is None  # priced as before: no cost


def test_collective_factors_outside_their_range_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"collective_factors .* must lie in"):
        Link(bandwidth_GBps=1, latency_us=1, busbw_efficiency=1,
             collective_factors={"reduce_scatter": 0.0})  # fmt: skip
    with pytest.raises(ValidationError, match="collective_factors"):
        Link.model_validate({"bandwidth_GBps": 1, "latency_us": 1, "busbw_efficiency": 1,
                             "collective_factors": {"gossip": 1.0}})  # fmt: skip


def test_last_level_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_memory_sweep_warns_when_it_would_measure_the_cache(
    caplog: pytest.LogCaptureFixture,
) -> None:
    samples = memory_sweep(torch.device("cpu"), torch.float32, (256, 1024), repeats=2)
    assert [s.work for s in samples] == [3 * 256 * 4, 3 * 1024 * 4]
    if last_level_cache_bytes() is not None:
        assert "last-level cache" in caplog.text


def test_powersgd_is_priced_exposed_on_cpu_where_the_hook_waits() -> None:
    profile = _cpu_profile()
    plan = _plan("tiny-gpt", dp=2, micro_batch_size=2,
                 compression={"kind": "powersgd", "rank": 2})  # fmt: skip
    small_buckets = {"dp_bucket_mib": 0.05}  # several buckets: overlap hides all but the last
    cpu_options = measured_run_options(profile).model_copy(update=small_buckets)
    cpu = predict_plan(plan, profile, cpu_options)
    overlapped = predict_plan(
        plan, profile, cpu_options.model_copy(update={"overlap_powersgd": True})
    )
    assert cpu.breakdown_s["comm_dp"] > overlapped.breakdown_s["comm_dp"]
    gpu = measured_run_options(load_profile("h100-sxm-80gb"))
    assert gpu.overlap_powersgd  # NCCL: torch's own hook, overlapped
    assert not gpu.sp_regather_input and not cpu_options.sp_regather_input  # DTensor SP


def test_memory_tracker_counts_comm_hook_state() -> None:
    from strategies.measure import _comm_hook_tensors

    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=2, use_error_feedback=True
    )
    state.error_dict[0] = torch.zeros(1000)
    state.p_memory_dict[0] = torch.zeros(30)
    state.q_memory_dict[0] = torch.zeros(20)
    model = torch.nn.Linear(2, 2)
    model._comm_hooks = [(powerSGD_hook.powerSGD_hook, state)]  # as DDP keeps them
    assert sorted(t.numel() for t in _comm_hook_tensors([model])) == [20, 30, 1000]
    assert _comm_hook_tensors([torch.nn.Linear(2, 2)]) == []


def test_a_cpu_peak_below_the_gemms_timed_is_raised_to_their_rate() -> None:
    nominal, _ = cpu_peak_tflops(1)
    rate = 3 * nominal * 1e12  # FLOP/s: faster than the reported clock allows
    gemms = [Sample(f"gemm {n}", 2.0 * n**3, 2.0 * n**3 / rate + 5e-6) for n in (64, 256, 1024)]
    peak, how = cpu_peak_tflops(1, gemms)
    assert peak == pytest.approx(3 * nominal, rel=0.01)
    assert "raised to" in how and "the rate the GEMM sweep reached" in how
    slow = [Sample(f"gemm {n}", 2.0 * n**3, 4.0 * n**3 / (nominal * 1e12)) for n in (256, 1024)]
    assert cpu_peak_tflops(1, slow) == cpu_peak_tflops(1)  # at half the estimate: kept


@pytest.mark.parametrize(("ranks", "where"), [(1, "one process"), (2, "DDP over 2 processes")])
def test_an_eager_training_step_gives_the_framework_overheads(ranks, where) -> None:
    """A CPU profile prices the eager framework time its training step showed beyond the
    operators' own: the calibrated profile reproduces that step, forward+backward (with
    DDP's reduction when it ran over several ranks) and optimizer, and a profile without
    the step prices none of it."""
    from planner.calibrate import measured_run_options
    from planner.calibrate.fit import StepSample
    from planner.cost.build import build_cost_model, spec_graph
    from planner.models import get_preset
    from planner.spec import Cluster, Strategy, Training

    step = StepSample("tiny-llama", 4, forward_backward_s=0.012, optimizer_s=0.003, ranks=ranks)
    plain = _measurements(_samples({Collective.ALL_REDUCE: 1.0}))
    stepped = Measurements(**{**plain.__dict__, "step": step})
    kwargs = dict(
        name="cpu", stamp="measured today", device_kind="cpu", base=None, peak_tflops=0.2,
        peak_source="given", memory_capacity_gib=8.0,
    )  # fmt: skip
    without, _ = build_profile(plain, **kwargs)  # type: ignore[arg-type]
    profile, report = build_profile(stepped, **kwargs)  # type: ignore[arg-type]
    assert without.op_overhead_us is None and without.param_overhead_us is None
    assert profile.op_overhead_us is not None and profile.op_overhead_us > 0
    assert profile.param_overhead_us is not None and profile.param_overhead_us > 0
    assert (
        f"eager training step of tiny-llama (4 sequences, fp32, {where})"
        in (profile.sources["op_overhead_us"])
    )
    assert report.fits["framework"].rms_after == pytest.approx(0.0, abs=1e-9)
    spec = get_preset("tiny-llama")
    training = Training(global_batch_size=4 * ranks, seq_len=spec.seq_len, dtype=DType.FP32)
    cluster = Cluster(gpu="cpu", num_gpus=ranks, gpus_per_node=ranks)
    priced = {
        name: build_cost_model(
            spec_graph(spec, training), cluster, training, causal=True,
            options=measured_run_options(p), profile=p,
        ).estimate(Strategy(dp=ranks, micro_batch_size=4)).breakdown_s
        for name, p in (("with", profile), ("without", without))
    }  # fmt: skip
    passes = sum(priced["with"].values()) - priced["with"]["optimizer"]
    assert passes == pytest.approx(step.forward_backward_s)
    assert priced["with"]["optimizer"] == pytest.approx(step.optimizer_s)
    assert priced["without"]["compute"] < step.forward_backward_s / 2


def test_the_training_step_probe_times_forward_backward_and_the_optimizer() -> None:
    from planner.calibrate.microbench import PROBE_MODEL, training_step_sample

    step = training_step_sample(torch.device("cpu"), repeats=3)
    assert step.model == PROBE_MODEL
    assert step.forward_backward_s > step.optimizer_s > 0


def test_a_gpu_sweep_refits_nccls_protocol_curve_on_the_base_links() -> None:
    """On a base whose links carry NCCL's protocols (a GPU), the sweep of the process
    group refits that curve, on the tier the group ran on, not an alpha-beta line."""
    from planner.calibrate.links import LinkSample, price, table_error, with_link, with_values

    hopper = load_profile("h100-sxm-80gb")
    truth = with_link(hopper, "intra_node", with_values(
        hopper.links.intra_node, {"bandwidth_GBps": 330.0, "launch_us": 25.0}
    ))  # fmt: skip
    kinds = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER,
             Collective.ALL_TO_ALL, Collective.SEND_RECV)  # fmt: skip
    samples = [
        LinkSample(kind, 8, 8, float(size), 1.0)
        for kind in kinds for size in (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 27)
    ]  # fmt: skip
    collectives = [(s.kind, s.ranks, s.size_bytes, price(s, truth)) for s in samples]
    measured = Measurements(**{**_measurements(collectives).__dict__, "ranks_per_node": 8})
    profile, report = build_profile(
        measured, name="gpu", stamp="measured today", device_kind="gpu", base=hopper,
        peak_tflops=0.2, peak_source="given", memory_capacity_gib=80.0,
    )  # fmt: skip
    intra = profile.links.intra_node
    assert intra.bandwidth_GBps == pytest.approx(330.0, rel=0.02)
    assert intra.protocols.keys() == hopper.links.intra_node.protocols.keys()
    assert profile.links.inter_node == hopper.links.inter_node  # one node: the base's network
    assert "protocol curve" in profile.sources["links.intra_node.launch_us"]
    timed = [LinkSample(k, n, 8, b, t) for k, n, b, t in collectives]
    assert table_error(timed, profile) < 0.02 < table_error(timed, hopper)
    assert report.fits["collectives"].rms_after < 0.02
