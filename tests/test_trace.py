"""The profiler: FLOPs against FlopCounterMode and Megatron, segments, bytes, errors."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from planner.errors import SpecError, TraceError
from planner.graph import OpKind
from planner.models import PRESETS, ModelHandle, build, handle_for_module, resolve_model
from planner.models.small import MLPStack
from planner.modules import find_blocks
from planner.spec import Family, ModelSpec
from planner.tracing import trace, trace_model

SEQ = 64
GPT_PRESETS = [name for name, spec in PRESETS.items() if spec.family is Family.GPT]

aten = torch.ops.aten


def _sdpa_fwd(query, key, value, *args, **kwargs):
    return sdpa_flop_count(query, key, value)


def _sdpa_bwd(grad_out, query, key, value, *args, **kwargs):
    """Model FLOPs: 2x forward, as the math path's matmuls and Megatron count.

    torch's flash-backward formula adds the recomputed scores (2.5x): hardware FLOPs.
    """
    return 2 * sdpa_flop_count(query, key, value)


# FlopCounterMode knows no formula for the CPU flash-attention kernel (DESIGN traps):
# register torch's own SDPA forward formula for it, so attention is counted by torch too.
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_bwd,
}


def _counted(spec: ModelSpec) -> tuple[int, int]:
    """(forward, backward) FLOPs of one training step on meta, by FlopCounterMode."""
    model = build(spec.with_seq_len(SEQ))
    tokens = torch.empty(1, SEQ, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
    with counter:
        logits = model(tokens)
        forward = counter.get_total_flops()
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    return forward, counter.get_total_flops() - forward


def _shallow(spec: ModelSpec) -> ModelSpec:
    """``spec`` at two layers at most (a mixture of experts keeps one MoE block, and one
    dense block when it has some)."""
    layers = min(spec.num_layers, 2)
    dense = min(spec.dense_layers, layers - 1)
    return ModelSpec.model_validate(
        {**spec.model_dump(), "num_layers": layers, "dense_layers": dense}
    )


def _trace_spec(spec: ModelSpec, dtype: str = "bf16"):
    spec = spec.with_seq_len(SEQ)
    handle = ModelHandle(
        spec.name, spec.name, build(spec), lambda b, s: (torch.empty(b, s, dtype=torch.long),), spec
    )
    return trace(handle, seq_len=SEQ, dtype=dtype)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flops_match_flop_counter_mode(name):
    """Every preset's architecture, at two layers (identical blocks are traced once)."""
    spec = _shallow(PRESETS[name])
    forward, backward = _counted(spec)
    graph = _trace_spec(spec)
    assert graph.flops_fwd == pytest.approx(forward, rel=5e-3)
    assert graph.flops_bwd == pytest.approx(backward, rel=5e-3)


@pytest.mark.parametrize("name", ["gpt2", "tiny-llama"])
def test_flops_match_flop_counter_mode_at_full_depth(name):
    forward, backward = _counted(PRESETS[name])
    graph = _trace_spec(PRESETS[name])
    assert graph.flops_fwd == pytest.approx(forward, rel=5e-3)
    assert graph.flops_bwd == pytest.approx(backward, rel=5e-3)


def _megatron(spec: ModelSpec, batch: int, seq: int) -> float:
    """Narayanan et al. (SC'21) training FLOPs without recompute, logits layer included."""
    layers, hidden, vocab = spec.num_layers, spec.hidden_size, spec.vocab_size
    return (
        72 * batch * seq * layers * hidden**2
        * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    )  # fmt: skip


@pytest.mark.parametrize("name", GPT_PRESETS)
def test_gpt_flops_match_megatron_formula(name):
    graph = trace_model(name, batch_size=2, seq_len=SEQ)
    expected = _megatron(PRESETS[name], 2, SEQ)
    assert graph.flops_fwd + graph.flops_bwd == pytest.approx(expected, rel=1e-2)


