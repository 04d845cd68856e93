"""CostModel end to end on tiny graphs: conventions, breakdown, caching, stages, memory."""

import pytest

from planner.cost import CostModel, CostOptions, graph_from_spec
from planner.cost.flops import megatron_hardware_flops, megatron_model_flops
from planner.errors import SpecError
from planner.parallel_dims import ParallelDims
from planner.spec import Axis, Cluster, DType, Family, ModelSpec, RecomputeMode, Strategy, Training

GPT = ModelSpec(
    family=Family.GPT, num_layers=8, hidden_size=256, num_heads=8, vocab_size=1024, seq_len=128
)
CLUSTER = Cluster(gpu="a100-sxm-80gb", num_gpus=16, gpus_per_node=8)


def _model(gbs=32, cluster=CLUSTER, **options):
    return CostModel(
        graph_from_spec(GPT),
        cluster,
        Training(global_batch_size=gbs),
        options=CostOptions(**options),
    )


def _strategy(**fields):
    base = {"dp": 2, "tp": 4, "pp": 2, "micro_batch_size": 2, "num_microbatches": 8}
    return Strategy(**{**base, **fields})


def test_breakdown_and_memory_add_up():
    prediction = _model().estimate(_strategy(recompute="full", sequence_parallel=True))
    assert sum(prediction.breakdown_s.values()) == pytest.approx(prediction.step_time_s)
    assert sum(prediction.memory_gib.values()) == pytest.approx(prediction.peak_memory_gib)
    assert {"compute", "recompute", "comm_tp", "comm_dp", "comm_pp", "bubble", "optimizer"} <= set(
        prediction.breakdown_s
    )
    assert prediction.breakdown_s["comm_tp"] > 0 and prediction.breakdown_s["bubble"] > 0


def test_mfu_uses_megatron_model_flops_and_hfu_adds_recompute():
    prediction = _model().estimate(_strategy(recompute="full"))
    step, gpus = prediction.step_time_s, 16
    model_flops = prediction.model_tflops_per_gpu * 1e12 * step * gpus
    assert model_flops == pytest.approx(megatron_model_flops(32, 128, 8, 256, 1024))
    hardware = megatron_hardware_flops(32, 128, 8, 256, 1024)
    assert prediction.hfu / prediction.mfu == pytest.approx(hardware / model_flops)
    assert "6*(N - N_embedding)" in prediction.flop_convention


def test_no_recompute_has_equal_mfu_and_hfu():
    prediction = _model().estimate(_strategy())
    assert prediction.hfu == pytest.approx(prediction.mfu)
    assert prediction.breakdown_s["recompute"] == 0


def test_segment_types_are_priced_once_per_key():
    model = _model()
    model.estimate(_strategy())
    priced = len(model._type_costs)
    model.estimate(_strategy(dp=4, pp=1, num_microbatches=4))  # same tp/cp/sp/mbs/recompute
    assert len(model._type_costs) == priced


def test_segment_costs_cover_the_model():
    costs = _model().segment_costs(_strategy(tp=1))
    assert [c.fqn for c in costs] == ["embedding", *(f"layers.{i}" for i in range(8)), "head"]
    assert sum(c.param_count for c in costs) == pytest.approx(GPT.num_params())
    assert all(c.forward_s > 0 and c.backward_s > c.forward_s for c in costs if c.kind == "block")


def test_uneven_custom_stages_are_slower_and_bad_stages_rejected():
    model = _model()
    even = model.estimate(_strategy())
    uneven = model.estimate(_strategy(), stages=[[0, 1, 2], [3, 4, 5, 6, 7, 8, 9]])
    assert uneven.step_time_s > even.step_time_s
    with pytest.raises(SpecError, match="every segment"):
        model.estimate(_strategy(), stages=[[0, 1, 2], [4, 5, 6, 7, 8, 9]])
    with pytest.raises(SpecError, match="chunks"):
        model.estimate(_strategy(), stages=[list(range(10))])


