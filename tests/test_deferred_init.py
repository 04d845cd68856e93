"""Deferred initialisation: a model built on the meta device, parallelised, gets only its
shards and the same full weights under every plan, then trains like one process.

Each case builds its model under ``torch.device("meta")``, applies a plan on gloo ranks
(every strategy the runtime has, the zoo Llama, a user module and a Hugging Face Llama)
and reports the gathered weights right after initialisation and the losses of
``STEPS`` steps; the single-process reference initialises the same meta model with the
same seed.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner
from planner.assemble import assemble_plan
from planner.errors import SpecError
from planner.models import ModelHandle, build, get_preset
from planner.spec import Cluster, Plan, Strategy, Training
from strategies.apply import parallelize
from strategies.parallel_model import local_slice
from strategies.runner import Trainer, synthetic_batch
from tests.ranks import run_on_ranks
from tests.test_runtime_numerics import (
    BATCH,
    CLIP,
    LR,
    SEQ,
    STEPS,
    VOCAB,
    Case,
    _per_rank,
    build_handle,
    parameter_digests,
)
from tests.user_models import GPT, ComplexRopeLlama, MaskBufferGPT, RopeLlama

SEED = 7


def meta_model(model: str) -> nn.Module:
    """The case's model built on the meta device (no values)."""
    if model == "tiny-llama":
        return build(get_preset(model), device="meta")
    if model == "tiny-gpt-tied":
        return build(get_preset("tiny-gpt").model_copy(update={"tied_embeddings": True}))
    if model == "user-llama-rope":  # its rotary tables keep what __init__ computes
        with planner.parameters_on_meta():
            return build_handle(model).module
    with torch.device("meta"):
        return build_handle(model).module


def train_deferred(case: Case, world_size: int, rank: int) -> dict[str, Any]:
    """Gathered weights after deferred initialisation, then the losses of ``STEPS`` steps."""
    plan = case.plan(world_size)
    parallel = parallelize(meta_model(case.model), plan, seed=SEED)
    initial = parameter_digests(parallel)
    trainer = Trainer(parallel, lr=LR, max_grad_norm=CLIP)
    losses = []
    for step in range(STEPS):
        inputs, targets = synthetic_batch(VOCAB, BATCH, SEQ, seed=0, step=step)
        losses.append(trainer.step(*local_slice(plan, rank, inputs, targets)))
    return {"initial": initial, "losses": losses}


@functools.cache
def reference(model: str) -> dict[str, Any]:
    return train_deferred(Case("reference", model, {"micro_batch_size": BATCH}), 1, 0)


def _cases(model: str, *, pipelines: bool = True, cp: bool = True) -> list[Case]:
    layout = None if model == "tiny-llama" else "ilp"  # the sharding ILP's layout
    cases = [
        Case(f"{model} ddp", model, _per_rank(4)),
        Case(f"{model} fsdp", model, _per_rank(4, zero=3)),
        Case(f"{model} hsdp 2x2", model, _per_rank(4, zero=3, dp_shard=2)),
        Case(f"{model} tp2 x fsdp2", model, _per_rank(2, tp=2, zero=3), layout=layout),
        Case(f"{model} ddp over tp", model, _per_rank(2, tp=2), layout=layout),
    ]
    if pipelines:
        cases += [
            Case(
                f"{model} pp2 1f1b x zero2", model, _per_rank(2, pp=2, zero=2, num_microbatches=2)
            ),
            Case(
                f"{model} pp2 interleaved x tp2",
                model,
                _per_rank(
                    1, pp=2, tp=2, num_microbatches=4, schedule="interleaved-1f1b", virtual_stages=2
                ),
                layout=layout,
            ),
        ]
    if cp:
        cases.append(Case(f"{model} cp2 x fsdp2", model, _per_rank(2, cp=2, zero=3)))
    return cases


