"""What runs is what was priced: every tensor-parallel plan the search emits, on models
the project did not write, against one process.

Models: the zoo's GPT and Llama, a nanoGPT-style user module (fused ``c_attn``, blocks
in an ``nn.ModuleList``) and its tied variant, and tiny Hugging Face Llama (also with
tied embeddings), Qwen2, Mistral, GPT-2, GPT-NeoX, Falcon, Mixtral, Phi-3, OLMo2 and
Gemma 3 configs. Plans: what ``make_plan`` emits with the
tensor-parallel degree and sequence parallelism pinned (the expert-parallel degree is
the search's: for Mixtral it spreads the experts over the tp ranks), at tp 2 and 4 and dp 2 x tp 2
(DDP, or FSDP2 where DDP cannot keep tied weights over TP shards), on a test device where tensor parallelism pays even for tiny layers (slow compute, a
fast link). Every plan must

- train 3 SGD steps under gloo with the same losses and (gathered) parameters as one
  process, to 1e-5;
- hold exactly the parameter elements per rank its prediction counts (experts too);
- move exactly the tensor-parallel bytes per step its prediction counts, as counted
  at DTensor's collectives (:class:`strategies.comm_bytes.CollectiveBytes`).

Sequence parallelism is offered for every model but Mixtral, whose mixture-of-experts
block has no module boundary to re-shard its output at, Falcon, which modifies its
MLP's output in place (the rehearsal refuses a layout that would hand it on as a view of
``DTensor.to_local()``), and OLMo2, whose residual stream enters attention with no norm
before it. (GPT-2 reshapes its output to
the whole sequence in its own code: its sequence-parallel region ends at the last block.)
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from planner.cost import CostModel
from planner.errors import PlannerError
from planner.graph import OpGraph
from planner.layouts import FIXED_STYLE_PRICER, plan_layout
from planner.models import ModelHandle, resolve_model
from planner.modules import shares_parameters
from planner.parallel_dims import ParallelDims
from planner.planning import make_plan
from planner.solve.search import Pins
from planner.spec import Cluster, ModelSpec, Plan, Training
from planner.tracing import trace_for_training
from tests.devices import write_tp_pays
from tests.ranks import map_in_processes, run_on_ranks

pytest.importorskip("transformers")
from planner.hf import resolve_hf_config

SEQ, BATCH, VOCAB, STEPS, LR, EXACT = 16, 8, 256, 3, 0.05, 1e-5
TRAINING = Training(global_batch_size=BATCH, seq_len=SEQ, dtype="fp32", optimizer="sgd")
_DECODER = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}  # fmt: skip
HF = {
    "llama": _DECODER,
    "llama-tied": {**_DECODER, "tie_word_embeddings": True},
    "qwen2": _DECODER,
    "mistral": _DECODER,
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "gpt_neox": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64},
    "mixtral": {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
    # fused projections: q, k and v in one ``qkv_proj``, gate and up in one ``gate_up_proj``
    "phi3": {**_DECODER, "pad_token_id": 0},
    # norms after attention and MLP, and q/k norms over every head at once
    "olmo2": _DECODER,
    # norms that scale by ``1 + weight``, computed from the weight alone; sliding windows
    "gemma3_text": {**_DECODER, "head_dim": 16, "sliding_window": 8},
    # attention and MLP side by side, then ``mlp_output += attention_output`` in place
    "falcon": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_kv_heads": 4, "vocab_size": VOCAB, "new_decoder_architecture": True,
               "bias": False, "alibi": False, "max_position_embeddings": 64},
}  # fmt: skip
ZOO_LLAMA = ModelSpec(
    name="zoo-llama", family="llama", num_layers=2, hidden_size=64, num_heads=4,
    num_kv_heads=4, vocab_size=VOCAB, seq_len=SEQ,
)  # fmt: skip
# "-ep1": the search's plan with expert parallelism pinned off (experts whole beside TP).
MODELS = ["zoo-gpt", "zoo-llama", "nanogpt", "nanogpt-tied", *(f"hf-{f}" for f in HF),
          "hf-mixtral-ep1"]  # fmt: skip
MESHES = [(1, 2), (1, 4), (2, 2)]  # (dp, tp)
# Falcon adds to its MLP's output in place, which a sequence-parallel boundary there
# would hand on as a view of DTensor.to_local() that autograd will not let it modify.
# OLMo2 normalises after attention, so its residual stream enters q/k/v as it is: no
# norm to end a sequence-parallel region at (the layout ILP says so).
NO_SEQUENCE_PARALLEL = {"hf-mixtral", "hf-mixtral-ep1", "hf-falcon", "hf-olmo2"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-matrix")
    write_tp_pays(root)
    (root / "zoo-llama.json").write_text(ZOO_LLAMA.to_json())
    for family, fields in HF.items():
        model_type = family.removesuffix("-tied")
        (root / family).mkdir()
        (root / family / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
    return {"root": root}


def build(model: str, root: Path, device: str = "meta") -> ModelHandle:
    """The model, seeded: every rank and the reference start from the same weights."""
    torch.manual_seed(0)
    if model == "zoo-gpt":
        return resolve_model("tiny-gpt", device=device, seed=0)
    if model == "zoo-llama":
        return resolve_model(str(root / "zoo-llama.json"), device=device, seed=0)
    if model.startswith("nanogpt"):
        source = "tests.user_models:gpt_tied" if model.endswith("tied") else "tests.user_models:gpt"
        return resolve_model(source, device=device, seed=0)
    return resolve_hf_config(root / model.removeprefix("hf-").removesuffix("-ep1"), device=device)


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    plan: str  # JSON
    params: float  # predicted parameter elements per rank
    comm: dict[str, float]  # predicted TP bytes per step by "kind pass"


def _plan(model: str, root: Path, dp: int, tp: int, sp: bool) -> Plan:
    """ZeRO-0 where DDP runs; with tied weights over TP shards, ZeRO-2 replicates."""
    cluster = Cluster(gpu=str(root / "tp-pays.json"), num_gpus=dp * tp, gpus_per_node=8)
    handle = build(model, root)
    tied = ParallelDims(dp=dp, tp=tp).ddp_blocker(tied=shares_parameters(handle.module))
    pins = Pins(
        dp=dp, tp=tp, pp=1, cp=1, zero=0 if tied is None else 2, sequence_parallel=sp,
        recompute="none", micro_batch_size=BATCH // dp, ep=1 if model.endswith("-ep1") else None,
    )  # fmt: skip
    return make_plan(handle, cluster, TRAINING, pins=pins)


@functools.cache
def _traced(model: str, root: Path) -> tuple[ModelHandle, OpGraph]:
    """The model on meta and its training graph, traced once for every plan of it."""
    handle = build(model, root)
    return handle, trace_for_training(handle, TRAINING)


def _case(model: str, root: Path, dp: int, tp: int, sp: bool) -> Case:
    plan = _plan(model, root, dp, tp, sp)
    handle, graph = _traced(model, root)
    layout = plan_layout(handle, graph, plan, FIXED_STYLE_PRICER)
    priced = CostModel(graph, plan.cluster, TRAINING, tp_layouts=lambda t, s: layout.assignment)
    counted = priced.tp_comm_bytes(plan.strategy)
    return Case(
        f"{model} dp{dp} tp{tp}{' sp' if sp else ''}", model, plan.to_json(),
        priced.whole_model(plan.strategy).param_count,
        {f"{kind} {phase}": nbytes for (kind, phase), nbytes in counted.items() if nbytes},
    )  # fmt: skip


def _train(case: Case, root: Path, out: Path, rank: int) -> dict[str, Any]:
    from strategies.apply import parallelize
    from strategies.comm_bytes import CollectiveBytes
    from strategies.parallel_model import local_slice
    from strategies.runner import Trainer, synthetic_batch

    plan = Plan.model_validate_json(case.plan)
    parallel = parallelize(build(case.model, root, "cpu").module, plan)
    unique = {id(p): p for p in parallel.parameters()}.values()
    local = sum(_tp_local_elements(p) for p in unique)
    trainer = Trainer(parallel, lr=LR)
    losses, counted = [], None
    for step in range(STEPS):
        batch = local_slice(plan, rank, *synthetic_batch(VOCAB, BATCH, SEQ, seed=0, step=step))
        if step == 0:
            with CollectiveBytes() as counted:
                losses.append(trainer.step(*batch))
        else:
            losses.append(trainer.step(*batch))
    state = {k.removeprefix("module."): v for k, v in parallel.state_dict().items()}
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in state.items()
    }
    if rank == 0:
        torch.save(full, out / f"{case.name}.pt")
    assert counted is not None
    bytes_ = {f"{kind} {phase}": float(n) for (kind, phase), n in counted.bytes.items()}
    return {"losses": losses, "local_params": local, "comm": bytes_}


def _tp_local_elements(param: torch.Tensor) -> int:
    """Elements a tensor-parallel rank holds of ``param``: its share of the ``tp`` axis,
    and of the experts' ``ep`` axis when the search chose expert parallelism (a
    data-parallel FSDP2 shard of it counts whole, as the prediction does)."""
    if not isinstance(param, DTensor):
        return param.numel()  # plain, or DDP's local shard of a tensor-parallel one
    shape = list(param.shape)
    names = param.device_mesh.mesh_dim_names or ()
    for axis, placement in enumerate(param.placements):
        if placement.is_shard() and names[axis] in ("tp", "ep"):
            shape[placement.dim] //= param.device_mesh.size(axis)
    return math.prod(shape)


def _reference(model: str, root: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: 3 SGD steps of the whole model on the whole batch."""
    from strategies.apply import parallelize
    from strategies.runner import Trainer, synthetic_batch

    cluster = Cluster(gpu=str(root / "tp-pays.json"), num_gpus=1)
    plan = make_plan(build(model, root), cluster, TRAINING, pins=Pins(micro_batch_size=BATCH))
    parallel = parallelize(build(model, root, "cpu").module, plan)
    trainer = Trainer(parallel, lr=LR)
    losses = [
        trainer.step(*synthetic_batch(VOCAB, BATCH, SEQ, seed=0, step=step))
        for step in range(STEPS)
    ]
    return losses, {k: v.detach() for k, v in parallel.state_dict().items()}


