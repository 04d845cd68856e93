"""Pipelines of any model with repeated blocks: zoo, Hugging Face and user modules.

The runtime cuts stages itself (:mod:`planner.staging`): blocks of other stages become
skips of their container (an ``nn.ModuleList`` keeps its indices), other modules
parameter-free stand-ins, and the model's own forward runs each stage. The
multi-process cases reuse :mod:`tests.test_runtime_numerics`' harness (every case within
``EXACT`` of one process on every step; SGD cases on the gathered parameters too). The
fast tests chain stages in one process, and check that what cannot run as a pipeline is
refused with its reason, by the search as well as at runtime.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from planner.errors import SpecError
from planner.models import handle_for_module, resolve_model
from planner.modules import pipeline_blocker
from planner.planning import make_plan
from planner.solve.search import Pins
from planner.spec import Cluster, Training
from planner.staging import (
    STAGE_IDS,
    build_chunk,
    install_stage_forward,
    split_problem,
    stage_problem,
)
from strategies.pipeline import check_split
from tests.test_runtime_numerics import (
    SEQ,
    Case,
    _compare,
    _per_rank,
    build_handle,
    run_cases,
)
from tests.user_models import GPT, gpt_tied

PIPE = {"pp": 2, "num_microbatches": 2}
INTERLEAVED = {"pp": 2, "virtual_stages": 2, "num_microbatches": 2}


def _pp(name: str, model: str, schedule: str = "1f1b", **strategy: object) -> Case:
    shape = INTERLEAVED if schedule == "interleaved-1f1b" else PIPE
    return Case(
        name, model, _per_rank(strategy.pop("dp", 1), **shape, schedule=schedule, **strategy)
    )


WORLD2 = [
    _pp("user gpt (ModuleList) 1f1b", "user-gpt"),
    _pp("user gpt interleaved", "user-gpt", "interleaved-1f1b"),
    _pp("user gpt zero-bubble", "user-gpt", "zero-bubble"),
    _pp("tiny-lm (ModuleDict, plain forward) 1f1b", "tiny-lm"),
    _pp("hf-llama 1f1b", "hf-llama4"),
    _pp("hf-llama gpipe", "hf-llama4", "gpipe"),
    _pp("hf-llama interleaved", "hf-llama4", "interleaved-1f1b"),
    _pp("hf-llama zero-bubble", "hf-llama4", "zero-bubble"),
    _pp("hf-qwen2 1f1b", "hf-qwen2-4"),
    _pp("hf-mistral interleaved", "hf-mistral-4", "interleaved-1f1b"),
    _pp("hf-gpt2 (untied) 1f1b", "hf-gpt2"),
    _pp("hf-gpt-neox zero-bubble", "hf-gpt_neox", "zero-bubble"),
    _pp("hf-llama 1f1b recompute full", "hf-llama4", recompute="full"),
    _pp("user gpt zero-bubble recompute full", "user-gpt", "zero-bubble", recompute="full"),
    _pp("hf-qwen2 interleaved recompute selective", "hf-qwen2-4", "interleaved-1f1b",
        recompute="selective"),
    _pp("tiny-llama 1f1b", "tiny-llama"),
    Case("hf-llama 1f1b (sgd)", "hf-llama4", _per_rank(1, **PIPE), optimizer="sgd"),
    Case("user gpt zero-bubble (sgd)", "user-gpt", _per_rank(1, **PIPE, schedule="zero-bubble"),
         optimizer="sgd"),
    Case("hf-gpt2 1f1b (sgd)", "hf-gpt2", _per_rank(1, **PIPE), optimizer="sgd"),
    Case("hf-mixtral 1f1b (sgd)", "hf-mixtral", _per_rank(1, **PIPE), optimizer="sgd"),
]  # fmt: skip
WORLD4 = [
    _pp("hf-llama pp2 x dp2 (zero 1)", "hf-llama4", dp=2, zero=1),
    _pp("hf-llama pp2 x dp2 (fsdp) interleaved", "hf-llama4", "interleaved-1f1b", dp=2, zero=3),
    _pp("user gpt pp2 x dp2 (zero 2) zero-bubble", "user-gpt", "zero-bubble", dp=2, zero=2),
    Case("hf-llama pp2 x tp2", "hf-llama4", _per_rank(1, **PIPE, tp=2, zero=2), layout="ilp"),
    Case("hf-qwen2 pp2 x tp2+sp", "hf-qwen2-4",
         _per_rank(1, **PIPE, tp=2, zero=2, sequence_parallel=True), layout="ilp sp"),
    Case("user gpt pp2 x tp2", "user-gpt", _per_rank(1, **PIPE, tp=2, zero=2), layout="ilp"),
    _pp("hf-llama pp2 x cp2 (fsdp over cp)", "hf-llama4", cp=2, zero=3),
    _pp("user gpt (positions) pp2 x cp2 interleaved", "user-gpt-positions", "interleaved-1f1b",
        cp=2, zero=1),
    Case("hf-llama pp2 x dp2 (sgd)", "hf-llama4", _per_rank(2, **PIPE, zero=1), optimizer="sgd"),
    Case("hf-mixtral pp2 x dp2 (fsdp, sgd)", "hf-mixtral", _per_rank(2, **PIPE, zero=3),
         optimizer="sgd"),
]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "cases"), [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"]
)
def test_pipelines_match_single_process_on_any_model(
    world_size: int, cases: list[Case], tmp_path: Path
) -> None:
    failures = _compare(cases, run_cases(world_size, cases, tmp_path))
    assert not failures, "\n".join(failures)


# --- stages in one process ----------------------------------------------------------------


def _chained(model: nn.Module, stages: list[list[str]], ids: torch.Tensor) -> torch.Tensor:
    """The logits of ``model`` run as ``stages`` one after the other, as the runtime does."""
    hidden = None
    for index, fqns in enumerate(stages):
        chunk = build_chunk(model, fqns)
        install_stage_forward(chunk, first=index == 0, last=index == len(stages) - 1)
        hidden = chunk(ids) if hidden is None else chunk(hidden, **{STAGE_IDS: ids})
    assert hidden is not None
    return hidden


@pytest.mark.parametrize("model", ["user-gpt", "tiny-lm", "tiny-gpt", "hf-llama4", "hf-gpt2"])
def test_stages_chained_in_one_process_equal_the_whole_model(model: str) -> None:
    handle = build_handle(model)
    module = handle.module.eval()
    stages = list(Case("x", model, _per_rank(1, pp=4)).plan(4).stages)
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    whole = module(ids)
    expected = getattr(whole, "logits", whole)
    torch.testing.assert_close(_chained(module, stages, ids), expected, rtol=0, atol=0)


def test_a_chunk_keeps_whole_model_names_and_list_positions() -> None:
    model = GPT(n_layer=4)
    chunk = build_chunk(
        model, ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]
    )
    names = {name for name, _ in chunk.named_parameters()}
    assert names and all(
        name.startswith(("transformer.h.2.", "transformer.h.3.", "transformer.ln_f.", "lm_head."))
        for name in names
    )
    assert len(chunk.transformer.h) == 4  # positions of the whole model
    assert chunk.transformer.h[3] is chunk.transformer.h._modules["3"]
    hidden = torch.randn(1, 4, 64)
    assert chunk.transformer.h[0](hidden) is hidden  # another stage's block: a skip
    kept = sum(p.numel() for p in chunk.parameters())
    first = build_chunk(model, ["transformer.wte", "transformer.wpe", "transformer.h.0",
                                "transformer.h.1"])  # fmt: skip
    assert kept + sum(p.numel() for p in first.parameters()) == sum(
        p.numel() for p in model.parameters()
    )


def test_a_zoo_chunk_keeps_its_module_dict_keys_in_whole_model_order() -> None:
    model = resolve_model("tiny-gpt", device="cpu", seed=0).module
    chunk = build_chunk(model, ["layers.2", "layers.3", "norm", "output"])
    assert list(chunk.layers.keys()) == ["0", "1", "2", "3"]
    assert [name for name, _ in chunk.layers.named_children()] == ["2", "3"]
    assert "tok_embeddings" not in dict(chunk.named_children())  # a stand-in, not a module
    assert {name for name, _ in chunk.named_parameters()} == {
        name
        for name, _ in model.named_parameters()
        if not name.startswith(("tok_", "pos_", "layers.0", "layers.1"))
    }


@pytest.mark.parametrize(
    "model", ["user-gpt", "hf-llama4", "hf-qwen2-4", "hf-mistral-4", "hf-gpt2", "hf-gpt_neox",
              "hf-mixtral", "tiny-lm"]
)  # fmt: skip
def test_the_stage_check_passes_every_model_the_runtime_pipelines(model: str) -> None:
    module = build_handle(model).module
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    assert pipeline_blocker(module) is None
    assert stage_problem(module, (ids,)) is None


# --- what cannot run as a pipeline is refused, with its reason ------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class _LM(nn.Module):
    """Embedding, four blocks, head; ``wiring`` picks a forward no stage split can run."""

    def __init__(self, wiring: str) -> None:
        super().__init__()
        self.wiring = wiring
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = embedded = self.embed(tokens)
        blocks = list(self.blocks)
        if self.wiring == "shared block":
            blocks = [blocks[0], *blocks]
        for block in blocks:
            x = block(x)
            if self.wiring == "scaled between blocks":
                x = x * 0.5
        if self.wiring == "long skip":
            x = x + embedded  # the head's input reaches back to the embeddings
        if self.wiring == "last position":  # nanoGPT's forward without targets
            return self.head(x[:, [-1], :]), None
        return self.head(x)

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        return (torch.zeros(batch_size, 8, dtype=torch.long),)


@pytest.mark.parametrize(
    ("wiring", "reason"),
    [
        ("shared block", r"block 'blocks.0' runs 2 times in one forward"),
        ("scaled between blocks", r"does not take block 'blocks.0''s output as its first input"),
        ("long skip", r"the last stage uses the output of .embed., which sits on another stage"),
        ("last position", r"logits of shape \(2, 1, 64\) for token ids of shape \(2, 8\)"),
    ],
)
def test_a_forward_that_cannot_run_as_stages_gets_no_pipeline_plan(
    wiring: str, reason: str
) -> None:
    module = _LM(wiring)
    assert stage_problem(module, module.example_inputs(2)) is not None
    training = Training(global_batch_size=8, micro_batch_size=2, seq_len=8)
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2, gpus_per_node=2)
    with pytest.raises(SpecError, match=reason):
        make_plan(handle_for_module(module), cluster, training, pins=Pins(pp=2))
    plan = make_plan(handle_for_module(module), cluster, training)
    assert plan.strategy.pp == 1


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class _FloatStack(nn.Module):
    """Blocks fed by a float input (features, images): no tokens to stage."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Residual() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_model_of_float_inputs_is_told_pipelines_run_token_models() -> None:
    """Not "logits of shape (2, 8) for token ids of shape (2, 8)": it takes no tokens."""
    problem = stage_problem(_FloatStack(), (torch.randn(2, 8),))
    assert problem == (
        "_FloatStack takes a fp32 input of shape (2, 8), not token ids (batch, seq): "
        "pipeline stages run token models, trained with a loss per token"
    )