NANOGPT = [  # nanoGPT's shape: fused qkv, ModuleList blocks, its own forward
    Case("user-gpt fsdp", "user-gpt", _per_rank(4, zero=3)),
    Case("user-gpt ddp over tp", "user-gpt", _per_rank(2, tp=2), layout="ilp"),
    Case("user-gpt pp2 1f1b x zero2", "user-gpt", _per_rank(2, pp=2, zero=2, num_microbatches=2)),
]
TIED = [  # one weight in two modules: initialised once, still one tensor when sharded
    Case("tiny-gpt-tied ddp", "tiny-gpt-tied", _per_rank(4)),
    Case("tiny-gpt-tied fsdp", "tiny-gpt-tied", _per_rank(4, zero=3)),
    # Its losses are near 40 (the tied weight keeps nn.Embedding's N(0, 1) init, as the
    # model built on the CPU does): 5e-5 is about 1e-6 of the loss.
    Case("tiny-gpt-tied tp2 x fsdp2", "tiny-gpt-tied", _per_rank(2, tp=2, zero=3), bound=5e-5),
    Case("user-gpt-tied fsdp", "user-gpt-tied", _per_rank(4, zero=3)),
    Case("user-gpt-tied ddp", "user-gpt-tied", _per_rank(4)),
]
ROPE = [  # a Llama of one's own: rotary buffers computed in __init__, parameters on meta
    Case("user-llama-rope fsdp", "user-llama-rope", _per_rank(4, zero=3)),
    Case("user-llama-rope tp2 x fsdp2", "user-llama-rope", _per_rank(2, tp=2, zero=3), layout="ilp"),
    Case("user-llama-rope pp2 1f1b x zero2", "user-llama-rope",
         _per_rank(2, pp=2, zero=2, num_microbatches=2)),
    Case("user-llama-rope cp2 x fsdp2", "user-llama-rope", _per_rank(2, cp=2, zero=3)),
]  # fmt: skip
WORLD4 = (
    _cases("tiny-llama")
    + _cases("tiny-lm", cp=False)
    + _cases("hf-llama", pipelines=False)
    + NANOGPT
    + TIED
    + ROPE
)
WORLD2 = [Case("hf-llama pp2 1f1b", "hf-llama", _per_rank(1, pp=2, num_microbatches=2))]
WORLD8 = [
    Case("tiny-llama pp2 x tp2 x fsdp2", "tiny-llama",
         _per_rank(2, pp=2, tp=2, zero=3, num_microbatches=2)),
]  # fmt: skip


def _failures(cases: list[Case], per_case: dict[str, list[Any]]) -> list[str]:
    failures = []
    for case in cases:
        results = per_case[case.name]
        raised = next((r for r in results if isinstance(r, str)), None)
        if raised is not None:
            failures.append(f"{case.name}: raised\n{raised}")
            continue
        expected = reference(case.model)
        held = {name: d for result in results for name, d in result["initial"].items()}
        if held != expected["initial"]:
            wrong = sorted(n for n in expected["initial"] if held.get(n) != expected["initial"][n])
            failures.append(f"{case.name}: initial weights differ from one process: {wrong}")
        losses = results[0]["losses"]
        worst = max(abs(a - b) for a, b in zip(losses, expected["losses"], strict=True))
        print(f"{case.name:<36} weights equal; max |loss - reference| = {worst:.2e}")
        if worst > case.bound:
            failures.append(f"{case.name}: losses {losses} vs {expected['losses']}")
    return failures


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "cases"),
    [(2, WORLD2), (4, WORLD4), (8, WORLD8)],
    ids=["world2", "world4", "world8"],
)
def test_deferred_init_matches_single_process(
    world_size: int, cases: list[Case], tmp_path: Path
) -> None:
    tasks = {
        case.name: functools.partial(train_deferred, case.planned(world_size), world_size)
        for case in cases
    }
    failures = _failures(cases, run_on_ranks(world_size, tasks, tmp_path))
    assert not failures, "\n".join(failures)


def test_same_seed_same_weights_and_different_seed_differs() -> None:
    plan = Case("one", "tiny-lm", {"micro_batch_size": BATCH}).plan(1)
    first = parameter_digests(parallelize(meta_model("tiny-lm"), plan, seed=1))
    again = parameter_digests(parallelize(meta_model("tiny-lm"), plan, seed=1))
    other = parameter_digests(parallelize(meta_model("tiny-lm"), plan, seed=2))
    assert first == again
    assert first["embed.weight"] != other["embed.weight"]


@pytest.mark.parametrize("model", ["tiny-gpt-tied", "user-gpt-tied"])
def test_tied_weights_stay_one_tensor(model: str) -> None:
    """``to_empty`` gives each module a tensor of its own; deferred initialisation ties
    them again, so the head trains the embedding (as the model built on the CPU does)."""
    plan = Case("one", model, {"micro_batch_size": BATCH}).plan(1)
    parallel = parallelize(meta_model(model), plan, seed=0)
    built = build_handle(model).module
    tied = {name for name, _ in built.named_parameters(remove_duplicate=False)} - {
        name for name, _ in built.named_parameters()
    }
    assert tied, f"{model} has no tied weight"
    ours = dict(parallel.module.named_parameters(remove_duplicate=False))
    assert len(ours) == len(dict(built.named_parameters(remove_duplicate=False)))
    assert len(list(parallel.parameters())) == len(list(built.parameters()))


