"""Hugging Face configs: tiny causal LMs built on meta and traced with torch.export."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from planner.errors import SpecError, UnknownNameError
from planner.graph import OpKind
from planner.tracing import trace

pytest.importorskip("transformers")
from planner.hf import resolve_hf_config
from tests.test_trace import CPU_ATTENTION

SEQ = 16
_DECODER = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 128,
}  # fmt: skip
CONFIGS = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128},
    "gpt_neox": {
        "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128,
    },
}  # fmt: skip


def _write(tmp_path, model_type: str, **fields) -> str:
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
    return str(path)


def _counted(module: torch.nn.Module) -> tuple[int, int]:
    """FLOPs of one eager step on CPU (HF's mask code calls .item(), which meta refuses)."""
    tokens = torch.zeros(1, SEQ, dtype=torch.long)
    counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
    with counter:
        logits = module(input_ids=tokens, use_cache=False).logits
        forward = counter.get_total_flops()
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    return forward, counter.get_total_flops() - forward


# The fast lane runs one family per architecture kind (a Llama-style decoder, GPT-2's
# Conv1D, Mixtral's experts); the other families run in the slow lane.
FAST_FAMILIES = ("gpt2", "llama", "mixtral")


def by_family(families) -> list:
    """``families`` as parameters, those outside :data:`FAST_FAMILIES` marked slow."""
    return [
        pytest.param(family, marks=() if family in FAST_FAMILIES else pytest.mark.slow)
        for family in sorted(families)
    ]


@pytest.mark.parametrize("model_type", by_family(CONFIGS))
def test_tiny_hf_models_trace_with_export(tmp_path, model_type):
    path = _write(tmp_path, model_type, **CONFIGS[model_type])
    handle = resolve_hf_config(path)
    graph = trace(handle, seq_len=SEQ)
    assert graph.tracer in ("export", "draft_export")
    kinds = [graph.segment_type(s).kind for s in graph.segments]
    assert kinds == ["embedding", "block", "block", "head"]
    assert len({s.type_id for s in graph.blocks}) == 1
    assert graph.blocks[0].fqn.endswith("layers.0") or graph.blocks[0].fqn.endswith("h.0")
    unique = {id(p): p.numel() for p in handle.module.parameters()}
    assert graph.param_count == sum(unique.values())
    forward, backward = _counted(resolve_hf_config(path, device="cpu").module)
    assert graph.flops_fwd == pytest.approx(forward, rel=5e-3)
    assert graph.flops_bwd == pytest.approx(backward, rel=5e-3)
    head = graph.segment_type(graph.segments[-1])
    assert any(n.kind is OpKind.LOSS for n in head.nodes)
    block = graph.segment_type(graph.blocks[0])
    assert sum(n.kind is OpKind.ATTENTION for n in block.nodes) == 1


def test_segments_name_the_modules_a_pipeline_stage_holds(tmp_path):
    graph = trace(resolve_hf_config(_write(tmp_path, "llama", **_DECODER)), seq_len=SEQ)
    assert [s.modules for s in graph.segments] == [
        ("model.embed_tokens", "model.rotary_emb"),
        ("model.layers.0",),
        ("model.layers.1",),
        ("model.norm", "lm_head"),
    ]
    block = graph.segment_type(graph.blocks[0])
    assert {"self_attn.q_proj", "mlp.down_proj"} <= {n.module for n in block.nodes}


def test_config_file_path_is_accepted(tmp_path):
    directory = _write(tmp_path, "llama", **_DECODER)
    handle = resolve_hf_config(f"{directory}/config.json")
    assert handle.device == torch.device("meta")
    assert type(handle.module).__name__ == "LlamaForCausalLM"


def test_missing_config_names_the_path(tmp_path):
    with pytest.raises(SpecError, match=r"no such file; give a config\.json") as missing:
        resolve_hf_config(tmp_path / "nowhere")
    assert "Hub id" not in str(missing.value)


def test_a_hub_id_is_not_downloaded_and_the_error_says_how_to_fetch_its_config(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match=r"Hub id is not downloaded here.*config\.json"):
        resolve_hf_config("meta-llama/Llama-3.1-8B")


def test_config_without_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SpecError, match="no 'model_type' field"):
        resolve_hf_config(tmp_path)


def test_unknown_model_type_suggests_close_names(tmp_path):
    with pytest.raises(UnknownNameError, match="Did you mean 'llama'"):
        resolve_hf_config(_write(tmp_path, "lama", **_DECODER))


def test_broken_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match=r"config.json is not valid JSON \(Expecting property name"):
        resolve_hf_config(tmp_path)


def test_a_config_transformers_rejects_is_an_error_naming_the_file(tmp_path):
    """huggingface_hub's strict validators raise their own exception class, not ValueError."""
    path = _write(tmp_path, "llama", **_DECODER, layer_types=["full_attention"])
    with pytest.raises(SpecError, match=r"invalid llama config: ValueError: .*layer_types"):
        resolve_hf_config(path)