def test_data_parallel_across_nodes_costs_more_than_within():
    strategy = _strategy(dp=16, tp=1, pp=1, num_microbatches=1)
    wide = Cluster(gpu="a100-sxm-80gb", num_gpus=16, gpus_per_node=16)
    across = _model(overlap_grad_reduce=False).estimate(strategy)
    within = _model(cluster=wide, overlap_grad_reduce=False).estimate(strategy)
    assert across.breakdown_s["comm_dp"] > within.breakdown_s["comm_dp"] > 0
    overlapped = _model(dp_bucket_mib=1).estimate(strategy)  # several buckets: all but one hide
    assert overlapped.breakdown_s["comm_dp"] < across.breakdown_s["comm_dp"]


def test_zero3_reports_fsdp_communication_and_shards_states():
    zero0 = _model().estimate(_strategy(pp=1, dp=4, num_microbatches=4))
    zero3 = _model().estimate(_strategy(pp=1, dp=4, num_microbatches=4, zero=3))
    assert "comm_fsdp" in zero3.breakdown_s
    assert zero3.memory_gib["optimizer"] < zero0.memory_gib["optimizer"] / 3


def test_recompute_trades_memory_for_time():
    none = _model().estimate(_strategy())
    full = _model().estimate(_strategy(recompute=RecomputeMode.FULL))
    assert full.memory_gib["activations"] < none.memory_gib["activations"]
    assert full.step_time_s > none.step_time_s


def test_mesh_strides_put_tensor_parallelism_innermost():
    dims = ParallelDims.of(Strategy(dp=4, dp_shard=2, zero=1, tp=2, cp=2, pp=2))
    strides = {axis: dims.stride(axis) for axis in Axis}
    assert strides == {Axis.TP: 1, Axis.CP: 2, Axis.DP_SHARD: 4, Axis.DP_REPLICATE: 8, Axis.PP: 16}


def test_batch_mismatch_and_seq_mismatch_are_errors():
    with pytest.raises(SpecError, match="global_batch_size"):
        _model(gbs=30).estimate(_strategy())
    with pytest.raises(SpecError, match="seq_len"):
        CostModel(graph_from_spec(GPT), CLUSTER, Training(global_batch_size=32, seq_len=64))


def test_not_fitting_names_the_dominant_term():
    big = GPT.model_copy(update={"num_layers": 8, "hidden_size": 8192, "num_heads": 64})
    model = CostModel(graph_from_spec(big), CLUSTER, Training(global_batch_size=32))
    prediction = model.estimate(
        _strategy(tp=1, pp=1, dp=16, micro_batch_size=2, num_microbatches=1)
    )
    assert not prediction.fits
    assert "GiB over" in prediction.reason and "largest term" in prediction.reason


def test_traced_graph_prices_like_the_formula_graph():
    trace = pytest.importorskip("planner.tracing")
    from planner.layouts import FIXED_STYLE_PRICER, ModelLayouts
    from planner.models import resolve_model

    handle = resolve_model("tiny-llama")
    traced = trace.trace(handle, batch_size=1, seq_len=32, dtype="bf16")
    formula = graph_from_spec(handle.spec, seq_len=32)
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    strategy = Strategy(tp=2, micro_batch_size=2, num_microbatches=2)
    megatron = ModelLayouts(handle, traced, FIXED_STYLE_PRICER)  # the same layout, solved
    results = [
        CostModel(
            traced, cluster, Training(global_batch_size=4), tp_layouts=megatron.assignment
        ).estimate(strategy),
        CostModel(formula, cluster, Training(global_batch_size=4)).estimate(strategy),
    ]
    flops = [r.model_tflops_per_gpu * r.step_time_s for r in results]
    assert flops[0] == pytest.approx(flops[1])
    assert 0.5 < results[0].step_time_s / results[1].step_time_s < 2
    assert results[0].peak_memory_gib == pytest.approx(results[1].peak_memory_gib, rel=0.2)


