"""Dropout under tensor parallelism: tp ranks seeded alike draw the same masks on the
activations they share and keep their copies of the weights equal; ranks seeded apart
are refused at the first step instead of training apart (strategies.random_state)."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from planner.models import handle_for_module
from planner.planning import make_plan
from planner.solve.search import Pins
from planner.spec import Cluster, Plan, Training
from strategies.random_state import has_dropout
from tests.devices import write_tp_pays
from tests.ranks import run_on_ranks
from tests.user_models import GPT, VOCAB

SEQ, BATCH = 16, 8


class DropoutGPT(GPT):
    """nanoGPT with dropout on the residual stream (replicated over tp without SP)."""

    def __init__(self) -> None:
        super().__init__(n_layer=2)
        self.drop = nn.Dropout(0.2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = self.drop(block(x))
        return self.lm_head(self.transformer.ln_f(x))

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        """Drawn at random, as user modules' often are: tracing draws them."""
        return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def _model() -> DropoutGPT:
    torch.manual_seed(0)
    return DropoutGPT()


def _train(plan_json: str, seed_per_rank: bool, rank: int) -> list[float]:
    """Three AdamW steps; the final norm's weight (replicated over tp) as this rank holds it.
    Only the first rank checks the plan's layout (a trace and a rehearsal of the model):
    the ranks still draw alike after ``parallelize``."""
    from strategies.apply import parallelize
    from strategies.runner import Trainer, synthetic_batch

    plan = Plan.model_validate_json(plan_json)
    parallel = parallelize(_model(), plan)  # seeded alike before it is built, as users do
    if seed_per_rank:
        torch.manual_seed(rank)
    trainer = Trainer(parallel, lr=1e-2)
    for step in range(3):
        trainer.step(*synthetic_batch(VOCAB, BATCH, SEQ, seed=0, step=step))
    weight = parallel.module.transformer.ln_f.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return local.detach().tolist()


def test_dropout_is_found_in_modules_and_what_they_hand_to_attention() -> None:
    """A dropout module, or a probability an attention module holds (Hugging Face's
    ``attention_dropout``); a config field no module reads (GPT-2's
    ``summary_first_dropout``) is not dropout."""
    assert has_dropout(DropoutGPT()) and not has_dropout(GPT())
    configured = GPT()
    configured.config = SimpleNamespace(summary_first_dropout=0.1, hidden_size=64)  # type: ignore[assignment]
    assert not has_dropout(configured)
    configured.transformer.h[0].attn.attention_dropout = 0.0
    assert not has_dropout(configured)
    configured.transformer.h[0].attn.attention_dropout = 0.1
    assert has_dropout(configured)


def test_a_routers_jitter_noise_counts_as_dropout() -> None:
    """PhiMoE's sparse block holds ``router_jitter_noise`` (on in its configs), which it
    draws in training: random like dropout, under the same rules."""
    transformers = pytest.importorskip("transformers")
    config = transformers.PhimoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, router_jitter_noise=0.01, input_jitter_noise=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    assert has_dropout(transformers.PhimoeForCausalLM(config))
    config.router_jitter_noise = 0.0
    assert not has_dropout(transformers.PhimoeForCausalLM(config))


@pytest.mark.distributed
def test_dropout_under_tp_trains_alike_or_is_refused(tmp_path: Path) -> None:
    cluster = Cluster(gpu=str(write_tp_pays(tmp_path)), num_gpus=2)
    training = Training(global_batch_size=BATCH, seq_len=SEQ, dtype="fp32")
    pins = Pins(dp=1, tp=2, pp=1, cp=1, zero=0, sequence_parallel=False, micro_batch_size=BATCH)
    plan = make_plan(handle_for_module(_model()), cluster, training, pins=pins)
    tasks: dict[str, Any] = {
        name: functools.partial(_train, plan.to_json(), apart)
        for name, apart in (("alike", False), ("apart", True))
    }
    results = run_on_ranks(2, tasks, tmp_path)
    first, second = results["alike"]
    assert isinstance(first, list) and first == second  # the tp ranks' copies stay equal
    assert all(isinstance(r, str) and "random states differ" in r for r in results["apart"])
