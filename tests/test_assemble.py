"""Assembling runnable plans: mesh, fingerprint, stage split and Megatron layout."""

from __future__ import annotations

import pytest
from torch import nn

from planner.assemble import assemble_plan, even_stages, megatron_layout
from planner.errors import SpecError
from planner.models import ModelHandle, fingerprint, resolve_model
from planner.spec import Axis, Cluster, ModuleTP, Plan, Strategy, TPStyle, Training

CLUSTER = Cluster(gpu="h100", num_gpus=8)
TRAINING = Training(global_batch_size=16, seq_len=32)


def test_plan_carries_mesh_fingerprint_and_source() -> None:
    handle = resolve_model("tiny-gpt")
    strategy = Strategy(dp=2, tp=2, pp=2, zero=3, micro_batch_size=2, num_microbatches=4)
    plan = assemble_plan(handle, CLUSTER, TRAINING, strategy)
    assert [(axis.name, axis.size) for axis in plan.mesh] == [
        (Axis.PP, 2),
        (Axis.DP_SHARD, 2),
        (Axis.TP, 2),
    ]
    assert plan.model_fingerprint == fingerprint(handle.module)
    assert plan.model_source == "tiny-gpt"
    assert plan.model == handle.spec
    assert Plan.from_json(plan.to_json()) == plan


def test_even_stages_put_embeddings_first_and_head_last() -> None:
    stages = even_stages(resolve_model("tiny-gpt").module, 3)
    # the split the cost model prices (cost.pipeline.even_split): spare blocks go to the
    # middle chunks, since the first holds the embeddings and the last the head
    assert stages == [
        ["tok_embeddings", "pos_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "norm", "output"],
    ]


def test_even_stages_place_every_module_once() -> None:
    module = resolve_model("llama3-8b").module
    stages = even_stages(module, 8)
    placed = [fqn for chunk in stages for fqn in chunk]
    assert len(placed) == len(set(placed)) == 32 + 3
    assert [sum(fqn.startswith("layers.") for fqn in chunk) for chunk in stages] == [4] * 8


def test_even_stages_refuse_too_many_chunks() -> None:
    with pytest.raises(SpecError, match="4 repeated blocks, too few for 5"):
        even_stages(resolve_model("tiny-llama").module, 5)


def _megatron(preset: str, **strategy: object) -> dict[str, ModuleTP]:
    handle = resolve_model(preset)
    training = Training(global_batch_size=4, seq_len=32, dtype="fp32")
    return megatron_layout(handle, training, Strategy(tp=2, num_microbatches=4, **strategy))


def test_megatron_layout_for_llama_with_sequence_parallel() -> None:
    layout = _megatron("tiny-llama", sequence_parallel=True)
    styles = {fqn: m.style for fqn, m in layout.items()}
    assert styles["layers.*.attention.wq"] is TPStyle.COLWISE
    assert styles["layers.*.attention.wo"] is TPStyle.ROWWISE
    assert styles["layers.*.feed_forward.w3"] is TPStyle.COLWISE
    assert styles["layers.*.feed_forward.w2"] is TPStyle.ROWWISE
    assert styles["tok_embeddings"] is TPStyle.VOCAB_PARALLEL
    assert styles["output"] is TPStyle.COLWISE
    assert styles["norm"] is styles["layers.*.ffn_norm"] is TPStyle.SEQUENCE_PARALLEL
    # each module says where its tensors change placement, as the runtime applies it
    assert layout["layers.*.attention.wq"].params == {"weight": "Shard(0)"}
    assert layout["layers.*.attention.wo"].output == ("Partial()", "Shard(1)")  # reduce-scatter
    norm = layout["layers.*.attention_norm"]
    assert norm.output == ("Shard(1)", "Replicate()") and norm.output_dtensor  # one all-gather
    assert layout["layers.0"].input == ("Replicate()", "Shard(1)")  # SP starts at the block
    assert layout["tok_embeddings"].output == ("Partial()", "Replicate()")
    assert layout["output"].output_dtensor  # vocabulary-parallel loss


def test_megatron_layout_for_gpt_without_sp_has_no_w3_and_replicated_norms() -> None:
    layout = _megatron("tiny-gpt")
    assert "layers.*.feed_forward.w3" not in layout
    assert all(m.style is not TPStyle.SEQUENCE_PARALLEL for m in layout.values())
    assert layout["pos_embeddings"].style is TPStyle.REPLICATE
    assert layout["layers.*.feed_forward.w2"].params == {
        "weight": "Shard(1)",
        "bias": "Replicate()",
    }


def test_tp_outside_the_zoo_needs_a_layout() -> None:
    module = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    handle = ModelHandle("mlp", "mine:mlp", module, lambda b, s: ())
    with pytest.raises(SpecError, match="give its tp_layout"):
        assemble_plan(handle, CLUSTER, TRAINING, Strategy(tp=2, micro_batch_size=16))
    layout = {
        "0": ModuleTP(style="colwise", params={"weight": "Shard(0)", "bias": "Shard(0)"}),
        "1": ModuleTP(style="rowwise", params={"weight": "Shard(1)", "bias": "Replicate()"}),
    }
    whole = Strategy(tp=2, micro_batch_size=16)
    plan = assemble_plan(handle, CLUSTER, TRAINING, whole, tp_layout=layout)
    assert plan.tp_layout == layout
    assert plan.model is None


def test_a_strategy_that_does_not_make_the_global_batch_is_refused() -> None:
    with pytest.raises(
        SpecError, match=r"global_batch_size = 16 != dp\(1\) \* micro_batch_size\(2\)"
    ):
        assemble_plan(resolve_model("tiny-gpt"), CLUSTER, TRAINING, Strategy(micro_batch_size=2))


def test_a_traced_model_planned_without_a_sequence_length_keeps_the_one_it_was_traced_at():
    """The README's loop makes ``(batch, plan.seq_len + 1)`` tokens: a module of one's own
    planned without ``--seq`` records the length its forward was traced with."""
    handle = resolve_model("tests.user_models:gpt")
    training = Training(global_batch_size=4, dtype="fp32")
    plan = assemble_plan(
        handle, Cluster(gpu="cpu", num_gpus=1), training, Strategy(micro_batch_size=4)
    )
    assert plan.seq_len is not None and plan.seq_len == plan.inputs[0].shape[1]
    zoo = assemble_plan(resolve_model("tiny-llama"), Cluster(gpu="cpu", num_gpus=1), training,
                        Strategy(micro_batch_size=4))  # fmt: skip
    assert zoo.training.seq_len is None and zoo.seq_len == zoo.model.seq_len