def _preset(name, gpus, batch, seq=None, dtype="bf16", **options):
    from planner.cost.build import build_cost_model, spec_graph
    from planner.presets import get_preset

    spec = get_preset(name).with_seq_len(seq or get_preset(name).seq_len)
    training = Training(global_batch_size=batch, dtype=dtype)
    cluster = Cluster(gpu=options.pop("gpu", "h100-sxm-80gb"), num_gpus=gpus)
    graph = spec_graph(spec, training)
    return build_cost_model(
        graph, cluster, training, causal=spec.causal, options=CostOptions(**options)
    )


def test_recompute_never_speeds_up_hybrid_sharding():
    """gpt3-6.7b, ZeRO-3 sharded over 4 x cp2 and replicated over 4: the replica
    all-reduce and FSDP's gathers and reduce-scatters hid under one backward each, so a
    longer backward (recompute) hid more than it added. They share it now."""
    model = _preset("gpt3-6.7b", 32, 128)
    base = {"dp": 16, "dp_shard": 4, "cp": 2, "zero": 3, "num_microbatches": 8}
    steps = [
        model.estimate(Strategy(recompute=mode, **base)).step_time_s
        for mode in ("none", "selective", "full")
    ]
    assert steps == sorted(steps)


def test_fp8_mfu_is_against_the_fp8_peak_and_never_above_one():
    """Llama 3.1 405B in fp8 on H200s was reported at 119% MFU (against the bf16 peak)."""
    model = _preset("llama3.1-405b", 1, 16, seq=4096, dtype="fp8", gpu="h200-sxm-141gb",
                    fused_pointwise=True)  # fmt: skip
    prediction = model.estimate(Strategy(micro_batch_size=16))
    assert 0.4 < prediction.mfu <= 1
    fp8_peak = model.profile.peak_flops(DType.FP8)
    assert prediction.mfu == pytest.approx(prediction.model_tflops_per_gpu * 1e12 / fp8_peak)
    assert "fp8 peak" in prediction.flop_convention


def test_transformer_engine_casts_each_tensor_once_and_the_weights_once_a_step():
    """MLPerf's GPT-3 175B (NeMo, Transformer Engine fp8, 128 micro-batches a step) was
    priced 70% too slow while every GEMM cast its input and weight again in every
    micro-batch, as torchao's Float8Linear does; Transformer Engine casts a tensor once,
    with its transpose, and the weights once a step (bench_mlperf.py)."""
    strategy = Strategy(dp=2, tp=4, sequence_parallel=True, micro_batch_size=1, num_microbatches=16)
    torchao, te, bf16 = (
        _preset("llama3-8b", 8, 32, seq=4096, dtype=dtype, **options).estimate(strategy)
        for dtype, options in (("fp8", {}), ("fp8", {"fp8_linear": "te"}), ("bf16", {}))
    )
    assert te.breakdown_s["compute"] < torchao.breakdown_s["compute"]
    assert te.breakdown_s["compute"] < 0.85 * bf16.breakdown_s["compute"]
    assert te.breakdown_s["optimizer"] > torchao.breakdown_s["optimizer"]  # the step's casts


def test_fp8_weights_are_kept_in_one_byte_and_the_output_layer_in_bf16():
    """Megatron's --fp8-param-gather keeps (and gathers) the compute weights in fp8; the
    output layer is no fp8 layer in Megatron or torchtitan, so it stays in bf16."""
    strategy = Strategy(dp=8, zero=1, micro_batch_size=1, num_microbatches=2)
    plain, fp8_weights = (
        _preset("llama3-8b", 8, 16, seq=4096, dtype="fp8", fp8_linear="te", **options)
        .estimate(strategy).memory_gib["weights"]
        for options in ({}, {"fp8_param_gather": True})
    )  # fmt: skip
    assert fp8_weights == pytest.approx(plain / 2)
    from planner.cost.compute import ComputeModel
    from planner.graph import OpKind, OpNode

    h100 = _preset("llama3-8b", 8, 16).profile
    gemm = OpNode(name="output", kind=OpKind.MATMUL, target="t", module="output", inputs=(),
                  input_shapes=((1, 8, 8),), output_shape=(1, 8, 8), dtype="bf16",
                  flops_fwd=1e12, flops_bwd=2e12, bytes_read=1e6, bytes_written=1e6)  # fmt: skip
    fp8, half = (ComputeModel(h100, dtype, CostOptions()) for dtype in (DType.FP8, DType.BF16))
    assert fp8.node_time(gemm, 1.0, low_precision=False) == half.node_time(gemm, 1.0)
    assert fp8.node_time(gemm, 1.0).forward_s < half.node_time(gemm, 1.0).forward_s


