"""One tensor-parallel truth: the layout the ILP solves is the plan's, the runtime's and
the cost model's, for models the project did not write.

The distributed half (every emitted plan runs and matches one process, with exact
parameter elements and collective bytes) is ``tests/test_tp_matrix.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from planner.assemble import assemble_plan
from planner.cost import CostModel, graph_from_spec
from planner.cost.tp import megatron_assignment
from planner.errors import PlannerError, SpecError
from planner.fqn import expand_patterns, fqn_matches
from planner.graph import OpGraph, OpKind
from planner.layouts import FIXED_STYLE_PRICER, ModelLayouts, check_plan_layout, module_info
from planner.models import ModelHandle, get_preset, handle_for_module, resolve_model
from planner.planning import make_plan
from planner.rehearse import rehearse
from planner.solve.layout import LayoutConstraints, Roofline
from planner.solve.program import solve_tp_layout
from planner.solve.search import Pins
from planner.spec import Cluster, ModelSpec, ModuleTP, Strategy, TPStyle, Training
from planner.tracing import trace_for_training
from tests.devices import write_tp_pays
from tests.user_models import GPT, SEQ, VOCAB, Block

pytest.importorskip("transformers")
from planner.hf import resolve_hf_config

TRAINING = Training(global_batch_size=8, seq_len=16, dtype="fp32")
H100 = Cluster(gpu="h100-sxm-80gb", num_gpus=4, gpus_per_node=4)
SLOW = Roofline(  # slow compute, fast link: sharding pays even for tiny layers
    peak_flops=1e9, memory_bandwidth_GBps=1, link_bandwidth_GBps=1e6, link_latency_us=0
)
LLAMA = ModelSpec(
    name="llama-kv4", family="llama", num_layers=2, hidden_size=64, num_heads=4,
    num_kv_heads=4, vocab_size=256, seq_len=16,
)  # fmt: skip
_DECODER = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 64,
}  # fmt: skip


def _hf(tmp_path: Path, model_type: str, **fields: object) -> str:
    path = tmp_path / model_type
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **_DECODER, **fields}))
    return str(path)


def _summary(graph: OpGraph, assignment) -> tuple[float, float, dict[tuple[str, bool], float]]:
    """Parameters per rank, tensor-core FLOPs per rank, collective bytes by (kind, backward)."""
    params = flops = 0.0
    comm: dict[tuple[str, bool], float] = {}
    for segment in graph.segments:
        seg_type, split = graph.segment_type(segment), assignment.segment(segment.type_id)
        params += sum(split.param_elements)
        flops += sum(
            (n.flops_fwd + n.flops_bwd) / d
            for n, d in zip(seg_type.nodes, split.work_divisor, strict=True)
            if n.kind in (OpKind.MATMUL, OpKind.ATTENTION)
        )
        for c in split.comms:
            comm[(c.kind.value, c.backward)] = comm.get((c.kind.value, c.backward), 0.0) + c.nbytes
    return params, flops, comm


_FORMULA_CASES = [
    *(
        (preset, tp, sp)
        for preset in ("tiny-gpt", "llama-kv4")
        for tp in (2, 4)
        for sp in (False, True)
    ),
    ("tiny-moe", 2, False),  # 2 key/value heads; sequence parallelism does not run through MoE
]


@pytest.mark.parametrize(("preset", "tp", "sequence_parallel"), _FORMULA_CASES)
def test_zoo_formula_prices_megatrons_solved_layout_exactly(preset, tp, sequence_parallel):
    """The zoo keeps its fast formula graph; Megatron's layout solved on the real trace
    gives the same parameters, tensor-core FLOPs and collective bytes per rank (a
    mixture of experts: routers and routed experts whole, shared experts as the FFN)."""
    spec = LLAMA if preset == "llama-kv4" else get_preset(preset)
    handle = resolve_model(preset) if preset != "llama-kv4" else _zoo(spec)
    training = TRAINING.model_copy(update={"seq_len": spec.seq_len})
    traced = trace_for_training(handle, training)
    formula = graph_from_spec(spec, seq_len=spec.seq_len, dtype=training.dtype)
    solved = ModelLayouts(handle, traced, FIXED_STYLE_PRICER).layout(tp, sequence_parallel)
    assert solved is not None
    by_rule = _summary(formula, megatron_assignment(formula, tp, sequence_parallel))
    by_ilp = _summary(traced, solved.assignment)
    assert by_rule[0] == by_ilp[0]
    assert by_rule[1] == pytest.approx(by_ilp[1])
    assert by_rule[2] == pytest.approx(by_ilp[2])


def _zoo(spec: ModelSpec):
    from planner.models import build, handle_for_module

    return handle_for_module(build(spec))


def test_a_pinned_tp_splits_the_blocks_even_where_keeping_them_whole_is_cheaper():
    """Case 1: a user module at tp 4 on H100s, where sharding its tiny layers does not pay:
    the pinned tp 4 still splits a weight of its blocks (the cheapest layout that does,
    priced as it runs), and the free search plans without tensor parallelism."""
    handle = resolve_model("tests.user_models:gpt")
    pinned = make_plan(handle, H100, TRAINING, pins=Pins(tp=4))
    assert pinned.strategy.tp == 4
    split = [p for p, m in pinned.tp_layout.items() if m.shards_parameters]
    assert split and all(p.startswith("transformer.h.*.") for p in split)
    free = make_plan(handle, H100, TRAINING)
    assert free.strategy.tp == 1
    assert free.prediction.step_time_s < pinned.prediction.step_time_s


def test_a_mask_handed_to_every_block_is_matched_not_converted():
    """A boolean mask sliced from a buffer between the blocks and handed to each: it
    carries no gradient, so the blocks' only converted input is the residual stream (two
    conversions at one block boundary once crashed the layout ILP, free search included)."""
    handle = resolve_model("tests.user_models:gpt_mask_buffer")
    pinned = make_plan(handle, H100, TRAINING, pins=Pins(tp=4))
    assert any(m.shards_parameters for m in pinned.tp_layout.values())
    assert make_plan(handle, H100, TRAINING).strategy.tp == 1


def test_tensor_parallel_prediction_holds_the_layouts_own_shards():
    """Where sharding pays, the prediction's parameters per rank are the layout's."""
    handle = resolve_model("tests.user_models:gpt")
    graph = trace_for_training(handle, TRAINING)
    layout = ModelLayouts(handle, graph, SLOW).layout(4, False)
    assert layout is not None and layout.shards_parameters
    priced = CostModel(graph, H100, TRAINING, tp_layouts=lambda tp, sp: layout.assignment)
    per_rank = priced.whole_model(Strategy(tp=4, micro_batch_size=8)).param_count
    expected = 0.0
    for fqn, module in handle.module.named_modules():
        entry = next((e for p, e in layout.modules.items() if fqn_matches(p, fqn)), None)
        for name, param in module.named_parameters(recurse=False):
            sharded = entry is not None and entry.params.get(name, "").startswith("Shard")
            expected += param.numel() / (4 if sharded else 1)
    assert per_rank == expected


def test_hand_written_sequence_parallel_norms_before_replicated_attention_are_refused():
    """Case 3: norms on a sequence shard, attention left whole and no gather declared:
    refused, naming the module, instead of training on a shard of the sequence."""
    handle = resolve_model("tiny-llama", device="cpu", seed=0)
    plan = make_plan(
        resolve_model("tiny-llama"), Cluster(gpu="h100-sxm-80gb", num_gpus=2), TRAINING,
        pins=Pins(tp=2, sequence_parallel=True),
    )  # fmt: skip
    layout = {fqn: module for fqn, module in plan.tp_layout.items() if "attention." not in fqn}
    norm = layout["layers.*.attention_norm"]
    layout["layers.*.attention_norm"] = norm.model_copy(
        update={"output": ("Shard(1)", "Shard(1)"), "output_dtensor": False}
    )
    edited = plan.model_copy(update={"tp_layout": layout})
    with pytest.raises(SpecError, match=r"'layers\.\*\.attention") as caught:
        check_plan_layout(edited, handle.module)
    assert "plan.tp_layout" in str(caught.value)


def test_fused_qkv_is_gathered_before_its_split_or_replicated():
    """Case 5: nanoGPT's ``c_attn`` output is split by the full width, so no layout hands
    on a column shard of it; its attention runs on whole heads (checked numerically in
    the matrix)."""
    handle = resolve_model("tests.user_models:gpt")
    graph = trace_for_training(handle, TRAINING)
    layouts = ModelLayouts(handle, graph, SLOW)
    for tp in (2, 4):
        for sp in (False, True):
            layout = layouts.layout(tp, sp)
            assert layout is not None
            c_attn = layout.modules["transformer.h.*.attn.c_attn"]
            assert c_attn.style is TPStyle.REPLICATE or c_attn.output[1] == "Replicate()"


def test_a_module_kept_whole_is_entered_whole_and_hands_on_a_sequence_shard():
    """nanoGPT's attention ends in an ``nn.Dropout``, which holds no parameter. Kept whole
    (its code cannot run on head shards), the region's own boundary gathers its input
    and slices its output to the sequence shard, so sequence parallelism still runs (it
    trains as one process: tests/test_runtime_numerics.py), and the plan's layout
    re-derives from the plan alone at parallelize time."""
    handle = resolve_model("tests.user_models:gpt")
    graph = trace_for_training(handle, TRAINING)
    kept = LayoutConstraints(replicated=frozenset({"transformer.h.*.attn"}))
    layout = solve_tp_layout(
        graph, tp=2, pricer=SLOW, sequence_parallel=True, info=module_info(handle.module),
        constraints=kept,
    )  # fmt: skip
    attn = layout.modules["transformer.h.*.attn"]
    assert attn.style is TPStyle.REPLICATE and attn.output == ("Replicate()", "Shard(1)")
    strategy = Strategy(tp=2, sequence_parallel=True, micro_batch_size=8)
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    plan = assemble_plan(handle, cluster, TRAINING, strategy, tp_layout=layout.modules)
    check_plan_layout(plan, resolve_model("tests.user_models:gpt", device="cpu", seed=0).module)


def test_a_module_without_example_inputs_is_checked_with_the_inputs_its_plan_traced(tmp_path):
    """``planner.parallelize`` re-traces the model to check a tensor-parallel plan: a module
    of your own that took its example inputs from its factory (no ``example_inputs``
    method) is traced with the inputs its plan recorded."""
    handle = resolve_model("tests.user_models:gpt")
    cluster = Cluster(gpu=str(write_tp_pays(tmp_path)), num_gpus=2)
    plan = make_plan(handle, cluster, TRAINING, pins=Pins(tp=2))
    assert [(i.dtype, i.shape) for i in plan.inputs] == [("int64", (1, 16))]
    torch.manual_seed(0)
    bare = GPT()
    bare.example_inputs = None  # type: ignore[assignment,method-assign]
    check_plan_layout(plan, bare)
    with pytest.raises(SpecError, match="gpt has no example inputs to be traced with"):
        check_plan_layout(plan.model_copy(update={"inputs": ()}), bare)


def test_tied_hugging_face_llama_is_planned_at_tp_2(tmp_path):
    """Case 4: the ILP places the shared embedding/head weight one way for both (it also
    runs and matches one process: tests/test_tp_matrix.py)."""
    path = _hf(tmp_path, "llama", tie_word_embeddings=True)
    handle = resolve_hf_config(path)
    cluster = Cluster(gpu=str(write_tp_pays(tmp_path)), num_gpus=2)
    plan = make_plan(handle, cluster, TRAINING, pins=Pins(tp=2))
    embed = plan.tp_layout["model.embed_tokens"].params.get("weight", "plain")
    head = plan.tp_layout["lm_head"].params.get("weight", "plain")
    assert embed == head
    check_plan_layout(plan, resolve_hf_config(path, device="cpu").module)


def test_tensor_parallelism_that_splits_kv_heads_is_refused_at_plan_time(tmp_path):
    handle = resolve_hf_config(_hf(tmp_path, "llama"))  # 4 heads, 2 key/value heads
    with pytest.raises(
        PlannerError,
        match=r"tp\(4\) does not divide the attention heads \(4 query and 2 key/value heads: "
        r"num_attention_heads and num_key_value_heads\); use tp in \[1, 2\]",
    ):
        make_plan(handle, H100, TRAINING, pins=Pins(tp=4))


class _PeeksAtLastBlock(GPT):
    """Reads its last block's tensor outside that block's forward."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + self.transformer.h[-1].ln_2.bias.sum() * 0