def test_96_layer_gpt_is_one_block_type_plus_embedding_and_head():
    graph = trace_model("gpt3-175b", seq_len=SEQ)
    kinds = [graph.segment_type(s).kind for s in graph.segments]
    assert kinds == ["embedding"] + ["block"] * 96 + ["head"]
    assert len({s.type_id for s in graph.blocks}) == 1
    assert len(graph.types) == 3
    assert graph.segments[0].modules == ("tok_embeddings", "pos_embeddings")
    assert graph.segments[1].modules == ("layers.0",)
    assert graph.segments[-1].modules == ("norm", "output")
    assert graph.param_count == PRESETS["gpt3-175b"].with_seq_len(SEQ).num_params()


@pytest.mark.parametrize("name", ["gpt2", "llama3-8b", "bert-base", "tiny-llama"])
def test_parameters_are_counted_once(name):
    spec = _shallow(PRESETS[name])
    graph = _trace_spec(spec)
    assert graph.param_count == spec.with_seq_len(SEQ).num_params()
    assert graph.total("param_bytes") == 2 * graph.param_count  # bf16


def test_tied_output_weight_belongs_to_the_embedding():
    graph = _trace_spec(_shallow(PRESETS["gpt2"]))
    head = graph.segment_type(graph.segments[-1])
    output = next(n for n in head.nodes if n.module == "output")
    assert output.param_count == 0
    embedding = graph.segment_type(graph.segments[0])
    assert embedding.param_count == (50304 + SEQ) * 768  # the vocabulary padded to 128s


def test_block_nodes_are_relative_and_carry_gemm_shapes():
    spec = PRESETS["tiny-llama"]
    graph = _trace_spec(spec)
    block = graph.segment_type(graph.blocks[0])
    by_module = {n.module: n for n in block.nodes if n.kind is OpKind.MATMUL}
    tokens = SEQ
    assert by_module["attention.wq"].gemm == (1, tokens, 64, 64)
    assert by_module["attention.wk"].gemm == (1, tokens, 32, 64)  # 2 kv heads of 16
    assert by_module["feed_forward.w2"].gemm == (1, tokens, 64, 160)
    assert by_module["attention.wq"].flops_fwd == 2 * tokens * 64 * 64
    attention = next(n for n in block.nodes if n.kind is OpKind.ATTENTION)
    assert attention.gemm == (4, SEQ, SEQ, 16)
    assert attention.flops_fwd == 4 * 4 * SEQ * SEQ * 16
    assert attention.flops_bwd == 2 * attention.flops_fwd
    names = {n.name for n in block.nodes}
    assert all(set(n.inputs) <= names for n in block.nodes)


def test_head_has_a_loss_node():
    graph = _trace_spec(PRESETS["tiny-gpt"])
    head = graph.segment_type(graph.segments[-1])
    loss = [n for n in head.nodes if n.kind is OpKind.LOSS]
    assert len(loss) == 1
    assert loss[0].flops_fwd == 0
    # torchtitan's convention: the loss runs on fp32 logits, which it keeps for backward
    assert loss[0].saved_bytes >= SEQ * 256 * 4


def test_saved_bytes_of_a_gpt_block_follow_korthikanti_with_fused_attention():
    """s*b*h*(34 + 5as/h) without dropout masks (2sbh) and with SDPA's q, k, v, out, lse."""
    spec = ModelSpec(
        family=Family.GPT, num_layers=2, hidden_size=128, num_heads=4, vocab_size=512, seq_len=SEQ
    )
    graph = _trace_spec(spec)
    block = graph.segment_type(graph.blocks[0])
    s, b, h, a = SEQ, 1, 128, 4
    norm_stats = 2 * s * b * 8  # fp32 mean and rstd of two layer norms
    logsumexp = a * s * b * 4
    assert block.saved_bytes == s * b * h * 32 + norm_stats + logsumexp


