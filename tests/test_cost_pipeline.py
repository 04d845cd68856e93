"""Pipeline bubble per schedule and stage splits."""

import itertools

import pytest

from planner.cost.build import build_cost_model, spec_graph
from planner.cost.options import CostOptions
from planner.cost.pipeline import (
    balanced_chunks,
    even_split,
    most_chunks,
    pipeline_time,
    rank_chunks,
    schedule_rounds,
)
from planner.presets import get_preset
from planner.spec import Cluster, Schedule, Strategy, Training


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(schedule):
    ideal = 8 * 1.0
    total = pipeline_time(schedule, [1.0] * 4, 8)
    assert (total - ideal) / ideal == pytest.approx(3 / 8)


def test_interleaved_bubble_shrinks_by_v():
    total = pipeline_time(Schedule.INTERLEAVED_1F1B, [1.0] * 4, 8, virtual_stages=2)
    assert (total - 8) / 8 == pytest.approx(3 / 16)


def test_zero_bubble_leaves_the_forward_share():
    total = pipeline_time(Schedule.ZERO_BUBBLE, [3.0] * 4, 8, forward_fraction=1 / 3)
    assert total - 24 == pytest.approx(3 * 1.0)


def test_uneven_stages_run_at_the_slowest():
    assert pipeline_time(Schedule.ONE_F_ONE_B, [1.0, 2.0], 10) == pytest.approx(10 * 2 + 1)


def test_balanced_chunks_and_rank_assignment():
    assert balanced_chunks(10, 4) == [2, 3, 3, 2]
    assert balanced_chunks(8, 4) == [2, 2, 2, 2]
    assert sum(balanced_chunks(126, 8)) == 126
    assert rank_chunks(2, 2) == [[0, 2], [1, 3]]


def test_even_split_gives_the_middle_the_extra_blocks_and_the_ends_the_rest():
    blocks = [f"layers.{i}" for i in range(4)]
    assert even_split(blocks, 3, ["embed"], ["norm", "head"]) == [
        ["embed", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "norm", "head"],
    ]
    assert even_split(range(10), 4) == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]


def test_beyond_the_blocks_the_embedding_then_the_head_take_a_chunk_of_their_own():
    """Megatron-LM's split accounting for the embedding and the loss (96 chunks of
    Qwen3-235B's 94 layers at pp 32 x vp 3), as far as the ends go."""
    blocks = [f"layers.{i}" for i in range(4)]
    assert most_chunks(4, ["embed"], ["norm", "head"]) == 6
    assert most_chunks(4, [], ["head"]) == 5
    assert even_split(blocks, 6, ["embed"], ["norm", "head"]) == [
        ["embed"], ["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"], ["norm", "head"],
    ]  # fmt: skip
    assert even_split(blocks, 5, ["embed"], ["head"]) == [
        ["embed"], ["layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "head"],
    ]  # fmt: skip
    assert even_split(blocks, 5, [], ["head"])[-1] == ["head"]
    with pytest.raises(ValueError, match="7 chunks exceed 4 blocks"):
        even_split(blocks, 7, ["embed"], ["head"])


def test_zero_bubble_never_speeds_up_when_a_rank_slows_down():
    """The bubble once took the forward share of whichever rank was slowest: recompute
    making another rank the slowest could shorten the step. Now it is the other ranks'
    forwards, and a slower rank never makes a faster step."""
    forwards = [0.33, 0.5]
    before = pipeline_time(Schedule.ZERO_BUBBLE, [1.0, 1.01], 2, forward_times=forwards)
    after = pipeline_time(Schedule.ZERO_BUBBLE, [1.02, 1.01], 2, forward_times=forwards)
    assert after >= before
    balanced = pipeline_time(Schedule.ZERO_BUBBLE, [3.0] * 4, 8, forward_times=[1.0] * 4)
    assert balanced == pytest.approx(8 * 3 + 3 * 1.0)  # (p - 1) forwards of fill and drain


@pytest.mark.parametrize("schedule", list(Schedule))
def test_the_bubble_never_grows_with_more_microbatches(schedule):
    times, forwards = [1.0, 1.3, 0.9, 1.1], [0.3, 0.45, 0.3, 0.35]
    kw = {"virtual_stages": 2, "forward_times": forwards}
    bubbles = [pipeline_time(schedule, times, m, **kw) - m * max(times) for m in (1, 4, 8, 64)]
    pairs = itertools.pairwise(bubbles)
    assert all(later <= earlier + 1e-12 for earlier, later in pairs), bubbles


def test_schedule_rounds_split_a_step_as_gradient_accumulation_does():
    assert schedule_rounds(4, 32, 8) == [8, 8, 8, 8]
    assert schedule_rounds(4, 10, 4) == [4, 4, 2]
    assert schedule_rounds(4, 8, None) == schedule_rounds(4, 8, 16) == [8]
    assert schedule_rounds(1, 32, 8) == [32]  # without a pipeline there is no schedule


def _rounds_model(per_round: int | None, batch: int = 64):
    spec = get_preset("tiny-llama")
    training = Training(global_batch_size=batch, seq_len=spec.seq_len)
    options = CostOptions(pipeline_round_microbatches=per_round)
    graph = spec_graph(spec, training, options)
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=8)
    return build_cost_model(graph, cluster, training, causal=True, options=options)


@pytest.mark.parametrize("zero", [0, 2])
def test_each_schedule_round_fills_and_drains_the_pipeline_and_reduces(zero):
    """torchtitan runs each gradient-accumulation step as its own schedule: 4 rounds of
    4 micro-batches pay 4 fills and drains, 4 x the p2p warm-up and 4 reductions."""
    strategy = Strategy(dp=2, pp=4, zero=zero, micro_batch_size=2, num_microbatches=16)
    one, four = _rounds_model(None).estimate(strategy), _rounds_model(4).estimate(strategy)
    assert four.breakdown_s["compute"] == one.breakdown_s["compute"]
    assert four.breakdown_s["bubble"] == pytest.approx(4 * one.breakdown_s["bubble"])
    reductions = ("comm_dp", "comm_fsdp")
    assert sum(four.breakdown_s.get(k, 0.0) for k in reductions) == pytest.approx(
        4 * sum(one.breakdown_s.get(k, 0.0) for k in reductions)
    )
    model = _rounds_model(4)
    assert four.breakdown_s["comm_pp"] > one.breakdown_s["comm_pp"]
    assert model.estimate(
        strategy.model_copy(update={"pp": 1, "dp": 8, "num_microbatches": 4})
    ) == (
        _rounds_model(None).estimate(
            strategy.model_copy(update={"pp": 1, "dp": 8, "num_microbatches": 4})
        )
    )  # no pipeline: the option changes nothing


def test_gpipe_rounds_keep_one_rounds_activations():
    """GPipe keeps every micro-batch of its schedule: in rounds of 4, those of 4."""
    strategy = Strategy(dp=2, pp=4, micro_batch_size=2, num_microbatches=16, schedule="gpipe")
    one, four = _rounds_model(None).estimate(strategy), _rounds_model(4).estimate(strategy)
    single = _rounds_model(None, batch=16).estimate(
        strategy.model_copy(update={"num_microbatches": 4})
    )
    assert four.memory_gib["activations"] < one.memory_gib["activations"]
    assert four.memory_gib["activations"] == pytest.approx(single.memory_gib["activations"])