def test_an_encoders_masked_attention_is_priced_bidirectional(tmp_path):
    """Hugging Face attention takes a mask, so its calls do not say whether it is causal;
    its attention modules do (``is_causal``): a BERT is priced over every key and
    refused context parallel (which masks causally only), a Llama is a decoder."""
    from planner.cost.build import build_cost_model
    from planner.modules import context_parallel_blocker
    from planner.spec import Cluster, Training

    bert = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128,
    }  # fmt: skip
    encoder = resolve_hf_config(_write(tmp_path, "bert", **bert))
    decoder = resolve_hf_config(_write(tmp_path, "llama", **_DECODER))
    graphs = [trace(handle, seq_len=SEQ, dtype="fp32") for handle in (encoder, decoder)]
    assert [g.attention_causal for g in graphs] == [False, True]
    training = Training(global_batch_size=4, seq_len=SEQ, dtype="fp32")
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=1)
    priced = [build_cost_model(g, cluster, training, causal=None) for g in graphs]
    assert [model.options.causal for model in priced] == [False, True]
    # their export-traced masks are not what their eager forwards hand SDPA (none)
    assert not any(g.masked_attention_share or model.options.masked_attention_share
                   for g, model in zip(graphs, priced, strict=True))  # fmt: skip
    assert "bidirectional" in (context_parallel_blocker(encoder.module) or "")
    assert context_parallel_blocker(decoder.module) is None


def test_sliding_windows_the_sequence_outgrows_are_priced_over_every_block(tmp_path):
    """Hugging Face hands SDPA a mask on its sliding-window layers once the sequence
    outgrows the window (``is_causal`` within it), and the kernel then computes every
    block: a Qwen2 with 3 of its 4 layers sliding is priced with 3/4 of its attention
    calls masked at 16 tokens (window 8), none at 4; a Llama has none."""
    from planner.cost.build import build_cost_model
    from planner.spec import Cluster, Training

    sliding = {
        **_DECODER, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 8,
        "max_window_layers": 1,
    }  # fmt: skip
    qwen2 = resolve_hf_config(_write(tmp_path, "qwen2", **sliding))
    llama = resolve_hf_config(_write(tmp_path, "llama", **_DECODER))
    shares = [trace(qwen2, seq_len=seq).masked_attention_share for seq in (4, SEQ)]
    assert shares == [0.0, 0.75]
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=1)
    training = Training(global_batch_size=4, seq_len=SEQ, dtype="bf16")
    times = []
    for handle in (llama, qwen2):
        graph = trace(handle, seq_len=SEQ)
        model = build_cost_model(graph, cluster, training, causal=None)
        block = graph.segment_type(graph.blocks[0])
        attention = next(node for node in block.nodes if node.kind is OpKind.ATTENTION)
        overhead = model.compute.node_time(attention, 0.0).forward_s
        times.append(model.compute.node_time(attention, 1e6).forward_s - overhead)
    causal_s, sliding_s = times
    assert sliding_s == pytest.approx((0.25 + 0.75 * 2) * causal_s, rel=1e-6)


def test_an_alibi_bias_is_a_mask_on_every_attention_call(tmp_path, caplog):
    """Falcon with ALiBi adds its bias to the mask it hands SDPA at every length: priced
    masked throughout, its operators (the bias's ``.T``) all known."""
    import logging

    falcon = {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 256, "alibi": True,
    }  # fmt: skip
    handle = resolve_hf_config(_write(tmp_path, "falcon", **falcon))
    with caplog.at_level(logging.WARNING):
        graph = trace(handle, seq_len=4)
    assert graph.masked_attention_share == 1.0
    assert "no pricing rule" not in caplog.text


def test_masks_that_cannot_be_counted_on_meta_tensors_are_said(tmp_path, caplog):
    """BioGPT's forward reads its all-ones padding mask's values (positions, the mask
    check), which meta tensors do not hold: priced without masks, and the log says so."""
    import logging

    biogpt = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 256,
    }  # fmt: skip
    handle = resolve_hf_config(_write(tmp_path, "biogpt", **biogpt))
    with caplog.at_level(logging.WARNING):
        graph = trace(handle, seq_len=SEQ)
    assert graph.masked_attention_share == 0.0
    assert "could not be counted on meta tensors" in caplog.text


def test_a_router_with_jitter_is_priced_by_its_bytes(tmp_path, caplog):
    """PhiMoE's sparse-mixer router samples with jitter (uniform_, exponential_,
    logical_or, scatter, concat): element-wise ops, priced by their bytes; only its
    no-grad region, which torch.export wraps as one operator, is named unpriced."""
    import logging

    phimoe = {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}
    handle = resolve_hf_config(_write(tmp_path, "phimoe", **phimoe))
    with caplog.at_level(logging.WARNING):
        trace(handle, seq_len=SEQ)
    assert "no pricing rule for wrap_with_set_grad_enabled;" in caplog.text


