"""Pipeline stage partition: dynamic programming over a model's consecutive segments.

The model is a sequence of ``n`` segments (embedding, blocks, head) with a time
``t[i]`` (s, per micro-batch, forward and backward), a static memory ``m[i]`` (bytes:
weights, gradients, optimizer states) and optionally an activation memory ``a[i]``
(bytes per micro-batch in flight). Stage ``k`` takes a run ``[i, j)`` of segments and
holds ``sum m[i:j] + mult[k] * sum a[i:j]`` bytes, where ``mult[k]`` is how many
micro-batches stage ``k`` keeps in flight (``p - k`` under 1F1B), within ``cap[k]``.

The programme minimises the slowest stage::

    best[1][j] = T(0, j)                                  if stage 0 fits [0, j)
    best[k][j] = min_{k-1 <= i < j} max(best[k-1][i], T(i, j))   over i where stage k-1 fits [i, j)

with ``T(i, j) = sum t[i:j]`` from prefix sums; each ``k`` is one vectorised step over
an ``(n+1) x (n+1)`` table, so ``O(p n^2)`` work. Stages need not hold equal numbers
of segments. Among equally slow splits each boundary is the earliest that reaches the
optimum (``argmin``), so the answer is deterministic.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.errors import InfeasibleError, SpecError
from planner.solve.sharding import format_bytes

__all__ = ["StagePartition", "partition_stages", "to_fqns"]


@dataclass(frozen=True)
class StagePartition:
    """Stage ``k`` covers segments ``boundaries[k]:boundaries[k+1]``."""

    boundaries: tuple[int, ...]
    stage_times_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_times_s)

    @property
    def max_time_s(self) -> float:
        """The slowest stage's time: the pipeline's bottleneck per micro-batch."""
        return max(self.stage_times_s)

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.boundaries, self.boundaries[1:], strict=False))


def _vector(values: Sequence[float] | np.ndarray, name: str, size: int | None = None) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.ndim != 1 or (size is not None and array.shape[0] != size):
        expected = f"({size},)" if size is not None else "one dimension"
        raise SpecError(f"{name} has shape {array.shape}, expected {expected}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise SpecError(f"{name} must be finite and >= 0, got {array.tolist()}")
    return array


def _per_stage(
    value: float | Sequence[float] | np.ndarray, name: str, num_stages: int
) -> np.ndarray:
    array = np.asarray(value, dtype=float)
    if array.ndim == 0:
        array = np.full(num_stages, float(array))
    if array.shape != (num_stages,):
        raise SpecError(
            f"{name} has shape {array.shape}: give one number or one per stage ({num_stages},)"
        )
    if np.any(np.isnan(array)) or np.any(array < 0):
        raise SpecError(f"{name} must be >= 0, got {array.tolist()}")
    return array


def _span_sums(values: np.ndarray) -> np.ndarray:
    """``S[i, j] = sum values[i:j]`` for ``i < j`` (``inf`` elsewhere): an (n+1) x (n+1) table."""
    prefix = np.concatenate(([0.0], np.cumsum(values)))
    spans = prefix[None, :] - prefix[:, None]
    spans[np.tril_indices(len(prefix))] = np.inf
    return spans


def _min_max_split(stage_costs: Sequence[np.ndarray], n: int) -> tuple[float, list[int]]:
    """Split ``[0, n)`` into ``len(stage_costs)`` runs minimising the largest run cost.

    ``stage_costs[k][i, j]`` is stage ``k``'s cost for ``[i, j)`` (``inf``: not allowed).
    Returns the optimum and the boundaries (``inf`` and ``[]`` when nothing is allowed).
    """
    best = np.full(n + 1, np.inf)
    best[0] = -np.inf  # the empty prefix costs nothing, even against negative run costs
    choices = []
    for costs in stage_costs:
        candidates = np.maximum(best[:, None], costs)
        choice = np.argmin(candidates, axis=0)
        best = candidates[choice, np.arange(n + 1)]
        choices.append(choice)
    if not np.isfinite(best[n]):
        return float("inf"), []
    boundaries = [n]
    for choice in reversed(choices):
        boundaries.append(int(choice[boundaries[-1]]))
    return float(best[n]), boundaries[::-1]


def partition_stages(
    times: Sequence[float] | np.ndarray,
    memory: Sequence[float] | np.ndarray,
    num_stages: int,
    memory_cap: float | Sequence[float] | np.ndarray,
    *,
    activation: Sequence[float] | np.ndarray | None = None,
    activation_multiplier: float | Sequence[float] | np.ndarray = 1.0,
    required: Sequence[bool] | None = None,
) -> StagePartition:
    """Split consecutive segments into ``num_stages`` stages minimising the slowest one.

    ``times`` (s) and ``memory`` (bytes) hold one entry per segment; ``memory_cap``
    (bytes) and ``activation_multiplier`` are one number or one per stage;
    ``activation`` (bytes per micro-batch, per segment) is scaled by the multiplier;
    every stage holds at least one of the ``required`` segments (a runtime that starts
    and ends each stage at a transformer block: the blocks). Raises
    :class:`InfeasibleError` saying the least memory a stage needs when no split fits.
    """
    t = _vector(times, "times")
    n = t.shape[0]
    m = _vector(memory, "memory", n)
    a = np.zeros(n) if activation is None else _vector(activation, "activation", n)
    if num_stages < 1 or num_stages > n:
        raise InfeasibleError(
            f"num_stages = {num_stages} cannot split {n} segments: use 1 to {n} stages"
        )
    caps = _per_stage(memory_cap, "memory_cap", num_stages)
    multipliers = _per_stage(activation_multiplier, "activation_multiplier", num_stages)
    time_spans, static_spans, act_spans = _span_sums(t), _span_sums(m), _span_sums(a)
    stage_memory = [static_spans + mult * act_spans for mult in multipliers]
    holds = np.ones((n + 1, n + 1), dtype=bool)
    if required is not None:
        holds = _span_sums(_vector([float(r) for r in required], "required", n)) > 0
    allowed = [
        np.where((mem <= cap) & holds, time_spans, np.inf)
        for mem, cap in zip(stage_memory, caps, strict=True)
    ]
    _, boundaries = _min_max_split(allowed, n)
    if not boundaries:
        raise _no_fit(stage_memory, caps, n)
    spans = list(itertools.pairwise(boundaries))
    return StagePartition(
        boundaries=tuple(boundaries),
        stage_times_s=tuple(float(time_spans[i, j]) for i, j in spans),
        stage_memory_bytes=tuple(float(stage_memory[k][i, j]) for k, (i, j) in enumerate(spans)),
    )


def _no_fit(stage_memory: list[np.ndarray], caps: np.ndarray, n: int) -> InfeasibleError:
    """The split with the smallest excess over the caps, for the error message."""
    excess = [mem - cap for mem, cap in zip(stage_memory, caps, strict=True)]
    _, boundaries = _min_max_split(excess, n)
    spans = list(itertools.pairwise(boundaries))
    worst = max(range(len(spans)), key=lambda k: excess[k][spans[k]])
    needed = stage_memory[worst][spans[worst]]
    return InfeasibleError(
        f"no split of {n} segments into {len(caps)} pipeline stages fits the memory caps: "
        f"the best split, {[j - i for i, j in spans]} segments per stage, needs "
        f"{format_bytes(needed)} on stage {worst} whose cap is {format_bytes(caps[worst])}; "
        "use more stages, recompute activations, shard weights (ZeRO-3) or raise the cap"
    )


def to_fqns(partition: StagePartition, segment_modules: Sequence[Sequence[str]]) -> list[list[str]]:
    """Module FQNs per stage (torchtitan's ``module_fqns_per_model_part``).

    ``segment_modules[i]`` lists the top-level modules of segment ``i`` (as
    :attr:`planner.graph.Segment.modules`).
    """
    if len(segment_modules) != partition.boundaries[-1]:
        raise SpecError(
            f"segment_modules has {len(segment_modules)} entries, the partition covers "
            f"{partition.boundaries[-1]} segments: give one module list per segment"
        )
    return [
        [fqn for modules in segment_modules[i:j] for fqn in modules]
        for i, j in zip(partition.boundaries, partition.boundaries[1:], strict=False)
    ]
