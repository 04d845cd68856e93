"""Hugging Face decoder families: planned by the CLI, priced under TP, run on gloo.

Every family (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, Mixtral) is a tiny config the
tests write. Planning goes through ``plan search --hf-config``; tensor-parallel pricing
is checked against the parameters of the real module; the distributed test trains
each family on two gloo ranks (DDP or FSDP, and TP with the sharding ILP's layout)
and compares the loss with one process.
"""

from __future__ import annotations

import functools
import json
import logging

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from planner.assemble import assemble_plan
from planner.cli import main
from planner.cost import CostModel
from planner.cost.model import SegmentCost
from planner.errors import SpecError
from planner.graph import OpGraph
from planner.hf import resolve_hf_config
from planner.layouts import ModelLayouts
from planner.modules import check_model_against_plan
from planner.planning import make_plan, trace_for_training
from planner.solve.layout import Roofline
from planner.solve.search import Pins
from planner.spec import Cluster, Plan, Strategy, TPStyle, Training, load_document
from planner.tracing import trace
from planner.validate import validate_plan_for_world
from strategies.apply import parallelize
from strategies.parallel_model import local_slice
from strategies.runner import Trainer, synthetic_batch
from tests.devices import write_tp_pays
from tests.ranks import map_in_processes, run_on_ranks
from tests.test_hf import _DECODER, CONFIGS, SEQ, _counted, _write, by_family
from tests.test_runtime_numerics import BATCH, CLIP, EXACT, LR, STEPS, VOCAB