def _tp2_layout(model: GPT) -> tuple[ModelHandle, OpGraph, dict[str, ModuleTP]]:
    """The module's handle, trace and tensor-parallel layout at tp 2."""
    handle = handle_for_module(model)
    graph = trace_for_training(handle, TRAINING)
    layout = ModelLayouts(handle, graph, SLOW).layout(2, False)
    assert layout is not None
    return handle, graph, layout.modules


def _rehearsed_block_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records each run of a nanoGPT block on fake tensors (a rehearsal's, not a trace's)."""
    runs: list[int] = []
    forward = Block.forward

    def counted(self: Block, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, FakeTensor):
            runs.append(1)
        return forward(self, x)

    monkeypatch.setattr(Block, "forward", counted)
    return runs


def test_rehearsal_runs_one_block_of_each_kind(monkeypatch):
    """Blocks of one traced type under one layout run the same code on the same shapes:
    the rehearsal runs the first and hands its output on; a block the layout places
    differently is a kind of its own."""
    handle, graph, layout = _tp2_layout(GPT(n_layer=4))
    runs = _rehearsed_block_runs(monkeypatch)
    assert rehearse(handle, graph, layout, tp=2) is None
    assert len(runs) == 1
    names = [name for name, _ in handle.module.named_modules() if name]
    last_whole = {
        fqn: how
        for fqn, how in expand_patterns(layout, names).items()
        if not fqn.startswith("transformer.h.3.")
    }
    runs.clear()
    assert rehearse(handle, graph, last_whole, tp=2) is None
    assert len(runs) == 2


def test_a_rehearsal_failure_with_blocks_not_run_is_confirmed_by_running_them_all(monkeypatch):
    """A block not run keeps its tensors on meta: the model's own code reading one outside
    the block fails that short rehearsal, and the rehearsal of every block, which runs,
    is the answer."""
    handle, graph, layout = _tp2_layout(_PeeksAtLastBlock(n_layer=4))
    runs = _rehearsed_block_runs(monkeypatch)
    assert rehearse(handle, graph, layout, tp=2) is None
    assert len(runs) == 1 + 4


def test_sequence_parallelism_ends_where_the_models_own_code_needs_the_whole_sequence(
    tmp_path,
):
    """GPT-2 reshapes its output to the whole sequence after the last block: the rehearsal
    finds it, and the sequence-parallel region ends at the last block's output."""
    path = tmp_path / "gpt2"
    path.mkdir()
    config = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}
    (path / "config.json").write_text(json.dumps(config))
    handle = resolve_hf_config(path)
    layout = ModelLayouts(handle, trace_for_training(handle, TRAINING), SLOW).layout(2, True)
    assert layout is not None
    assert layout.modules["transformer.h.1"].output == ("Shard(1)", "Replicate()")


