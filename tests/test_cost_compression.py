"""Gradient compression in the cost model: wire bytes, PowerSGD work and memory, crossover."""

import pytest

from planner.cost import CostModel, CostOptions, graph_from_spec
from planner.cost.communication import Collective, LinkModel, collective_time, link_for_axis
from planner.cost.compression import (
    GradientShapes,
    all_gather_break_even_ranks,
    bucket_count,
    gradient_shapes,
    half_wire_bytes,
    powersgd_memory_bytes,
    powersgd_work,
    should_compress,
)
from planner.cost.tp import megatron_assignment, unsharded
from planner.errors import SpecError
from planner.hardware import load_profile
from planner.spec import Cluster, Family, ModelSpec, Strategy, Training

GPT = ModelSpec(
    family=Family.GPT, num_layers=2, hidden_size=256, num_heads=4, vocab_size=1024, seq_len=128
)
POWERSGD = {"kind": "powersgd", "rank": 4}


def _alpha_beta(name):
    """Profile ``name`` with plain alpha-beta links (no protocols, launch or tree): the
    hand computations below count steps and bytes."""
    profile = load_profile(name)
    plain = {"launch_us": None, "protocols": {}, "tree_bandwidth_share": None,
             "collective_factors": {}}  # fmt: skip
    links = profile.links.model_copy(update={
        tier: getattr(profile.links, tier).model_copy(update=plain)
        for tier in ("intra_node", "inter_node")
    })  # fmt: skip
    return profile.model_copy(update={"links": links})


def _model(intra_node_GBps=None, **options):
    cluster = Cluster(
        gpu="a100-sxm-80gb", num_gpus=2, gpus_per_node=2, intra_node_GBps=intra_node_GBps
    )
    training = Training(global_batch_size=4, dtype="fp32")
    return CostModel(
        graph_from_spec(GPT), cluster, training, profile=_alpha_beta("a100-sxm-80gb"),
        options=CostOptions(**options),
    )  # fmt: skip


def _estimate(model, compression=None, **fields):
    extra = {"compression": compression} if compression else {}
    return model.estimate(Strategy(dp=2, micro_batch_size=2, **extra, **fields))


def _dp_link(model):
    """The link of the two data-parallel ranks (adjacent GPUs: tp = cp = 1)."""
    return link_for_axis(2, 1, model.cluster, model.profile)


def _params(model):
    return sum(c.param_count for c in model.segment_costs(Strategy(dp=2, micro_batch_size=2)))


def test_half_precision_halves_the_bytes_on_the_wire():
    assert half_wire_bytes(4) == 2 and half_wire_bytes(2) == 2
    model = _model(overlap_grad_reduce=False)
    plain = _estimate(model).breakdown_s["comm_dp"]
    for kind in ("fp16", "bf16"):
        half = _estimate(model, {"kind": kind}).breakdown_s
        bandwidth = _dp_link(model).busbw_Bps
        # all-reduce over 2 ranks: bus factor 1, same latency; 4 -> 2 bytes per element
        assert plain - half["comm_dp"] == pytest.approx(2 * _params(model) / bandwidth)
        assert half["compression"] > 0  # casts down and back up


def test_half_precision_changes_nothing_when_gradients_are_reduced_in_two_bytes():
    model = _model(grad_reduce_bytes=2)
    plain, half = _estimate(model), _estimate(model, {"kind": "bf16"})
    assert half.breakdown_s["comm_dp"] == plain.breakdown_s["comm_dp"]
    assert half.breakdown_s["compression"] == 0
    assert half.step_time_s == plain.step_time_s


def test_powersgd_work_of_one_matrix_by_hand():
    shapes = GradientShapes(matrices=((1000, 500), (10, 10)), vector_elements=300)
    work = powersgd_work(shapes, rank=4)
    assert work.compressed == ((1000, 500),)  # 10x10: P and Q (80) are not < half of 100
    assert work.p_elements == 4 * 1000 and work.q_elements == 4 * 500
    assert work.uncompressed_elements == 300 + 100
    assert work.product_flops == 6 * 1000 * 500 * 4  # M Q, M^T P, P Q^T
    assert work.orthogonalize_flops == 2 * (1000 + 500) * 4**2  # Q's (warm start) and P's
    assert shapes.elements == 1000 * 500 + 100 + 300


def test_narrow_products_are_priced_at_the_profiles_width_and_rank_1_as_a_gemv():
    """torch's CPU build runs P = M Q and Q = M^T P of rank 2-8 as slowly as a ~52-column
    GEMM (plan calibrate measures it); rank 1 takes the GEMV path; GPUs: their own width."""
    from planner.cost.compression import powersgd_compute_time
    from planner.cost.compute import ComputeModel
    from planner.spec import DType

    shapes = GradientShapes(matrices=((2048, 256),) * 8, vector_elements=0)
    base = load_profile("a100-sxm-80gb")
    slow = base.model_copy(update={"narrow_matmul_width": 52.0})

    def seconds(profile, rank):
        compute = ComputeModel(profile, DType.FP32, CostOptions())
        work = powersgd_work(shapes, rank)
        return powersgd_compute_time(work, rank, 1, shapes.elements, compute, 4)

    assert seconds(slow, 1) == seconds(base, 1)
    assert seconds(slow, 4) > seconds(base, 4)