def _case_or_refusal(args: tuple[str, Path, int, int, bool]) -> Case | str:
    model, root, dp, tp, sp = args
    try:
        return _case(model, root, dp, tp, sp)
    except PlannerError as exc:
        return f"{model} dp{dp} tp{tp}{' sp' if sp else ''}: {exc}"


def _cases(root: Path, world: int) -> tuple[list[Case], list[str]]:
    """The plans of every model at each mesh of ``world`` ranks, and those not offered."""
    wanted = [
        (model, root, dp, tp, sp)
        for model in MODELS
        for dp, tp in MESHES
        if dp * tp == world
        for sp in (False, True)
    ]
    made = map_in_processes(_case_or_refusal, wanted)
    return [c for c in made if isinstance(c, Case)], [r for r in made if isinstance(r, str)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_emitted_plan_runs_matches_and_is_priced_exactly(setup, tmp_path, world):
    root = setup["root"]
    cases, refused = _cases(root, world)
    expected_refusals = {
        f"{model} dp{dp} tp{tp} sp"
        for model in NO_SEQUENCE_PARALLEL
        for dp, tp in MESHES
        if dp * tp == world
    }
    assert {line.split(":")[0] for line in refused} == expected_refusals, refused
    assert all("sequence" in line for line in refused), refused
    mixtral_ep = {
        c.name: Plan.model_validate_json(c.plan).strategy.ep for c in cases if "mixtral" in c.model
    }
    assert all((ep == 1) == ("-ep1" in name) for name, ep in mixtral_ep.items()), mixtral_ep
    tasks = {case.name: functools.partial(_train, case, root, tmp_path) for case in cases}
    per_case = run_on_ranks(world, tasks, tmp_path)
    references = {model: _reference(model, root) for model in MODELS}
    failures = []
    for case in cases:
        result = per_case[case.name][0]
        if isinstance(result, str):
            failures.append(f"{case.name}: {result}")
            continue
        losses, params = references[case.model]
        loss_gap = max(abs(a - b) for a, b in zip(result["losses"], losses, strict=True))
        trained = torch.load(tmp_path / f"{case.name}.pt")
        param_gap = max(float((trained[k] - params[k]).abs().max()) for k in params)
        print(
            f"{case.name:<28} loss {loss_gap:.1e} params {param_gap:.1e} "
            f"elements/rank {result['local_params']:.0f} (predicted {case.params:.0f}) "
            f"TP bytes/step {sum(result['comm'].values()):.0f} "
            f"(predicted {sum(case.comm.values()):.0f})"
        )
        if loss_gap > EXACT or param_gap > EXACT:
            failures.append(f"{case.name}: loss {loss_gap:.2e}, params {param_gap:.2e}")
        if result["local_params"] != case.params:
            failures.append(f"{case.name}: {result['local_params']} elements, {case.params} priced")
        if result["comm"] != pytest.approx(case.comm):
            failures.append(f"{case.name}: counted {result['comm']}, priced {case.comm}")
    assert not failures, "\n".join(failures)
