"""Mixture-of-experts and latent-attention models: presets, the zoo's latent attention,
the tracer's router/experts/shared-experts marks, the formula graph against the trace,
and Hugging Face Mixtral, Qwen3-MoE and DeepSeek-V3 configs."""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.cli import main
from planner.cost import graph_from_spec
from planner.errors import SpecError, TraceError
from planner.graph import OpKind, OpRole
from planner.models import build, resolve_model
from planner.models.moe import Experts, MoE
from planner.models.transformer import LatentAttention
from planner.presets import PRESETS, get_preset
from planner.spec import ModelSpec
from planner.tracing import trace
from planner.tracing.roles import moe_facts

TENSOR_CORE = (OpKind.MATMUL, OpKind.ATTENTION, OpKind.CONV)
TINY_MLA = ModelSpec(
    name="tiny-mla", family="llama", num_layers=3, hidden_size=64, num_heads=4, vocab_size=256,
    seq_len=32, num_experts=8, top_k=2, moe_ffn_hidden_size=32, num_shared_experts=1,
    dense_layers=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=16,
)  # fmt: skip
NO_Q_LORA = ModelSpec.model_validate({**TINY_MLA.model_dump(), "q_lora_rank": None})
# Qwen3-MoE's shape: heads wider than hidden / heads (4 x 24 query features on 64),
# each query and key head RMS-normalised
TINY_QWEN3 = ModelSpec.model_validate(
    {**get_preset("tiny-moe").model_dump(), "name": "tiny-qwen3", "head_dim": 24, "qk_norm": True}
)

# (total, active) parameters as published, in billions, and the tolerance the preset
# keeps (the published figures are rounded: Qwen3-30B-A3B's active 3.35B is "3.3B").
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9, 0.01),
    "mixtral-8x22b": (141.0, 39.0, 0.01),
    "deepseek-v3": (671.0, 37.0, 0.02),  # without its multi-token-prediction module
    "olmoe-1b-7b": (6.9, 1.3, 0.02),
    "qwen3-30b-a3b": (30.5, 3.3, 0.02),
    "qwen3-235b-a22b": (235.0, 22.0, 0.01),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_presets_have_the_published_total_and_active_parameters(name):
    total, active, tolerance = PUBLISHED[name]
    spec = get_preset(name)
    assert spec.num_params() / 1e9 == pytest.approx(total, rel=tolerance)
    assert spec.active_params() / 1e9 == pytest.approx(active, rel=tolerance)
    assert spec.active_params() < spec.num_params()


def test_deepseek_v3_preset_is_the_published_layout():
    spec = get_preset("deepseek-v3")
    assert spec.latent_attention and spec.moe
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    assert (spec.num_experts, spec.top_k, spec.num_shared_experts) == (256, 8, 1)
    assert (spec.expert_ffn_size, spec.ffn_size) == (2048, 18432)


