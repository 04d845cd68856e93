"""The cost model: step time and peak memory per GPU for one strategy.

:class:`CostModel` prices each segment type once per :class:`ShardKey` and recompute
mode (cached), so :meth:`CostModel.estimate` only sums cached per-segment costs over
pipeline ranks (:mod:`~planner.cost.ranks`) and adds the per-step terms: pipeline
bubble and point-to-point here, the gradients' accumulation over micro-batches (on
each rank's micro-batch time), data-parallel and FSDP communication, compression and
the optimizer step (:mod:`~planner.cost.data_parallel`), memory
(:mod:`~planner.cost.memory`) and MFU/HFU (:mod:`~planner.cost.throughput`). Every
time in the breakdown is the *exposed* part on the critical path; the parts add up to
``step_time_s``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from planner.cost.communication import Collective, MeshLinks, collective_time
from planner.cost.compute import ComputeModel
from planner.cost.data_parallel import DataParallelCost
from planner.cost.memory import MemoryModel, ModelStateBytes, boundary_bytes
from planner.cost.options import CostOptions
from planner.cost.pipeline import even_split, most_chunks, pipeline_time, schedule_rounds
from planner.cost.ranks import TIMES, RankSums, SegmentTable, sum_ranks
from planner.cost.segment import SegmentPricer, TypeCost
from planner.cost.throughput import Throughput
from planner.cost.tp import AssignmentSource, ShardKey, TPAssignment, megatron_assignment, unsharded
from planner.errors import SpecError
from planner.graph import OpGraph, OpNode, SegmentType
from planner.hardware import HardwareProfile, load_profile
from planner.parallel_dims import ParallelDims
from planner.spec import Axis, Cluster, Prediction, RecomputeMode, Strategy, Training

__all__ = ["CostModel", "LayoutCosts", "SegmentCost", "WholeModelCost"]

_RANK_CACHE_SIZE = 4096  # per-rank sums kept for reuse (a search's groups come in bursts)


@dataclass(frozen=True)
class SegmentCost:
    """One segment's cost on one GPU per micro-batch (times in s, sizes in bytes).

    ``forward_s``/``backward_s`` are compute; ``recompute_s`` is the forward re-run
    before backward (with its communication); ``comm_tp_s``/``comm_cp_s``/``comm_ep_s``
    are the exposed tensor-, context- and expert-parallel communication of forward and
    backward. ``param_count`` counts the experts a rank holds too.
    Model states follow the strategy's ZeRO stage (before FSDP's unsharded copies).
    """

    fqn: str
    kind: str
    forward_s: float
    backward_s: float
    recompute_s: float
    comm_tp_s: float
    comm_cp_s: float
    comm_ep_s: float
    param_count: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    recompute_peak_bytes: float

    @property
    def time_s(self) -> float:
        """Everything this segment adds to one micro-batch's forward + backward."""
        return (
            self.forward_s + self.backward_s + self.recompute_s
            + self.comm_tp_s + self.comm_cp_s + self.comm_ep_s
        )  # fmt: skip


@dataclass(frozen=True)
class WholeModelCost:
    """Sums over every segment for one micro-batch (s, parameters, bytes)."""

    time_s: float  # forward, backward, recompute and TP/CP/EP communication
    param_count: float  # per tensor-parallel rank (its share of the experts under EP too)
    expert_param_count: float  # of which routed experts held under EP
    least_block_activation_bytes: float  # the smallest block's kept activations


