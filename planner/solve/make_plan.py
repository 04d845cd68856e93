"""From a model and a cluster to a runnable :class:`~planner.spec.Plan`.

``trace -> CostModel -> search -> stage DP -> sharding ILP -> assemble``: the search
picks the strategy, the stage DP re-splits its pipeline stages under the memory cap,
and the ILP chooses the tensor-parallel layout of each module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from planner.assemble import assemble_plan
from planner.cost import CostModel, CostOptions, graph_from_spec
from planner.cost.communication import link_for_axis
from planner.cost.memory import in_flight_microbatches
from planner.errors import InfeasibleError
from planner.graph import OpGraph
from planner.models import ModelHandle, Transformer
from planner.solve.layout import Roofline, TPLayout, solve_tp_layout, weight_module_paths
from planner.solve.lossy import LossyCompression, tradeoff
from planner.solve.search import ModelLimits, Pins, Progress, Scored, search
from planner.solve.stages import partition_stages
from planner.spec import (
    Candidate,
    Cluster,
    DType,
    Plan,
    Prediction,
    SolverStats,
    Strategy,
    TPStyle,
    Training,
)
from planner.trace import trace
from planner.validate import (
    check_model_against_plan,
    pipeline_splittable,
    shares_parameters,
    validate_plan_for_world,
)

__all__ = ["PlanSearch", "cost_graph", "make_plan", "search_plan", "trace_for_training"]

log = logging.getLogger(__name__)
_POOL = 3  # candidates kept per runner-up shown, to pick diverse ones from


def trace_for_training(handle: ModelHandle, training: Training) -> OpGraph:
    """The model's traced graph at batch 1 and the training sequence length and dtype."""
    seq = training.seq_len or (handle.spec.seq_len if handle.spec else None)
    dtype = {DType.FP32: "fp32", DType.FP16: "fp16"}.get(training.dtype, "bf16")  # fp8: bf16 acts
    return trace(handle, batch_size=1, seq_len=seq, dtype=dtype)


def cost_graph(handle: ModelHandle, training: Training) -> OpGraph:
    """The graph the cost model prices: for transformers with a spec the formula graph
    that ``plan estimate`` and the accuracy benchmark use (same FLOPs, parameters and
    module paths as the trace, tested), for other models the trace."""
    if handle.spec is None:
        return trace_for_training(handle, training)
    return graph_from_spec(handle.spec, seq_len=training.seq_len, dtype=training.dtype)


@dataclass(frozen=True)
class PlanSearch:
    """A plan and every candidate the search priced on the way (for plots)."""

    plan: Plan
    costed: tuple[Scored, ...]


def make_plan(
    handle: ModelHandle,
    cluster: Cluster,
    training: Training,
    *,
    pins: Pins | None = None,
    top_k: int = 5,
    options: CostOptions | None = None,
    progress: Progress | None = None,
    ilp_time_limit_s: float = 10.0,
    lossy: LossyCompression | None = None,
) -> Plan:
    """Search the fastest fitting strategy for ``handle`` on ``cluster`` and assemble its
    plan; ``lossy`` names the lossy gradient compression it may choose (none by default)."""
    return search_plan(
        handle, cluster, training, pins=pins, top_k=top_k, options=options, progress=progress,
        ilp_time_limit_s=ilp_time_limit_s, lossy=lossy,
    ).plan  # fmt: skip