def test_plan_models_lists_total_and_active_parameters(capsys):
    assert main(["models"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["deepseek-v3"][2:4] == ["671.03B", "37.55B"]
    assert rows["mixtral-8x7b"][2:4] == ["46.70B", "12.88B"]
    assert "256+1/top8" in rows["deepseek-v3"] and "-" in rows["llama3-8b"]


# ---- multi-head latent attention --------------------------------------------------------


@pytest.mark.parametrize("spec", [TINY_MLA, NO_Q_LORA], ids=["q_lora", "direct_q"])
def test_latent_attention_builds_the_parameters_the_spec_counts(spec):
    model = build(spec, device="cpu", seed=0)
    assert isinstance(model.layers["0"].attention, LatentAttention)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    names = {n for n, _ in model.layers["0"].attention.named_parameters()}
    expected = {"wkv_a.weight", "kv_norm.weight", "wkv_b.weight", "wo.weight"}
    expected |= (
        {"wq_a.weight", "q_norm.weight", "wq_b.weight"} if spec.q_lora_rank else {"wq.weight"}
    )
    assert names == expected


def test_latent_attention_is_causal_with_values_narrower_than_keys():
    torch.manual_seed(0)
    attention = LatentAttention(TINY_MLA)
    x = torch.randn(2, 10, 64)
    changed = x.clone()
    changed[:, 6:] = torch.randn(2, 4, 64)
    out, out_changed = attention(x), attention(changed)
    assert out.shape == x.shape
    torch.testing.assert_close(out[:, :6], out_changed[:, :6])
    assert not torch.allclose(out[:, 6:], out_changed[:, 6:])


def _shard_heads(attention: LatentAttention, rank: int, ranks: int) -> LatentAttention:
    """A copy holding heads ``rank`` of ``ranks``: column shards of the query and
    key/value up-projections, a row shard of ``wo`` (Megatron's attention layout)."""
    local = LatentAttention.__new__(LatentAttention)
    nn.Module.__init__(local)
    local.__dict__.update({k: v for k, v in attention.__dict__.items() if k[0] != "_"})
    for name, child in attention.named_children():
        local.add_module(name, child)
    q_name = "wq" if attention.wq is not None else "wq_b"
    for name, dim in ((q_name, 0), ("wkv_b", 0), ("wo", 1)):
        weight = getattr(attention, name).weight
        size = weight.shape[dim] // ranks
        piece = weight.narrow(dim, rank * size, size)
        linear = nn.Linear(piece.shape[1], piece.shape[0], bias=False)
        linear.weight = nn.Parameter(piece.detach().clone())
        local.add_module(name, linear)
    return local


@pytest.mark.parametrize("spec", [TINY_MLA, NO_Q_LORA], ids=["q_lora", "direct_q"])
def test_latent_attention_takes_its_heads_from_local_shapes(spec):
    """Column-sharded up-projections and a row-sharded ``wo`` sum to the whole (TP 2)."""
    torch.manual_seed(0)
    attention = LatentAttention(spec)
    x = torch.randn(2, 8, 64)
    partial = sum(_shard_heads(attention, rank, 2)(x) for rank in range(2))
    torch.testing.assert_close(partial, attention(x), rtol=1e-5, atol=1e-5)


# ---- tracer marks -----------------------------------------------------------------------


def _role_totals(graph):
    """Per role: tensor-core forward FLOPs, parameters, saved bytes, summed over segments."""
    totals = defaultdict(lambda: [0.0, 0, 0.0])
    for segment in graph.segments:
        for node in graph.segment_type(segment).nodes:
            row = totals[node.role]
            row[0] += node.flops_fwd if node.kind in TENSOR_CORE else 0.0
            row[1] += node.param_count
            row[2] += node.saved_bytes
    return totals


def _moe_type(graph):
    (moe,) = {graph.segment_type(s) for s in graph.blocks if graph.segment_type(s).num_experts}
    return moe


def test_trace_marks_router_experts_and_shared_experts(caplog):
    spec = get_preset("tiny-moe")
    with caplog.at_level(logging.WARNING):
        graph = trace(resolve_model("tiny-moe"), seq_len=32)
    assert "no pricing rule" not in caplog.text  # argsort, topk, pad are priced
    moe = _moe_type(graph)
    assert (moe.num_experts, moe.top_k, moe.hidden_size) == (8, 2, 64)
    dense = graph.segment_type(graph.blocks[0])
    assert (dense.num_experts, dense.top_k, dense.hidden_size) == (0, 0, 0)
    assert {graph.segment_type(s).type_id for s in graph.blocks[1:]} == {moe.type_id}
    for node in moe.nodes:
        expected = {
            "feed_forward.router": OpRole.ROUTER, "feed_forward.experts": OpRole.EXPERTS,
            "feed_forward.shared_experts": OpRole.SHARED_EXPERTS,
        }  # fmt: skip
        prefix = next((p for p in expected if node.module.startswith(p)), None)
        assert node.role is expected.get(prefix, OpRole.NONE), node
    grouped = [n for n in moe.nodes if n.role is OpRole.EXPERTS and n.kind is OpKind.MATMUL]
    assert [n.gemm for n in grouped] == [(8, 64, 8, 64), (8, 64, 8, 32)]  # 32 * 2 / 8 rows
    e, h, f = spec.num_experts, spec.hidden_size, spec.expert_ffn_size
    totals = _role_totals(graph)
    assert totals[OpRole.EXPERTS][1] == 3 * (spec.num_layers - spec.dense_layers) * e * h * f
    assert all(
        n.role is OpRole.NONE for s in graph.segments[:1] for n in graph.segment_type(s).nodes
    )


def test_moe_facts_refuse_a_layer_without_top_k():
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = MoE(16, 8, num_experts=4, top_k=2).experts

    assert moe_facts(MoE(16, 8, num_experts=4, top_k=2)) == (4, 2, 16)
    with pytest.raises(SpecError, match="top_k"):
        moe_facts(nn.Sequential(Bare()), "layers.0")


# ---- formula graph against the trace ----------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [get_preset("tiny-moe"), TINY_MLA, TINY_QWEN3],
    ids=["tiny-moe", "tiny-mla", "wide-heads"],
)
def test_formula_graph_prices_moe_and_latent_attention_like_the_trace(spec):
    seq = 48  # 48 * 2 / 8 = 12 rows per expert
    traced, formula = trace(resolve_model(spec), seq_len=seq), graph_from_spec(spec, seq_len=seq)
    assert [s.modules for s in formula.segments] == [s.modules for s in traced.segments]
    facts = [
        (t.num_experts, t.top_k, t.hidden_size)
        for graph in (traced, formula)
        for t in (graph.segment_type(s) for s in graph.blocks)
    ]
    assert facts[: spec.num_layers] == facts[spec.num_layers :]
    assert formula.param_count == traced.param_count == spec.num_params()
    traced_roles, formula_roles = _role_totals(traced), _role_totals(formula)
    # latent attention's up-projections are marked on formula graphs only (for Megatron's
    # mla_up_proj recompute): the trace counts them with the unmarked operators
    up = formula_roles.pop(OpRole.LATENT_UP, [0.0, 0, 0.0])
    assert (up[1] > 0) is spec.latent_attention
    formula_roles[OpRole.NONE] = [
        a + b for a, b in zip(formula_roles[OpRole.NONE], up, strict=True)
    ]
    marked = set(OpRole) - {OpRole.LATENT_UP}
    assert set(formula_roles) == set(traced_roles) == marked
    for role in marked:
        flops, params, saved = formula_roles[role]
        assert flops == pytest.approx(traced_roles[role][0], rel=1e-9), role
        assert params == traced_roles[role][1], role
        if role in (OpRole.EXPERTS, OpRole.SHARED_EXPERTS):
            assert saved == traced_roles[role][2], role
    # the router's input is kept by the norm in the formula, by the router in the trace
    assert formula.total("saved_bytes") == pytest.approx(traced.total("saved_bytes"), rel=0.25)
    expert_gemms = [
        [n.gemm for n in graph.segment_type(graph.blocks[-1]).nodes if n.role is OpRole.EXPERTS
         and n.kind is OpKind.MATMUL]
        for graph in (traced, formula)
    ]  # fmt: skip
    assert expert_gemms[0] == expert_gemms[1] == [(8, 64, 12, 64), (8, 64, 12, 32)]


def test_formula_graph_of_deepseek_v3_is_fast_and_complete():
    spec = PRESETS["deepseek-v3"]
    start = time.perf_counter()
    graph = graph_from_spec(spec)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.05
    assert graph.param_count == spec.num_params()
    assert [graph.segment_type(s).num_experts for s in graph.blocks[2:5]] == [0, 256, 256]
    attention = next(n for n in graph.types["moe_block"].nodes if n.kind is OpKind.ATTENTION)
    assert attention.gemm == (128, 4096, 4096, 192)
    assert attention.flops_fwd == 2.0 * 128 * 4096 * 4096 * (192 + 128)


def test_deepseek_v3_traces_at_full_size_on_meta():
    graph = trace(resolve_model("deepseek-v3", seq_len=64), seq_len=64)
    moe = _moe_type(graph)
    assert (moe.num_experts, moe.top_k, moe.hidden_size) == (256, 8, 7168)
    assert graph.param_count == PRESETS["deepseek-v3"].num_params()
    assert len({s.type_id for s in graph.blocks}) == 2


# ---- Hugging Face configs ---------------------------------------------------------------

_HF_BASE = {
    "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
}  # fmt: skip
HF_MOE = {
    "mixtral": {"intermediate_size": 32, "num_local_experts": 8},
    "qwen3_moe": {"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
                  "head_dim": 16, "decoder_sparse_step": 1, "mlp_only_layers": [0]},
    "deepseek_v3": {"intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 24,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                    "v_head_dim": 16, "n_group": 2, "topk_group": 1, "num_key_value_heads": 4,
                    "rope_scaling": None},
}  # fmt: skip
# (MoE layers, layers with shared experts) of each config above
HF_LAYERS = {"mixtral": (3, 0), "qwen3_moe": (2, 0), "deepseek_v3": (2, 2)}


def _hf_config(tmp_path, model_type: str) -> str:
    path = tmp_path / model_type
    path.mkdir()
    fields = {"model_type": model_type, **_HF_BASE, **HF_MOE[model_type]}
    (path / "config.json").write_text(json.dumps(fields))
    return str(path)


@pytest.mark.parametrize(
    "model_type",
    [
        "mixtral", "deepseek_v3",  # the fast lane: one per experts layout
        pytest.param("qwen3_moe", marks=pytest.mark.slow),  # Mixtral's layout, Qwen's names
    ],
)  # fmt: skip
def test_hf_moe_configs_trace_with_the_marks(tmp_path, model_type):
    pytest.importorskip("transformers")
    from planner.hf import resolve_hf_config

    graph = trace(resolve_hf_config(_hf_config(tmp_path, model_type)), seq_len=16)
    moe_layers, shared_layers = HF_LAYERS[model_type]
    moe = _moe_type(graph)
    assert (moe.num_experts, moe.top_k, moe.hidden_size) == (8, 2, 64)
    assert sum(graph.segment_type(s).num_experts > 0 for s in graph.blocks) == moe_layers
    totals = _role_totals(graph)
    assert totals[OpRole.ROUTER][1] == moe_layers * 8 * 64
    assert totals[OpRole.EXPERTS][1] == moe_layers * 8 * 3 * 64 * 32
    assert totals[OpRole.SHARED_EXPERTS][1] == shared_layers * 3 * 64 * 32
    # every routed pair computed once: 16 tokens x 2 experts through 3 * 64 * 32 weights
    assert totals[OpRole.EXPERTS][0] == moe_layers * 2 * 16 * 2 * 3 * 64 * 32
    grouped = [n.gemm for n in moe.nodes if n.role is OpRole.EXPERTS and n.kind is OpKind.MATMUL]
    assert grouped == [(8, 64, 4, 64), (8, 64, 4, 32)]


def test_a_config_whose_sizes_disagree_is_named_not_blamed_on_tracing(tmp_path):
    """DeepSeek-V3's latent attention keeps a key and value per query head: a config
    with fewer key/value heads (copied from a dense model) fails in transformers' own
    forward, and the error says so and where, not how to make a forward traceable."""
    pytest.importorskip("transformers")
    from planner.hf import resolve_hf_config

    path = Path(_hf_config(tmp_path, "deepseek_v3"), "config.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_key_value_heads": 2}))
    with pytest.raises(
        TraceError, match=r"deepseek_v3: its forward fails \(RuntimeError: .*\) in "
    ):
        trace(resolve_hf_config(path.parent), seq_len=16)