def test_dtype_sets_bytes():
    spec = PRESETS["tiny-gpt"]
    half, full = _trace_spec(spec, "bf16"), _trace_spec(spec, "fp32")
    assert full.total("param_bytes") == 2 * half.total("param_bytes")
    assert full.flops_fwd == half.flops_fwd
    block_half, block_full = (g.segment_type(g.blocks[0]) for g in (half, full))
    matmul = next(n for n in block_half.nodes if n.kind is OpKind.MATMUL)
    assert matmul.dtype == "bf16"
    assert sum(n.bytes_read for n in block_full.nodes) > sum(n.bytes_read for n in block_half.nodes)


def test_small_models_without_blocks_are_one_segment():
    graph = trace_model("cnn", batch_size=4)
    assert [graph.segment_type(s).kind for s in graph.segments] == ["other"]
    assert graph.segments[0].modules == ("convs", "head")
    conv = next(
        n for s in graph.segments for n in graph.segment_type(s).nodes if n.kind is OpKind.CONV
    )
    assert conv.flops_fwd == 2 * 4 * 32 * 32 * 32 * 3 * 3 * 3
    assert conv.flops_bwd == conv.flops_fwd  # the image needs no gradient: weight grad only
    assert graph.param_count == sum(p.numel() for p in resolve_model("cnn").module.parameters())


def test_user_model_blocks_are_detected_generically():
    graph = trace_model("mlp-mixer", batch_size=2)
    kinds = [graph.segment_type(s).kind for s in graph.segments]
    assert kinds == ["block"] * 4 + ["head"]
    assert graph.segments[-1].modules == ("norm", "head")
    # the first block sees inputs that need no gradient, yet prices the same: one type
    assert len({s.type_id for s in graph.blocks}) == 1


class _Branchy(nn.Module):
    """Python control flow on a tensor's value: fx cannot trace it, export can."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if x.dim() > 1 and x.shape[0] > 0:
            x = x.relu()
        return x


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _user_handle(module: nn.Module, width: int) -> ModelHandle:
    return ModelHandle("user", "test", module, lambda b, s: (torch.randn(b, width),))


def test_fx_failure_falls_back_to_export(caplog):
    caplog.set_level(logging.INFO, logger="planner.tracing.tracer")
    graph = trace(_user_handle(_Branchy(), 16), batch_size=2)
    assert graph.tracer == "export"
    assert "tracing with torch.export" in caplog.text
    assert graph.flops_fwd == 3 * 2 * 2 * 16 * 16
    assert [graph.segment_type(s).kind for s in graph.segments] == ["block"] * 3 + ["head"]


def test_export_skips_node_stack_traces_and_prices_the_same(monkeypatch):
    """torch.export runs without recording each node's stack trace (nothing reads them)
    and leaves torch's setting as it was; the graph is the one a traced run with stack
    traces prices."""
    import contextlib

    import planner.tracing.fx as fx

    handle = _user_handle(_Branchy(), 16)
    fast = trace(handle, batch_size=2)
    assert fast.tracer == "export"
    assert torch.fx.config.do_not_emit_stack_traces is False
    monkeypatch.setattr(fx, "_no_stack_traces", contextlib.nullcontext)
    assert trace(handle, batch_size=2).digest == fast.digest


def test_a_list_of_bare_layers_is_not_a_list_of_blocks():
    """Blocks are made of modules (what tensor parallelism lays out); a ModuleList of
    equal nn.Linear layers is the model's layers, traced as one segment."""
    with torch.device("meta"):
        model = MLPStack((16, 16, 16))
    graph = trace(_user_handle(model, 16))
    assert [graph.segment_type(s).kind for s in graph.segments] == ["other"]
    assert find_blocks(model) == []


def test_untraceable_model_raises_trace_error_with_advice(monkeypatch):
    """A forward both tracers fail on, though it runs: each tracer's reason and the fix."""
    import planner.tracing.tracer as tracer

    def refuse(*args, **kwargs):
        raise RuntimeError("unsupported construct")

    monkeypatch.setattr(tracer, "trace_fx", refuse)
    monkeypatch.setattr(tracer, "trace_export", refuse)
    with pytest.raises(
        TraceError, match=r"(?s)could not trace model 'user'.*torch.fx: .*unsupported.*Fix:"
    ):
        trace(_user_handle(_Broken(), 8))


