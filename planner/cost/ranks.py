"""What each pipeline rank spends and holds: sums of its segments' costs.

:class:`SegmentTable` keeps prefix sums of per-segment costs, so a rank's totals cost
O(chunks), not O(segments); :func:`sum_ranks` adds up each rank's chunks. Times are
seconds per micro-batch, sizes bytes (activations at the rank's peak, over its
in-flight micro-batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from planner.cost.memory import head_in_flight, in_flight_microbatches, pending_weight_gradients
from planner.cost.pipeline import rank_chunks
from planner.cost.segment import TypeCost
from planner.spec import Strategy

__all__ = ["TIMES", "RankSums", "SegmentTable", "sum_ranks"]

TIMES = ("forward_s", "backward_s", "recompute_s", "comm_tp_s", "comm_cp_s", "comm_ep_s")
_PARAMS = ("param_count", "expert_param_count")
_SUMMED = (
    *TIMES, *_PARAMS, "body_activation_bytes", "head_activation_bytes", "weight_grad_bytes",
)  # fmt: skip


class SegmentTable:
    """Per-segment costs (``kinds[i]``, ``type_costs[i]``) with prefix sums.

    Model-state bytes are left out: they are linear in the parameter count, so a rank's
    follow from its summed ``param_count`` under any ZeRO stage.
    """

    def __init__(self, kinds: list[str], costs: list[TypeCost]) -> None:
        self.kinds = kinds
        self.type_costs = costs
        pairs = list(zip(kinds, costs, strict=True))
        columns = {
            field: [getattr(c, field) for c in costs]
            for field in (*TIMES, *_PARAMS, "weight_grad_bytes")
        }
        columns["body_activation_bytes"] = [
            0.0 if k == "head" else c.activation_bytes for k, c in pairs
        ]
        columns["head_activation_bytes"] = [
            c.activation_bytes if k == "head" else 0.0 for k, c in pairs
        ]
        self.params = [c.param_count + c.expert_param_count for c in costs]
        # FSDP2's units: each block with parameters, and the parameters of the rest
        columns["block_units"] = [
            1.0 if k == "block" and p > 0 else 0.0 for k, p in zip(kinds, self.params, strict=True)
        ]
        columns["root_params"] = [
            0.0 if k == "block" else p for k, p in zip(kinds, self.params, strict=True)
        ]
        self.prefix = {field: [0.0, *accumulate(values)] for field, values in columns.items()}
        self.recompute_peak = [c.recompute_peak_bytes for c in costs]

    def span(self, field: str, start: int, stop: int) -> float:
        """The sum of ``field`` over segments ``start`` to ``stop - 1``."""
        prefix = self.prefix[field]
        return prefix[stop] - prefix[start]


@dataclass(frozen=True)
class RankSums:
    """What one pipeline rank holds and spends: sums over its segments."""

    totals: dict[str, float]  # per micro-batch: times (s), parameters, kept bytes
    activation_bytes: float  # at its peak, all in-flight micro-batches
    recompute_peak_bytes: float  # the largest transient of one recomputed segment
    largest_params: tuple[float, ...]  # parameter counts (experts too) of its two largest segments
    # FSDP2 units (one gather and one reduce-scatter each): its blocks with parameters and,
    # per model chunk holding others (embeddings, norm, head), the chunk's root
    fsdp_units: int = 1

    @property
    def time_s(self) -> float:
        """Seconds of one micro-batch's forward and backward on this rank."""
        return sum(self.totals[field] for field in TIMES)

    @property
    def reduce_window_s(self) -> float:
        """Seconds per micro-batch a gradient reduction can hide under: the backward
        with its recompute."""
        return self.totals["backward_s"] + self.totals["recompute_s"]

    @property
    def params(self) -> float:
        """Dense parameters on this rank (every parameter without EP)."""
        return self.totals["param_count"]

    @property
    def expert_params(self) -> float:
        """Routed-expert parameters on this rank under EP (its 1 / ep of them)."""
        return self.totals["expert_param_count"]

    def total(self, field: str) -> float:
        return self.totals[field]


def sum_ranks(
    strategy: Strategy, chunks: Sequence[Sequence[int]], table: SegmentTable,
    schedule_microbatches: int,
) -> list[RankSums]:  # fmt: skip
    """Each pipeline rank's sums over its model chunks (segment indices per chunk), its
    activations those of the micro-batches in flight in a schedule of
    ``schedule_microbatches``."""
    heads = head_in_flight(strategy.schedule, schedule_microbatches, strategy.pp)
    ranks = []
    for rank, chunk_ids in enumerate(rank_chunks(strategy.pp, strategy.virtual_stages)):
        spans = [(chunks[c][0], chunks[c][-1] + 1) for c in chunk_ids if chunks[c]]
        totals = {field: sum(table.span(field, a, b) for a, b in spans) for field in _SUMMED}
        in_flight = in_flight_microbatches(
            strategy.schedule, pp=strategy.pp, rank=rank,
            num_microbatches=schedule_microbatches, virtual_stages=strategy.virtual_stages,
        )  # fmt: skip
        pending = pending_weight_gradients(
            strategy.schedule, pp=strategy.pp, rank=rank,
            num_microbatches=schedule_microbatches, virtual_stages=strategy.virtual_stages,
        )  # fmt: skip
        activations = (
            totals["body_activation_bytes"] * in_flight
            + totals["head_activation_bytes"] * heads
            + totals["weight_grad_bytes"] * pending
        )
        peak = max((max(table.recompute_peak[a:b]) for a, b in spans), default=0.0)
        params = sorted((p for a, b in spans for p in table.params[a:b]), reverse=True)
        units = sum(
            table.span("block_units", a, b) + (table.span("root_params", a, b) > 0)
            for a, b in spans
        )
        ranks.append(RankSums(totals, activations, peak, tuple(params[:2]), max(1, round(units))))
    return ranks
