"""What a framework's kernels keep for backward, and Megatron-Core's fine-grained recompute.

Formula graphs default to the zoo's eager PyTorch (as traced); ``Kernels`` (from the
cost options ``fused_norm_swiglu``, ``gqa_native``, ``moe_probs_in_activation``) give
Megatron-Core's: fused norms and SwiGLU, grouped K/V read as they are, routing
probabilities applied in the experts' activation. ``selective="modules"`` recomputes
Megatron's ``--recompute-modules`` (core_attn, layernorm, moe_act, mla_up_proj).
"""

import pytest
from pydantic import ValidationError

from planner.calibrate import measured_run_options
from planner.cost import CostModel, CostOptions, graph_from_spec
from planner.cost.build import spec_graph
from planner.cost.options import OptimizerImpl, SelectivePolicy, device_options
from planner.cost.spec_graph import Kernels
from planner.frameworks import KERNELS, Framework, framework_options
from planner.graph import OpKind, OpRole
from planner.hardware import load_profile
from planner.spec import Cluster, Family, ModelSpec, RecomputeMode, Strategy, Training

T, H, HEADS, KV, F = 64, 128, 8, 2, 256  # tokens, hidden, heads, kv heads, ffn
E = 2  # bf16 bytes
LLAMA = ModelSpec(
    name="gqa-llama", family=Family.LLAMA, num_layers=2, hidden_size=H, num_heads=HEADS,
    num_kv_heads=KV, ffn_hidden_size=F, vocab_size=256, seq_len=T,
)  # fmt: skip
MOE = LLAMA.model_copy(
    update={"name": "tiny-moe-gqa", "num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 64}
)


def _kept(graph, type_id: str, module: str) -> float:
    """Bytes the nodes of ``module`` in segment type ``type_id`` keep for backward."""
    return sum(n.saved_bytes for n in graph.types[type_id].nodes if n.module == module)


def test_fused_norms_keep_input_and_output_eager_ones_also_their_fp32_steps():
    eager = graph_from_spec(LLAMA)
    fused = graph_from_spec(LLAMA, kernels=Kernels(fused_norm_swiglu=True))
    assert _kept(eager, "block", "attention_norm") == T * H * (4 + 2 + 2)
    assert _kept(fused, "block", "attention_norm") == T * H * (2 + 2)


def test_fused_swiglu_keeps_its_two_inputs_not_silus_output():
    def ffn(graph):
        return _kept(graph, "block", "feed_forward")  # silu and product (w2 keeps its input)

    assert ffn(graph_from_spec(LLAMA)) == T * F * E * 3
    assert ffn(graph_from_spec(LLAMA, kernels=Kernels(fused_norm_swiglu=True))) == T * F * E * 2


def test_native_gqa_attention_keeps_keys_and_values_at_their_own_heads():
    head = H // HEADS

    def attention(graph):
        return next(n for n in graph.types["block"].nodes if n.kind is OpKind.ATTENTION)

    repeated, native = (
        graph_from_spec(LLAMA),
        graph_from_spec(LLAMA, kernels=Kernels(gqa_native=True)),
    )
    assert attention(repeated).saved_bytes == T * head * 3 * HEADS * E
    assert attention(native).saved_bytes == T * head * (HEADS + 2 * KV) * E
    assert attention(native).flops_fwd == attention(repeated).flops_fwd
    assert not any("repeat_kv" in n.name for n in native.types["block"].nodes)


def test_probabilities_in_the_activation_free_the_weighted_expert_outputs():
    pairs = T * MOE.top_k
    eager, megatron = (
        graph_from_spec(MOE),
        graph_from_spec(MOE, kernels=Kernels(moe_probs_in_activation=True)),
    )
    by_name = [
        {n.name: n.saved_bytes for n in g.types["moe_block"].nodes} for g in (eager, megatron)
    ]
    assert by_name[0]["combine_mul"] == pairs * H * E + pairs * E
    assert by_name[1]["combine_mul"] == 0
    assert by_name[1]["mul"] == by_name[0]["mul"] + pairs * E  # the probabilities, kept
    assert eager.total("flops_fwd") == megatron.total("flops_fwd")


def test_cost_options_choose_the_kernels_of_the_formula_graph():
    training = Training(global_batch_size=1)
    default = spec_graph(MOE, training)
    megatron = spec_graph(MOE, training, CostOptions(**KERNELS[Framework.MEGATRON]))
    assert default.total("saved_bytes") == graph_from_spec(MOE).total("saved_bytes")
    assert megatron.total("saved_bytes") < default.total("saved_bytes")


def test_a_megatron_target_prices_its_kernels_unless_the_options_say_otherwise():
    given = CostOptions(gqa_native=False, dropout=True)
    chosen = framework_options(Framework.MEGATRON, given)
    assert not chosen.gqa_native and chosen.dropout  # what the user set stays
    assert chosen.fused_norm_swiglu and chosen.moe_probs_in_activation
    titan = framework_options(Framework.TORCHTITAN, given)  # fused AdamW, per-op SAC, DDP
    kernels = {"optimizer_impl": OptimizerImpl.FUSED, "selective": SelectivePolicy.OP,
               "ddp_no_sync": False}  # fmt: skip
    assert titan == given.model_copy(update=kernels)


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_this_runtime_is_searched_and_compared_with_its_own_selective_recompute(device):
    """strategies.checkpointing keeps every matmul output: the search for this runtime
    and ``plan compare``/calibration (measured_run_options) price that, not Megatron's
    attention core; an explicit choice stays."""
    profile = load_profile("h200-sxm-141gb" if device == "gpu" else "a100-sxm-80gb")
    profile = profile.model_copy(update={"device_kind": device})
    searched = framework_options(Framework.PLANNER, device_options(device))
    for options in (searched, measured_run_options(profile)):
        assert options.selective is SelectivePolicy.MATMULS
    chosen = framework_options(Framework.PLANNER, CostOptions(selective="attention"))
    assert chosen.selective is SelectivePolicy.ATTENTION


def _block(graph, options: CostOptions, mode: RecomputeMode):
    """The first block's cost (one micro-batch, one GPU) and its segment type."""
    model = CostModel(graph, Cluster(gpu="h100-sxm-80gb", num_gpus=1), Training(global_batch_size=1),
                      options=options)  # fmt: skip
    costs = model.segment_costs(Strategy(recompute=mode, micro_batch_size=1))
    return next(c for c in costs if c.kind == "block"), graph.types[graph.segments[1].type_id]


def _modules(*names: str) -> CostOptions:
    return CostOptions(selective="modules", recompute_modules=names)


def test_layernorm_recompute_keeps_only_the_block_norms_inputs():
    graph = graph_from_spec(MOE, kernels=Kernels(fused_norm_swiglu=True))
    none, seg = _block(graph, CostOptions(), RecomputeMode.NONE)
    norms, _ = _block(graph, _modules("layernorm"), RecomputeMode.SELECTIVE)
    assert {n.module for n in seg.nodes if n.kind is OpKind.NORM} == {"attention_norm", "ffn_norm"}
    # each of the two block norms keeps its input (T x H) instead of input and output
    assert none.activation_bytes - norms.activation_bytes == pytest.approx(2 * T * H * E)
    assert norms.recompute_s > 0


def test_moe_act_recompute_drops_the_second_expert_gemms_input():
    graph = graph_from_spec(MOE)
    none, seg = _block(graph, CostOptions(), RecomputeMode.NONE)
    act, _ = _block(graph, _modules("moe_act"), RecomputeMode.SELECTIVE)
    down = [n for n in seg.nodes if n.role is OpRole.EXPERTS and n.kind is OpKind.MATMUL][-1]
    assert none.activation_bytes - act.activation_bytes == pytest.approx(down.saved_bytes)
    assert 0 < act.recompute_s < none.forward_s


def test_core_attn_module_is_megatrons_default_selective_recompute():
    graph = graph_from_spec(LLAMA)
    attention, _ = _block(graph, CostOptions(), RecomputeMode.SELECTIVE)
    module, _ = _block(graph, _modules("core_attn"), RecomputeMode.SELECTIVE)
    assert (module.activation_bytes, module.recompute_s) == (
        attention.activation_bytes, attention.recompute_s,
    )  # fmt: skip


def test_mlp_and_shared_experts_recompute_checkpoint_their_module_whole():
    """Megatron-Core's ``mlp`` recomputes a dense block's feed-forward and
    ``shared_experts`` the shared experts, each keeping only its input; a block with
    routed experts has no dense MLP."""
    graph = graph_from_spec(LLAMA)
    none, seg = _block(graph, CostOptions(), RecomputeMode.NONE)
    mlp, _ = _block(graph, _modules("mlp"), RecomputeMode.SELECTIVE)
    ff = [n for n in seg.nodes if n.module.split(".")[0] == "feed_forward"]
    dropped = sum(n.saved_bytes for n in ff) - ff[0].input_bytes
    assert none.activation_bytes - mlp.activation_bytes == pytest.approx(dropped)
    assert 0 < mlp.recompute_s < none.forward_s
    shared = MOE.model_copy(update={"num_shared_experts": 1})
    moe_graph = graph_from_spec(shared)
    routed, moe_seg = _block(moe_graph, _modules("mlp"), RecomputeMode.SELECTIVE)
    assert routed.recompute_s == 0  # no dense MLP in a block with experts
    moe_none, _ = _block(moe_graph, CostOptions(), RecomputeMode.NONE)
    kept, _ = _block(moe_graph, _modules("shared_experts"), RecomputeMode.SELECTIVE)
    members = [n for n in moe_seg.nodes if n.role is OpRole.SHARED_EXPERTS]
    dropped = sum(n.saved_bytes for n in members) - members[0].input_bytes
    assert moe_none.activation_bytes - kept.activation_bytes == pytest.approx(dropped)
    assert kept.recompute_s > 0


def test_an_unknown_recompute_module_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="recompute_modules"):
        CostOptions(selective="modules", recompute_modules=("moe",))