def test_a_forward_that_fails_on_its_own_says_where_not_how_to_trace():
    """Shapes that disagree fail the model's own forward, whatever the tracer: the
    error names the model's line and the failure, not tracing advice."""
    with pytest.raises(
        TraceError,
        match=r"user: its forward fails \(RuntimeError: .*\) in forward\(\) at test_trace.py:\d+, "
        r"whatever the tracer: check the model's code or its config",
    ):
        trace(_user_handle(_Broken(), 5))  # inputs 5 wide, the layer takes 8


def test_bad_arguments_raise_spec_errors():
    handle = resolve_model("tiny-gpt")
    with pytest.raises(SpecError, match=r"dtype 'fp8'.*bf16, fp16, fp32"):
        trace(handle, dtype="fp8")
    with pytest.raises(SpecError, match="seq_len 64 exceeds tiny-gpt's position table"):
        trace(handle, seq_len=64)
    with pytest.raises(SpecError, match="batch_size must be a positive integer, got 0"):
        trace(handle, batch_size=0)


def test_user_module_function_path(tmp_path, monkeypatch):
    module = types.ModuleType("user_models_for_trace")
    module.make = lambda: (
        nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)),
        torch.randn(4, 8),
    )  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_models_for_trace", module)
    graph = trace_model("user_models_for_trace:make")
    assert graph.flops_fwd == 2 * (2 * 4 * 8 * 32)
    assert graph.param_count == 8 * 32 + 32 + 32 * 8 + 8


def test_each_distinct_block_is_traced_once(monkeypatch):
    import planner.tracing.fx

    calls = []
    original = planner.tracing.fx._trace_block
    monkeypatch.setattr(
        planner.tracing.fx, "_trace_block", lambda *args: calls.append(1) or original(*args)
    )
    graph = trace_model("llama3.1-405b", seq_len=8192)
    assert len(calls) == 1
    assert len(graph.blocks) == 126
    assert graph.param_count == PRESETS["llama3.1-405b"].num_params()
    block = graph.segment_type(graph.blocks[0])
    attention = next(n for n in block.nodes if n.kind is OpKind.ATTENTION)
    assert attention.gemm == (128, 8192, 8192, 128)


class _Einsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,bj->bij", self.proj(x), x)


def test_ops_without_a_pricing_rule_are_reported(caplog):
    graph = trace(_user_handle(_Einsum(), 8), batch_size=2)
    assert "no pricing rule for einsum" in caplog.text
    assert graph.flops_fwd == 2 * 2 * 8 * 8  # the linear layer only


def test_a_sequence_longer_than_a_learned_position_table_is_refused(tmp_path):
    """On meta tensors an out-of-range lookup cannot fail, on the cluster it would: a
    position embedding indexed by an arange (nanoGPT's wpe, Hugging Face GPT-2's through
    its cache positions) refuses a longer sequence, naming the table."""
    import json

    from planner.hf import resolve_hf_config

    nanogpt = resolve_model("tests.user_models:gpt")  # block_size 64
    assert trace(nanogpt, seq_len=64).seq_len == 64
    with pytest.raises(
        SpecError, match=r"seq_len 100 looks up positions 0..99 in 'transformer.wpe'"
    ):
        trace(nanogpt, seq_len=100)
    config = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256,
              "n_positions": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match=r"a table of 64 positions: use seq_len <= 64"):
        trace(resolve_hf_config(tmp_path), seq_len=100)
    # rotary tables built in __init__ and indexed by positions, beside or inside the blocks
    with pytest.raises(SpecError, match=r"positions 0..99 in .*a table of 64 positions"):
        trace(resolve_model("tests.user_models:llama_rope"), seq_len=100)
    with pytest.raises(SpecError, match=r"positions 0..99 in 'rope' \(BlockRope\), a table of 64"):
        trace(handle_for_module(BlockRopeModel()), seq_len=100)
    assert trace(handle_for_module(BlockRopeModel()), seq_len=64).seq_len == 64


