"""Operator compute time: roofline, efficiency curve, attention kernels, Megatron's TP rule."""

import pytest

from planner.cost.compute import ComputeModel
from planner.cost.options import CostOptions
from planner.cost.spec_graph import graph_from_spec
from planner.cost.tp import megatron_assignment
from planner.graph import OpKind, OpNode
from planner.hardware import load_profile
from planner.models import get_preset
from planner.spec import DType

A100 = load_profile("a100-sxm-80gb")
H100 = load_profile("h100-sxm-80gb")
ONE = 1.0  # the traced batch-1 node's work, whole


def _node(name="x", kind=OpKind.ELEMENTWISE, module="", flops=0.0, nbytes=0.0, gemm=None):
    return OpNode(
        name=name, kind=kind, target="t", module=module, inputs=(), input_shapes=((1, 8, 8),),
        output_shape=(1, 8, 8), dtype="bf16", flops_fwd=flops, flops_bwd=2 * flops,
        bytes_read=nbytes / 2, bytes_written=nbytes / 2, gemm=gemm,
    )  # fmt: skip


def test_gemm_time_is_throughput_plus_fixed_overhead():
    model = ComputeModel(A100, DType.BF16, CostOptions())
    expected = 1e12 / (312e12 * A100.matmul_efficiency) + A100.matmul_overhead_us * 1e-6
    assert model.gemm_time(1e12, 0.0) == pytest.approx(expected)
    # efficiency saturates: a 1000x smaller GEMM runs at a lower fraction of peak
    small, large = model.gemm_time(1e9, 0.0), model.gemm_time(1e12, 0.0)
    assert 1e9 / small < 1e12 / large


def test_matmul_backward_is_two_gemms_and_memory_bound_ops_use_bandwidth():
    model = ComputeModel(A100, DType.BF16, CostOptions())
    mm = model.node_time(_node(kind=OpKind.MATMUL, flops=1e12), ONE)
    assert mm.backward_s == pytest.approx(2 * mm.forward_s)
    add = model.node_time(_node(nbytes=1e9), ONE)
    bandwidth = 2039e9 * A100.memory_efficiency
    assert add.forward_s == pytest.approx(1e9 / bandwidth + A100.kernel_overhead_us * 1e-6)


def test_fp8_uses_the_fp8_peak_for_matmuls():
    bf16 = ComputeModel(H100, DType.BF16, CostOptions()).gemm_time(1e13, 0.0)
    fp8 = ComputeModel(H100, DType.FP8, CostOptions()).gemm_time(1e13, 0.0)
    assert fp8 < 0.6 * bf16


def _attention_node():
    flops = 4.0 * 32 * 2048 * 2048 * 128  # QK^T and PV for 32 heads
    return _node(kind=OpKind.ATTENTION, module="attention", flops=flops, gemm=(32, 2048, 2048, 128))


def test_flash_causal_halves_attention_and_unfused_is_slower():
    node = _attention_node()
    causal = ComputeModel(H100, DType.BF16, CostOptions()).node_time(node, ONE)
    full = ComputeModel(H100, DType.BF16, CostOptions(causal=False)).node_time(node, ONE)
    unfused = ComputeModel(H100, DType.BF16, CostOptions(attention="unfused")).node_time(node, ONE)
    overhead = H100.matmul_overhead_us * 1e-6
    assert full.forward_s - overhead == pytest.approx(2 * (causal.forward_s - overhead))
    assert unfused.forward_s > full.forward_s


def test_cudnn_attention_runs_at_its_own_efficiency_where_the_profile_gives_one():
    """Transformer Engine's cuDNN kernel (Megatron-Core's on Hopper) at the profile's
    cudnn_attention_efficiency; a profile without one (A100) prices it as FlashAttention-2."""
    node = _attention_node()
    overhead = H100.matmul_overhead_us * 1e-6
    sdpa, cudnn = (
        ComputeModel(H100, DType.BF16, CostOptions(causal=False, flash_impl=impl)).node_time(
            node, ONE
        )
        for impl in ("sdpa", "cudnn")
    )
    assert H100.cudnn_attention_efficiency is not None
    ratio = H100.cudnn_attention_efficiency / H100.attention_efficiency
    assert (sdpa.forward_s - overhead) == pytest.approx(ratio * (cudnn.forward_s - overhead))
    assert A100.cudnn_attention_efficiency is None
    a100 = (
        ComputeModel(A100, DType.BF16, CostOptions(flash_impl=impl)).node_time(node, ONE)
        for impl in ("sdpa", "cudnn")
    )
    assert len(set(a100)) == 1