def test_the_optimizer_step_moves_what_its_implementation_reads_and_writes():
    """torch's for-loop and foreach Adam pass over its states one operator at a time
    (on this CPU the for-loop step measured 2.4x the bytes a fused kernel moves,
    bench_cpu_loop.py); a fused kernel reads each once. Only the for-loop pays the
    per-tensor eager overhead."""
    from planner.cost.optimizer_step import step_passes
    from planner.cost.options import OptimizerImpl
    from planner.spec import Optimizer

    fused, foreach = (
        step_passes(i, Optimizer.ADAMW) for i in (OptimizerImpl.FUSED, OptimizerImpl.FOREACH)
    )
    assert fused == (2.0, 2.0, 1.0) and foreach == (2.0, 7.0, 2.0)
    assert step_passes(OptimizerImpl.FOR_LOOP, Optimizer.SGD) == (2.0, 5.0, 1.0)
    strategy = _strategy(pp=1, dp=2, tp=1, num_microbatches=1)
    times = {
        impl: _model(4, optimizer_impl=impl).estimate(strategy).breakdown_s["optimizer"]
        for impl in OptimizerImpl
    }
    assert times["fused"] < times["foreach"] < 2.5 * times["fused"]
    assert times["for-loop"] == times["foreach"]  # the profile measured no eager overhead


def test_autograd_sums_gradients_over_micro_batches_at_memory_speed():
    """From the second micro-batch on, autograd adds each new gradient to the kept one
    (fp32 here: 12 bytes per parameter read and written); Megatron's fused accumulation
    adds in the weight-gradient GEMM. The pass stretches each pipeline rank's micro-batch,
    so it lengthens the bubble too."""
    from planner.cost.options import GradAccumulation

    model = _model(32)
    one, four, eight = (_model(4 * m).estimate(_strategy(num_microbatches=m)) for m in (1, 4, 8))
    assert one.breakdown_s["grad_accumulation"] == 0.0
    passes = eight.breakdown_s["grad_accumulation"] / four.breakdown_s["grad_accumulation"]
    assert passes == pytest.approx(7 / 3)
    params = model.whole_model(_strategy()).param_count / 2  # a pipeline rank's, about
    bandwidth = model.profile.memory_bandwidth_GBps * 1e9 * model.profile.memory_efficiency
    launch = model.profile.kernel_overhead_us * 1e-6
    expected = 7 * (12 * params / bandwidth + launch)  # seven passes of a kernel each
    assert eight.breakdown_s["grad_accumulation"] == pytest.approx(expected, rel=0.05)
    fused = _model(32, grad_accumulation=GradAccumulation.FUSED).estimate(_strategy())
    assert "grad_accumulation" not in {k for k, v in fused.breakdown_s.items() if v}
    assert fused.breakdown_s["bubble"] < eight.breakdown_s["bubble"]
    assert sum(eight.breakdown_s.values()) == pytest.approx(eight.step_time_s)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_fsdp2_gathers_and_reduce_scatters_every_micro_batch_megatron_keeps_weights_whole(zero):
    """Without a pipeline FSDP2 runs each micro-batch whole (gather, reduce-scatter into
    the shards, which autograd's accumulation then sums: 1 / shard of the gradients);
    Megatron-Core and DeepSpeed (``zero_accumulation='partitioned'``) keep the weights
    whole: ZeRO-1 reduces its buffer once per step, ZeRO-2 every micro-batch."""
    from planner.cost.options import ZeroAccumulation

    def comm(m, **options):
        strategy = Strategy(dp=16, zero=zero, micro_batch_size=2, num_microbatches=m)
        breakdown = _model(32 * m, **options).estimate(strategy).breakdown_s
        gathers = breakdown["comm_dp"] + breakdown.get("comm_fsdp", 0.0)
        return gathers, breakdown["grad_accumulation"]

    (one, _), (four, summed) = comm(1), comm(4)
    assert four == pytest.approx(4 * one, rel=0.05)
    dp_only = Strategy(dp=16, micro_batch_size=2, num_microbatches=4)
    whole = _model(128).estimate(dp_only).breakdown_s["grad_accumulation"]
    assert summed < whole / 4  # over 1/16 of the gradients (each pass a kernel launch too)
    partitioned = {"zero_accumulation": ZeroAccumulation.PARTITIONED}
    (one_p, _), (four_p, _) = comm(1, **partitioned), comm(4, **partitioned)
    if zero == 3:  # ZeRO-3 frees its gathered weights in every framework
        assert four_p == pytest.approx(four)
    elif zero == 2:  # a reduce-scatter every micro-batch, one gather a step
        assert one_p < four_p
    else:
        assert four_p == pytest.approx(one_p, rel=0.05)


