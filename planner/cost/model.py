"""The cost model: step time and peak memory per GPU for one strategy.

:class:`CostModel` prices each segment type once per :class:`ShardKey` and recompute
mode (cached), so :meth:`CostModel.estimate` only sums cached per-segment costs over
pipeline ranks and adds the per-step terms (data-parallel and FSDP communication,
pipeline bubble and point-to-point, optimizer step). Every time in the breakdown is
the *exposed* part on the critical path; the parts add up to ``step_time_s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

from planner.cost.communication import Collective, LinkModel, collective_time, link_for_axis
from planner.cost.compression import (
    INT8_WIRE_BYTES,
    GradientShapes,
    PowerSGDWork,
    bucket_count,
    gradient_shapes,
    half_cast_time,
    half_wire_bytes,
    int8_buffer_bytes,
    int8_quantize_time,
    powersgd_comm_time,
    powersgd_compute_time,
    powersgd_memory_bytes,
    powersgd_work,
)
from planner.cost.compute import ComputeModel
from planner.cost.flops import FLOP_CONVENTION
from planner.cost.memory import ModelStateBytes, in_flight_microbatches, model_state_bytes
from planner.cost.options import CostOptions
from planner.cost.pipeline import balanced_chunks, pipeline_time, rank_chunks
from planner.cost.segment import SegmentPricer, TypeCost
from planner.cost.tp import AssignmentSource, ShardKey, TPAssignment, megatron_assignment, unsharded
from planner.errors import SpecError
from planner.graph import OpGraph, OpKind, OpNode, SegmentType
from planner.hardware import HardwareProfile, load_profile
from planner.spec import (
    Cluster,
    CompressionKind,
    DType,
    Prediction,
    RecomputeMode,
    Schedule,
    Strategy,
    Training,
)

__all__ = ["CostModel", "LayoutCosts", "SegmentCost", "WholeModelCost"]

_GIB = 2**30
_RANK_CACHE_SIZE = 4096  # per-rank sums kept for reuse (a search's groups come in bursts)
_COUNTED = (OpKind.MATMUL, OpKind.ATTENTION, OpKind.CONV)  # FLOPs that MFU/HFU count


@dataclass(frozen=True)
class SegmentCost:
    """One segment's cost on one GPU per micro-batch (times in s, sizes in bytes).

    ``forward_s``/``backward_s`` are compute; ``recompute_s`` is the forward re-run
    before backward (with its communication); ``comm_tp_s``/``comm_cp_s`` are the
    exposed tensor- and context-parallel communication of forward and backward.
    Model states follow the strategy's ZeRO stage (before FSDP's unsharded copies).
    """

    fqn: str
    kind: str
    forward_s: float
    backward_s: float
    recompute_s: float
    comm_tp_s: float
    comm_cp_s: float
    param_count: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    recompute_peak_bytes: float

    @property
    def time_s(self) -> float:
        """Everything this segment adds to one micro-batch's forward + backward."""
        return self.forward_s + self.backward_s + self.recompute_s + self.comm_tp_s + self.comm_cp_s


@dataclass(frozen=True)
class WholeModelCost:
    """Sums over every segment for one micro-batch (s, parameters, bytes)."""

    time_s: float  # forward, backward, recompute and TP/CP communication
    param_count: float  # per tensor-parallel rank
    least_block_activation_bytes: float  # the smallest block's kept activations


@dataclass(frozen=True)
class LayoutCosts:
    """Seconds the layout ILP weighs, from the cost model's own compute and link models."""

    compute: ComputeModel
    axis_link: Callable[[int, int], LinkModel]

    def op_seconds(self, node: OpNode, divisor: int) -> float:
        """Forward plus backward of ``node`` at the traced batch, split ``divisor`` ways."""
        time = self.compute.node_time(node, 1.0 / divisor)
        return time.forward_s + time.backward_s

    def comm_seconds(self, kind: Collective, nbytes: float, tp: int) -> float:
        """One collective of ``nbytes`` (the whole array) over the ``tp`` group's link."""
        return collective_time(kind, nbytes, tp, self.axis_link(tp, 1))


_TIMES = ("forward_s", "backward_s", "recompute_s", "comm_tp_s", "comm_cp_s")
_SUMMED = (*_TIMES, "param_count", "body_activation_bytes", "head_activation_bytes")


class _SegmentTable:
    """Per-segment costs with prefix sums, so a rank's totals cost O(chunks), not O(segments).

    Model-state bytes are left out: they are linear in the parameter count, so a rank's
    follow from its summed ``param_count`` under any ZeRO stage.
    """

    def __init__(self, kinds: list[str], costs: list[TypeCost]) -> None:
        self.kinds = kinds
        self.type_costs = costs
        pairs = list(zip(kinds, costs, strict=True))
        columns = {field: [getattr(c, field) for c in costs] for field in (*_TIMES, "param_count")}
        columns["body_activation_bytes"] = [
            0.0 if k == "head" else c.activation_bytes for k, c in pairs
        ]
        columns["head_activation_bytes"] = [
            c.activation_bytes if k == "head" else 0.0 for k, c in pairs
        ]
        self.prefix = {field: [0.0, *accumulate(values)] for field, values in columns.items()}
        self.recompute_peak = [c.recompute_peak_bytes for c in costs]
        self.params = columns["param_count"]

    def span(self, field: str, start: int, stop: int) -> float:
        prefix = self.prefix[field]
        return prefix[stop] - prefix[start]