_WEIGHT_STYLES = (TPStyle.COLWISE, TPStyle.ROWWISE, TPStyle.VOCAB_PARALLEL)
_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
FAMILIES = {
    **CONFIGS,
    "gpt2": {**CONFIGS["gpt2"], **_NO_DROPOUT},  # one process and two draw other masks
    "mixtral": {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
}
TRAINING = Training(global_batch_size=BATCH, micro_batch_size=BATCH, seq_len=SEQ, dtype="fp32")
SLOW = Roofline(  # slow enough that sharding pays even for tiny layers
    peak_flops=1e9, memory_bandwidth_GBps=1, link_bandwidth_GBps=1000, link_latency_us=0
)


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {family: _write(root, family, **fields) for family, fields in FAMILIES.items()}


@pytest.fixture(scope="module")
def graphs(config_dirs) -> dict[str, OpGraph]:
    """Each family traced once at the test's batch and sequence (fp32)."""
    return {
        family: trace_for_training(resolve_hf_config(path), TRAINING)
        for family, path in config_dirs.items()
    }


# --- planning through the CLI ---------------------------------------------------------


@pytest.mark.parametrize("family", by_family(FAMILIES))
def test_cli_plans_each_family_with_tensor_parallelism(config_dirs, family, tmp_path, capsys):
    """On a device where sharding pays (on H100s these tiny layers would not be split:
    tp 2 would shard nothing and is refused)."""
    out = tmp_path / "plan.json"
    cluster = tmp_path / "cluster.json"
    gpu = write_tp_pays(tmp_path)
    cluster.write_text(json.dumps({"gpu": str(gpu), "num_gpus": 2, "gpus_per_node": 2}))
    argv = [
        "search", "--hf-config", config_dirs[family], "--cluster", str(cluster),
        "--tp", "2", "--global-batch", "8", "--seq", str(SEQ), "-o", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    plan = load_document(Plan, out)
    validate_plan_for_world(plan, 2)
    check_model_against_plan(plan, resolve_hf_config(config_dirs[family]).module)
    assert plan.strategy.tp == 2
    assert plan.prediction is not None
    sharded = any(p.startswith("Shard") for m in plan.tp_layout.values() for p in m.params.values())
    assert (plan.prediction.breakdown_s.get("comm_tp", 0.0) > 0) is sharded  # priced as laid out


# --- tensor-parallel pricing ----------------------------------------------------------


def _block_params(module: nn.Module) -> tuple[int, int]:
    """(parameters TP splits, parameters every TP rank keeps) of the first block.

    Split: the attention and (dense) MLP sublayers' weights. Kept: norms, a
    mixture-of-experts layer's router and experts (DTensor shards no 3-D weight) and
    GPT-2's ``Conv1D`` weights (no ``nn.Linear``).
    """
    block = next(m for name, m in module.named_modules() if name.endswith(("layers.0", "h.0")))
    conv1d = {n for n, m in block.named_modules() if type(m).__name__ == "Conv1D"}
    split = kept = 0
    for name, param in block.named_parameters():
        moe = ".experts." in f".{name}" or name.startswith("mlp.gate.")
        if "norm" in name or "ln_" in name or moe or name.rpartition(".")[0] in conv1d:
            kept += param.numel()
        else:
            split += param.numel()
    return split, kept


def _biases(family: str) -> float:
    """Row-parallel biases stay whole on every rank: GPT-NeoX's two per block."""
    return 64.0 if family == "gpt_neox" else 0.0


def _first_block(model: CostModel, strategy: Strategy) -> SegmentCost:
    return next(c for c in model.segment_costs(strategy) if c.kind == "block")


@pytest.mark.parametrize("family", by_family(FAMILIES))
def test_tensor_parallel_splits_attention_and_mlp_weights(config_dirs, graphs, family):
    """Where sharding pays, the ILP splits attention and dense MLP weights (not GPT-2's
    Conv1D ones), and the cost model prices exactly that layout."""
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    layouts = ModelLayouts(resolve_hf_config(config_dirs[family]), graphs[family], SLOW)
    model = CostModel(graphs[family], cluster, TRAINING, tp_layouts=layouts.assignment)
    costs = {tp: _first_block(model, Strategy(tp=tp, micro_batch_size=BATCH)) for tp in (1, 2)}
    split, kept = _block_params(resolve_hf_config(config_dirs[family]).module)
    assert costs[1].param_count == split + kept
    assert costs[2].param_count == pytest.approx(split / 2 + kept, abs=_biases(family))
    if family not in ("mixtral", "gpt2"):  # dense blocks: about half (norms stay whole)
        assert costs[2].param_count / costs[1].param_count == pytest.approx(0.5, abs=0.01)
    assert costs[1].comm_tp_s == 0
    assert costs[2].comm_tp_s > 0
    assert costs[2].forward_s < costs[1].forward_s


# --- mixture of experts -----------------------------------------------------------------


def test_mixtral_experts_are_priced_at_their_real_flops(config_dirs):
    """Routed rows total tokens * top_k whatever the balance, so FLOPs match eager exactly."""
    graph = trace(resolve_hf_config(config_dirs["mixtral"]), seq_len=SEQ)
    module = resolve_hf_config(config_dirs["mixtral"], device="cpu").module
    module.config._experts_implementation = "eager"  # per-expert linears FlopCounter sees
    forward, backward = _counted(module)
    assert graph.flops_fwd == forward
    assert graph.flops_bwd == backward
    block = graph.segment_type(graph.blocks[0])
    assert sum(n.kind.value == "matmul" and n.module == "mlp.experts" for n in block.nodes) == 2


def test_a_load_balancing_loss_the_default_loss_leaves_out_is_refused(config_dirs):
    """A config that adds the routers' auxiliary loss (output_router_logits) would train
    without it under token cross-entropy: parallelize says so unless given a loss."""
    handle = resolve_hf_config(config_dirs["mixtral"], device="cpu")
    cluster = Cluster(gpu="cpu", num_gpus=1, gpus_per_node=1)
    plan = assemble_plan(handle, cluster, TRAINING, Strategy(micro_batch_size=BATCH))
    handle.module.config.output_router_logits = True
    with pytest.raises(SpecError, match=r"output_router_logits = True.*loss_fn="):
        parallelize(handle.module, plan)
    assert parallelize(handle.module, plan, loss_fn=lambda output, targets: output.logits.sum())
    # a pipeline's last stage returns the logits alone: no loss of one's own can add it
    stages = Strategy(pp=2, micro_batch_size=BATCH // 2, num_microbatches=2)
    piped = assemble_plan(handle, Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2), TRAINING, stages)
    with pytest.raises(SpecError, match=r"plan.strategy.pp = 2: model.config.output_router"):
        parallelize(handle.module, piped, loss_fn=lambda output, targets: output.logits.sum())
    # and the search plans no pipeline for it (it chose pp 2, which then refused to run)
    from planner.planning import make_plan
    from planner.solve.search import Pins

    with pytest.raises(SpecError, match=r"pp\(2\): model.config.output_router_logits = True"):
        make_plan(handle, Cluster(gpu="h100-sxm-80gb", num_gpus=2), TRAINING, pins=Pins(pp=2))


def test_a_framework_target_plans_a_traced_moe_without_its_unrunnable_layouts(config_dirs):
    """Mixtral's tokens cannot stay sequence-sharded through its experts, so no layout runs
    tp 2 with sequence parallelism; a search for DeepSpeed (which runs no tp at all) once
    priced that candidate on the missing layout and failed, where it plans data parallel."""
    from planner.planning import make_plan

    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    handle = resolve_hf_config(config_dirs["mixtral"])
    training = Training(global_batch_size=8, seq_len=SEQ, dtype="fp32")
    plan = make_plan(handle, cluster, training, target="deepspeed")
    assert plan.strategy.tp == 1 and plan.target.startswith("deepspeed")


def test_pinned_sequence_parallelism_a_traced_moe_cannot_run_says_why(config_dirs):
    """Pinned alone, sequence parallelism names the layout that cannot keep it through the
    experts (not "no mesh divides the heads"); pinned beside ep, the fix offers no
    Megatron-LM, which cannot build a traced model."""
    from planner.planning import make_plan
    from planner.solve.search import Pins

    handle = resolve_hf_config(config_dirs["mixtral"])
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=4)
    training = Training(global_batch_size=8, seq_len=SEQ, dtype="fp32")
    with pytest.raises(SpecError, match=r"sequence parallelism at tp 2: no layout keeps"):
        make_plan(handle, cluster, training, pins=Pins(sequence_parallel=True))
    with pytest.raises(SpecError, match=r"beside ep\(2\) > 1: .*\(turn sequence parallelism off\)"):
        make_plan(handle, cluster, training, pins=Pins(tp=2, ep=2, sequence_parallel=True))


def test_a_load_balancing_loss_is_priced_without_unknown_operators(config_dirs, caplog):
    """The routers' auxiliary loss counts tokens per expert (histc): priced by its bytes."""
    handle = resolve_hf_config(config_dirs["mixtral"])
    handle.module.config.output_router_logits = True
    with caplog.at_level(logging.WARNING):
        trace(handle, seq_len=SEQ)
    assert "histc" not in caplog.text and "no pricing rule" not in caplog.text


def test_the_expected_load_dispatch_switches_only_the_tracers_copy(config_dirs):
    """The model built (on meta too: plan run materialises it) routes as transformers
    does; only the copy the tracer prices runs the expected-load dispatch."""
    from planner.tracing.tracer import prepare_traced_module

    meta = resolve_hf_config(config_dirs["mixtral"])
    cpu = resolve_hf_config(config_dirs["mixtral"], device="cpu").module
    for model in (meta.module, cpu):
        assert "forward" not in vars(model.get_submodule("model.layers.0.mlp.experts"))
    traced, _, prefix = prepare_traced_module(meta, 1, 16, torch.float32)
    assert "forward" in vars(traced.get_submodule(prefix + "model.layers.0.mlp.experts"))


def test_unsupported_experts_layout_names_the_model_type(tmp_path):
    path = _write(tmp_path, "gpt_oss", **_DECODER, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(SpecError, match=r"gpt_oss: experts module .* is laid out has_bias=True"):
        resolve_hf_config(path)


# --- numerics on two gloo ranks ---------------------------------------------------------


def _model(path: str) -> nn.Module:
    torch.manual_seed(0)
    return resolve_hf_config(path, device="cpu").module


def _plan(path: str, world_size: int, strategy: Strategy, layout=None) -> str:
    handle = resolve_hf_config(path)
    cluster = Cluster(gpu="cpu", num_gpus=world_size, gpus_per_node=world_size)
    training = TRAINING.model_copy(update={"micro_batch_size": strategy.micro_batch_size})
    return assemble_plan(handle, cluster, training, strategy, tp_layout=layout).model_dump_json()


def _train(path: str, plan_json: str, rank: int) -> list[float]:
    plan = Plan.model_validate_json(plan_json)
    parallel = parallelize(_model(path), plan)
    trainer = Trainer(parallel, lr=LR, max_grad_norm=CLIP)
    losses = []
    for step in range(STEPS):
        inputs, targets = synthetic_batch(VOCAB, BATCH, SEQ, seed=0, step=step)
        losses.append(trainer.step(*local_slice(plan, rank, inputs, targets)))
    return losses


_DATA_PARALLEL = {  # one data-parallel runtime per family, DDP and FSDP alternating
    "llama": 3, "mistral": 0, "qwen2": 3, "gpt2": 0, "gpt_neox": 3, "mixtral": 3,
}  # fmt: skip
# Tensor parallelism of every family: tests/test_tp_matrix.py.


@pytest.mark.distributed
@pytest.mark.slow
def test_families_match_single_process_on_two_ranks(config_dirs, tmp_path):
    cases = {}
    for family, zero in _DATA_PARALLEL.items():
        strategy = Strategy(dp=2, zero=zero, micro_batch_size=BATCH // 2)
        plan_json = _plan(config_dirs[family], 2, strategy)
        cases[f"{family} {'fsdp' if zero else 'ddp'}"] = functools.partial(
            _train, config_dirs[family], plan_json
        )
    per_case = run_on_ranks(2, cases, tmp_path)
    # One process runs the ranks' two micro-batches one after the other: a micro-batch's
    # tokens decide how Mixtral's experts group them, and Adam turns the fp32 rounding of
    # another grouping into a loss 1.5e-4 away by the fourth step (the whole batch at
    # once); the same micro-batches agree to the bit.
    one_process = Strategy(micro_batch_size=BATCH // 2, num_microbatches=2)
    references = {
        family: _train(path, _plan(path, 1, one_process), 0) for family, path in config_dirs.items()
    }
    failures = []
    for name in cases:
        losses, other = per_case[name]
        if isinstance(losses, str) or other != losses:
            failures.append(f"{name}: {losses} / {other}")
            continue
        family = name.split()[0]
        expected = references[family]
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        print(f"{name:<28} max |loss - reference| = {worst:.2e} (bound {EXACT:.0e})")
        if worst > EXACT:
            failures.append(f"{name}: {losses} vs reference {expected}")
    assert not failures, "\n".join(failures)


# --- more families: every parallelism at once --------------------------------------------

_HEAD_DIM = {"head_dim": 16}
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# Families beside the ones above, each as its config's own code runs it (tensor parallel
# layouts of Phi-3's fused projections and OLMo2's norms: tests/test_tp_matrix.py), with
# heads untied (Gemma and Cohere tie theirs by default, which a pipeline refuses)
MORE_FAMILIES = {
    "qwen3": {**_DECODER, **_HEAD_DIM},
    "gemma2": {**_DECODER, **_HEAD_DIM, "sliding_window": 8, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "gemma3_text": {**_DECODER, **_HEAD_DIM, "sliding_window": 8},
    "cohere": _DECODER,
    "stablelm": _DECODER,
    "starcoder2": {**_DECODER, "sliding_window": None},
    "granite": _DECODER,
    "qwen3_moe": {**_DECODER, **_HEAD_DIM, **_EXPERTS, "decoder_sparse_step": 1},
    "olmoe": {**_DECODER, **_EXPERTS},
    "phi3": {**_DECODER, "pad_token_id": 0},
    "olmo2": _DECODER,
    # latent attention, a dense first layer, a shared expert and group-limited routing
    "deepseek_v3": {**_DECODER, "num_key_value_heads": 4, "intermediate_size": 96,
                    "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 24,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                    "v_head_dim": 16, "n_group": 2, "topk_group": 1, "rope_scaling": None},
}  # fmt: skip
# Mixtral's experts layout under dp x tp: tests/test_tp_matrix.py, test_runtime_expert_parallel
_EXPERTS_AS_MIXTRALS = {"qwen3_moe", "olmoe"}
_TP_MATRIX = {"phi3", "olmo2"}  # dp x tp in tests/test_tp_matrix.py
# context parallelism refuses Gemma-2's eager attention and Gemma-3's sliding windows
_NO_CONTEXT_PARALLEL = {"gemma2", "gemma3_text"}
MORE_FAMILIES = {
    family: {**fields, "tie_word_embeddings": False} for family, fields in MORE_FAMILIES.items()
}


def _searched(path: str, world_size: int, pins: Pins, device: str) -> str:
    """The plan the search emits for ``pins`` on ``world_size`` ranks of ``device``, in
    two micro-batches, trained with SGD (Adam would magnify fp32 rounding towards the
    bound, as it does for Mixtral above)."""
    cluster = Cluster(gpu=device, num_gpus=world_size, gpus_per_node=world_size)
    training = Training(
        **{**TRAINING.model_dump(), "micro_batch_size": BATCH // 2, "optimizer": "sgd"}
    )
    return make_plan(resolve_hf_config(path), cluster, training, pins=pins).model_dump_json()


def _searched_from(arguments: tuple[str, int, Pins, str]) -> str:
    return _searched(*arguments)


def test_norms_scaling_by_one_plus_weight_run_on_shards(tmp_path):
    """Gemma's norms scale by ``1 + weight``, an operator of the weight alone, before
    meeting the activations: the weight stays whole with a partial gradient (summed once
    per micro-batch), so its q/k norms keep the heads split and attention runs on
    shards (they were replicated, and attention computed whole on every rank)."""
    device = str(write_tp_pays(tmp_path))
    path = _write(tmp_path, "gemma3_text", **MORE_FAMILIES["gemma3_text"])
    plan = Plan.model_validate_json(
        _searched(path, 2, Pins(dp=1, tp=2, pp=1, sequence_parallel=False), device)
    )
    norms = {fqn: entry for fqn, entry in plan.tp_layout.items() if fqn.endswith("_norm")}
    assert {e.style for e in norms.values()} == {TPStyle.SEQUENCE_PARALLEL}, norms
    q_norm = norms["model.layers.*.self_attn.q_norm"]
    assert q_norm.params == {"weight": "Replicate()"}
    assert q_norm.input == ("Shard(1)", "Shard(1)")  # (batch, heads, seq, head_dim)


@pytest.mark.distributed
@pytest.mark.slow
def test_more_families_match_single_process_under_tensor_pipeline_and_context_parallelism(
    tmp_path,
):
    """Each family trains on four gloo ranks as one process does with the same two
    micro-batches: two pipeline stages of two tensor-parallel ranks each (the search's
    layout, schedule and expert parallelism); each dense family and DeepSeek-V3 as two
    data-parallel replicas (DDP and FSDP2 by turns) of two tensor-parallel ranks; and
    each family whose attention context parallelism runs as two data-parallel replicas
    (the other of the two) of two context-parallel ranks."""
    device = str(write_tp_pays(tmp_path))
    paths = {family: _write(tmp_path, family, **fields) for family, fields in MORE_FAMILIES.items()}
    meshes = {"tp2 x pp2": (1, 2, 2, 1), "dp2 x tp2": (2, 2, 1, 1), "dp2 x cp2": (2, 1, 1, 2)}
    wanted = {
        "tp2 x pp2": set(paths),
        "dp2 x tp2": set(paths) - _EXPERTS_AS_MIXTRALS - _TP_MATRIX,
        "dp2 x cp2": set(paths) - _NO_CONTEXT_PARALLEL,
    }
    searches = {
        (family, mesh): (
            path,
            4,
            Pins(dp=dp, tp=tp, pp=pp, cp=cp, zero=3 * ((i + cp) % 2) if dp > 1 else None),
            device,
        )
        for i, (family, path) in enumerate(paths.items())
        for mesh, (dp, tp, pp, cp) in meshes.items()
        if family in wanted[mesh]
    }
    plans = dict(zip(searches, map_in_processes(_searched_from, searches.values()), strict=True))
    for (family, mesh), plan_json in plans.items():
        strategy = Plan.model_validate_json(plan_json).strategy
        assert (strategy.dp, strategy.tp, strategy.pp, strategy.cp) == meshes[mesh], family
    # one launch: each rank trains one plan after another (gradient clipping once waited
    # forever in the second of a pipelined and a data-parallel plan: strategies/clipping.py)
    cases = {
        f"{f} {m}": functools.partial(_train, paths[f], plan) for (f, m), plan in plans.items()
    }
    per_case = run_on_ranks(4, cases, tmp_path)
    one_process = Pins(dp=1, tp=1, pp=1)
    references = {f: _train(p, _searched(p, 1, one_process, device), 0) for f, p in paths.items()}
    failures = []
    for name, ranks in per_case.items():
        if any(isinstance(losses, str) for losses in ranks):
            failures.append(f"{name}: {ranks}")
            continue
        expected = references[name.split()[0]]
        worst = max(abs(a - b) for losses in ranks for a, b in zip(losses, expected, strict=True))
        print(f"{name:<22} max |loss - reference| = {worst:.2e} (bound {EXACT:.0e})")
        if worst > EXACT:
            failures.append(f"{name}: {ranks} vs reference {expected}")
    assert not failures, "\n".join(failures)