def test_sequence_parallelism_is_not_offered_where_no_module_can_reshard(tmp_path):
    """Mixtral's mixture-of-experts block returns a whole sequence and holds no parameter
    of its own to re-shard at: sequence parallelism is refused, saying so."""
    handle = resolve_hf_config(_hf(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2))
    layouts = ModelLayouts(handle, trace_for_training(handle, TRAINING), SLOW)
    assert layouts.layout(2, True) is None
    assert "residual stream sharded" in (layouts.why_not(2, True) or "")


def test_sequence_parallelism_is_not_offered_where_the_model_modifies_a_moved_tensor(tmp_path):
    """Falcon adds attention to its MLP's output in place: a boundary that moves that
    output hands it on as a view of DTensor.to_local(), which autograd will not let it
    modify; the rehearsal meets the same error and sequence parallelism is refused."""
    fields = {"num_kv_heads": 2, "new_decoder_architecture": True, "bias": False}
    handle = resolve_hf_config(_hf(tmp_path, "falcon", **fields))
    layouts = ModelLayouts(handle, trace_for_training(handle, TRAINING), SLOW)
    assert layouts.layout(2, True) is None
    why = layouts.why_not(2, True) or ""
    assert "modifies in place a tensor the layout moved" in why and "--no-sequence-parallel" in why
    assert layouts.layout(2, False) is not None