def test_the_same_model_with_a_plain_forward_passes_the_check() -> None:
    module = _LM("plain")
    assert stage_problem(module, module.example_inputs(2)) is None


def test_tied_weights_are_refused_naming_the_shared_parameter() -> None:
    """The head tied to the embedding, or blocks sharing a weight (ALBERT-style)."""
    assert "tied weights: 'transformer.wte.weight' and 'lm_head.weight' are one parameter" in (
        pipeline_blocker(gpt_tied()) or ""
    )
    shared = GPT(n_layer=3)
    for block in shared.transformer.h[1:]:
        block.mlp.c_fc.weight = shared.transformer.h[0].mlp.c_fc.weight
    problem = pipeline_blocker(shared) or ""
    assert (
        "'transformer.h.0.mlp.c_fc.weight' and 'transformer.h.1.mlp.c_fc.weight' (and 1 more) "
        "are one parameter, which pipeline stages would hold apart" in problem
    )


def test_a_parameter_of_the_model_itself_is_refused_with_where_to_hold_it() -> None:
    """minGPT's and ViT's learned positions, an ``nn.Parameter`` on the root: no stage
    holds it."""
    module = GPT()
    module.pos = nn.Parameter(torch.zeros(4))
    stages = [["transformer.wte", "transformer.wpe", "transformer.h.0"],
              ["transformer.h.1", "transformer.ln_f", "lm_head"]]  # fmt: skip
    problem = split_problem(module, stages)
    assert problem is not None
    assert problem.startswith("parameter 'pos' belongs to the model itself")