def test_megatron_core_prices_cudnn_attention_and_the_others_flash_attention_2():
    from planner.frameworks import Framework, framework_options

    chosen = {f: framework_options(f, CostOptions()).flash_impl for f in Framework}
    assert chosen.pop(Framework.MEGATRON) == "cudnn"
    assert set(chosen.values()) == {"sdpa"}


def test_causal_flash_never_counts_more_than_the_peak():
    """The convention counts causal attention whole (forward + 2x backward) where the
    kernel runs half of it (forward + 2.5x backward): the efficiency is held at 7/12, so
    counted FLOPs per second stay at the peak at most (A100's profile says 0.6)."""
    node = _attention_node()
    assert A100.attention_efficiency > 7 / 12 > H100.attention_efficiency
    for profile in (A100, H100):
        time = ComputeModel(profile, DType.BF16, CostOptions()).node_time(node, ONE)
        counted = node.flops_fwd + node.flops_bwd
        assert counted / (time.forward_s + time.backward_s) <= profile.peak_flops(DType.BF16)
    full = ComputeModel(A100, DType.BF16, CostOptions(causal=False)).node_time(node, ONE)
    overhead = A100.matmul_overhead_us * 1e-6
    rate = full.forward_s - overhead  # bidirectional: the profile's own efficiency
    assert rate == pytest.approx(node.flops_fwd / (312e12 * A100.attention_efficiency))


def test_fused_pointwise_reads_first_input_and_writes_last_output():
    chain = [_node(f"n{i}", nbytes=2e8) for i in range(4)]
    eager = ComputeModel(A100, DType.BF16, CostOptions()).segment_times(chain, [ONE] * 4)
    fused = ComputeModel(A100, DType.BF16, CostOptions(fused_pointwise=True)).segment_times(
        chain, [ONE] * 4
    )
    assert sum(t.forward_s for t in fused) < sum(t.forward_s for t in eager) / 3
    assert [t.forward_s > 0 for t in fused] == [True, False, False, False]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_megatron_rule_splits_sublayers_and_vocabulary(sequence_parallel):
    """Inside attention/FFN, the embedding, head and loss divide by tp; norms and residual
    adds only under sequence parallelism, and only from the first block on."""
    graph = graph_from_spec(get_preset("tiny-gpt"))
    layout = megatron_assignment(graph, 4, sequence_parallel)
    block = graph.types["block"]
    work = dict(
        zip((n.name for n in block.nodes), layout.segment("block").work_divisor, strict=True)
    )
    assert work["attention_wq"] == work["attention"] == work["feed_forward_w2"] == 4
    sequence = 4 if sequence_parallel else 1
    assert work["attention_residual"] == work["attention_norm_layer_norm"] == sequence
    head = dict(
        zip(
            (n.name for n in graph.types["head"].nodes),
            layout.segment("head").work_divisor,
            strict=True,
        )
    )
    assert head["output"] == head["loss_cross_entropy"] == 4
    embedding = graph.types["embedding"].nodes
    pos = [n.name for n in embedding].index("pos_embeddings")
    assert layout.segment("embedding").work_divisor[pos] == 1  # before the first block: whole


def test_split_work_is_faster_by_its_divisor():
    model = ComputeModel(A100, DType.BF16, CostOptions())
    norm = _node(kind=OpKind.NORM, module="attention_norm", nbytes=8e9)
    replicated, split = model.node_time(norm, 1.0).forward_s, model.node_time(norm, 0.25).forward_s
    assert replicated > 3.5 * split


def test_fp8_gemms_run_at_the_profiles_fp8_share_of_bf16s_efficiency():
    hopper = load_profile("h100-sxm-80gb")
    fp8, bf16 = (ComputeModel(hopper, dtype, CostOptions()) for dtype in (DType.FP8, DType.BF16))
    overhead = hopper.matmul_overhead_us * 1e-6
    assert hopper.fp8_matmul_ratio is not None and hopper.fp8_matmul_ratio < 1
    assert (bf16.gemm_time(1e12, 0.0) - overhead) / (fp8.gemm_time(1e12, 0.0) - overhead) == (
        pytest.approx(
            hopper.fp8_matmul_ratio * hopper.peak_tflops[DType.FP8] / hopper.peak_tflops[DType.BF16]
        )
    )
    unknown = hopper.model_copy(update={"fp8_matmul_ratio": None})  # fp8 at bf16's efficiency
    assert unknown.matmul_efficiency_for(DType.FP8) == hopper.matmul_efficiency