class BlockRope(nn.Module):
    """Rotary tables of 64 positions in each block, indexed by positions made there."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", torch.ones(64, 8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.size(1), device=x.device)
        return x * self.cos[positions].repeat(1, 4)


class RopeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rope, self.proj = BlockRope(), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.rope(x))


class BlockRopeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.layers = nn.ModuleList(RopeBlock() for _ in range(2))
        self.head = nn.Linear(32, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        return (torch.zeros(batch_size, 16, dtype=torch.long),)


def test_a_weight_shared_by_blocks_counts_once():
    """ALBERT-style sharing: the blocks after the first are a segment type of their own,
    priced without the weight the first already holds."""
    from tests.user_models import SharedGPT

    model = SharedGPT(n_layer=3)
    graph = trace(handle_for_module(model), seq_len=16)
    assert graph.param_count == sum(p.numel() for p in model.parameters())
    first, second, third = (graph.segment_type(s) for s in graph.blocks)
    shared = model.transformer.h[0].mlp.c_fc.weight.numel()
    assert first.param_count - second.param_count == shared and second == third


def test_a_token_model_of_ones_own_is_priced_with_the_loss_its_step_computes(caplog):
    """``ParallelModel.step`` computes token cross-entropy on any model's logits: a module
    of one's own that takes token ids is traced with it (the bytes the formula graph's
    loss moves), one that returns the last position's logits only is warned about."""
    from planner.graph import CROSS_ENTROPY_BYTES
    from tests.user_models import GPT, VOCAB

    graph = trace(resolve_model("tests.user_models:gpt"), seq_len=16)
    head = graph.segment_type(graph.segments[-1])
    [loss] = [node for node in head.nodes if node.kind is OpKind.LOSS]
    assert loss.bytes_read == 16 * VOCAB * CROSS_ENTROPY_BYTES[0]

    class LastPosition(GPT):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return super().forward(idx)[:, [-1], :]

    handle = handle_for_module(LastPosition())
    graph = trace(handle, seq_len=16)
    assert "the training loss is not priced" in caplog.text
    assert all(n.kind is not OpKind.LOSS for s in graph.types.values() for n in s.nodes)
    trace(handle, batch_size=2, seq_len=16)  # the search traces at several shapes
    assert caplog.text.count("the training loss is not priced") == 1  # said once


def test_a_mask_handed_to_the_attention_kernel_is_priced_over_every_block():
    """SDPA given a mask tensor skips no block, causal or not: nanoGPT with its mask
    buffer is priced at twice the attention work of ``is_causal``."""
    from planner.cost.build import build_cost_model
    from planner.graph import OpKind
    from planner.spec import Cluster, Training

    training = Training(global_batch_size=4, seq_len=64, dtype="bf16")
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=1)
    times = []
    for name in ("gpt", "gpt_mask_buffer"):
        graph = trace(resolve_model(f"tests.user_models:{name}"), seq_len=64)
        model = build_cost_model(graph, cluster, training, causal=None)
        block = graph.segment_type(graph.blocks[0])
        attention = next(node for node in block.nodes if node.kind is OpKind.ATTENTION)
        overhead = model.compute.node_time(attention, 0.0).forward_s
        times.append((graph, model.compute.node_time(attention, 1e6).forward_s - overhead))
    (causal, causal_s), (masked, masked_s) = times
    assert (causal.masked_attention_share, masked.masked_attention_share) == (0.0, 1.0)
    assert causal.digest != masked.digest
    assert masked_s == pytest.approx(2 * causal_s, rel=1e-6)