def test_plan_carries_each_modules_placements_and_explain_shows_them(capsys):
    from rich.console import Console

    from planner.cli.render import render_plan

    plan = make_plan(
        resolve_model("tiny-llama"), Cluster(gpu="h100-sxm-80gb", num_gpus=2), TRAINING,
        pins=Pins(tp=2, sequence_parallel=True),
    )  # fmt: skip
    wo = plan.tp_layout["layers.*.attention.wo"]
    assert wo == ModuleTP(
        style="rowwise", params={"weight": "Shard(1)"}, input=("Shard(-1)", "Shard(-1)"),
        output=("Partial()", "Shard(1)"),
    )  # fmt: skip
    assert plan.loss_parallel
    render_plan(plan, Console(width=120))
    shown = capsys.readouterr().out
    assert "Tensor-parallel layout (tp=2" in shown
    assert "row-parallel; weight Shard(1); out Partial() -> Shard(1)" in shown


@pytest.mark.parametrize("gpu", ["a100-sxm-40gb", "mi300x"])
def test_zoo_plan_layout_does_not_depend_on_the_cluster(gpu):
    """A zoo plan's layout is Megatron's as ``assemble_plan`` writes it, on any cluster."""
    from planner.assemble import megatron_layout

    handle = resolve_model("tiny-llama")
    cluster = Cluster(gpu=gpu, num_gpus=4, gpus_per_node=4)
    plan = make_plan(handle, cluster, TRAINING, pins=Pins(tp=2, sequence_parallel=True))
    assert plan.tp_layout == megatron_layout(handle, plan.training, plan.strategy)


