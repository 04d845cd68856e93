"""Sharding ILP on traced models: Megatron's layout for GPT and Llama, others differ."""

import itertools
import math
from fnmatch import fnmatch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from planner.cost.communication import Collective
from planner.graph import OpGraph, OpKind, OpNode, Segment, SegmentType
from planner.models import ModelHandle, resolve_model
from planner.models.small import MLPStack
from planner.solve.layout import Roofline, build_layout_problem
from planner.solve.placements import _permutation_map, _reshape_map, reshard_collectives
from planner.solve.program import TPLayout, solve_tp_layout
from planner.solve.sharding import ShardingInfeasibleError
from planner.spec import TPStyle
from planner.tracing import trace

H100 = Roofline(
    peak_flops=989e12, memory_bandwidth_GBps=3350, link_bandwidth_GBps=450, link_latency_us=3
)
COL, ROW, SP, REP = (
    TPStyle.COLWISE,
    TPStyle.ROWWISE,
    TPStyle.SEQUENCE_PARALLEL,
    TPStyle.REPLICATE,
)


@pytest.fixture(scope="module")
def gpt() -> OpGraph:
    return trace(resolve_model("gpt3-1.3b"), batch_size=1, seq_len=2048)


@pytest.fixture(scope="module")
def llama() -> OpGraph:
    return trace(resolve_model("llama3-8b"), batch_size=1, seq_len=4096)


def megatron(layout: TPLayout, projections: dict[str, TPStyle]) -> None:
    for module, style in projections.items():
        assert layout.styles[f"layers.*.{module}"] is style, module


GPT_MEGATRON = {
    "attention.wq": COL,
    "attention.wk": COL,
    "attention.wv": COL,
    "attention.wo": ROW,
    "feed_forward.w1": COL,
    "feed_forward.w2": ROW,
}
LLAMA_MEGATRON = {**GPT_MEGATRON, "feed_forward.w3": COL}


def test_gpt_block_rediscovers_megatron(gpt):
    layout = solve_tp_layout(gpt, tp=8, pricer=H100)
    megatron(layout, GPT_MEGATRON)
    assert layout.solution.status == "optimal"
    assert layout.modules["layers.*.attention.wo"].output == ("Partial()", "Replicate()")
    assert layout.modules["layers.*.attention.wq"].input == ("Replicate()", "Replicate()")
    assert layout.modules["layers.*.attention_norm"].output_dtensor  # one all-reduce for q, k, v
    assert not any(key.startswith("layers.0.") for key in layout.styles)  # one pattern per type


def test_gpt_with_sequence_parallel_shards_norms_on_the_sequence(gpt):
    layout = solve_tp_layout(gpt, tp=8, pricer=H100, sequence_parallel=True)
    megatron(layout, GPT_MEGATRON)
    assert layout.styles["layers.*.attention_norm"] is SP
    assert layout.styles["layers.*.ffn_norm"] is SP
    assert layout.modules["layers.0"].input == ("Replicate()", "Shard(1)")  # SP starts here
    assert layout.modules["layers.*.attention.wo"].output[1] == "Shard(1)"  # reduce-scatter
    assert layout.modules["layers.*.feed_forward.w2"].output[1] == "Shard(1)"


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_llama_block_rediscovers_megatron_with_gqa_and_swiglu(llama, sequence_parallel):
    layout = solve_tp_layout(llama, tp=8, pricer=H100, sequence_parallel=sequence_parallel)
    megatron(layout, LLAMA_MEGATRON)
    assert ("layers.0" in layout.modules) is sequence_parallel  # the residual stream's entry
    if sequence_parallel:
        assert layout.styles["layers.*.attention_norm"] is SP
        assert layout.modules["layers.*.attention_norm"].input[1] == "Shard(1)"


def test_tp_of_one_replicates_everything(gpt):
    layout = solve_tp_layout(gpt, tp=1, pricer=H100, sequence_parallel=True)
    assert set(layout.styles.values()) == {REP}
    assert not layout.shards_anything


def test_tp_that_divides_no_dim_replicates_the_projections(gpt):
    layout = solve_tp_layout(gpt, tp=3, pricer=H100)  # 2048 hidden, 16 heads
    assert layout.styles["layers.*.attention.wq"] is REP
    assert layout.styles["layers.*.feed_forward.w1"] is REP


def test_llama_ilp_shares_variables_across_its_32_blocks(llama):
    problem = build_layout_problem(llama, tp=8, pricer=H100).problem
    block_type = llama.blocks[0].type_id
    assert len(llama.blocks) == 32
    per_type = len(llama.types[block_type].nodes)
    assert len(problem.nodes) < 2 * per_type  # one copy of the block, not 32