def test_mla_up_proj_recompute_keeps_the_latents_not_queries_keys_and_values():
    from tests.test_export import TINY_MLA as spec

    graph = graph_from_spec(spec, kernels=Kernels(fused_norm_swiglu=True))
    none, seg = _block(graph, CostOptions(), RecomputeMode.NONE)
    up, _ = _block(graph, _modules("mla_up_proj"), RecomputeMode.SELECTIVE)
    attention = next(n for n in seg.nodes if n.kind is OpKind.ATTENTION)
    norms = {n.module for n in seg.nodes if n.role is OpRole.LATENT_UP and n.kind is OpKind.NORM}
    assert norms == {"attention.q_norm", "attention.kv_norm"}
    t = attention.gemm[1]  # tokens
    latents = t * (spec.q_lora_rank + spec.kv_lora_rank) * E  # each norm keeps its output no more
    assert none.activation_bytes - up.activation_bytes == pytest.approx(
        attention.saved_bytes + latents
    )
    assert 0 < up.recompute_s < none.forward_s


def test_mla_up_proj_on_a_model_without_latent_attention_is_refused():
    from planner.cost import RunConfig
    from planner.errors import SpecError

    run = {
        "model": {"preset": "tiny-moe"}, "cluster": {"gpu": "h100-sxm-80gb", "num_gpus": 1},
        "training": {"global_batch_size": 1}, "strategy": {"recompute": "selective"},
        "options": {"selective": "modules", "recompute_modules": ["mla_up_proj"]},
    }  # fmt: skip
    with pytest.raises(SpecError, match="recompute_modules has 'mla_up_proj'"):
        RunConfig.from_dict(run)


def test_a_plan_for_megatron_fits_megatrons_memory_not_eager_pytorchs():
    """The same pinned strategy: ``--for megatron`` prices Transformer Engine's kernels
    (less kept), the default target the zoo's eager runtime."""
    from planner.models import resolve_model
    from planner.planning import make_plan
    from planner.solve.search import Pins

    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=8)
    training = Training(global_batch_size=8, seq_len=4096)
    pins = Pins(dp=8, tp=1, pp=1, cp=1, zero=3, recompute="none", micro_batch_size=1)
    peak = {
        target: make_plan(
            resolve_model("llama3-8b"), cluster, training, pins=pins, target=target
        ).prediction.peak_memory_gib
        for target in ("planner", "megatron")
    }
    assert peak["megatron"] < peak["planner"]