def test_hf_experts_in_another_layout_are_refused_naming_the_field(tmp_path):
    pytest.importorskip("transformers")
    from planner.hf import expected_load_experts, resolve_hf_config

    handle = resolve_hf_config(_hf_config(tmp_path, "mixtral"), device="cpu")
    experts = handle.module.get_submodule("model.layers.0.mlp.experts")
    experts.is_concatenated = False
    with pytest.raises(SpecError, match="is_concatenated=False"):
        expected_load_experts(handle.module, model_type="mixtral")


def test_hf_safetensors_refuse_what_mixtral_and_llama_lack_naming_the_field():
    from planner.models.hf_layout import check_hf_layout, hf_llama_config

    check_hf_layout(get_preset("tiny-moe"))  # experts export under Mixtral's names
    with pytest.raises(SpecError, match="num_shared_experts=1"):
        hf_llama_config(get_preset("tiny-moe"))
    dense_mla = ModelSpec.model_validate(
        {**TINY_MLA.model_dump(), "num_experts": 0, "top_k": 0, "moe_ffn_hidden_size": None,
         "num_shared_experts": 0, "dense_layers": 0}
    )  # fmt: skip
    with pytest.raises(SpecError, match="kv_lora_rank=16"):
        check_hf_layout(dense_mla)


