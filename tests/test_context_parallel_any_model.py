"""Context parallel on any SDPA model: zoo, Hugging Face and user modules, load-balanced.

The multi-process cases reuse :mod:`tests.test_runtime_numerics`' harness (one process
group per world size; every case within ``EXACT`` of one process on every step). The
fast tests check the load-balanced layout against the single-process causal mask, and
that what context parallel cannot run is refused with its reason: at plan time, before
any collective, and at runtime (on a fake process group, which communicates nothing).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from planner.assemble import assemble_plan
from planner.errors import SpecError
from planner.models import handle_for_module, resolve_model
from planner.planning import make_plan, search_plan
from planner.solve.search import Pins
from planner.spec import Cluster, Plan, Strategy, Training
from strategies import context_parallel
from strategies.apply import parallelize
from strategies.context_parallel import causal_mask, sequence_slice, shard_positions
from strategies.mesh import build_mesh
from tests.test_runtime_numerics import SEQ, Case, _compare, _per_rank, build_handle, run_cases
from tests.user_models import gpt

USER = "user-gpt-positions"

WORLD2 = [
    Case("hf-llama cp2", "hf-llama", _per_rank(1, cp=2)),
    Case("hf-qwen2 cp2 (packed-sequence mask)", "hf-qwen2", _per_rank(1, cp=2)),
    Case("hf-mistral cp2 (packed-sequence mask)", "hf-mistral", _per_rank(1, cp=2)),
    Case("hf-gpt-neox cp2", "hf-gpt_neox", _per_rank(1, cp=2)),
    Case("hf-gpt2 cp2", "hf-gpt2", _per_rank(1, cp=2)),
    Case("hf-mixtral cp2 (sgd)", "hf-mixtral", _per_rank(1, cp=2), optimizer="sgd"),
    Case("user module cp2", USER, _per_rank(1, cp=2)),
    Case("hf-llama cp2 fsdp over cp", "hf-llama", _per_rank(1, cp=2, zero=3)),
    Case("hf-llama cp2 recompute full", "hf-llama", _per_rank(1, cp=2, recompute="full")),
    Case("hf-qwen2 cp2 recompute selective", "hf-qwen2", _per_rank(1, cp=2, recompute="selective")),
    Case("user module cp2 recompute selective", USER, _per_rank(1, cp=2, recompute="selective")),
    Case("tiny-gpt cp2 recompute selective", "tiny-gpt", _per_rank(1, cp=2, recompute="selective")),
    Case("hf-llama cp2 (sgd)", "hf-llama", _per_rank(1, cp=2), optimizer="sgd"),
]
WORLD4 = [
    Case("hf-llama cp4", "hf-llama", _per_rank(1, cp=4)),
    Case("hf-mistral cp4", "hf-mistral", _per_rank(1, cp=4)),
    Case("user module cp4", USER, _per_rank(1, cp=4)),
    Case("tiny-llama cp4 recompute full", "tiny-llama", _per_rank(1, cp=4, recompute="full")),
    # over tensor-parallel shards the cp replicas' gradients are averaged by FSDP2
    Case("hf-llama cp2 x tp2", "hf-llama", _per_rank(1, cp=2, tp=2, zero=2), layout="ilp"),
    Case(
        "hf-qwen2 cp2 x tp2+sp",
        "hf-qwen2",
        _per_rank(1, cp=2, tp=2, zero=2, sequence_parallel=True),
        layout="ilp sp",
    ),
    Case("user module cp2 x tp2", USER, _per_rank(1, cp=2, tp=2, zero=2), layout="ilp"),
    Case(
        "hf-llama cp2 x tp2 recompute selective",
        "hf-llama",
        _per_rank(1, cp=2, tp=2, zero=2, recompute="selective"),
        layout="ilp",
    ),
    Case("hf-llama cp2 x dp2 (fsdp)", "hf-llama", _per_rank(2, cp=2, zero=3)),
    Case("user module cp2 x dp2 (ddp)", USER, _per_rank(2, cp=2)),
    Case(
        "hf-mistral cp2 x dp2 (fsdp) recompute full",
        "hf-mistral",
        _per_rank(2, cp=2, zero=3, recompute="full"),
    ),
]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "cases"), [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"]
)
def test_context_parallel_matches_single_process_on_any_model(
    world_size: int, cases: list[Case], tmp_path: Path
) -> None:
    failures = _compare(cases, run_cases(world_size, cases, tmp_path))
    assert not failures, "\n".join(failures)


# --- the load-balanced layout -----------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_are_load_balanced_and_their_masks_are_rows_of_the_causal_mask(cp: int) -> None:
    seq, local = 16, 16 // cp
    whole = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    positions = [shard_positions(local, index, cp) for index in range(cp)]
    keys = torch.cat(positions)
    assert sorted(keys.tolist()) == list(range(seq))
    work = set()
    for index, queries in enumerate(positions):
        tokens = torch.arange(seq)[None, :, None]
        assert torch.equal(sequence_slice(tokens, index, cp)[0, :, 0], queries)
        assert torch.equal(causal_mask(queries, keys), whole[queries][:, keys])
        work.add(int((queries + 1).sum()))  # keys each query attends to
    assert len(work) == 1  # every rank attends to as many keys


def test_rank_zero_holds_the_first_and_last_chunks() -> None:
    assert shard_positions(8, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(8, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_a_sequence_not_cut_into_two_cp_chunks_is_refused() -> None:
    with pytest.raises(SpecError, match=r"seq_len 12 is not divisible by 2 \* cp\(4\) = 8"):
        sequence_slice(torch.zeros(1, 12), 0, 4)


# --- refusals at plan time --------------------------------------------------------------

CLUSTER = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
TRAINING = Training(global_batch_size=8, dtype="fp32", seq_len=SEQ)
NO_POSITIONS = r"its forward takes no position_ids \(forward\(idx\)\), so positions would restart"


def test_a_module_without_position_ids_gets_no_context_parallel_plan() -> None:
    handle = resolve_model("tests.user_models:gpt")
    with pytest.raises(SpecError, match=rf"cp\(2\): {NO_POSITIONS}"):
        make_plan(handle, CLUSTER, TRAINING, pins=Pins(cp=2))
    costed = search_plan(handle, CLUSTER, TRAINING).costed
    assert costed and all(scored.strategy.cp == 1 for scored in costed)


def test_a_module_with_position_ids_gets_a_context_parallel_plan() -> None:
    plan = make_plan(resolve_model("tests.user_models:gpt_positions"), CLUSTER, TRAINING,
                     pins=Pins(cp=2))  # fmt: skip
    assert plan.strategy.cp == 2


NO_SDPA = r"its forward makes no scaled_dot_product_attention call"


def test_attention_written_by_hand_gets_no_context_parallel_plan() -> None:
    """Its trace has no SDPA call for context parallel to gather keys at: the search
    does not offer cp (the run would be refused at the first step)."""
    handle = handle_for_module(_Model("by hand"))
    with pytest.raises(SpecError, match=rf"cp\(2\): {NO_SDPA}"):
        make_plan(handle, CLUSTER, TRAINING, pins=Pins(cp=2))
    costed = search_plan(handle, CLUSTER, TRAINING).costed
    assert costed and all(scored.strategy.cp == 1 for scored in costed)


def test_an_alibi_model_gets_no_context_parallel_plan(tmp_path: Path) -> None:
    """Falcon with ALiBi adds its bias as an explicit mask, which context parallel refuses."""
    pytest.importorskip("transformers")
    from planner.hf import resolve_hf_config

    config = {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 256, "alibi": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    handle = resolve_hf_config(tmp_path)
    with pytest.raises(SpecError, match=r"cp\(2\): its attention adds an ALiBi bias"):
        make_plan(handle, CLUSTER, TRAINING, pins=Pins(cp=2))


def test_a_model_without_sdpa_attention_is_told_to_use_cp_1(tmp_path: Path) -> None:
    """Gemma2 has no SDPA attention in transformers (it is built eager): the refusal says
    so, not to load it with attn_implementation='sdpa', which transformers refuses."""
    pytest.importorskip("transformers")
    from planner.hf import resolve_hf_config

    config = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 256}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    handle = resolve_hf_config(tmp_path)
    with pytest.raises(SpecError, match=r"gemma2 has no SDPA attention .*; use cp = 1"):
        make_plan(handle, CLUSTER, TRAINING, pins=Pins(cp=2))


# --- refusals at runtime ----------------------------------------------------------------


@pytest.fixture
def fake_pair() -> Iterator[None]:
    """A fake 2-rank process group (rank 0; collectives communicate nothing)."""
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _cp2_plan(module: nn.Module) -> Plan:
    training = Training(global_batch_size=2, seq_len=SEQ)
    cluster = Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2)
    return assemble_plan(
        handle_for_module(module), cluster, training, Strategy(cp=2, micro_batch_size=2)
    )


def test_a_module_without_position_ids_is_refused_before_any_collective(fake_pair: None) -> None:
    module = gpt()
    plan = _cp2_plan(module)
    with pytest.raises(
        SpecError, match=rf"cp = 2 but GPT cannot run context parallel: {NO_POSITIONS}"
    ):
        parallelize(module, plan)
    with pytest.raises(SpecError, match=NO_POSITIONS):
        context_parallel.apply(module, build_mesh(plan), plan)


class _Attention(nn.Module):
    """Self-attention over (batch, seq, 16) with two heads, masked as ``mask`` says."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.mask == "by hand":
            scores = (q @ k.transpose(-1, -2)).softmax(-1)
            return (scores @ v).transpose(1, 2).reshape(b, s, 16)
        padding = torch.ones(s, s, dtype=torch.bool)
        padding[:, -1] = False  # the last token is padding
        attn_mask = padding if self.mask == "padding" else None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None
        )
        return out.transpose(1, 2).reshape(b, s, 16)