def test_should_compress_follows_torchs_rate_rule():
    assert should_compress(100, 100, 4)  # 4 * 200 * 2 = 1600 < 10000
    assert not should_compress(100, 100, 25)  # 25 * 200 * 2 = 10000, not less


def test_gradient_shapes_cover_every_parameter_and_split_by_tp():
    graph = graph_from_spec(GPT)
    total = sum(n.param_count for s in graph.segments for n in graph.segment_type(s).nodes)
    shapes = gradient_shapes(graph, unsharded(graph))
    assert shapes.elements == pytest.approx(total)
    assert (4 * 256, 256) in shapes.matrices and (256, 4 * 256) in shapes.matrices
    assert (1024, 256) in shapes.matrices  # the token-embedding table
    split = gradient_shapes(graph, megatron_assignment(graph, 2, False))
    assert (2 * 256, 256) in split.matrices
    assert split.elements < shapes.elements


def test_error_feedback_memory_by_hand():
    work = powersgd_work(GradientShapes(((1000, 500),), 0.0), rank=4)
    expected = (1000 * 500 + 4 * 1500) * 4  # error buffer, P and Q
    assert powersgd_memory_bytes(work, 1000 * 500, 4) == expected


def test_powersgd_memory_term_in_the_prediction():
    model = _model()
    plain, compressed = _estimate(model), _estimate(model, POWERSGD)
    assert "compression" not in plain.memory_gib
    work = powersgd_work(gradient_shapes(model.graph, unsharded(model.graph)), 4)
    params = _params(model)
    expected = (params + work.p_elements + work.q_elements) * 4
    assert compressed.memory_gib["compression"] == pytest.approx(expected / 2**30)
    assert sum(compressed.breakdown_s.values()) == pytest.approx(compressed.step_time_s)


def test_powersgd_wins_on_a_slow_link_and_loses_on_a_fast_one():
    slow = _model(intra_node_GBps=0.5)
    assert _estimate(slow, POWERSGD).step_time_s < _estimate(slow).step_time_s
    fast = _model()  # NVLink
    plain, compressed = _estimate(fast), _estimate(fast, POWERSGD)
    assert compressed.step_time_s > plain.step_time_s
    assert compressed.breakdown_s["comm_dp"] <= plain.breakdown_s["comm_dp"]
    assert compressed.breakdown_s["compression"] > 0


def test_powersgd_sends_three_all_reduces_per_bucket():
    model = _model(overlap_grad_reduce=False, dp_bucket_mib=0.25)
    link = _dp_link(model)
    params = _params(model)
    buckets = bucket_count(4 * params, 0.25 * 2**20)
    assert buckets > 1
    work = powersgd_work(gradient_shapes(model.graph, unsharded(model.graph)), 4)
    elements = work.uncompressed_elements + work.p_elements + work.q_elements
    # 2 ranks: two latency steps and bus factor 1 per all-reduce
    expected = 3 * buckets * 2 * link.latency_s + 4 * elements / link.busbw_Bps
    assert _estimate(model, POWERSGD).breakdown_s["comm_dp"] == pytest.approx(expected)


def test_powersgd_outside_ddp_is_refused():
    with pytest.raises(SpecError, match="powersgd"):
        _estimate(_model(), POWERSGD, zero=1)


def test_compression_follows_the_meshes_the_runtime_runs():
    """The cost model refuses what ParallelDims refuses: a DDP hook under a pipeline,
    int8 without FSDP, any compression without a gradient reduction."""
    model = _model()
    with pytest.raises(SpecError, match="DDP cannot run under a pipeline"):
        _estimate(model, {"kind": "bf16"}, pp=2)
    with pytest.raises(SpecError, match="int8"):
        _estimate(model, {"kind": "int8"})
    with pytest.raises(SpecError, match="no gradient reduction"):
        model.estimate(Strategy(micro_batch_size=4, compression=POWERSGD))
    local = {"kind": "local_sgd", "local_group": 2, "period": 4}
    with pytest.raises(SpecError, match="local_group = 2 with dp"):
        _estimate(model, local)


@pytest.mark.parametrize("ratio", [2, 4, 16])
def test_all_gather_break_even_group(ratio):
    """Up to the break-even size an all-gather of compressed payloads beats an
    uncompressed all-reduce; one rank more and it no longer does."""
    link = LinkModel("test", busbw_Bps=1e9, latency_s=0.0)
    size = 1e8

    def gather_wins(n: int) -> bool:
        gathered = collective_time(Collective.ALL_GATHER, n * size / ratio, n, link)
        return gathered < collective_time(Collective.ALL_REDUCE, size, n, link)

    limit = all_gather_break_even_ranks(ratio)
    assert gather_wins(limit) and not gather_wins(limit + 1)