def test_too_small_memory_budget_names_the_memory_family(gpt):
    with pytest.raises(ShardingInfeasibleError) as caught:
        solve_tp_layout(gpt, tp=8, pricer=H100, memory_budget_bytes=2**20)
    assert caught.value.family == "memory_budget"
    assert "1.00 MiB" in str(caught.value)


def test_memory_budget_forces_a_sharded_embedding(gpt):
    unlimited = solve_tp_layout(gpt, tp=8, pricer=H100)
    embedding_bytes = 51200 * 2048 * 2
    budget = unlimited.solution.memory_bytes - 0.6 * embedding_bytes
    tight = solve_tp_layout(gpt, tp=8, pricer=H100, memory_budget_bytes=budget)
    assert unlimited.styles["tok_embeddings"] is REP
    assert tight.styles["tok_embeddings"] is not REP
    assert tight.solution.memory_bytes <= budget
    assert tight.solution.objective_s >= unlimited.solution.objective_s


def test_mlp_stack_under_a_memory_budget_alternates_column_and_row():
    graph = trace(resolve_model("mlp"), batch_size=1)
    unlimited = solve_tp_layout(graph, tp=2, pricer=H100)
    layout = solve_tp_layout(graph, tp=2, pricer=H100, memory_budget_bytes=2.0e6)
    assert set(unlimited.styles.values()) == {REP}  # a tiny batch: communication never pays
    styles = [layout.styles[f"layers.{i}"] for i in range(3)]
    assert any(a is COL and b is ROW for a, b in itertools.pairwise(styles))
    assert layout.solution.memory_bytes <= 2.0e6
    col = styles.index(COL)
    assert layout.modules[f"layers.{col}"].output[1] == "Shard(-1)"  # handed on, no gather


def test_cnn_keeps_convolutions_replicated():
    graph = trace(resolve_model("cnn"), batch_size=64)
    layout = solve_tp_layout(graph, tp=2, pricer=H100, memory_budget_bytes=1e9)
    assert {layout.styles[f"convs.{i}"] for i in range(3)} == {REP}
    assert set(layout.styles) == {"convs.0", "convs.1", "convs.2", "head"}


def test_mlp_mixer_under_a_memory_budget_shards_token_and_channel_mixing():
    graph = trace(resolve_model("mlp-mixer"), batch_size=512)
    unlimited = solve_tp_layout(graph, tp=2, pricer=H100)
    budget = 0.7 * unlimited.solution.memory_bytes
    layout = solve_tp_layout(graph, tp=2, pricer=H100, memory_budget_bytes=budget)
    mixers = [
        f"layers.*.{m}" for m in ("token_mix.0", "token_mix.2", "channel_mix.0", "channel_mix.2")
    ]
    assert {unlimited.styles[m] for m in mixers} == {REP}
    assert {layout.styles[m] for m in mixers} & {COL, ROW}
    assert layout.solution.memory_bytes <= budget
    assert math.isfinite(layout.solution.objective_s)


def block_graph(nodes: tuple[OpNode, ...]) -> OpGraph:
    block = SegmentType("b", "block", nodes)
    segments = tuple(Segment(f"layers.{i}", "b", (f"layers.{i}",)) for i in range(2))
    return OpGraph("hand", 1, 64, "bf16", "fx", segments, {"b": block})


def node(name, kind, inputs, in_shapes, out, *, params=0, target="", module="", flops=0.0):
    return OpNode(
        name=name, kind=kind, target=target or name, module=module, inputs=inputs,
        input_shapes=in_shapes, output_shape=out, dtype="bf16", flops_fwd=flops,
        flops_bwd=2 * flops, bytes_read=0.0, bytes_written=0.0, param_count=params,
        param_bytes=2.0 * params,
    )  # fmt: skip


def test_hand_built_mlp_block_gets_megatron_mlp():
    """norm -> w1 -> gelu -> w2 -> add, as a block that repeats: column then row."""
    t, h, f = 8192, 4096, 16384
    x = (1, t, h)
    nodes = (
        node("norm", OpKind.NORM, (), (x,), x, params=h, target="layer_norm", module="norm"),
        node("w1", OpKind.MATMUL, ("norm",), (x, (f, h)), (1, t, f), params=f * h,
             target="Linear", module="w1", flops=2.0 * t * h * f),
        node("gelu", OpKind.ELEMENTWISE, ("w1",), ((1, t, f),), (1, t, f)),
        node("w2", OpKind.MATMUL, ("gelu",), ((1, t, f), (h, f)), x, params=f * h,
             target="Linear", module="w2", flops=2.0 * t * h * f),
        node("add", OpKind.ELEMENTWISE, ("w2",), (x, x), x),
    )  # fmt: skip
    graph = block_graph(nodes)
    layout = solve_tp_layout(graph, tp=8, pricer=H100)
    assert layout.styles["layers.*.w1"] is COL
    assert layout.styles["layers.*.w2"] is ROW
    # per block: both matmuls split 8 ways, one all-reduce forward (w2's output) and one
    # backward (w1's input); the objective counts every block of the type
    compute = 2 * 3 * (2.0 * t * h * f) / 8 / H100.peak_flops
    all_reduce = H100.comm_seconds(Collective.ALL_REDUCE, 2.0 * t * h, 8)
    per_block = compute + 2 * all_reduce
    assert layout.solution.objective_s == pytest.approx(len(graph.segments) * per_block)