def test_a_stage_split_out_of_order_is_refused_before_any_collective() -> None:
    handle = resolve_model("tiny-gpt", device="cpu", seed=0)
    plan = Case("x", "tiny-gpt", _per_rank(1, **PIPE)).plan(2)
    first, last = plan.stages
    swapped = plan.model_copy(update={"stages": (last, first)})
    with pytest.raises(SpecError, match="put it on the first stage"):
        check_split(handle.module, swapped)


@pytest.mark.parametrize("model", ["tests.user_models:gpt", "tiny-llama"])
def test_the_search_emits_stages_the_runtime_accepts(model: str) -> None:
    handle = resolve_model(model)
    training = Training(global_batch_size=8, micro_batch_size=2, seq_len=16, dtype="fp32")
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2, gpus_per_node=2)
    plan = make_plan(handle, cluster, training, pins=Pins(pp=2))
    assert plan.strategy.pp == 2
    assert split_problem(handle.module, plan.stages) is None


def test_the_search_emits_stages_for_a_hugging_face_model(tmp_path: Path) -> None:
    from planner.hf import resolve_hf_config
    from tests.test_hf import _DECODER, _write

    handle = resolve_hf_config(_write(tmp_path, "llama", **{**_DECODER, "num_hidden_layers": 4}))
    training = Training(global_batch_size=8, micro_batch_size=2, seq_len=16, dtype="fp32")
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=4, gpus_per_node=4)
    plan = make_plan(handle, cluster, training, pins=Pins(pp=2, virtual_stages=2))
    assert len(plan.stages) == 4
    assert split_problem(handle.module, plan.stages) is None