def test_a_pinned_tp_over_modules_torch_cannot_split_names_them(tmp_path):
    """GPT-2's blocks hold their matrices in ``Conv1D`` modules, which torch's
    tensor-parallel styles do not split: a pinned tp is refused naming them."""
    path = tmp_path / "gpt2"
    path.mkdir()
    config = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlannerError, match=r"matrices are in Conv1D modules, and torch's"):
        make_plan(resolve_hf_config(str(path)), H100, TRAINING, pins=Pins(tp=2))


class _EncoderLM(torch.nn.Module):
    """Blocks of ``nn.TransformerEncoderLayer``: its ``MultiheadAttention`` hands on a
    tuple, and its MLP is two ``nn.Linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            for _ in range(2)
        )
        self.out = torch.nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        return (torch.zeros(batch_size, 8, dtype=torch.long),)


def test_a_tp_pin_refused_after_its_layouts_failed_says_which_module_failed(
    tmp_path: Path,
) -> None:
    """Not "its blocks' matrices are in MultiheadAttention modules": the MLP's
    ``nn.Linear`` split too, and the run of that layout failed on the attention."""
    handle = handle_for_module(_EncoderLM())
    training = Training(global_batch_size=4, seq_len=8, dtype="fp32")
    cluster = Cluster(gpu=str(write_tp_pays(tmp_path)), num_gpus=2)
    with pytest.raises(SpecError) as refused:
        make_plan(handle, cluster, training, pins=Pins(tp=2))
    assert (
        "no layout at tp 2 splits a weight of the model's blocks (the layouts that do failed "
        "when run: module 'layers.0.self_attn': its output is not a tensor"
    ) in str(refused.value)


class _DrawingGPT(GPT):
    """nanoGPT with dropout whose example inputs are drawn at random."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + self.drop(torch.zeros(()))

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def test_checking_a_plan_on_one_rank_leaves_its_random_state_as_the_others(tmp_path):
    """``planner.parallelize`` checks a tensor-parallel layout on the first rank alone; the
    check draws the module's example inputs and traces and rehearses its dropout, yet
    that rank's random stream is left where its peers' are, so tp ranks seeded alike
    before the call still drop alike."""
    cluster = Cluster(gpu=str(write_tp_pays(tmp_path)), num_gpus=2)
    plan = make_plan(handle_for_module(_DrawingGPT()), cluster, TRAINING, pins=Pins(tp=2))
    torch.manual_seed(0)
    model = _DrawingGPT()
    before = torch.get_rng_state()
    check_plan_layout(plan, model)
    assert torch.equal(torch.get_rng_state(), before)
