"""The pipeline-stage DP against brute force, with uneven splits and per-stage memory."""

import itertools
import math

import numpy as np
import pytest

from planner.errors import InfeasibleError, SpecError
from planner.solve.stages import partition_stages, to_fqns


def brute_force(times, memory, activation, num_stages, caps, multipliers):
    """The smallest slowest-stage time over every split that fits (inf if none)."""
    n = len(times)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        spans = list(itertools.pairwise(bounds))
        fits = all(
            sum(memory[i:j]) + multipliers[k] * sum(activation[i:j]) <= caps[k]
            for k, (i, j) in enumerate(spans)
        )
        if fits:
            best = min(best, max(sum(times[i:j]) for i, j in spans))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_random_arrays(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 11))
    stages = int(rng.integers(1, n + 1))
    times, memory, activation = rng.uniform(0, 1, (3, n))
    multipliers = rng.uniform(0, 3, stages)
    caps = rng.uniform(1.0, 5.0, stages)
    expected = brute_force(times, memory, activation, stages, caps, multipliers)
    if not math.isfinite(expected):
        with pytest.raises(InfeasibleError, match="fits the memory caps"):
            partition_stages(times, memory, stages, caps, activation=activation,
                             activation_multiplier=multipliers)  # fmt: skip
        return
    part = partition_stages(
        times, memory, stages, caps, activation=activation, activation_multiplier=multipliers
    )
    assert part.max_time_s == pytest.approx(expected)
    assert part.boundaries[0] == 0 and part.boundaries[-1] == n
    assert all(size >= 1 for size in part.stage_sizes)
    assert np.all(np.array(part.stage_memory_bytes) <= caps + 1e-12)
    assert sum(part.stage_times_s) == pytest.approx(times.sum())


def test_random_cases_include_feasible_and_infeasible():
    outcomes = set()
    for seed in range(40):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 11))
        stages = int(rng.integers(1, n + 1))
        times, memory, activation = rng.uniform(0, 1, (3, n))
        multipliers, caps = rng.uniform(0, 3, stages), rng.uniform(1.0, 5.0, stages)
        best = brute_force(times, memory, activation, stages, caps, multipliers)
        outcomes.add(math.isfinite(best))
    assert outcomes == {True, False}


def test_uneven_layers_split_unevenly_with_embedding_and_head():
    # embedding, 10 equal blocks, a heavy head (output projection + loss), 4 stages
    times = np.array([0.5] + [1.0] * 10 + [2.0])
    part = partition_stages(times, np.zeros(12), 4, math.inf)
    assert sorted(part.stage_sizes) != [3, 3, 3, 3]
    assert part.max_time_s == pytest.approx(3.5)  # 13.5 s of work, no split beats 3.5
    assert part.stage_sizes[-1] <= 2  # the head's stage takes fewer blocks


def test_first_stage_keeps_more_microbatches_so_it_takes_fewer_blocks():
    n, stages = 8, 4
    times, memory, activation = np.ones(n), np.full(n, 1.0), np.full(n, 1.0)
    in_flight = np.array([4.0, 3.0, 2.0, 1.0])  # 1F1B on 4 stages
    part = partition_stages(times, memory, stages, 9.0, activation=activation,
                            activation_multiplier=in_flight)  # fmt: skip
    sizes = part.stage_sizes
    assert sizes[0] < sizes[-1]
    assert part.stage_memory_bytes[0] == pytest.approx(sizes[0] * (1 + 4))
    assert all(mem <= 9.0 for mem in part.stage_memory_bytes)


def test_per_stage_caps_are_respected():
    part = partition_stages(np.ones(6), np.ones(6), 2, [1.0, 10.0])
    assert part.stage_sizes == (1, 5)


def test_no_fit_says_the_memory_needed():
    with pytest.raises(InfeasibleError) as caught:
        partition_stages(np.ones(4), np.full(4, 3 * 2**30), 2, 4 * 2**30)
    message = str(caught.value)
    assert "6.00 GiB" in message and "4.00 GiB" in message  # needed on a stage, and the cap
    assert "more stages" in message


def test_more_stages_than_segments_is_refused():
    with pytest.raises(InfeasibleError, match="num_stages = 5 cannot split 3 segments"):
        partition_stages(np.ones(3), np.ones(3), 5, math.inf)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"memory": np.ones(3)}, "memory"),
        ({"times": -np.ones(4)}, "times"),
        ({"memory_cap": [1.0, 2.0, 3.0]}, "memory_cap"),
        ({"activation_multiplier": [-1.0, 1.0]}, "activation_multiplier"),
    ],
)
def test_bad_arrays_name_the_field(kwargs, field):
    arguments = {"times": np.ones(4), "memory": np.ones(4), "num_stages": 2, "memory_cap": 10.0}
    with pytest.raises(SpecError, match=field):
        partition_stages(**{**arguments, **kwargs})


def test_fqns_per_stage_in_torchtitan_form():
    segment_modules = [
        ("tok_embeddings",),
        *((f"layers.{i}",) for i in range(5)),
        ("norm", "output"),
    ]
    times = np.array([0.2, 1, 1, 1, 1, 1, 1.5])
    part = partition_stages(times, np.zeros(7), 3, math.inf)
    fqns = to_fqns(part, segment_modules)
    assert [m for stage in fqns for m in stage] == [m for seg in segment_modules for m in seg]
    assert fqns[0][0] == "tok_embeddings" and fqns[-1][-2:] == ["norm", "output"]
    assert [len(stage) for stage in fqns] == [
        sum(len(m) for m in segment_modules[i:j]) for i, j in itertools.pairwise(part.boundaries)
    ]


def test_fqns_need_one_module_list_per_segment():
    part = partition_stages(np.ones(3), np.zeros(3), 2, math.inf)
    with pytest.raises(SpecError, match="segment_modules has 2 entries"):
        to_fqns(part, [("a",), ("b",)])


def test_every_stage_holds_a_required_segment():
    """A heavy embedding would be a stage of its own; a runtime that starts each stage
    at a block (``required``: the blocks) gets it beside the first block instead."""
    times = np.array([4.0, 1.0, 1.0, 0.5])  # embedding, two blocks, head
    assert partition_stages(times, np.zeros(4), 2, math.inf).stage_sizes == (1, 3)
    blocks = [False, True, True, False]
    part = partition_stages(times, np.zeros(4), 2, math.inf, required=blocks)
    assert part.stage_sizes == (2, 2)