class _Model(nn.Module):
    """Two attention blocks, masked as ``mask`` says."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(_Attention(mask)) for _ in range(2))

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        return (torch.zeros(batch_size, SEQ, dtype=torch.long),)


@pytest.mark.parametrize(
    ("model", "error"),
    [
        (_Model("padding"), r"explicit attn_mask of shape \(8, 8\) that is not the causal mask"),
        (_Model("by hand"), "its forward makes no scaled_dot_product_attention call"),
    ],
    ids=["custom mask", "attention by hand"],
)
def test_attention_context_parallel_cannot_shard_raises(
    fake_pair: None, model: nn.Module, error: str
) -> None:
    plan = _cp2_plan(model)
    sharded = context_parallel.apply(model, build_mesh(plan), plan)
    with pytest.raises(SpecError, match=error):
        sharded(torch.zeros(2, SEQ // 2, dtype=torch.long))


def test_hugging_face_masks_from_our_positions_run_and_padding_is_refused(fake_pair: None) -> None:
    """Hugging Face's packed-sequence mask (no KV cache) and an all-ones attention_mask are
    read as causal attention; padding and the caller's own position_ids are refused."""
    model = build_handle("hf-llama").module
    plan = _cp2_plan(model)
    sharded = context_parallel.apply(model, build_mesh(plan), plan)
    tokens = torch.zeros(2, SEQ // 2, dtype=torch.long)
    sharded(tokens, use_cache=False)
    sharded(tokens, attention_mask=torch.ones_like(tokens))
    padded = torch.ones_like(tokens)
    padded[0, -1] = 0
    with pytest.raises(SpecError, match="attention_mask that masks tokens"):
        sharded(tokens, attention_mask=padded)
    with pytest.raises(SpecError, match="called with position_ids"):
        sharded(tokens, position_ids=torch.arange(SEQ // 2)[None])