def test_hf_rotary_buffers_recomputed() -> None:
    plan = Case("one", "hf-llama", {"micro_batch_size": BATCH}).plan(1)
    parallel = parallelize(meta_model("hf-llama"), plan, seed=0)
    built = build_handle("hf-llama").module
    ours = dict(parallel.module.named_buffers())
    for name, buffer in built.named_buffers():
        assert torch.equal(ours[name], buffer), name


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _Uninitialisable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.scale = _Scale()
        self.head = nn.Linear(4, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.scale(self.embed(tokens)))


def _one_process_plan(model: nn.Module) -> Plan:
    handle = ModelHandle("m", "tests:m", model, lambda b, s: (torch.zeros(b, s, dtype=torch.long),))
    training = Training(global_batch_size=2, micro_batch_size=2, seq_len=4, dtype="fp32")
    return assemble_plan(
        handle, Cluster(gpu="cpu", num_gpus=1), training, Strategy(micro_batch_size=2)
    )


def test_a_tensor_no_initialiser_sets_is_named_with_the_fix() -> None:
    plan = _one_process_plan(_Uninitialisable())
    with torch.device("meta"):
        model = _Uninitialisable()
    with pytest.raises(SpecError, match=r"'scale.weight' \(_Scale\) was not initialised.*init="):
        parallelize(model, plan)
    with torch.device("meta"):
        model = _Uninitialisable()

    def init(module: nn.Module) -> None:
        for param in module.parameters(recurse=False):
            nn.init.normal_(param)

    parallel = parallelize(model, plan, init=init)
    assert not any(p.isnan().any() for p in parallel.parameters())


def test_a_half_meta_model_is_refused() -> None:
    model = _Uninitialisable()
    plan = _one_process_plan(model)
    model.head.to("meta")
    with pytest.raises(
        SpecError, match=r"parameter 'head\.weight' is on the meta device but 'embed\.weight'"
    ):
        parallelize(model, plan)


def test_a_meta_buffer_beside_real_parameters_is_refused() -> None:
    model = RopeLlama(n_layer=1)
    plan = _one_process_plan(model)
    model.freqs_cos = model.freqs_cos.to("meta")
    with pytest.raises(SpecError, match=r"buffer 'freqs_cos' is on the meta device but"):
        parallelize(model, plan)


def test_buffers_computed_in_init_keep_their_values_beside_meta_parameters() -> None:
    """Rotary tables a module computes in ``__init__``: built under
    ``parameters_on_meta`` they keep their values through deferred initialisation; built
    under ``torch.device("meta")`` they have none, and the error says how to build."""
    built = RopeLlama(n_layer=1)
    plan = _one_process_plan(built)
    with planner.parameters_on_meta():
        model = RopeLlama(n_layer=1)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    parallel = parallelize(model, plan, seed=0)
    ours = dict(parallel.module.named_buffers())
    for name, buffer in built.named_buffers():
        assert torch.equal(ours[name], buffer), name
    assert not any(p.is_meta or p.isnan().any() for p in parallel.parameters())
    with torch.device("meta"):
        model = RopeLlama(n_layer=1)
    with pytest.raises(
        SpecError,
        match=r"'freqs_cos' \(RopeLlama\) is a buffer built on the meta device.*"
        r"planner\.parameters_on_meta\(\)",
    ):
        parallelize(model, plan)


def _built_on_the_cpu(plan_json: str, seed_per_rank: bool, rank: int) -> str:
    """Build the user module on the CPU (seeded alike, or by rank) and parallelise it."""
    torch.manual_seed(rank if seed_per_rank else 0)
    model = GPT(n_layer=4)  # build_handle("user-gpt")'s model, without its seed
    try:
        parallelize(model, Plan.model_validate_json(plan_json))
    except SpecError as exc:
        return str(exc)
    return "ran"