def test_a_view_that_folds_the_head_shard_into_the_sequence_is_caught(tmp_path):
    """OPT views its projections as ``(bsz, -1, num_heads, head_dim)``: on a head shard
    the ``-1`` takes half the sequence, so each head would attend to every other token.
    It ran and trained another model at tp 2; the rehearsal now compares the queries'
    shape with the trace's, and no layout shards OPT's attention."""
    from planner.rehearse import rehearse
    from planner.spec import ModuleTP

    opt = {
        "hidden_size": 64, "ffn_dim": 128, "word_embed_proj_dim": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128,
    }  # fmt: skip
    handle = resolve_hf_config(_write(tmp_path, "opt", **opt))
    graph = trace(handle, seq_len=SEQ, dtype="fp32")
    attention = "model.decoder.layers.*.self_attn."
    column = ModuleTP(style="colwise", params={"weight": "Shard(0)", "bias": "Shard(0)"},
                      output=("Shard(-1)", "Shard(-1)"))  # fmt: skip
    row = ModuleTP(style="rowwise", params={"weight": "Shard(1)"},
                   input=("Shard(-1)", "Shard(-1)"), output=("Partial()", "Replicate()"))  # fmt: skip
    layout = {attention + name: column for name in ("q_proj", "k_proj", "v_proj")}
    failure = rehearse(handle, graph, {**layout, attention + "out_proj": row}, tp=2)
    assert failure is not None and "folds the heads' shard" in failure.message
    assert failure.module.endswith("self_attn")


@pytest.mark.parametrize(
    ("model_type", "fields", "table"),
    [
        ("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64}, "model.decoder.embed_positions"),
        ("bert", {"intermediate_size": 128}, "bert.embeddings.position_embeddings"),
    ],
)  # fmt: skip
def test_a_sequence_longer_than_a_learned_position_table_is_refused(
    tmp_path, model_type, fields, table
):
    """OPT counts positions with a cumulative sum, BERT slices a buffer of them: neither
    lookup fails on meta tensors (BERT's failed later, as a tracing error), and the
    cluster's would; the plan is refused naming the table and the longest sequence."""
    path = _write(
        tmp_path, model_type, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=32, vocab_size=256, **fields,
    )  # fmt: skip
    handle = resolve_hf_config(path)
    with pytest.raises(
        SpecError, match=rf"seq_len 64 looks up positions 0..63 in .{table}. .* <= 32"
    ):
        trace(handle, seq_len=64)
    assert trace(handle, seq_len=32).flops_fwd > 0


def test_an_encoder_decoder_config_is_refused_in_one_line_with_the_way_to_plan_it(tmp_path):
    """T5 builds no causal LM; transformers' error goes on to list every config class it
    knows (about 200): the refusal keeps its first line and says what to do."""
    path = _write(tmp_path, "t5", d_model=32, num_layers=1, num_heads=2, d_ff=64, d_kv=16)
    with pytest.raises(SpecError) as refused:
        resolve_hf_config(path)
    message = str(refused.value)
    assert "t5 config does not build a causal LM" in message and "module:function" in message
    assert "\n" not in message and "GPT2Config" not in message


def test_the_attention_implementation_a_config_asks_for_is_what_is_built(tmp_path):
    """What transformers builds from the config is what is traced and priced: its
    attn_implementation, or SDPA where the family has it; FlashAttention kernels (a GPU
    package) are traced as SDPA; one the family cannot build is refused naming the field."""
    eager = resolve_hf_config(_write(tmp_path, "llama", **_DECODER, attn_implementation="eager"))
    assert eager.module.config._attn_implementation == "eager"
    (tmp_path / "llama").rename(tmp_path / "eager")
    for asked in (None, "flash_attention_2"):
        fields = _DECODER if asked is None else {**_DECODER, "attn_implementation": asked}
        built = resolve_hf_config(_write(tmp_path, "llama", **fields))
        assert built.module.config._attn_implementation == "sdpa"
        (tmp_path / "llama").rename(tmp_path / f"as-{asked}")
    gemma2 = {**_DECODER, "head_dim": 16, "attn_implementation": "sdpa"}
    with pytest.raises(
        SpecError, match=r"attn_implementation = 'sdpa': Gemma2ForCausalLM .*'eager'"
    ):
        resolve_hf_config(_write(tmp_path, "gemma2", **gemma2))
    with pytest.raises(SpecError, match=r"attn_implementation = 'magic'"):
        resolve_hf_config(_write(tmp_path, "llama", **_DECODER, attn_implementation="magic"))