def test_views_carry_sharding_through_splits_merges_and_unique_transposes():
    assert _reshape_map((1, 64, 8, 16), (1, 64, 128)) == {1: 1, 2: 2}  # hidden -> heads
    assert _reshape_map((1, 64, 128), (1, 64, 8, 16)) == {1: 1, 2: 2}  # heads -> hidden
    assert _permutation_map((1, 8, 64, 16), (1, 64, 8, 16)) == {0: 0, 1: 2, 2: 1, 3: 3}
    # swapping two dims of equal size cannot be traced from shapes: neither keeps a shard
    assert _permutation_map((2, 64, 64), (2, 64, 64)) == {0: 0}


def test_redistributions_are_the_collectives_dtensor_runs():
    assert reshard_collectives("R", "S1") == ()  # slicing is local
    assert reshard_collectives("S1", "P") is None  # a value never becomes partial sums
    assert reshard_collectives("P", "R") == (Collective.ALL_REDUCE,)
    assert reshard_collectives("P", "S1") == (Collective.REDUCE_SCATTER,)
    assert reshard_collectives("S1", "R") == (Collective.ALL_GATHER,)
    assert reshard_collectives("S1", "S2") == (Collective.ALL_TO_ALL,)
    assert reshard_collectives("V", "R") is None  # loss-parallel logits go to the loss only


def test_bad_arguments_name_the_field(gpt):
    with pytest.raises(Exception, match="tp = 0"):
        build_layout_problem(gpt, tp=0, pricer=H100)
    with pytest.raises(Exception, match="link_bandwidth_GBps"):
        Roofline(peak_flops=1e12, memory_bandwidth_GBps=1, link_bandwidth_GBps=0, link_latency_us=1)


@settings(max_examples=15, deadline=None)
@given(
    widths=st.lists(st.sampled_from([16, 32, 48, 64, 96]), min_size=2, max_size=5),
    tp=st.sampled_from([1, 2, 4]),
    batch=st.sampled_from([1, 64, 4096]),
    squeeze=st.sampled_from([None, 0.9, 0.5, 0.01]),
)
def test_any_mlp_stack_gets_a_layout_covering_every_linear(widths, tp, batch, squeeze):
    with torch.device("meta"):
        model = MLPStack(tuple(widths))
    handle = ModelHandle("mlp", "test", model, lambda b, s: model.example_inputs(b))
    graph = trace(handle, batch_size=batch)
    unlimited = solve_tp_layout(graph, tp=tp, pricer=H100)
    layout = unlimited
    if squeeze is not None:
        budget = squeeze * unlimited.solution.memory_bytes
        try:
            layout = solve_tp_layout(graph, tp=tp, pricer=H100, memory_budget_bytes=budget)
        except ShardingInfeasibleError as error:
            assert error.family == "memory_budget"
            return
        assert layout.solution.memory_bytes <= budget * (1 + 1e-9)
    assert math.isfinite(layout.solution.objective_s)
    for i in range(len(widths) - 1):
        matching = [style for key, style in layout.styles.items() if fnmatch(f"layers.{i}", key)]
        assert len(matching) == 1, (i, layout.styles)
        assert matching[0] in {COL, ROW, REP}
        if tp == 1:
            assert matching[0] is REP


class _HeadNamedHead(nn.Module):
    """Residual MLP blocks and a top-level module called ``head``: the head segment's label."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(3)
        )
        self.head = nn.Linear(256, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_a_module_named_like_its_segment_keeps_its_own_fqn():
    with torch.device("meta"):
        module = _HeadNamedHead()
    handle = ModelHandle(
        "heads", "test", module, lambda b, s: (torch.empty(b, 64, 256, device="meta"),)
    )
    graph = trace(handle, batch_size=8)
    roofline = Roofline(1e12, 1000, 100, 5)
    layout = solve_tp_layout(graph, tp=2, pricer=roofline, memory_budget_bytes=6e6)
    names = {name for name, _ in module.named_modules()}
    assert "head" in layout.styles
    assert set(layout.styles) <= names