def test_torchtitan_all_reduces_every_micro_batch_this_runtime_once_a_step():
    """DDP: this runtime's micro-batches before the last run under ``no_sync`` (one
    all-reduce a step, the gradients held twice: beside the buckets); torchtitan's
    ``replicate`` all-reduces every micro-batch's (``ddp_no_sync=False``)."""
    from planner.frameworks import KERNELS, Framework

    def predicted(m, **options):
        strategy = Strategy(dp=16, micro_batch_size=2, num_microbatches=m)
        return _model(32 * m, **options).estimate(strategy)

    titan = KERNELS[Framework.TORCHTITAN]
    assert predicted(4).breakdown_s["comm_dp"] == pytest.approx(predicted(1).breakdown_s["comm_dp"])
    every = predicted(4, ddp_no_sync=titan["ddp_no_sync"]).breakdown_s["comm_dp"]
    assert every == pytest.approx(4 * predicted(1).breakdown_s["comm_dp"])
    one_copy = predicted(1).memory_gib["gradients"]
    assert predicted(4).memory_gib["gradients"] == pytest.approx(2 * one_copy)


def test_fsdp2_pays_each_units_collective_megatron_its_buckets(tmp_path):
    """FSDP2 gathers and reduce-scatters unit by unit (each block, and the root holding
    the embeddings and head): every call pays the link's latency, which a slow link and
    no overlap expose in full (ZeRO-3 in every framework); Megatron-Core's distributed
    optimizer reduces in buckets (one transfer of the whole array here)."""
    from planner.cost.options import ZeroAccumulation
    from tests.devices import write_tp_pays

    slow = Cluster(gpu=str(write_tp_pays(tmp_path)), num_gpus=8, intra_node_latency_us=1000.0)
    units = GPT.num_layers + 1
    no_overlap = {"overlap_param_gather": False, "overlap_grad_reduce": False}
    strategy = Strategy(dp=8, zero=3, micro_batch_size=4, num_microbatches=1)
    fsdp2 = _model(32, slow, **no_overlap).estimate(strategy).breakdown_s["comm_fsdp"]
    ring = 7 * 1000e-6  # a ring of 8: 7 steps of 1 ms
    # per micro-batch: a gather for forward, a gather and a reduce-scatter in backward
    assert fsdp2 == pytest.approx(3 * units * ring, rel=0.01)
    zero2 = strategy.model_copy(update={"zero": 2})
    bucketed = _model(32, slow, zero_accumulation=ZeroAccumulation.PARTITIONED, **no_overlap)
    breakdown = bucketed.estimate(zero2).breakdown_s  # a gather and a reduce-scatter a step
    assert breakdown["comm_dp"] == pytest.approx(2 * ring, rel=0.01)