@pytest.mark.distributed
def test_ranks_that_built_different_weights_are_refused(tmp_path: Path) -> None:
    """A model built on a real device is what the plan cuts on every rank: ranks seeded
    apart would hold different copies of what tensor parallelism keeps replicated (and
    train them apart without an error), so they are refused, naming a tensor."""
    strategy = Strategy(tp=2, sequence_parallel=False, micro_batch_size=BATCH)
    plan = Case("user-gpt tp", "user-gpt", strategy.model_dump(), layout="ilp").plan(2)
    tasks = {
        name: functools.partial(_built_on_the_cpu, plan.to_json(), apart)
        for name, apart in (("alike", False), ("apart", True))
    }
    results = run_on_ranks(2, tasks, tmp_path)
    assert results["alike"] == ["ran", "ran"]
    differ = "the ranks built different weights: 'transformer.wte.weight'"
    assert all(differ in r for r in results["apart"])


def test_an_integer_or_boolean_buffer_left_without_values_is_named() -> None:
    """A boolean mask built on meta has no values, and nothing computes it again: it is
    named (it trained on uninitialised memory), as a floating one is."""
    plan = _one_process_plan(MaskBufferGPT())
    with torch.device("meta"):
        model = MaskBufferGPT()
    with pytest.raises(SpecError, match=r"'mask' \(MaskBufferGPT\) is a buffer built on the meta"):
        parallelize(model, plan)
    with planner.parameters_on_meta():
        model = MaskBufferGPT()
    parallel = parallelize(model, plan)
    assert torch.equal(dict(parallel.module.named_buffers())["mask"], MaskBufferGPT().mask)


class _SharedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 4), nn.Linear(4, VOCAB)
        self.embed.register_buffer("table", torch.arange(4.0))
        self.head.register_buffer("table", self.embed.table)  # one tensor, two holders

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens) * self.embed.table * self.head.table)


def test_a_buffer_two_modules_share_stays_one_tensor() -> None:
    plan = _one_process_plan(_SharedTable())
    with planner.parameters_on_meta():
        model = _SharedTable()
    parallel = parallelize(model, plan).module
    assert parallel.embed.table is parallel.head.table
    assert torch.equal(parallel.head.table, torch.arange(4.0))


def test_plan_run_keeps_buffers_as_built() -> None:
    """``plan run`` casts the parameters to the plan's dtype, not the buffers: a complex
    rotary table keeps its imaginary part (``Module.to(float32)`` dropped it, and the
    model trained on cosines alone)."""
    from planner.planning import make_plan
    from strategies.runner import model_to_run

    source = "tests.user_models:llama_complex_rope"
    training = Training(global_batch_size=2, seq_len=16, dtype="fp32")
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=1)
    plan = make_plan(planner.resolve_model(source), cluster, training)
    module = model_to_run(plan, "plan run").module
    assert torch.equal(module.freqs_cis, ComplexRopeLlama().freqs_cis)


def test_planning_a_module_of_your_own_allocates_no_parameter() -> None:
    """Planning builds a ``module:function`` on the meta device: a parameter larger than
    this machine's memory costs nothing (its buffers are not needed to plan)."""
    handle = planner.resolve_model("tests.user_models:huge_embedding")
    assert handle.module.tok_embeddings.weight.is_meta


def test_plan_run_builds_a_module_that_sets_its_parameters_in_init_on_the_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """nanoGPT's LayerNorm sets its parameters in ``__init__`` and has no
    ``reset_parameters``: built on the meta device it has no values, and ``plan run``
    says so with the fixes; ``--build-on cpu`` builds it as its function does (seeded
    with ``--seed``) and trains from those weights."""
    from planner.cli import main
    from planner.planning import make_plan
    from strategies.runner import synthetic_batch

    source = "tests.user_models:gpt_own_norm"
    training = Training(global_batch_size=2, seq_len=16, dtype="fp32")
    plan = make_plan(
        planner.resolve_model(source), Cluster(gpu="h100-sxm-80gb", num_gpus=1), training
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert main(["run", str(path), "--steps", "1"]) == 2
    assert "was not initialised" in (err := capsys.readouterr().err) and "--build-on cpu" in err
    assert (
        main(["run", str(path), "--steps", "1", "--build-on", "cpu", "--seed", "3", "--json"]) == 0
    )
    loss = json.loads(capsys.readouterr().out)["steps"][0]["loss"]
    model = planner.resolve_model(source, device="cpu", seed=3).module
    inputs, targets = synthetic_batch(VOCAB, 2, 16, seed=3, step=0)
    expected = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    assert loss == pytest.approx(expected.item(), rel=1e-6)
