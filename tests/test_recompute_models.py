"""Activation recompute (full and selective) on the models users bring.

Each model trains one step in one process (fp32) with and without recompute of its
blocks; the loss and every parameter gradient must agree to 1e-6. Hugging Face models
are called as users call them, with the config's ``use_cache=True``: the KV cache that
broke selective recompute (the backward replay appended to it a second time) is what
the tests exercise. GPT-2 also runs with dropout, so the replay must redraw the same
masks. The distributed cases run Hugging Face Llama under FSDP and tensor parallelism.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")
from planner.hf import resolve_hf_config
from planner.models import is_hf_model, resolve_model
from planner.modules import find_blocks
from planner.spec import RecomputeMode
from strategies.checkpointing import recompute_block
from tests import user_models
from tests.test_hf import CONFIGS
from tests.test_hf_families import FAMILIES
from tests.test_runtime_numerics import (
    BATCH,
    SEQ,
    VOCAB,
    Case,
    _compare,
    _per_rank,
    reference,
    run_cases,
    train,
)

TOLERANCE = 1e-6
HF_MODELS = {**FAMILIES, "gpt2 (dropout)": CONFIGS["gpt2"]}
MODELS = [*HF_MODELS, "tiny-gpt", "tiny-llama", "user gpt"]
MODES = [RecomputeMode.FULL, RecomputeMode.SELECTIVE]


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory) -> dict[str, Path]:
    """One ``config.json`` directory per Hugging Face model."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for index, (name, fields) in enumerate(HF_MODELS.items()):
        model_type = name.split(" ")[0]
        path = root / str(index)
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
        dirs[name] = path
    return dirs


def _build(name: str, config_dirs: dict[str, Path]) -> nn.Module:
    torch.manual_seed(0)
    if name in ("tiny-gpt", "tiny-llama"):
        return resolve_model(name, device="cpu", seed=0).module
    if name == "user gpt":
        return user_models.gpt()
    return resolve_hf_config(config_dirs[name], device="cpu").module


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))


def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model called as its users call it (HF: the config's ``use_cache``)."""
    return model(input_ids=tokens).logits if is_hf_model(model) else model(tokens)


def _loss_and_grads(
    model: nn.Module, tokens: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(1)  # the same dropout masks in every run
    loss = F.cross_entropy(_logits(model, tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _recomputed(model: nn.Module, mode: RecomputeMode) -> nn.Module:
    model = copy.deepcopy(model)
    for _, block in find_blocks(model):
        recompute_block(block, mode)
    return model


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.value)
@pytest.mark.parametrize("name", MODELS)
def test_recompute_matches_no_recompute(config_dirs, name, mode):
    model = _build(name, config_dirs)
    assert len(find_blocks(model)) >= 2
    tokens = _tokens()
    loss, grads = _loss_and_grads(copy.deepcopy(model), tokens)
    loss_rc, grads_rc = _loss_and_grads(_recomputed(model, mode), tokens)
    assert loss_rc == pytest.approx(loss, abs=TOLERANCE)
    assert grads_rc.keys() == grads.keys() == {n for n, _ in model.named_parameters()}
    for fqn, grad in grads.items():
        torch.testing.assert_close(grads_rc[fqn], grad, atol=TOLERANCE, rtol=0, msg=fqn)


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.value)
def test_kv_cache_is_kept_without_gradients_and_left_alone_in_training(config_dirs, mode):
    """Generation (no gradients) still fills the cache; a training step does not touch it
    (the replay would append to it a second time)."""
    model = _recomputed(_build("llama", config_dirs), mode)
    tokens = _tokens()
    with torch.no_grad():
        generated = model(input_ids=tokens, use_cache=True)
        plain = model(input_ids=tokens, use_cache=False)
    assert generated[1].get_seq_length() == SEQ
    torch.testing.assert_close(generated.logits, plain.logits, atol=0, rtol=0)
    trained = model(input_ids=tokens, use_cache=True)
    assert trained[1].get_seq_length() == 0
    F.cross_entropy(trained.logits.flatten(0, 1), tokens.flatten()).backward()


def test_planned_selective_recompute_trains_hf_llama_in_one_process():
    """The plan path (assemble_plan, parallelize, Trainer) as the search would run it."""
    case = Case(
        "hf-llama selective", "hf-llama", {"micro_batch_size": BATCH, "recompute": "selective"}
    )
    losses = train(case, 1, 0)["losses"]
    assert losses == pytest.approx(reference("hf-llama", "adamw"), abs=TOLERANCE)


DISTRIBUTED = [
    Case("hf-llama fsdp recompute full", "hf-llama", _per_rank(2, zero=3, recompute="full")),
    Case(
        "hf-llama fsdp recompute selective",
        "hf-llama",
        _per_rank(2, zero=3, recompute="selective"),
    ),
    Case(
        "hf-llama tp recompute full", "hf-llama", _per_rank(1, tp=2, recompute="full"), layout="ilp"
    ),
    Case(
        "hf-llama tp recompute selective",
        "hf-llama",
        _per_rank(1, tp=2, recompute="selective"),
        layout="ilp",
    ),
]


@pytest.mark.distributed
@pytest.mark.slow
def test_hf_llama_recompute_under_fsdp_and_tp_matches_single_process(tmp_path: Path) -> None:
    failures = _compare(DISTRIBUTED, run_cases(2, DISTRIBUTED, tmp_path))
    assert not failures, "\n".join(failures)