@dataclass
class _Rank:
    """What one pipeline rank holds and spends: sums over its segments."""

    totals: dict[str, float]  # per micro-batch times (s) and model-state sizes (bytes)
    activation_bytes: float  # at its peak, all in-flight micro-batches
    recompute_peak_bytes: float  # the largest transient of one recomputed segment
    largest_params: tuple[float, ...]  # parameter counts of its two largest segments

    @property
    def time_s(self) -> float:
        return sum(self.totals[field] for field in _TIMES)

    @property
    def params(self) -> float:
        return self.totals["param_count"]

    def total(self, field: str) -> float:
        return self.totals[field]


class CostModel:
    """Step time and memory of ``graph`` trained as ``training`` on ``cluster``.

    ``graph`` is traced at batch 1 and the training sequence length; micro-batch,
    tensor- and context-parallel splits are applied by scaling. ``profile`` defaults
    to the cluster's GPU profile. ``tp_layouts(tp, sequence_parallel)`` gives the
    tensor-parallel layout to price (the sharding ILP's for a traced model); a zoo
    formula graph defaults to Megatron-LM's (:func:`~planner.cost.tp.megatron_assignment`).
    """

    def __init__(
        self,
        graph: OpGraph,
        cluster: Cluster,
        training: Training,
        *,
        profile: HardwareProfile | None = None,
        options: CostOptions | None = None,
        tp_layouts: AssignmentSource | None = None,
    ) -> None:
        if graph.batch_size != 1:
            raise SpecError(f"graph.batch_size = {graph.batch_size}: trace the model at batch 1")
        if training.seq_len is not None and training.seq_len != graph.seq_len:
            raise SpecError(
                f"training.seq_len = {training.seq_len} but the graph was traced at "
                f"seq_len {graph.seq_len}: trace at the training sequence length"
            )
        self.graph = graph
        self.cluster = cluster
        self.training = training
        self.profile = profile or load_profile(cluster.gpu)
        self.options = options or CostOptions()
        self.compute = ComputeModel(self.profile, training.dtype, self.options)
        self._tp_source = tp_layouts or self._default_layouts
        self._assignments: dict[tuple[int, bool], TPAssignment] = {}
        self._pricer = SegmentPricer(self.compute, self.options, self._axis_link, self.tp_layout)
        self._type_costs: dict[tuple[str, ShardKey, RecomputeMode], TypeCost] = {}
        self._recompute_flops: dict[tuple[str, RecomputeMode], float] = {}
        self._tables: dict[tuple[object, ...], _SegmentTable] = {}
        self._stages: dict[tuple[int, int], list[list[int]]] = {}
        self._modes: dict[tuple[object, ...], list[RecomputeMode]] = {}
        self._rank_sums: dict[tuple[object, ...], list[_Rank]] = {}  # tables live as long
        self._step_flops: dict[tuple[RecomputeMode, ...], tuple[float, float]] = {}
        self._gradient_shapes: dict[tuple[int, bool], GradientShapes] = {}

    # ----- per segment type -------------------------------------------------------------

    def tp_layout(self, tp: int, sequence_parallel: bool) -> TPAssignment:
        """The tensor-parallel layout priced at ``tp`` (cached)."""
        key = (tp, sequence_parallel and tp > 1)
        if key not in self._assignments:
            self._assignments[key] = unsharded(self.graph) if tp == 1 else self._tp_source(*key)
        return self._assignments[key]

    def tp_comm_bytes(self, strategy: Strategy) -> dict[tuple[str, str], float]:
        """Bytes per step that one rank's tensor-parallel collectives move (whole arrays,
        as :mod:`~planner.cost.communication` prices them), by ``(kind, pass)``, over every
        segment (the whole model: one pipeline rank holds its share of them)."""
        key = self._shard_key(strategy)
        layout = self.tp_layout(strategy.tp, strategy.sequence_parallel)
        counted: dict[tuple[str, str], float] = {}
        for segment in self.graph.segments:
            for comm in layout.segment(segment.type_id).comms:
                phase = "backward" if comm.backward else "forward"
                slot = (comm.kind.value, phase)
                moved = comm.bytes_for(key) * strategy.num_microbatches
                counted[slot] = counted.get(slot, 0.0) + moved
        return counted

    def layout_pricer(self) -> LayoutCosts:
        """Operator and collective seconds as this model prices them, for the layout ILP."""
        return LayoutCosts(self.compute, self._axis_link)

    def _default_layouts(self, tp: int, sequence_parallel: bool) -> TPAssignment:
        if self.graph.tracer != "formula":
            raise SpecError(
                f"tp = {tp} for the traced model {self.graph.model_name!r}: its tensor-parallel "
                "layout comes from the sharding ILP; build the cost model with tp_layouts "
                "(planner.make_plan and plan estimate do)"
            )
        return megatron_assignment(
            self.graph, tp, sequence_parallel, regather=self.options.sp_regather_input
        )

    def _type_cost(self, seg_type: SegmentType, key: ShardKey, mode: RecomputeMode) -> TypeCost:
        cache_key = (
            seg_type.type_id,
            key,
            mode if seg_type.kind == "block" else RecomputeMode.NONE,
        )
        cached = self._type_costs.get(cache_key)
        if cached is None:
            cached = self._pricer.price(seg_type, key, cache_key[2])
            self._type_costs[cache_key] = cached
        return cached

    def _axis_link(self, size: int, stride: int) -> LinkModel:
        return link_for_axis(size, stride, self.cluster, self.profile)

    # ----- per strategy -----------------------------------------------------------------

    def _shard_key(self, strategy: Strategy) -> ShardKey:
        return ShardKey(
            strategy.tp, strategy.cp, strategy.sequence_parallel, strategy.micro_batch_size
        )

    def segment_costs(
        self, strategy: Strategy, *, recompute: Sequence[RecomputeMode] | None = None
    ) -> list[SegmentCost]:
        """Per-segment costs in execution order (``recompute`` overrides the mode per segment)."""
        table = self._table(strategy, recompute)
        rows = zip(self.graph.segments, table.kinds, table.type_costs, strict=True)
        costs = []
        states_of: dict[float, ModelStateBytes] = {}  # blocks share parameter counts
        for segment, kind, cost in rows:
            states = states_of.get(cost.param_count)
            if states is None:
                states = states_of.setdefault(
                    cost.param_count, self._states(strategy, cost.param_count)
                )
            costs.append(
                SegmentCost(
                    fqn=segment.fqn,
                    kind=kind,
                    forward_s=cost.forward_s,
                    backward_s=cost.backward_s,
                    recompute_s=cost.recompute_s,
                    comm_tp_s=cost.comm_tp_s,
                    comm_cp_s=cost.comm_cp_s,
                    param_count=cost.param_count,
                    param_bytes=states.weights,
                    grad_bytes=states.gradients,
                    optimizer_bytes=states.optimizer,
                    activation_bytes=cost.activation_bytes,
                    recompute_peak_bytes=cost.recompute_peak_bytes,
                )
            )
        return costs

    def _states(self, strategy: Strategy, params: float) -> ModelStateBytes:
        """Weights, gradients and optimizer bytes of ``params`` under the strategy's ZeRO."""
        return model_state_bytes(
            params, zero=strategy.zero, shard=self._zero_shard(strategy),
            optimizer=self.training.optimizer, dtype=self.training.dtype,
        )  # fmt: skip

    def _table(
        self, strategy: Strategy, recompute: Sequence[RecomputeMode] | None
    ) -> _SegmentTable:
        key = self._shard_key(strategy)
        modes = tuple(recompute or [strategy.recompute] * len(self.graph.segments))
        table = self._tables.get((key, modes))
        if table is None:
            types = [self.graph.segment_type(segment) for segment in self.graph.segments]
            priced: dict[tuple[str, RecomputeMode], TypeCost] = {}
            for seg_type, mode in zip(types, modes, strict=True):
                if (seg_type.type_id, mode) not in priced:
                    priced[seg_type.type_id, mode] = self._type_cost(seg_type, key, mode)
            costs = [priced[t.type_id, mode] for t, mode in zip(types, modes, strict=True)]
            table = _SegmentTable([t.kind for t in types], costs)
            self._tables[(key, modes)] = table
        return table

    def whole_model(self, strategy: Strategy) -> WholeModelCost:
        """The model's summed per-micro-batch costs on one tensor x context-parallel group."""
        table = self._table(strategy, None)
        blocks = [
            c for kind, c in zip(table.kinds, table.type_costs, strict=True) if kind == "block"
        ]
        return WholeModelCost(
            time_s=sum(table.span(field, 0, len(table.kinds)) for field in _TIMES),
            param_count=table.span("param_count", 0, len(table.kinds)),
            least_block_activation_bytes=min((c.activation_bytes for c in blocks), default=0.0),
        )

    @staticmethod
    def _zero_shard(strategy: Strategy) -> int:
        """Ranks ZeRO/FSDP shards over: ``dp_shard`` times ``cp`` (context-parallel ranks
        hold the same parameters, so torchtitan and Megatron shard over both)."""
        return strategy.shard_degree * strategy.cp if strategy.zero >= 1 else 1

    def default_stages(self, strategy: Strategy) -> list[list[int]]:
        """Segment indices per model chunk: blocks split evenly, embedding first, head last."""
        key = (strategy.pp, strategy.virtual_stages)
        if key not in self._stages:
            self._stages[key] = self._even_stages(strategy)
        return [list(chunk) for chunk in self._stages[key]]

    def _even_stages(self, strategy: Strategy) -> list[list[int]]:
        segments = self.graph.segments
        kinds = [self.graph.segment_type(s).kind for s in segments]
        blocks = [i for i, kind in enumerate(kinds) if kind == "block"]
        chunks = strategy.num_stages
        if chunks == 1:
            return [list(range(len(segments)))]  # also models without repeated blocks
        if len(blocks) < chunks:
            raise SpecError(
                f"pp({strategy.pp}) * virtual_stages({strategy.virtual_stages}) = {chunks} "
                f"model chunks but the model has {len(blocks)} blocks: use fewer stages"
            )
        stages: list[list[int]] = []
        start = 0
        for count in balanced_chunks(len(blocks), chunks):
            stages.append(blocks[start : start + count])
            start += count
        before = [i for i in range(len(segments)) if i < blocks[0]]
        after = [i for i in range(len(segments)) if i > blocks[-1]]
        stages[0] = before + stages[0]
        stages[-1] = stages[-1] + after
        return stages

    def _check_stages(self, stages: Sequence[Sequence[int]], strategy: Strategy) -> None:
        if len(stages) != strategy.num_stages:
            raise SpecError(
                f"stages has {len(stages)} chunks, the strategy needs pp({strategy.pp}) * "
                f"virtual_stages({strategy.virtual_stages}) = {strategy.num_stages}"
            )
        flat = [i for chunk in stages for i in chunk]
        if flat != list(range(len(self.graph.segments))):
            raise SpecError(
                f"stages must list every segment index 0..{len(self.graph.segments) - 1} "
                "once, in order, split into consecutive chunks"
            )

    def estimate(
        self, strategy: Strategy, *, stages: Sequence[Sequence[int]] | None = None
    ) -> Prediction:
        """Predicted step time, throughput, MFU/HFU and peak memory for ``strategy``."""
        self._check_batch(strategy)
        if stages is None:
            chunks = self.default_stages(strategy)
        else:
            chunks = [list(c) for c in stages]
            self._check_stages(chunks, strategy)
        modes = self._recompute_modes(strategy, chunks)
        table = self._table(strategy, modes)
        ranks = self._ranks(strategy, chunks, table)
        return self._predict(strategy, ranks, modes)

    def _check_batch(self, strategy: Strategy) -> None:
        per_step = strategy.dp * strategy.micro_batch_size * strategy.num_microbatches
        if per_step != self.training.global_batch_size:
            raise SpecError(
                f"dp({strategy.dp}) * micro_batch_size({strategy.micro_batch_size}) * "
                f"num_microbatches({strategy.num_microbatches}) = {per_step} != "
                f"training.global_batch_size({self.training.global_batch_size}): make them agree"
            )

    def _recompute_modes(self, strategy: Strategy, chunks: list[list[int]]) -> list[RecomputeMode]:
        key = (
            strategy.recompute, strategy.recompute_per_stage, strategy.recompute_blocks,
            strategy.pp, tuple(tuple(chunk) for chunk in chunks),
        )  # fmt: skip
        if key not in self._modes:
            self._modes[key] = self._modes_per_segment(strategy, chunks)
        return self._modes[key]

    def _modes_per_segment(
        self, strategy: Strategy, chunks: list[list[int]]
    ) -> list[RecomputeMode]:
        modes = [strategy.recompute] * len(self.graph.segments)
        for index, chunk in enumerate(chunks):
            rank = index % strategy.pp
            mode = strategy.recompute_for_stage(rank)
            blocks = [
                i for i in chunk if self.graph.segment_type(self.graph.segments[i]).kind == "block"
            ]
            limit = strategy.recompute_blocks
            for position, segment in enumerate(blocks):
                recomputed = limit is None or position < limit
                modes[segment] = mode if recomputed else RecomputeMode.NONE
        return modes

    def _ranks(
        self, strategy: Strategy, chunks: list[list[int]], table: _SegmentTable
    ) -> list[_Rank]:
        """Per pipeline rank sums, cached: ZeRO and compression variants share them."""
        key = (
            id(table), strategy.pp, strategy.virtual_stages, strategy.schedule,
            strategy.num_microbatches, tuple(map(tuple, chunks)),
        )  # fmt: skip
        ranks = self._rank_sums.get(key)
        if ranks is None:
            if len(self._rank_sums) >= _RANK_CACHE_SIZE:
                self._rank_sums.clear()
            ranks = self._rank_sums[key] = self._sum_ranks(strategy, chunks, table)
        return ranks

    def _sum_ranks(
        self, strategy: Strategy, chunks: list[list[int]], table: _SegmentTable
    ) -> list[_Rank]:
        # the head's backward follows its forward at once: one micro-batch (GPipe: all)
        head_in_flight = strategy.num_microbatches if strategy.schedule is Schedule.GPIPE else 1
        ranks = []
        for rank, chunk_ids in enumerate(rank_chunks(strategy.pp, strategy.virtual_stages)):
            spans = [(chunks[c][0], chunks[c][-1] + 1) for c in chunk_ids if chunks[c]]
            totals = {
                field: sum(table.span(field, a, b) for a, b in spans)
                for field in (*_SUMMED, "body_activation_bytes", "head_activation_bytes")
            }
            in_flight = in_flight_microbatches(
                strategy.schedule, pp=strategy.pp, rank=rank,
                num_microbatches=strategy.num_microbatches, virtual_stages=strategy.virtual_stages,
            )  # fmt: skip
            activations = (
                totals["body_activation_bytes"] * in_flight
                + totals["head_activation_bytes"] * head_in_flight
            )
            peak = max((max(table.recompute_peak[a:b]) for a, b in spans), default=0.0)
            params = sorted((p for a, b in spans for p in table.params[a:b]), reverse=True)
            ranks.append(_Rank(totals, activations, peak, tuple(params[:2])))
        return ranks

    # ----- step time --------------------------------------------------------------------

    def _predict(
        self, strategy: Strategy, ranks: list[_Rank], modes: list[RecomputeMode]
    ) -> Prediction:
        m = strategy.num_microbatches
        slowest = max(ranks, key=lambda r: r.time_s)
        pipe = self._pipe_time(strategy, ranks)
        breakdown = {
            "compute": m * (slowest.total("forward_s") + slowest.total("backward_s")),
            "recompute": m * slowest.total("recompute_s"),
            "comm_tp": m * slowest.total("comm_tp_s"),
            "comm_cp": m * slowest.total("comm_cp_s"),
            "bubble": pipe - m * slowest.time_s,
            "comm_pp": self._pp_time(strategy),
        }
        breakdown.update(self._dp_times(strategy, slowest))
        breakdown["optimizer"] = self._optimizer_time(strategy, max(r.params for r in ranks))
        step = sum(breakdown.values())
        memory = self._memory(strategy, ranks)
        return self._prediction(strategy, step, breakdown, memory, modes)

    def pipeline_floor_s(self, strategy: Strategy) -> float:
        """Seconds of the pipelined forward and backward alone over the default stages.

        Compute, recompute, tensor/context-parallel and point-to-point communication
        and the bubble: the step time without data-parallel communication, compression
        and the optimizer, so a lower bound of :meth:`estimate`'s ``step_time_s`` that a
        search can use to skip candidates (independent of ZeRO and compression).
        """
        chunks = self.default_stages(strategy)
        modes = self._recompute_modes(strategy, chunks)
        ranks = self._ranks(strategy, chunks, self._table(strategy, modes))
        return self._pipe_time(strategy, ranks) + self._pp_time(strategy)

    @staticmethod
    def _pipe_time(strategy: Strategy, ranks: list[_Rank]) -> float:
        rank_times = [r.time_s for r in ranks]
        slowest = ranks[rank_times.index(max(rank_times))]
        fraction = slowest.total("forward_s") / max(slowest.time_s, 1e-30)
        return pipeline_time(
            strategy.schedule, rank_times, strategy.num_microbatches,
            virtual_stages=strategy.virtual_stages, forward_fraction=fraction,
        )  # fmt: skip

    def _pp_time(self, strategy: Strategy) -> float:
        """Exposed pipeline send/recv: each micro-batch's activation crosses each boundary twice."""
        if strategy.pp == 1:
            return 0.0
        hidden = self._boundary_bytes() * strategy.micro_batch_size / (strategy.cp * strategy.tp)
        link = self._axis_link(strategy.pp, strategy.tp * strategy.cp * strategy.dp)
        one = collective_time(Collective.SEND_RECV, hidden, 2, link)
        transfers = strategy.num_microbatches * strategy.virtual_stages + strategy.pp - 1
        return 2 * one * transfers

    def _boundary_bytes(self) -> float:
        """Bytes of the activation passed between blocks, per sequence (batch 1); for a
        model without repeated blocks, the largest segment output."""
        types = list(self.graph.types.values())
        blocks = [t for t in types if t.kind == "block"] or types
        return max(t.nodes[-1].bytes_written for t in blocks if t.nodes)

    def _dp_times(self, strategy: Strategy, slowest: _Rank) -> dict[str, float]:
        """Exposed data-parallel ('comm_dp'), ZeRO-3/FSDP ('comm_fsdp') and gradient
        compression ('compression', only when compressed) seconds per step."""
        kind = strategy.compression.kind
        if kind is CompressionKind.POWERSGD:
            return self._powersgd_times(strategy, slowest)
        if kind is CompressionKind.LOCAL_SGD:
            return self._local_sgd_times(strategy, slowest)
        reduce_bytes = self.options.grad_reduce_bytes
        if kind is CompressionKind.NONE:
            return self._reduction_times(strategy, slowest, reduce_bytes)
        if kind is CompressionKind.INT8:
            if strategy.zero == 0:
                raise SpecError(
                    "strategy.compression = int8 with zero = 0: int8 replaces FSDP's gradient "
                    "reduce-scatter; use zero >= 1"
                )
            times = self._reduction_times(strategy, slowest, reduce_bytes, INT8_WIRE_BYTES)
            times["compression"] = int8_quantize_time(slowest.params, self.compute)
            return times
        times = self._reduction_times(strategy, slowest, half_wire_bytes(reduce_bytes))
        buckets = bucket_count(reduce_bytes * slowest.params, self._bucket_bytes)
        times["compression"] = half_cast_time(slowest.params, buckets, reduce_bytes, self.compute)
        return times

    @property
    def _bucket_bytes(self) -> float:
        return self.options.dp_bucket_mib * 2**20

    def _powersgd_times(self, strategy: Strategy, slowest: _Rank) -> dict[str, float]:
        """PowerSGD's exposed all-reduces ('comm_dp') and compression compute per step."""
        rank = self._powersgd_rank(strategy)
        work = self._powersgd_work(strategy)
        element = self.options.grad_reduce_bytes
        buckets = bucket_count(element * slowest.params, self._bucket_bytes)
        link = self._axis_link(strategy.dp, strategy.tp)
        comm, last = powersgd_comm_time(work, buckets, strategy.dp, link, element)
        backward = slowest.total("backward_s") + slowest.total("recompute_s")
        compute = powersgd_compute_time(work, rank, buckets, slowest.params, self.compute, element)
        overlapped = self.options.overlap_grad_reduce and self.options.overlap_powersgd
        return {"comm_dp": self._overlap(comm, backward, last, overlapped), "compression": compute}

    def _local_sgd_times(self, strategy: Strategy, slowest: _Rank) -> dict[str, float]:
        """Local SGD: every step a gradient all-reduce inside the local group (overlapped
        with backward like DDP's), every ``period`` steps an exposed all-reduce of the
        parameters over all data-parallel ranks (amortised per step)."""
        local, period = self._local_sgd_group(strategy)
        element = self.options.grad_reduce_bytes
        grads = element * slowest.params
        backward = slowest.total("backward_s") + slowest.total("recompute_s")
        link = self._axis_link(local, strategy.tp)
        reduce = collective_time(Collective.ALL_REDUCE, grads, local, link)
        last = collective_time(Collective.ALL_REDUCE, min(grads, self._bucket_bytes), local, link)
        overlapped = self.options.overlap_grad_reduce
        average = collective_time(
            Collective.ALL_REDUCE, grads, strategy.dp, self._axis_link(strategy.dp, strategy.tp)
        )
        return {"comm_dp": self._overlap(reduce, backward, last, overlapped) + average / period}

    @staticmethod
    def _local_sgd_group(strategy: Strategy) -> tuple[int, int]:
        """(local group, period) of a local-SGD strategy, checked against ``dp``."""
        compression = strategy.compression
        local, period = compression.local_group, compression.period
        if local is None or period is None or strategy.zero >= 1 or strategy.pp * strategy.cp > 1:
            raise SpecError(
                f"strategy.compression = {compression.describe()} with zero = {strategy.zero}, "
                f"pp = {strategy.pp}, cp = {strategy.cp}: local SGD is a DDP hook; use zero = 0, "
                "pp = cp = 1"
            )
        if local >= strategy.dp or strategy.dp % local:
            raise SpecError(
                f"strategy.compression.local_group = {local} must divide dp({strategy.dp}) "
                "and be smaller: it is the data-parallel ranks that reduce every step"
            )
        return local, period

    def dp_payload_bytes(self, strategy: Strategy) -> float:
        """Bytes per rank per step that enter reductions over the whole data-parallel
        group (the arrays' sizes, not bus bytes): what compression saves on the slowest
        link. Local SGD counts its parameter average amortised over ``period`` steps."""
        if strategy.dp * strategy.cp == 1:
            return 0.0
        params = max(self.whole_model(strategy).param_count / strategy.pp, 0.0)
        element = self.options.grad_reduce_bytes
        compression = strategy.compression
        if compression.kind is CompressionKind.POWERSGD:
            work = self._powersgd_work(strategy)
            moved = work.uncompressed_elements + work.p_elements + work.q_elements
            return moved * element
        if compression.kind is CompressionKind.LOCAL_SGD:
            return element * params / self._local_sgd_group(strategy)[1]
        if compression.kind in (CompressionKind.FP16, CompressionKind.BF16):
            return half_wire_bytes(element) * params
        if compression.kind is CompressionKind.INT8:  # an HSDP replica all-reduce stays exact
            replica = element / strategy.shard_degree if strategy.replicate_degree > 1 else 0.0
            return params * (INT8_WIRE_BYTES + replica)
        return element * params

    def _powersgd_work(self, strategy: Strategy) -> PowerSGDWork:
        """PowerSGD's elements and FLOPs; refuses a rank that compresses no matrix."""
        rank = self._powersgd_rank(strategy)
        shapes = self._shapes(strategy)
        work = powersgd_work(shapes, rank)
        if not work.compressed:
            m, n = max(shapes.matrices, key=lambda mn: mn[0] * mn[1], default=(0, 0))
            useful = (m * n - 1) // (2 * (m + n)) if m * n else 0
            raise SpecError(
                f"strategy.compression.rank = {rank} compresses none of the model's gradient "
                f"matrices (largest {m} x {n}; PowerSGD pays only when rank * (m + n) * 2 < "
                f"m * n): use a rank <= {useful}, or compression 'bf16'"
            )
        return work

    @staticmethod
    def _powersgd_rank(strategy: Strategy) -> int:
        rank = strategy.compression.rank
        if rank is None or strategy.zero >= 1 or strategy.pp * strategy.cp > 1:
            raise SpecError(
                f"strategy.compression = powersgd (rank {rank}) with zero = {strategy.zero}, "
                f"pp = {strategy.pp}, cp = {strategy.cp}: PowerSGD is a DDP hook; give a rank "
                "and use zero = 0, pp = cp = 1"
            )
        return rank

    def _shapes(self, strategy: Strategy) -> GradientShapes:
        """The graph's 2-D weight gradients and vector elements per tensor-parallel shard."""
        key = (strategy.tp, strategy.sequence_parallel)
        if key not in self._gradient_shapes:
            layout = self.tp_layout(*key)
            self._gradient_shapes[key] = gradient_shapes(self.graph, layout)
        return self._gradient_shapes[key]

    def _reduction_times(
        self,
        strategy: Strategy,
        slowest: _Rank,
        reduce_bytes: float,
        scatter_bytes: float | None = None,
    ) -> dict[str, float]:
        """Exposed 'comm_dp' and 'comm_fsdp' with ``reduce_bytes`` per gradient element
        (``scatter_bytes`` in ZeRO's reduce-scatter, if it differs)."""
        params = slowest.params
        shard, replicate = self._zero_shard(strategy), strategy.replicate_degree
        inner = strategy.tp
        grad = reduce_bytes * params
        scattered = (reduce_bytes if scatter_bytes is None else scatter_bytes) * params
        half = 2 * params
        fwd, bwd = (
            slowest.total("forward_s"),
            slowest.total("backward_s") + slowest.total("recompute_s"),
        )
        bucket = self._bucket_bytes
        if strategy.zero == 0:  # DDP over dp x cp (context-parallel ranks share weights)
            ranks = strategy.dp * strategy.cp
            link = self._axis_link(ranks, inner)
            reduce = collective_time(Collective.ALL_REDUCE, grad, ranks, link)
            last = collective_time(Collective.ALL_REDUCE, min(grad, bucket), ranks, link)
            return {"comm_dp": self._overlap(reduce, bwd, last, self.options.overlap_grad_reduce)}
        shard_link = self._axis_link(shard, inner)
        rep_link = self._axis_link(replicate, inner * shard)
        replica = collective_time(Collective.ALL_REDUCE, grad / shard, replicate, rep_link)
        scatter = collective_time(Collective.REDUCE_SCATTER, scattered, shard, shard_link)
        gather = collective_time(Collective.ALL_GATHER, half, shard, shard_link)
        last_rs = collective_time(
            Collective.REDUCE_SCATTER, min(scattered, bucket), shard, shard_link
        )
        last_ag = collective_time(Collective.ALL_GATHER, min(half, bucket), shard, shard_link)
        if strategy.zero < 3:
            exposed = self._overlap(
                scatter + replica, bwd, last_rs, self.options.overlap_grad_reduce
            )
            exposed += self._overlap(gather, fwd, last_ag, self.options.overlap_param_gather)
            return {"comm_dp": exposed}
        # pp == 1: gather before forward and backward, reduce-scatter per micro-batch;
        # pp > 1 (torchtitan): parameters stay gathered and gradients reduce once per step
        prefetch, reduce = self.options.overlap_param_gather, self.options.overlap_grad_reduce
        ag_fwd = self._overlap(gather, fwd, last_ag, prefetch)
        if strategy.pp == 1:
            ag_bwd = self._overlap(gather + scatter, bwd, last_rs, prefetch and reduce)
            fsdp = strategy.num_microbatches * (ag_fwd + ag_bwd)
        else:
            fsdp = ag_fwd + self._overlap(scatter, bwd, last_rs, reduce)
        return {"comm_fsdp": fsdp, "comm_dp": self._overlap(replica, bwd, 0.0, reduce)}

    @staticmethod
    def _overlap(comm: float, window: float, tail: float, overlapped: bool) -> float:
        """Exposed part of ``comm`` run under ``window`` of compute; ``tail`` is never hidden."""
        if not overlapped:
            return comm
        return max(comm - window, min(tail, comm))

    def _optimizer_time(self, strategy: Strategy, params: float) -> float:
        """Adam/SGD step, gradient-norm and zeroing on this rank's shard: memory-bound.

        Per sharded parameter: fp32 master read+write 8, fp32 gradient read 4, moments
        read+write 2x, half-precision weight write 2; plus a gradient read for the norm
        and a write to zero gradients (4 + 4 per gradient element held).
        """
        moments = self.training.optimizer.state_bytes_per_param
        shard = self._zero_shard(strategy)
        grad_shard = shard if strategy.zero >= 2 else 1
        per_param = (8 + 4 + 2 * moments + 2) / shard + (
            8 if self.training.grad_clip else 4
        ) / grad_shard
        return self.compute.memory_time(per_param * params)

    # ----- memory -----------------------------------------------------------------------

    def _memory(self, strategy: Strategy, ranks: list[_Rank]) -> dict[str, float]:
        worst: dict[str, float] = {}
        for index, rank in enumerate(ranks):
            parts = self._rank_memory(strategy, rank, last=index == len(ranks) - 1)
            if sum(parts.values()) > sum(worst.values()):
                worst = parts
        return worst

    def _rank_memory(self, strategy: Strategy, rank: _Rank, *, last: bool) -> dict[str, float]:
        """Bytes by term at this rank's peak."""
        states = self._states(strategy, rank.params)
        weights, grads = states.weights, states.gradients
        if strategy.zero >= 3:
            unsharded = self._fsdp_working_params(strategy, rank)
            weights += 2 * unsharded
            grads += 4 * unsharded  # FSDP2 reduces (and, with pp > 1, accumulates) in fp32
        logits = self._logits_bytes(strategy) if last else 0.0
        activations = rank.activation_bytes - logits
        transient = rank.recompute_peak_bytes
        parts = {
            "weights": weights,
            "gradients": grads,
            "optimizer": states.optimizer,
            "activations": activations + transient,
            "logits": logits,
            "buffers": self._buffer_bytes(strategy, rank),
        }
        if strategy.compression.kind is CompressionKind.POWERSGD:
            parts["compression"] = self._powersgd_memory(strategy, rank)
        if strategy.compression.kind is CompressionKind.INT8:
            parts["compression"] = int8_buffer_bytes(max(rank.largest_params, default=0.0))
        parts["allocator_margin"] = self.options.allocator_margin * sum(parts.values())
        return parts

    def _powersgd_memory(self, strategy: Strategy, rank: _Rank) -> float:
        """Error-feedback buffer and persistent P and Q (bytes)."""
        work = self._powersgd_work(strategy)
        return powersgd_memory_bytes(work, rank.params, self.options.grad_reduce_bytes)

    def _fsdp_working_params(self, strategy: Strategy, rank: _Rank) -> float:
        """Parameters held unsharded: the whole stage with pp > 1, else two blocks (prefetch)."""
        if strategy.pp > 1:
            return rank.params
        return sum(rank.largest_params)

    def _logits_bytes(self, strategy: Strategy) -> float:
        head = self.graph.segment_type(self.graph.segments[-1])
        key = self._shard_key(strategy)
        in_flight = strategy.num_microbatches if strategy.schedule is Schedule.GPIPE else 1
        return self._type_cost(head, key, RecomputeMode.NONE).logits_bytes * in_flight

    def _buffer_bytes(self, strategy: Strategy, rank: _Rank) -> float:
        """Communication buffers and library workspaces."""
        buffers = self.options.workspace_gib * _GIB
        if strategy.dp > 1 and strategy.zero < 3:
            buffers += 2 * self.options.dp_bucket_mib * 2**20
        if strategy.sequence_parallel:
            buffers += self._boundary_bytes() * strategy.micro_batch_size / strategy.cp
        return buffers + self._cp_buffer_bytes(strategy)

    def _cp_buffer_bytes(self, strategy: Strategy) -> float:
        """Context parallelism's gathered whole-sequence K and V, and their gradients."""
        if strategy.cp == 1:
            return 0.0
        largest = 0.0
        for seg_type in self.graph.types.values():
            for node in seg_type.nodes:
                if node.kind is OpKind.ATTENTION and len(node.input_shapes) >= 3:
                    kv = sum(math.prod(shape) for shape in node.input_shapes[1:3])
                    largest = max(largest, kv * self.training.dtype.activation_bytes)
        return 2 * largest * strategy.micro_batch_size / strategy.tp

    # ----- result -----------------------------------------------------------------------

    def _flops_per_step(self, modes: list[RecomputeMode]) -> tuple[float, float]:
        """(model FLOPs, recomputed FLOPs) per optimizer step, whole cluster.

        Only matmul, convolution and attention FLOPs count (the MFU convention).
        """
        key = tuple(modes)
        if key not in self._step_flops:
            self._step_flops[key] = self._count_step_flops(modes)
        return self._step_flops[key]

    def _count_step_flops(self, modes: list[RecomputeMode]) -> tuple[float, float]:
        recomputed = 0.0
        for segment, mode in zip(self.graph.segments, modes, strict=True):
            seg_type = self.graph.segment_type(segment)
            if seg_type.kind == "block" and mode is not RecomputeMode.NONE:
                recomputed += self._recomputed_flops(seg_type, mode)
        sequences = self.training.global_batch_size
        return self._model_flops_per_sequence * sequences, recomputed * sequences

    @cached_property
    def _model_flops_per_sequence(self) -> float:
        total = 0.0
        for segment in self.graph.segments:
            nodes = self.graph.segment_type(segment).nodes
            total += sum(n.flops_fwd + n.flops_bwd for n in nodes if n.kind in _COUNTED)
        return total

    def _recomputed_flops(self, seg_type: SegmentType, mode: RecomputeMode) -> float:
        """Forward FLOPs run again per sequence in one segment of ``seg_type`` (cached)."""
        cache_key = (seg_type.type_id, mode)
        if cache_key not in self._recompute_flops:
            nodes = seg_type.nodes
            again = self._pricer.recomputed_nodes(nodes, mode)
            self._recompute_flops[cache_key] = sum(
                nodes[i].flops_fwd for i in again if nodes[i].kind in _COUNTED
            )
        return self._recompute_flops[cache_key]

    def _prediction(
        self, strategy: Strategy, step: float, breakdown: dict[str, float],
        memory: dict[str, float], modes: list[RecomputeMode],
    ) -> Prediction:  # fmt: skip
        gpus = strategy.world_size
        peak = self.profile.peak_flops(
            DType.BF16 if self.training.dtype is DType.FP8 else self.training.dtype
        )
        model_flops, recomputed = self._flops_per_step(modes)
        tokens = self.training.global_batch_size * self.graph.seq_len
        limit = self.profile.memory_capacity_gib
        memory_gib = {k: v / _GIB for k, v in memory.items()}
        peak_gib = sum(memory_gib.values())
        fits = peak_gib <= limit
        return Prediction(
            step_time_s=step,
            tokens_per_s_per_gpu=tokens / step / gpus,
            model_tflops_per_gpu=model_flops / step / gpus / 1e12,
            mfu=model_flops / step / gpus / peak,
            hfu=(model_flops + recomputed) / step / gpus / peak,
            flop_convention=FLOP_CONVENTION,
            peak_memory_gib=peak_gib,
            memory_limit_gib=limit,
            fits=fits,
            breakdown_s=breakdown,
            memory_gib=memory_gib,
            reason="" if fits else _not_fitting_reason(memory_gib, peak_gib, limit),
        )


def _not_fitting_reason(memory_gib: dict[str, float], peak: float, limit: float) -> str:
    dominant = max(memory_gib, key=lambda k: memory_gib[k])
    return (
        f"needs {peak:.1f} GiB per GPU, {peak - limit:.1f} GiB over the {limit:.1f} GiB limit; "
        f"largest term: {dominant} {memory_gib[dominant]:.1f} GiB"
    )
