"""Pipeline bubble per schedule and stage splits."""

import itertools

import pytest

from planner.cost.pipeline import balanced_chunks, even_split, pipeline_time, rank_chunks
from planner.spec import Schedule


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