def test_a_module_returning_a_dict_of_logits_is_priced_with_its_loss():
    """``{"logits": ...}`` as Hugging Face-style modules of one's own return: the trace
    finds the logits as the runtime does (planner.staging.output_logits)."""
    graph = trace(resolve_model("tests.user_models:gpt_dict"), seq_len=16)
    plain = trace(resolve_model("tests.user_models:gpt"), seq_len=16)
    assert any(n.kind is OpKind.LOSS for s in graph.types.values() for n in s.nodes)
    assert graph.flops_fwd == plain.flops_fwd


def test_fp32_tables_beside_half_precision_trace_as_autocast_runs_them():
    """fp32 rotary tables make fp32 queries beside bf16 values; autocast casts them for
    attention at run time, and the trace does the same (meta tensors skip autocast)."""
    graph = trace(resolve_model("tests.user_models:gpt_rotary"), seq_len=16, dtype="bf16")
    block = graph.segment_type(graph.segments[1])
    assert any(node.kind is OpKind.ATTENTION for node in block.nodes)


def test_a_modules_own_attention_calls_set_the_causality_it_is_priced_with():
    """A nanoGPT-style module says ``is_causal=True``; an encoder of your own says False
    and is priced over every key (it was priced as a decoder); a mask leaves it to the
    options. The digest tells the two apart, so a plan of one never trains the other."""
    from planner.cost.build import build_cost_model
    from planner.spec import Cluster, Training

    training = Training(global_batch_size=4, seq_len=16, dtype="fp32")
    decoder = trace(resolve_model("tests.user_models:gpt"), seq_len=16, dtype="fp32")
    encoder = trace(resolve_model("tests.user_models:encoder"), seq_len=16, dtype="fp32")
    masked = trace(resolve_model("tests.user_models:masked"), seq_len=16, dtype="fp32")
    assert (decoder.attention_causal, encoder.attention_causal) == (True, False)
    assert masked.attention_causal is None
    assert decoder.digest != encoder.digest
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=1)
    priced = [build_cost_model(g, cluster, training, causal=None) for g in (decoder, encoder)]
    assert [model.options.causal for model in priced] == [True, False]


def test_a_forward_whose_shapes_depend_on_values_is_refused_naming_the_fix():
    """Experts in an ``nn.ModuleList`` fed by ``torch.where`` (nonzero: its size is the
    routing's) cannot run on meta tensors: a TraceError (the CLI's ``error:`` line)
    that names the layout the planner prices, not a traceback."""
    with pytest.raises(TraceError, match=r"GPT: its forward fails on the meta device .*nonzero"):
        trace(resolve_model("tests.user_models:gpt_routed"), seq_len=16)
    with pytest.raises(TraceError, match=r"planner\.models\.moe\.Experts"):
        trace(resolve_model("tests.user_models:gpt_routed"), seq_len=16)


def test_a_tensor_a_module_kept_from_its_last_forward_is_copied_to_meta():
    """A loss a module stashes as an attribute is part of an autograd graph, which
    deepcopy refuses; the meta copy the planner prices copies it as a meta tensor."""
    handle = resolve_model("tests.user_models:gpt_stash")
    module = handle.module.to_empty(device="cpu")
    module(torch.zeros(1, 16, dtype=torch.long))
    assert module.transformer.h[0].mlp.aux_loss.grad_fn is not None
    assert len(trace(handle, seq_len=16).blocks) == 2


def test_experts_of_ones_own_are_priced_staged_and_read_on_meta_at_their_expected_load():
    """Hand-written grouped experts that gather their tokens with torch.where run on meta
    tensors only as the expected-load dispatch the tracer prices: the pipeline-stage check
    and the token range ``plan run`` reads used the module's own forward and failed."""
    from planner.staging import stage_problem, token_vocab

    handle = resolve_model("tests.user_models:gpt_own_moe")
    assert trace(handle, seq_len=16).num_experts == 4
    assert stage_problem(handle.module, handle.make_inputs(2, 16)) is None
    assert token_vocab(handle, 16) == 256  # the token embedding's rows