def search_plan(
    handle: ModelHandle,
    cluster: Cluster,
    training: Training,
    *,
    pins: Pins | None = None,
    top_k: int = 5,
    options: CostOptions | None = None,
    progress: Progress | None = None,
    ilp_time_limit_s: float = 10.0,
    pareto: bool = False,
    lossy: LossyCompression | None = None,
) -> PlanSearch:
    """:func:`make_plan` that also returns the priced candidates; with ``pareto`` they
    include the whole Pareto front of step time against peak memory."""
    started = time.perf_counter()
    graph = cost_graph(handle, training)
    model = CostModel(graph, cluster, training, options=options)
    spec = handle.spec
    limits = ModelLimits(
        num_blocks=len(graph.blocks) or 1,
        seq_len=graph.seq_len,
        num_heads=spec.num_heads if spec else None,
        num_kv_heads=spec.kv_heads if spec else None,
        pipeline=pipeline_splittable(handle.module),
        context_parallel=isinstance(handle.module, Transformer),
        ddp_over_tp=not shares_parameters(handle.module),
    )
    result = search(
        model, limits, pins=pins, top_k=_POOL * (top_k + 1), pareto=pareto, lossy=lossy,
        progress=progress,
    )  # fmt: skip
    layouts: dict[tuple[int, bool], TPLayout | None] = {}

    def layout_of(strategy: Strategy) -> TPLayout | None:
        key = (strategy.tp, strategy.sequence_parallel)
        if key not in layouts:
            layouts[key] = _tp_layout(handle, training, model, strategy, ilp_time_limit_s)
        return layouts[key]

    best = _first_with_layout(result.ranked, layout_of)
    chunks, prediction = _refine_stages(model, best)
    layout = layout_of(best.strategy)
    stats = result.stats.model_copy(
        update={"search_time_s": time.perf_counter() - started} | _ilp_stats(layout, result.stats)
    )
    stages = [[fqn for i in chunk for fqn in graph.segments[i].modules] for chunk in chunks]
    plan = assemble_plan(
        handle,
        cluster,
        training,
        best.strategy,
        tp_layout=layout.styles if layout is not None else None,
        stages=stages if best.strategy.pp > 1 else None,
        prediction=prediction,
        runners_up=tuple(_runner_up(best, other) for other in _diverse(result.ranked, top_k)),
        solver=stats,
        tradeoffs=tuple(t for t in [tradeoff(model, best.strategy)] if t),
    )
    validate_plan_for_world(plan, cluster.num_gpus)  # what the search emits must run
    check_model_against_plan(plan, handle.module)
    return PlanSearch(plan, result.costed)


def _first_with_layout(
    ranked: Sequence[Scored], layout_of: Callable[[Strategy], TPLayout | None]
) -> Scored:
    """The fastest candidate whose sequence parallelism the ILP's layout can carry.

    A model without norms to shard on the sequence (a CNN, an MLP stack) gets no
    sequence-parallel module from the ILP, so its sequence-parallel candidates cannot run.
    """
    for scored in ranked:
        layout = layout_of(scored.strategy)
        if not scored.strategy.sequence_parallel or layout is None:
            return scored
        if any(style is TPStyle.SEQUENCE_PARALLEL for style in layout.styles.values()):
            return scored
        log.info(
            "skipping %s: the layout shards no module on the sequence", scored.strategy.describe()
        )
    raise InfeasibleError(
        "every fitting candidate uses sequence parallelism, but the tensor-parallel layout "
        "of this model shards no module on the sequence: pin --no-sequence-parallel"
    )


def _refine_stages(model: CostModel, best: Scored) -> tuple[list[list[int]], Prediction]:
    """Stage split by the DP when it beats the even split (pp > 1, one chunk per rank)."""
    strategy = best.strategy
    even = model.default_stages(strategy)
    if strategy.pp == 1 or strategy.virtual_stages > 1:
        return even, best.prediction
    costs = model.segment_costs(strategy)
    in_flight = [
        in_flight_microbatches(
            strategy.schedule,
            pp=strategy.pp,
            rank=rank,
            num_microbatches=strategy.num_microbatches,
        )
        for rank in range(strategy.pp)
    ]
    cap = model.profile.memory_capacity_gib * 2**30 * (1 - model.options.allocator_margin)
    try:
        split = partition_stages(
            [c.time_s for c in costs],
            [c.param_bytes + c.grad_bytes + c.optimizer_bytes for c in costs],
            strategy.pp,
            cap,
            activation=[c.activation_bytes for c in costs],
            activation_multiplier=in_flight,
        )
    except InfeasibleError as exc:
        log.info("stage DP found no split under the cap (%s); keeping the even split", exc)
        return even, best.prediction
    chunks = [
        list(range(a, b)) for a, b in zip(split.boundaries, split.boundaries[1:], strict=False)
    ]
    refined = model.estimate(strategy, stages=chunks)
    if refined.fits and refined.step_time_s < best.prediction.step_time_s:
        return chunks, refined
    return even, best.prediction