@dataclass(frozen=True)
class LayoutCosts:
    """Seconds the layout ILP weighs, from the cost model's own compute and link models."""

    compute: ComputeModel
    links: MeshLinks

    def op_seconds(self, node: OpNode, divisor: int) -> float:
        """Forward plus backward of ``node`` at the traced batch, split ``divisor`` ways."""
        time = self.compute.node_time(node, 1.0 / divisor)
        return time.forward_s + time.backward_s

    def comm_seconds(self, kind: Collective, nbytes: float, tp: int) -> float:
        """One collective of ``nbytes`` (the whole array) over the ``tp`` group's link."""
        return collective_time(kind, nbytes, tp, self.links.group(tp, ParallelDims(tp=tp), Axis.TP))


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
        self._links = MeshLinks(cluster, self.profile)
        self._tp_source = tp_layouts or self._default_layouts
        self._assignments: dict[tuple[int, bool], TPAssignment] = {}
        self._pricer = SegmentPricer(self.compute, self.options, self._links, self.tp_layout)
        self._data_parallel = DataParallelCost(
            graph, training, self.options, self.compute, self._links, self.tp_layout
        )
        self._memory = MemoryModel(graph, training, self.options)
        self._throughput = Throughput(graph, training, self.profile, self._pricer.recomputed_nodes)
        self._type_costs: dict[tuple[str, ShardKey, RecomputeMode], TypeCost] = {}
        self._tables: dict[tuple[object, ...], SegmentTable] = {}
        self._stages: dict[tuple[int, int], list[list[int]]] = {}
        self._modes: dict[tuple[object, ...], list[RecomputeMode]] = {}
        self._rank_sums: dict[tuple[object, ...], list[RankSums]] = {}  # tables live as long

    def widened(self, factor: int) -> CostModel:
        """This model on ``factor`` times the GPUs, each data-parallel rank keeping its
        batch (a global batch ``factor`` times larger); raises ``ValidationError`` for a
        count the cluster's nodes cannot hold."""
        cluster = self.cluster.with_gpus(self.cluster.num_gpus * factor)
        batch = self.training.global_batch_size * factor
        training = self.training.model_copy(update={"global_batch_size": batch})
        return CostModel(
            self.graph, cluster, training, profile=self.profile, options=self.options,
            tp_layouts=self._tp_source,
        )  # fmt: skip

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
        key = ShardKey.of(strategy)
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
        return LayoutCosts(self.compute, self._links)

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
        if key.ep > 1 and not seg_type.num_experts:
            key = replace(key, ep=1, etp=1)  # EP changes only the segments with experts
        cache_key = (
            seg_type.type_id,
            key,
            mode if seg_type.kind == "block" else RecomputeMode.NONE,
        )
        cached = self._type_costs.get(cache_key)
        if cached is None:
            if key.ep > 2:  # every ep > 1 computes alike: reprice only what the degree moves
                base = self._type_cost(seg_type, replace(key, ep=2), mode)
                cached = self._pricer.with_ep(base, seg_type, key, cache_key[2])
            else:
                cached = self._pricer.price(seg_type, key, cache_key[2])
            self._type_costs[cache_key] = cached
        return cached

    # ----- per strategy -----------------------------------------------------------------

    def segment_costs(
        self, strategy: Strategy, *, recompute: Sequence[RecomputeMode] | None = None
    ) -> list[SegmentCost]:
        """Per-segment costs in execution order (``recompute`` overrides the mode per segment)."""
        table = self._table(strategy, recompute)
        rows = zip(self.graph.segments, table.kinds, table.type_costs, strict=True)
        costs = []
        states_of: dict[tuple[float, float], ModelStateBytes] = {}  # blocks share counts
        for segment, kind, cost in rows:
            counts = (cost.param_count, cost.expert_param_count)
            states = states_of.get(counts)
            if states is None:
                states = states_of.setdefault(counts, self._memory.states(strategy, *counts))
            costs.append(
                SegmentCost(
                    fqn=segment.fqn,
                    kind=kind,
                    forward_s=cost.forward_s,
                    backward_s=cost.backward_s,
                    recompute_s=cost.recompute_s,
                    comm_tp_s=cost.comm_tp_s,
                    comm_cp_s=cost.comm_cp_s,
                    comm_ep_s=cost.comm_ep_s,
                    param_count=cost.param_count + cost.expert_param_count,
                    param_bytes=states.weights,
                    grad_bytes=states.gradients,
                    optimizer_bytes=states.optimizer,
                    activation_bytes=cost.activation_bytes,
                    recompute_peak_bytes=cost.recompute_peak_bytes,
                )
            )
        return costs

    def _table(self, strategy: Strategy, recompute: Sequence[RecomputeMode] | None) -> SegmentTable:
        key = ShardKey.of(strategy)
        modes = tuple(recompute or [strategy.recompute] * len(self.graph.segments))
        table = self._tables.get((key, modes))
        if table is None:
            types = [self.graph.segment_type(segment) for segment in self.graph.segments]
            priced: dict[tuple[str, RecomputeMode], TypeCost] = {}
            for seg_type, mode in zip(types, modes, strict=True):
                if (seg_type.type_id, mode) not in priced:
                    priced[seg_type.type_id, mode] = self._type_cost(seg_type, key, mode)
            costs = [priced[t.type_id, mode] for t, mode in zip(types, modes, strict=True)]
            table = SegmentTable([t.kind for t in types], costs)
            self._tables[(key, modes)] = table
        return table

    def whole_model(self, strategy: Strategy) -> WholeModelCost:
        """The model's summed per-micro-batch costs on one tensor x context-parallel group
        (each segment type priced once, times its occurrences)."""
        key = ShardKey.of(strategy)
        time = params = experts = 0.0
        least = math.inf
        for type_id, count in self._type_counts.items():
            seg_type = self.graph.types[type_id]
            cost = self._type_cost(seg_type, key, strategy.recompute)
            time += count * sum(getattr(cost, field) for field in TIMES)
            params += count * (cost.param_count + cost.expert_param_count)
            experts += count * cost.expert_param_count
            if seg_type.kind == "block":
                least = min(least, cost.activation_bytes)
        return WholeModelCost(
            time_s=time, param_count=params, expert_param_count=experts,
            least_block_activation_bytes=least if least < math.inf else 0.0,
        )  # fmt: skip

    @cached_property
    def _type_counts(self) -> Counter[str]:
        """How many segments each segment type has."""
        return Counter(segment.type_id for segment in self.graph.segments)

    def default_stages(self, strategy: Strategy) -> list[list[int]]:
        """Segment indices per model chunk: blocks split evenly, embedding first, head last."""
        key = (strategy.pp, strategy.virtual_stages)
        if key not in self._stages:
            self._stages[key] = self._even_stages(strategy)
        return [list(chunk) for chunk in self._stages[key]]

    def _even_stages(self, strategy: Strategy) -> list[list[int]]:
        chunks = strategy.num_stages
        if chunks == 1:
            return [list(range(len(self.graph.segments)))]  # also models without blocks
        blocks = self._blocks()
        before, after = self._ends(blocks) if blocks else ([], [])
        if chunks > most_chunks(len(blocks), before, after):
            raise SpecError(
                f"pp({strategy.pp}) * virtual_stages({strategy.virtual_stages}) = {chunks} "
                f"model chunks but the model has {len(blocks)} blocks, plus "
                f"{bool(before) + bool(after)} chunks for its embedding and head: use fewer "
                "stages"
            )
        return even_split(blocks, chunks, before, after)

    def _blocks(self) -> list[int]:
        return [i for i in range(len(self.graph.segments)) if self._is_block(i)]

    def _ends(self, blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """The segments before the first block (embedding) and after the last (head)."""
        indices = range(len(self.graph.segments))
        return [i for i in indices if i < blocks[0]], [i for i in indices if i > blocks[-1]]

    @property
    def most_chunks(self) -> int:
        """The most pipeline chunks the even split makes of this model: a block each, and
        one each for the embedding and the head (:func:`~planner.cost.pipeline.most_chunks`);
        a chunk without a block runs only where
        :func:`~planner.frameworks.blockless_chunk_refusal` allows it."""
        blocks = self._blocks()
        return most_chunks(len(blocks), *self._ends(blocks)) if blocks else 1

    def _is_block(self, index: int) -> bool:
        return self.graph.segment_type(self.graph.segments[index]).kind == "block"

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
        blocker = ParallelDims.of(strategy).batch_blocker(
            self.training.global_batch_size, strategy.micro_batch_size, strategy.num_microbatches
        )
        if blocker is not None:
            raise SpecError(blocker)
        if stages is None:
            chunks = self.default_stages(strategy)
        else:
            chunks = [list(c) for c in stages]
            self._check_stages(chunks, strategy)
        modes = self._recompute_modes(strategy, chunks)
        table = self._table(strategy, modes)
        ranks = self._ranks(strategy, chunks, table)
        return self._predict(strategy, ranks, modes)

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
            blocks = [i for i in chunk if self._is_block(i)]
            limit = strategy.recompute_blocks
            for position, segment in enumerate(blocks):
                recomputed = limit is None or position < limit
                modes[segment] = mode if recomputed else RecomputeMode.NONE
        return modes

    def _ranks(
        self, strategy: Strategy, chunks: list[list[int]], table: SegmentTable
    ) -> list[RankSums]:
        """Per pipeline rank sums, cached: ZeRO and compression variants share them."""
        key = (
            id(table), strategy.pp, strategy.virtual_stages, strategy.schedule,
            strategy.num_microbatches, tuple(map(tuple, chunks)),
        )  # fmt: skip
        ranks = self._rank_sums.get(key)
        if ranks is None:
            if len(self._rank_sums) >= _RANK_CACHE_SIZE:
                self._rank_sums.clear()
            largest_round = max(self._rounds(strategy))
            ranks = self._rank_sums[key] = sum_ranks(strategy, chunks, table, largest_round)
        return ranks

    # ----- step time --------------------------------------------------------------------

    def _predict(
        self, strategy: Strategy, ranks: list[RankSums], modes: list[RecomputeMode]
    ) -> Prediction:
        m = strategy.num_microbatches
        times = self._rank_times(strategy, ranks)
        index = max(range(len(ranks)), key=times.__getitem__)
        slowest, slowest_time = ranks[index], times[index]
        pipe = self._pipe_time(strategy, ranks, times)
        breakdown = {
            "compute": m * (slowest.total("forward_s") + slowest.total("backward_s")),
            "recompute": m * slowest.total("recompute_s"),
            "comm_tp": m * slowest.total("comm_tp_s"),
            "comm_cp": m * slowest.total("comm_cp_s"),
            "comm_ep": m * slowest.total("comm_ep_s"),
            "grad_accumulation": m * (slowest_time - slowest.time_s),
            "bubble": pipe - m * slowest_time,
            "comm_pp": self._pp_time(strategy),
        }
        rounds = self._rounds(strategy)
        breakdown.update(self._data_parallel.times(strategy, slowest, len(rounds)))
        heaviest = max(ranks, key=lambda r: r.params + r.expert_params)
        breakdown["optimizer"] = self._data_parallel.optimizer_time(
            strategy, heaviest.params, heaviest.expert_params
        )
        framework = self._framework_time(strategy, len(rounds))
        if framework:
            breakdown["framework"] = framework
        step = sum(breakdown.values())
        memory = self._memory.peak(
            strategy, ranks, logits_bytes=self._logits_bytes(strategy),
            compression=lambda rank: self._data_parallel.compression_bytes(strategy, rank),
            schedule_microbatches=max(rounds),
        )  # fmt: skip
        return self._throughput.prediction(strategy, step, breakdown, memory, modes)

    def _framework_time(self, strategy: Strategy, schedules: int) -> float:
        """Seconds per step of the training loop's own time, and of each of the step's
        ``schedules`` pipeline schedule runs' set-up (a calibrated CPU profile's
        ``step_overhead_us`` and ``pipeline_step_overhead_us``; 0 elsewhere)."""
        profile = self.profile
        seconds = (profile.step_overhead_us or 0.0) * 1e-6
        if strategy.pp > 1:
            seconds += schedules * (profile.pipeline_step_overhead_us or 0.0) * 1e-6
        return seconds

    def _logits_bytes(self, strategy: Strategy) -> float:
        """The head's logits and their gradient per micro-batch (bytes)."""
        head = self.graph.segment_type(self.graph.segments[-1])
        return self._type_cost(head, ShardKey.of(strategy), RecomputeMode.NONE).logits_bytes

    def pipeline_floor_s(self, strategy: Strategy) -> float:
        """Seconds of the pipelined forward and backward alone over the default stages.

        Compute, recompute, gradient accumulation (at its least bytes), tensor/context-
        parallel and point-to-point communication and the bubble: the step time without
        data-parallel communication, compression and the optimizer, so a lower bound of
        :meth:`estimate`'s ``step_time_s`` that a search can use to skip candidates
        (independent of ZeRO and compression).
        """
        chunks = self.default_stages(strategy)
        modes = self._recompute_modes(strategy, chunks)
        ranks = self._ranks(strategy, chunks, self._table(strategy, modes))
        times = self._rank_times(strategy, ranks, least=True)
        return self._pipe_time(strategy, ranks, times) + self._pp_time(strategy)

    def _rounds(self, strategy: Strategy) -> list[int]:
        """Micro-batches of each pipeline schedule in a step (one schedule unless the
        options run gradient-accumulation steps as schedules of their own)."""
        per_round = self.options.pipeline_round_microbatches
        return schedule_rounds(strategy.pp, strategy.num_microbatches, per_round)

    def _rank_times(
        self, strategy: Strategy, ranks: list[RankSums], *, least: bool = False
    ) -> list[float]:
        """Seconds per micro-batch on each pipeline rank: its segments' time and its
        share of the step's gradient accumulation (``least``: at its least bytes,
        :meth:`DataParallelCost.accumulation_time`)."""
        accumulate = self._data_parallel.accumulation_time
        return [
            r.time_s + accumulate(strategy, r.params + r.expert_params, least=least) for r in ranks
        ]

    def _pipe_time(self, strategy: Strategy, ranks: list[RankSums], times: list[float]) -> float:
        """Seconds of the pipeline schedules of a step whose ranks take ``times`` seconds
        per micro-batch."""
        forwards = [r.total("forward_s") for r in ranks]
        v = strategy.virtual_stages
        return sum(
            pipeline_time(strategy.schedule, times, m, virtual_stages=v, forward_times=forwards)
            for m in self._rounds(strategy)
        )

    def _pp_time(self, strategy: Strategy) -> float:
        """Exposed pipeline send/recv: each micro-batch's activation crosses each boundary
        twice; each schedule fills and drains the pipeline."""
        if strategy.pp == 1:
            return 0.0
        hidden = self._boundary_bytes * strategy.micro_batch_size / (strategy.cp * strategy.tp)
        link = self._links.group(strategy.pp, ParallelDims.of(strategy), Axis.PP)
        one = collective_time(Collective.SEND_RECV, hidden, 2, link)
        v, pp = strategy.virtual_stages, strategy.pp
        transfers = sum(m * v + pp - 1 for m in self._rounds(strategy))
        return 2 * one * transfers

    @cached_property
    def _boundary_bytes(self) -> float:
        return boundary_bytes(self.graph)

    def dp_payload_bytes(self, strategy: Strategy) -> float:
        """Bytes per rank per step that enter reductions over the whole data-parallel
        group (the arrays' sizes, not bus bytes): what compression saves on the slowest
        link. Local SGD counts its parameter average amortised over ``period`` steps."""
        params = max(self.whole_model(strategy).param_count / strategy.pp, 0.0)
        return self._data_parallel.payload_bytes(strategy, params)
