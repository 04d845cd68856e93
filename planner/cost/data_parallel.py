"""Per-step costs of the data-parallel axis: gradient reduction, compression, optimizer.

DDP all-reduces the gradients over ``dp x cp`` (context-parallel ranks hold the same
weights); ZeRO/FSDP2 reduce-scatters them over the ZeRO shard ranks and all-gathers
the half-precision weights, with an exact all-reduce over the hybrid-sharding replicas;
gradient compression (:mod:`~planner.cost.compression`) changes the bytes on the wire
and adds its compute. Every time is the exposed part, in seconds per optimizer step on
the slowest pipeline rank: with the options' overlap a reduction hides under the
backward and a gather under the forward, all but the last bucket. Transfers that hide
under the same backward share its seconds (one window, however many collectives), so
a longer backward (recompute) never hides more than it adds. Under a pipeline every
ZeRO stage is FSDP2 with the stage's weights gathered for the whole step
(:attr:`~planner.parallel_dims.ParallelDims.gathered_under_pipeline`): one gather and one
reduce-scatter per step, whatever the stage. Without one, ZeRO-3 gathers and
reduce-scatters every micro-batch, as ZeRO-1/2 do under FSDP2; Megatron-Core and
DeepSpeed keep the weights whole, reduce ZeRO-1's gradients once per step and ZeRO-2's
every micro-batch (:class:`~planner.cost.options.ZeroAccumulation`); HSDP's all-reduce
over the replicas runs in the last micro-batch only. FSDP2 (and ZeRO-3 anywhere) gathers
and reduce-scatters unit by unit (each block, and each chunk's root holding the rest:
``RankSums.fsdp_units``), each call paying its latency and dispatch, the last unit's
never hidden; Megatron-Core's and DeepSpeed's ZeRO-1/2 reduce in buckets, their last
bucket never hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from planner.cost.communication import (
    Collective,
    LinkModel,
    MeshLinks,
    collective_time,
    link_for_axis,
)
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
    max_useful_rank,
    powersgd_comm_time,
    powersgd_compute_time,
    powersgd_memory_bytes,
    powersgd_work,
)
from planner.cost.compute import ComputeModel, fp8_weight_cast_bytes
from planner.cost.memory import gradient_element_bytes, weight_element_bytes
from planner.cost.optimizer_step import step_passes
from planner.cost.options import CostOptions, GradAccumulation, OptimizerImpl, ZeroAccumulation
from planner.cost.ranks import RankSums
from planner.cost.tp import TPAssignment
from planner.dtypes import HALF_BYTES
from planner.errors import SpecError
from planner.graph import OpGraph
from planner.parallel_dims import ParallelDims
from planner.spec import Axis, CompressionKind, Strategy, Training

__all__ = ["DataParallelCost", "exposed", "exposed_together"]


def exposed(comm: float, window: float, tail: float, overlapped: bool) -> float:
    """Seconds of ``comm`` left exposed when it runs under ``window`` seconds of compute
    (if ``overlapped``); ``tail`` seconds of it (the last bucket) are never hidden."""
    if not overlapped:
        return comm
    return max(comm - window, min(tail, comm))


def exposed_together(window: float, tail: float, *parts: tuple[float, bool]) -> float:
    """Exposed seconds of several transfers ``(seconds, overlapped)`` that run one after
    another under the same ``window``: the overlapped ones share it (never hiding more
    than ``window`` between them), ``tail`` seconds of them are never hidden."""
    hidden = sum(comm for comm, overlapped in parts if overlapped)
    shown = sum(comm for comm, overlapped in parts if not overlapped)
    return shown + (exposed(hidden, window, tail, True) if hidden > 0 else 0.0)


@dataclass(frozen=True)
class CallTimes:
    """Seconds of an array moved in several collective calls: all of them, the last."""

    total: float
    last: float


def in_call_times(
    kind: Collective, nbytes: float, ranks: int, link: LinkModel, calls: int,
    wrapper_s: float = 0.0,
) -> CallTimes:  # fmt: skip
    """``nbytes`` of ``kind`` over ``ranks`` split evenly into ``calls`` collectives
    (FSDP2's units): each call pays its own fixed cost (latency steps, launch, dispatch,
    and ``wrapper_s`` of the framework's hooks around it) and moves its share."""
    calls = max(1, calls)
    last = collective_time(kind, nbytes / calls, ranks, link) + wrapper_s
    return CallTimes(calls * last, last)


def _refuse(blocker: str | None) -> None:
    if blocker is not None:
        raise SpecError(blocker)


@dataclass(frozen=True)
class _ExpertCollectives:
    """Seconds of the EP-held experts' collectives per step (see
    :meth:`DataParallelCost._expert_collectives`)."""

    all_reduce: float = 0.0
    scatter: float = 0.0
    gather: float = 0.0
    replica: float = 0.0


@dataclass(eq=False)
class DataParallelCost:
    """Data-parallel, FSDP and compression seconds and bytes of ``graph`` trained as
    ``training``; ``tp_layout(tp, sequence_parallel)`` gives the tensor-parallel shards
    whose gradient matrices PowerSGD compresses."""

    graph: OpGraph
    training: Training
    options: CostOptions
    compute: ComputeModel
    links: MeshLinks
    tp_layout: Callable[[int, bool], TPAssignment]
    _gradient_shapes: dict[tuple[int, bool], GradientShapes] = field(
        default_factory=dict, init=False, repr=False
    )

    def times(self, strategy: Strategy, slowest: RankSums, schedules: int) -> dict[str, float]:
        """Exposed data-parallel ('comm_dp'), ZeRO-3/FSDP ('comm_fsdp') and gradient
        compression ('compression', only when compressed) seconds per step, in which
        ``schedules`` pipeline schedules each reduce the gradients (and gather the
        stage's shards) once (local SGD averages parameters, once per step at most)."""
        kind = strategy.compression.kind
        _refuse(ParallelDims.of(strategy).compression_blocker(kind))
        if kind is CompressionKind.LOCAL_SGD:
            return self._local_sgd_times(strategy, slowest)
        per_schedule = self._gradient_times(strategy, slowest, kind)
        return {name: seconds * schedules for name, seconds in per_schedule.items()}

    def _gradient_times(
        self, strategy: Strategy, slowest: RankSums, kind: CompressionKind
    ) -> dict[str, float]:
        """:meth:`times` of one gradient reduction (and its weight gathers)."""
        if kind is CompressionKind.POWERSGD:
            return self._powersgd_times(strategy, slowest)
        reduce_bytes = self.options.grad_reduce_bytes
        if kind is CompressionKind.NONE:
            return self._reduction_times(strategy, slowest, reduce_bytes)
        if kind is CompressionKind.INT8:
            times = self._reduction_times(strategy, slowest, reduce_bytes, INT8_WIRE_BYTES)
            times["compression"] = int8_quantize_time(slowest.params, self.compute)
            return times
        times = self._reduction_times(strategy, slowest, half_wire_bytes(reduce_bytes))
        buckets = bucket_count(reduce_bytes * slowest.params, self.options.dp_bucket_bytes)
        cast = half_cast_time(slowest.params, buckets, reduce_bytes, self.compute)
        # a buffer kept in the reduction's dtype has nothing to cast
        times["compression"] = 0.0 if self.options.grads_in_reduce_dtype else cast
        return times

    def payload_bytes(self, strategy: Strategy, params: float) -> float:
        """Bytes per rank per step that enter reductions over the whole data-parallel
        group for ``params`` parameters per rank (the arrays' sizes, not bus bytes).
        Local SGD counts its parameter average amortised over ``period`` steps."""
        if ParallelDims.of(strategy).replicas == 1:
            return 0.0
        kind = strategy.compression.kind
        _refuse(ParallelDims.of(strategy).compression_blocker(kind))
        element = self.options.grad_reduce_bytes
        if kind is CompressionKind.POWERSGD:
            work = self.powersgd_work(strategy)
            moved = work.uncompressed_elements + work.p_elements + work.q_elements
            return moved * element
        if kind is CompressionKind.LOCAL_SGD:
            return element * params / self._local_sgd_group(strategy)[1]
        if kind.half:
            return half_wire_bytes(element) * params
        if kind is CompressionKind.INT8:  # an HSDP replica all-reduce of the shard stays exact
            shard = ParallelDims.of(strategy).zero_shard_ranks
            replica = element / shard if strategy.replicate_degree > 1 else 0.0
            return params * (INT8_WIRE_BYTES + replica)
        return element * params

    def compression_bytes(self, strategy: Strategy, rank: RankSums) -> float | None:
        """Bytes the gradient compression keeps on ``rank`` (PowerSGD's error feedback and
        ``P``, ``Q``; int8's transient copies of one module), ``None`` for other kinds."""
        kind = strategy.compression.kind
        if kind is CompressionKind.POWERSGD:
            work = self.powersgd_work(strategy)
            return powersgd_memory_bytes(work, rank.params, self.options.grad_reduce_bytes)
        if kind is CompressionKind.INT8:
            return int8_buffer_bytes(max(rank.largest_params, default=0.0))
        return None

    def powersgd_work(self, strategy: Strategy) -> PowerSGDWork:
        """PowerSGD's elements and FLOPs; refuses a rank that compresses no matrix."""
        rank = strategy.compression.rank
        assert rank is not None  # Compression gives powersgd a rank
        shapes = self._shapes(strategy)
        work = powersgd_work(shapes, rank)
        if not work.compressed:
            m, n = max(shapes.matrices, key=lambda mn: mn[0] * mn[1], default=(0, 0))
            useful = max_useful_rank(m, n) if m * n else 0
            raise SpecError(
                f"strategy.compression.rank = {rank} compresses none of the model's gradient "
                f"matrices (largest {m} x {n}; PowerSGD pays only when rank * (m + n) * 2 < "
                f"m * n): use a rank <= {useful}, or compression 'bf16'"
            )
        return work

    def accumulation_time(self, strategy: Strategy, params: float, *, least: bool = False) -> float:
        """Seconds per micro-batch, averaged over the step, that summing the gradients of
        the step's micro-batches costs a rank holding ``params`` parameters (its experts
        too). Autograd's accumulation (:class:`~planner.cost.options.GradAccumulation`)
        makes a memory-bound pass from the second micro-batch on, reading the kept and the
        new gradient and writing the kept one; a fused one adds nothing. ``least``: the
        gradients as a half-precision reduction would keep them, whatever the strategy's
        compression (a bound for every compression)."""
        m = strategy.num_microbatches
        if m == 1 or self.options.grad_accumulation is GradAccumulation.FUSED:
            return 0.0
        kind = CompressionKind.BF16 if least else strategy.compression.kind
        element = gradient_element_bytes(self.training, self.options, kind)
        if self.options.reduces_every_microbatch(strategy):  # into the reduce-scattered shards
            params /= ParallelDims.of(strategy).zero_shard_ranks
        return self.compute.memory_time(3 * element * params) * (m - 1) / m

    def optimizer_time(
        self, strategy: Strategy, params: float, expert_params: float = 0.0
    ) -> float:
        """Seconds of the Adam/SGD step, gradient norm and zeroing on this rank's shard of
        ``params`` parameters: memory-bound.

        The update's bytes (:meth:`_step_bytes`); ``expert_params`` (held under EP) are
        sharded over the expert shard ranks. Under Transformer Engine fp8, the step's
        weight casts (:func:`~planner.cost.compute.fp8_weight_cast_bytes`). A for-loop
        update pays the profile's eager ``param_overhead_us`` per parameter tensor of the
        rank's stage, and its ``dtensor_param_overhead_us`` more where the parameters are
        DTensors (:meth:`_dtensor_params`).
        """
        dims = ParallelDims.of(strategy)
        moved = self._step_bytes(strategy, params, dims.zero_shard_ranks)
        moved += self._step_bytes(strategy, expert_params, dims.expert_shard_ranks)
        moved += fp8_weight_cast_bytes(params + expert_params, self.options, self.training.dtype)
        overhead = 0.0
        if self.options.optimizer_impl is OptimizerImpl.FOR_LOOP:  # one tensor at a time
            per_tensor = self.compute.param_s
            if self._dtensor_params(strategy):
                per_tensor += self.compute.dtensor_param_s
            overhead = self._param_tensors / strategy.pp * per_tensor
        return self.compute.memory_time(moved) + overhead

    def _dtensor_params(self, strategy: Strategy) -> bool:
        """Whether the runtime holds the parameters as DTensors: sharded by tensor
        parallelism, or by FSDP2 (:meth:`_per_unit`) at any ZeRO stage."""
        return strategy.tp > 1 or (strategy.zero >= 1 and self._per_unit(strategy))

    def _step_bytes(self, strategy: Strategy, params: float, shard: int) -> float:
        """Bytes the optimizer step moves for ``params`` sharded ``shard`` ways by ZeRO:
        the update's passes over the kept weights, moments (with its temporaries) and
        gradient (:func:`step_passes`), a gradient read more for the norm with clipping,
        and under mixed precision the write of the compute copy of the weights (half
        precision, fp8 under ``fp8_param_gather``)."""
        training = self.training
        weights, moments, gradients = step_passes(self.options.optimizer_impl, training.optimizer)
        gradient = gradient_element_bytes(training, self.options, strategy.compression.kind)
        dims = ParallelDims.of(strategy)
        grad_shard = shard if strategy.zero >= 2 or dims.gathered_under_pipeline else 1
        copy = 0.0
        if training.master_copy:
            copy = min(weight_element_bytes(training, self.options), HALF_BYTES)
        sharded = weights * training.state_bytes + moments * training.moment_bytes + copy
        norm = 1 if training.grad_clip else 0  # clipping reads every gradient once more
        per_gradient = (gradients + norm) * gradient
        return params * (sharded / shard + per_gradient / grad_shard)

    @cached_property
    def _param_tensors(self) -> int:
        return self.graph.param_tensor_count

    def _shapes(self, strategy: Strategy) -> GradientShapes:
        """The graph's 2-D weight gradients and vector elements per tensor-parallel shard."""
        key = (strategy.tp, strategy.sequence_parallel)
        if key not in self._gradient_shapes:
            self._gradient_shapes[key] = gradient_shapes(self.graph, self.tp_layout(*key))
        return self._gradient_shapes[key]

    def _data_link(self, ranks: int, dims: ParallelDims) -> LinkModel:
        """The link of ``ranks`` data-parallel ranks (context parallelism innermost)."""
        return self.links.group(ranks, dims, Axis.CP)

    def _all_reduce(
        self, nbytes: float, ranks: int, dims: ParallelDims, window: float, also_s: float = 0.0
    ) -> float:
        """Exposed seconds of DDP's bucketed all-reduce of ``nbytes`` under ``window``
        (none of it hidden without ``ddp_overlap``), with ``also_s`` of other reductions
        sharing it."""
        buckets = self._bucketed(Collective.ALL_REDUCE, nbytes, ranks, self._data_link(ranks, dims))
        overlap = self.options.overlap_grad_reduce and self.options.ddp_overlap
        return exposed(also_s + buckets.total, window, buckets.last, overlap)

    def _bucketed(self, kind: Collective, nbytes: float, ranks: int, link: LinkModel) -> CallTimes:
        """``nbytes`` of ``kind`` reduced in buckets (DDP, Megatron-Core's and DeepSpeed's
        ZeRO-1/2): priced as one call whose last bucket is the part never hidden."""
        bucket = min(nbytes, self.options.dp_bucket_bytes)
        return CallTimes(
            collective_time(kind, nbytes, ranks, link), collective_time(kind, bucket, ranks, link)
        )

    def _per_unit(self, strategy: Strategy) -> bool:
        """Whether ZeRO gathers and reduce-scatters unit by unit: FSDP2 (this runtime,
        torchtitan) at any stage, and ZeRO-3 in every framework (DeepSpeed gathers each
        submodule, Megatron-FSDP each module); Megatron-Core's distributed optimizer and
        DeepSpeed's ZeRO-1/2 reduce in buckets."""
        return strategy.zero >= 3 or self.options.zero_accumulation is ZeroAccumulation.MICROBATCH

    def _reduction_times(
        self,
        strategy: Strategy,
        slowest: RankSums,
        reduce_bytes: float,
        scatter_bytes: float | None = None,
    ) -> dict[str, float]:
        """Exposed 'comm_dp' and 'comm_fsdp' with ``reduce_bytes`` per gradient element
        (``scatter_bytes`` in ZeRO's reduce-scatter, if it differs). Under EP the
        experts' reductions (:meth:`_expert_collectives`) share the same windows."""
        dims = ParallelDims.of(strategy)
        params = slowest.params
        grad = reduce_bytes * params
        fwd, bwd = slowest.total("forward_s"), slowest.reduce_window_s
        experts = self._expert_collectives(strategy, slowest, reduce_bytes, scatter_bytes)
        if strategy.zero == 0:  # DDP over dp x cp, once per schedule or every micro-batch
            each = not self.options.ddp_no_sync and strategy.pp == 1
            reductions = strategy.num_microbatches if each else 1
            once = self._all_reduce(grad, dims.replicas, dims, bwd, experts.all_reduce)
            return {"comm_dp": reductions * once}
        shard, replicate = dims.zero_shard_ranks, strategy.replicate_degree
        scattered = (reduce_bytes if scatter_bytes is None else scatter_bytes) * params
        half = weight_element_bytes(self.training, self.options) * params
        shard_link = self._data_link(shard, dims)
        rep_link = self.links.group(replicate, dims, Axis.DP_REPLICATE)
        per_unit = self._per_unit(strategy)

        def in_calls(kind: Collective, nbytes: float, ranks: int, link: LinkModel) -> CallTimes:
            if per_unit:  # one call per unit, each paying its latency, dispatch and hooks
                units = slowest.fsdp_units
                return in_call_times(kind, nbytes, ranks, link, units, self.compute.fsdp_call_s)
            return self._bucketed(kind, nbytes, ranks, link)

        replica = in_calls(Collective.ALL_REDUCE, grad / shard, replicate, rep_link).total
        replica += experts.replica
        scatters = in_calls(Collective.REDUCE_SCATTER, scattered, shard, shard_link)
        gathers = in_calls(Collective.ALL_GATHER, half, shard, shard_link)
        scatter, last_rs = experts.scatter + scatters.total, scatters.last
        gather, last_ag = experts.gather + gathers.total, gathers.last
        prefetch, reduce = self.options.overlap_param_gather, self.options.overlap_grad_reduce
        ag_fwd = exposed(gather, fwd, last_ag, prefetch)
        if dims.gathered_under_pipeline:
            # FSDP2 under a pipeline (any ZeRO stage): weights gathered once, gradients
            # reduce-scattered (and all-reduced over HSDP replicas) once per step
            rs = exposed(scatter, bwd, last_rs, reduce)
            both = exposed_together(bwd, last_rs, (scatter, reduce), (replica, reduce))
            return {"comm_fsdp": ag_fwd + rs, "comm_dp": both - rs}
        if strategy.zero < 3:
            # the last micro-batch's gather and reduce-scatter, the replicas' all-reduce with it
            comm = exposed(scatter + replica, bwd, last_rs, reduce) + ag_fwd
            earlier = strategy.num_microbatches - 1  # each earlier micro-batch's, where run
            if self.options.reduces_every_microbatch(strategy):
                comm += earlier * exposed(scatter, bwd, last_rs, reduce)
            if self.options.fsdp_per_microbatch(strategy):
                comm += earlier * ag_fwd
            return {"comm_dp": comm}
        # gather before forward and backward, reduce-scatter per micro-batch; the HSDP
        # replica all-reduce shares the last micro-batch's backward with its transfers
        ag_bwd = exposed(gather + scatter, bwd, last_rs, prefetch and reduce)
        last = exposed_together(bwd, last_rs, (gather + scatter, prefetch and reduce),
                                (replica, reduce))  # fmt: skip
        fsdp = strategy.num_microbatches * (ag_fwd + ag_bwd)
        return {"comm_fsdp": fsdp, "comm_dp": last - ag_bwd}

    def _expert_collectives(
        self, strategy: Strategy, slowest: RankSums, reduce_bytes: float,
        scatter_bytes: float | None,
    ) -> _ExpertCollectives:  # fmt: skip
        """Whole (unexposed) seconds of the EP-held experts' gradient reduction and
        weight gathers: averaged over the expert replicas (ZeRO 0), or reduce-scattered
        and gathered over the expert shard ranks and all-reduced over ``dp_replicate``
        (ZeRO >= 1). Members of either group sit ``ep x etp`` ranks apart."""
        dims = ParallelDims.of(strategy)
        params = slowest.expert_params
        if not params:
            return _ExpertCollectives()
        grad = reduce_bytes * params
        if strategy.zero == 0:
            ranks = dims.expert_replicas
            link = link_for_axis(ranks, dims.expert_group, self.links.cluster, self.links.profile)
            return _ExpertCollectives(
                all_reduce=collective_time(Collective.ALL_REDUCE, grad, ranks, link)
            )
        shard = dims.expert_shard_ranks
        link = link_for_axis(shard, dims.expert_group, self.links.cluster, self.links.profile)
        scattered = (reduce_bytes if scatter_bytes is None else scatter_bytes) * params
        replicate = strategy.replicate_degree
        rep_link = self.links.group(replicate, dims, Axis.DP_REPLICATE)
        return _ExpertCollectives(
            scatter=collective_time(Collective.REDUCE_SCATTER, scattered, shard, link),
            gather=collective_time(
                Collective.ALL_GATHER,
                weight_element_bytes(self.training, self.options) * params,
                shard,
                link,
            ),
            replica=collective_time(Collective.ALL_REDUCE, grad / shard, replicate, rep_link),
        )

    def _powersgd_times(self, strategy: Strategy, slowest: RankSums) -> dict[str, float]:
        """PowerSGD's exposed all-reduces ('comm_dp') and compression compute per step."""
        rank = strategy.compression.rank
        assert rank is not None  # Compression gives powersgd a rank
        work = self.powersgd_work(strategy)
        element = self.options.grad_reduce_bytes
        buckets = bucket_count(element * slowest.params, self.options.dp_bucket_bytes)
        link = self._data_link(strategy.dp, ParallelDims.of(strategy))  # a DDP hook: cp = 1
        comm, last = powersgd_comm_time(work, buckets, strategy.dp, link, element)
        compute = powersgd_compute_time(work, rank, buckets, slowest.params, self.compute, element)
        overlapped = self.options.overlap_grad_reduce and self.options.overlap_powersgd
        return {
            "comm_dp": exposed(comm, slowest.reduce_window_s, last, overlapped),
            "compression": compute,
        }

    def _local_sgd_times(self, strategy: Strategy, slowest: RankSums) -> dict[str, float]:
        """Local SGD: every step a gradient all-reduce inside the local group (overlapped
        with backward like DDP's), every ``period`` steps an exposed all-reduce of the
        parameters over all data-parallel ranks (amortised per step)."""
        local, period = self._local_sgd_group(strategy)
        dims = ParallelDims.of(strategy)  # a DDP hook: cp = 1
        grads = self.options.grad_reduce_bytes * slowest.params
        link = self._data_link(strategy.dp, dims)
        average = collective_time(Collective.ALL_REDUCE, grads, strategy.dp, link)
        return {
            "comm_dp": self._all_reduce(grads, local, dims, slowest.reduce_window_s)
            + average / period
        }

    @staticmethod
    def _local_sgd_group(strategy: Strategy) -> tuple[int, int]:
        """(local group, period) of a local-SGD strategy, checked against ``dp``."""
        compression = strategy.compression
        _refuse(ParallelDims.of(strategy).local_sgd_blocker(compression.local_group))
        local, period = compression.local_group, compression.period
        assert local is not None and period is not None  # Compression gives local_sgd both
        return local, period