def _tp_layout(
    handle: ModelHandle,
    training: Training,
    model: CostModel,
    strategy: Strategy,
    time_limit_s: float,
) -> TPLayout | None:
    """The sharding ILP on the traced graph (real operators and edges) at the plan's tp."""
    if strategy.tp == 1:
        return None
    graph = model.graph if handle.spec is None else trace_for_training(handle, training)
    profile = model.profile
    link = link_for_axis(strategy.tp, 1, model.cluster, profile)
    roofline = Roofline(
        peak_flops=profile.peak_flops(model.training.dtype) * profile.matmul_efficiency,
        memory_bandwidth_GBps=profile.memory_bandwidth_GBps * profile.memory_efficiency,
        link_bandwidth_GBps=link.busbw_Bps / 1e9,
        link_latency_us=link.latency_s * 1e6,
    )
    weights = (
        name for name, m in handle.module.named_modules() if isinstance(m, nn.Linear | nn.Embedding)
    )
    return solve_tp_layout(
        graph,
        tp=strategy.tp,
        roofline=roofline,
        sequence_parallel=strategy.sequence_parallel,
        time_limit_s=time_limit_s,
        weight_modules=weight_module_paths(weights),
    )


def _ilp_stats(layout: TPLayout | None, base: SolverStats) -> dict[str, object]:
    if layout is None:
        return {}
    solution = layout.solution
    notes: Sequence[str] = (*base.notes, solution.note) if solution.note else base.notes
    return {
        "ilp_status": solution.status,
        "ilp_objective": solution.objective_s,
        "ilp_time_s": solution.solve_time_s,
        "notes": tuple(notes),
    }


def _diverse(ranked: Sequence[Scored], count: int) -> list[Scored]:
    """Up to ``count`` runners-up, fastest first, preferring other meshes and settings.

    The fastest candidate of each mesh (dp, tp, pp, cp) and sharding comes first, so the
    list shows real alternatives rather than the winner with another virtual-stage count.
    """

    def shape(s: Strategy) -> tuple[object, ...]:
        return (s.dp, s.tp, s.pp, s.cp, s.zero, s.recompute)

    seen = {shape(ranked[0].strategy)}
    picked: list[Scored] = []
    for scored in ranked[1:]:
        if shape(scored.strategy) not in seen:
            seen.add(shape(scored.strategy))
            picked.append(scored)
    rest = [s for s in ranked[1:] if s not in picked]
    chosen = (picked + rest)[:count]
    return sorted(chosen, key=lambda s: s.prediction.step_time_s)


def _runner_up(best: Scored, other: Scored) -> Candidate:
    """``other`` with the reason it lost: how much slower and the term that grew most."""
    mine, theirs = best.prediction, other.prediction
    slower = theirs.step_time_s / mine.step_time_s - 1
    growth = {
        key: theirs.breakdown_s.get(key, 0.0) - mine.breakdown_s.get(key, 0.0)
        for key in set(mine.breakdown_s) | set(theirs.breakdown_s)
    }
    term, extra = max(sorted(growth.items()), key=lambda item: item[1])
    reason = f"{slower:.1%} slower"
    if extra > 0:
        reason += f": {term} +{extra:.3g} s"
    return Candidate(strategy=other.strategy, prediction=theirs, lost_because=reason)