def _backward_nodes(output: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind ``output``."""
    seen, todo, names = set(), [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_experts_backward_makes_one_gradient_per_grouped_weight():
    """The experts unbind their grouped weights once. Indexed per expert, backward wrote a
    zero-filled gradient of the whole grouped weight for every expert: OLMoE 1B-7B (64
    experts) ran 19x slower than priced on an H200 (benchmarks/data/h200)."""
    torch.manual_seed(0)
    experts = Experts(8, 16, 8)
    out = experts(torch.randn(12, 16), torch.randint(0, 8, (12, 2)), torch.rand(12, 2))
    names = _backward_nodes(out)
    assert "UnbindBackward0" in names
    assert "SelectBackward0" not in names


def test_tensor_parallel_experts_plan_without_sequence_parallelism_here() -> None:
    """This runtime's token dispatch cannot run on a sequence shard: a zoo MoE pinned to
    tp 2 is planned without sequence parallelism, and pinning it says why (not an ILP's
    internal error); Megatron-LM, which routes each rank's shard, keeps it with its own
    layout."""
    from planner.planning import make_plan
    from planner.solve.search import Pins
    from planner.spec import Cluster, Training

    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=8)
    training = Training(global_batch_size=16, seq_len=256)
    handle = resolve_model("tiny-moe")
    plan = make_plan(handle, cluster, training, pins=Pins(tp=2))
    assert plan.strategy.tp == 2 and not plan.strategy.sequence_parallel and plan.tp_layout
    with pytest.raises(SpecError, match=r"sequence parallelism at tp\(2\): no layout keeps"):
        make_plan(handle, cluster, training, pins=Pins(tp=2, sequence_parallel=True))
    pins = Pins(tp=2, sequence_parallel=True, ep=1)
    megatron = make_plan(handle, cluster, training, pins=pins, target="megatron")
    assert megatron.strategy.sequence_parallel and not megatron.tp_layout


def test_a_hugging_face_moe_built_for_pricing_routes_as_trained_once_materialised(tmp_path):
    """plan run and plan measure build the model on meta, where its experts price the
    expected load; materialised, they must route each token as transformers does (the
    static dispatch trained a model whose losses depended on the batch: 5.3e-4 off one
    process at dp 2)."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from planner.hf import resolve_hf_config

    path = _hf_config(tmp_path, "mixtral")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    priced = resolve_hf_config(path).module.to_empty(device="cpu")
    priced.load_state_dict(reference.state_dict())
    for (_, mine), (_, theirs) in zip(
        priced.named_buffers(), reference.named_buffers(), strict=True
    ):
        mine.copy_(theirs)  # non-persistent ones too: the rotary frequencies
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(priced(tokens).logits, reference(tokens).logits)
        alone = priced(tokens[:1]).logits  # a sequence's output does not depend on the batch
    assert torch.allclose(alone, reference(tokens).logits[:1], atol=1e-6)
