"""Pipeline schedules: step time from per-rank micro-batch times, and the even stage split.

With per-micro-batch times ``t_r`` on pipeline rank ``r`` (forward + backward +
recompute + exposed in-stage communication) and ``m`` micro-batches:

- GPipe and 1F1B: ``m * max(t) + (sum(t) - max(t))``; balanced, the bubble is
  ``(p - 1) / m`` of the ideal time (Narayanan et al. 2021).
- interleaved 1F1B with ``v`` chunks per rank: the fill/drain shrinks ``v``-fold,
  bubble ``(p - 1) / (v m)``.
- zero-bubble (ZB-H1, Qi et al. 2023): the backward's weight-gradient half fills the
  drain, leaving about the other ranks' forwards: ``max_r(m t_r + sum(f) - f_r)`` with
  ``f_r`` rank ``r``'s forward seconds per micro-batch; balanced, the bubble is
  ``(p - 1) f``, a third of 1F1B's when the backward takes twice the forward. That needs
  enough micro-batches to fill with (``m >= p``): never less than one micro-batch's way
  through every rank, forward and input-gradient backward, with only the weight
  gradients of ranks after the first (half of their backward) off that path:
  ``sum(t) - sum_{r > 0}(t_r - f_r) / 2``.

A step run as several schedules (torchtitan's gradient-accumulation steps under a
pipeline, :func:`schedule_rounds`) pays each one's fill and drain.

Every formula is non-decreasing in each rank's time (a slower rank never makes the
step faster), and with fixed per-micro-batch times the bubble (step minus
``m * max(t)``) never grows with ``m``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from planner.spec import Schedule

__all__ = [
    "pipeline_time", "schedule_rounds", "balanced_chunks", "most_chunks", "even_split",
    "rank_chunks",
]  # fmt: skip

T = TypeVar("T")


def pipeline_time(
    schedule: Schedule, rank_times: Sequence[float], num_microbatches: int, *,
    virtual_stages: int = 1, forward_fraction: float = 1 / 3,
    forward_times: Sequence[float] | None = None,
) -> float:  # fmt: skip
    """Seconds for the pipelined forward/backward of ``num_microbatches`` micro-batches.

    ``forward_times``: each rank's forward seconds per micro-batch, for zero-bubble
    (default: ``forward_fraction`` of its time)."""
    m = num_microbatches
    if schedule is Schedule.ZERO_BUBBLE:
        forwards = (
            list(forward_times)
            if forward_times is not None
            else [forward_fraction * t for t in rank_times]
        )
        total = sum(forwards)
        filled = max(m * t + total - f for t, f in zip(rank_times, forwards, strict=True))
        weight_grads = sum(t - f for t, f in zip(rank_times[1:], forwards[1:], strict=True)) / 2
        return max(filled, sum(rank_times) - weight_grads)
    slowest = max(rank_times)
    fill_drain = sum(rank_times) - slowest
    if schedule is Schedule.INTERLEAVED_1F1B:
        fill_drain /= virtual_stages
    return m * slowest + fill_drain


def schedule_rounds(pp: int, num_microbatches: int, per_round: int | None) -> list[int]:
    """Micro-batches of each pipeline schedule a step runs: all in one, or rounds of
    ``per_round`` (the last one the rest) when a framework runs each gradient-accumulation
    step as its own schedule (:attr:`~planner.cost.options.CostOptions.pipeline_round_microbatches`).
    Without a pipeline there is one."""
    if pp == 1 or per_round is None or per_round >= num_microbatches:
        return [num_microbatches]
    full, rest = divmod(num_microbatches, per_round)
    return [per_round] * full + ([rest] if rest else [])


def balanced_chunks(num_blocks: int, num_chunks: int) -> list[int]:
    """Blocks per model chunk: an even split, any remainder going to the middle chunks.

    The first chunk also runs the embedding and the last the head, so they take the
    smaller share when the blocks do not divide evenly.
    """
    base, extra = divmod(num_blocks, num_chunks)
    counts = [base] * num_chunks
    order = sorted(range(num_chunks), key=lambda i: (i in (0, num_chunks - 1), i))
    for index in order[:extra]:
        counts[index] += 1
    return counts


def most_chunks(num_blocks: int, before: Sequence[object], after: Sequence[object]) -> int:
    """The most chunks :func:`even_split` makes: a block each, and one each for a
    non-empty ``before`` and ``after``."""
    return num_blocks + bool(before) + bool(after)


def even_split(
    blocks: Sequence[T], num_chunks: int, before: Sequence[T] = (), after: Sequence[T] = ()
) -> list[list[T]]:
    """The even stage split: ``blocks`` in consecutive runs sized by :func:`balanced_chunks`,
    with ``before`` (the embeddings) joining the first run and ``after`` (the final norm
    and head) the last. With more chunks than blocks, ``before`` and then ``after`` take a
    chunk of their own, as Megatron-LM's split accounting for the embedding and the loss
    does. Needs ``num_chunks <= most_chunks(len(blocks), before, after)``."""
    spare = num_chunks - len(blocks)
    own_before = spare > 0 and bool(before)
    own_after = spare > own_before and bool(after)
    if spare > own_before + own_after:
        raise ValueError(f"{num_chunks} chunks exceed {len(blocks)} blocks and their ends")
    chunks: list[list[T]] = []
    start = 0
    for count in balanced_chunks(len(blocks), num_chunks - own_before - own_after):
        chunks.append(list(blocks[start : start + count]))
        start += count
    ends = ([list(before)] if own_before else [], [list(after)] if own_after else [])
    chunks = [*ends[0], *chunks, *ends[1]]
    if not own_before:
        chunks[0] = [*before, *chunks[0]]
    if not own_after:
        chunks[-1] = [*chunks[-1], *after]
    return chunks


def rank_chunks(pp: int, virtual_stages: int) -> list[list[int]]:
    """Model chunk indices held by each pipeline rank (rank r holds r, r + pp, ...)."""
    return [[rank + j * pp for j in range(virtual_stages)] for rank in range(pp)]
