"""From a model and a cluster to a runnable :class:`~planner.spec.Plan`.

``trace -> layouts + CostModel -> search -> stage DP -> assemble``: the tensor-parallel
layout at each degree (the sharding ILP's, rehearsed; Megatron's for the zoo) is what
the cost model prices, the search picks the strategy, the stage DP re-splits its
pipeline stages under the memory cap, and the plan carries the winner's layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.assemble import assemble_plan
from planner.cost import CostModel, CostOptions
from planner.cost.build import build_cost_model, spec_graph
from planner.cost.experts import expert_tradeoff
from planner.cost.memory import in_flight_microbatches
from planner.cost.options import device_options
from planner.errors import InfeasibleError, PlannerError, SpecError
from planner.frameworks import (
    PLANNER,
    Target,
    blockless_chunk_refusal,
    context_parallel_refusal,
    framework_options,
    model_refusal,
    parse_target,
    pipeline_refusal,
    strategy_refusal,
    training_refusal,
)
from planner.graph import OpGraph, OpKind
from planner.hardware import load_profile
from planner.layouts import FIXED_STYLE_PRICER, ModelLayouts
from planner.models import ModelHandle
from planner.modules import (
    check_model_against_plan,
    context_parallel_blocker,
    expert_parallel_blocker,
    pipeline_blocker,
    shares_parameters,
)
from planner.solve.lossy import LossyCompression, tradeoff
from planner.solve.search import Headroom, ModelLimits, Pins, Progress, Scored, search
from planner.solve.stages import partition_stages
from planner.spec import (
    Candidate,
    Cluster,
    ModelSpec,
    Plan,
    Prediction,
    Strategy,
    Training,
)
from planner.staging import stage_problem
from planner.tracing import trace_for_training
from planner.tracing.ops import writes_in_place
from planner.validate import validate_plan_for_world

__all__ = [
    "PlanSearch",
    "cost_graph",
    "make_plan",
    "model_limits",
    "priced_model",
    "search_options",
    "search_plan",
    "trace_for_training",
]

log = logging.getLogger(__name__)
_POOL = 3  # candidates kept per runner-up shown, to pick diverse ones from
TOLERANCE = 0.01  # plans this much slower than the fastest count as ties (fraction)


def cost_graph(
    handle: ModelHandle, training: Training, options: CostOptions | None = None
) -> OpGraph:
    """The graph the cost model prices: for transformers with a spec the formula graph
    that ``plan estimate`` and the accuracy benchmark use
    (:func:`~planner.cost.build.spec_graph`: same FLOPs, parameters and module paths as
    the trace, tested), for other models the trace."""
    if handle.spec is None:
        return trace_for_training(handle, training)
    return spec_graph(handle.spec, training, options)


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
    target: Target | str = "planner",
    headroom: Headroom | None = None,
    tolerance: float = TOLERANCE,
) -> Plan:
    """Search the fastest fitting strategy for ``handle`` on ``cluster`` and assemble its
    plan; see :func:`search_plan` for the options."""
    return search_plan(
        handle, cluster, training, pins=pins, top_k=top_k, options=options, progress=progress,
        ilp_time_limit_s=ilp_time_limit_s, lossy=lossy, target=target, headroom=headroom,
        tolerance=tolerance,
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
    target: Target | str = "planner",
    headroom: Headroom | None = None,
    tolerance: float = TOLERANCE,
) -> PlanSearch:
    """The plan for ``handle`` on ``cluster``, and every candidate priced on the way.

    ``lossy`` names the lossy gradient compression the search may choose (none by
    default); ``target`` (``"megatron"``, ``"torchtitan==0.2"``...) keeps to what that
    framework release runs, so the plan exports to it, and records the fastest plan it
    ruled out (``plan.without_target``); ``headroom`` is memory every GPU keeps free;
    among the plans within ``tolerance`` (a fraction) of the fastest, the one with the
    fewest parallel dimensions, then the most free memory, is chosen. With ``pareto``
    the candidates include the whole Pareto front of step time against peak memory.
    """
    started = time.perf_counter()
    target = _check_target(target, handle, training)
    options = search_options(target, cluster.gpu, options)
    graph = cost_graph(handle, training, options)
    model, layouts = priced_model(handle, graph, cluster, training, options, ilp_time_limit_s)
    limits = model_limits(handle, graph, cluster, layouts)
    headroom_gib = (headroom or Headroom()).gib_of(model.profile.memory_capacity_gib)
    result = search(
        model, target_limits(limits, target, handle.spec), pins=pins,
        top_k=_POOL * (top_k + 1), pareto=pareto, lossy=lossy, progress=progress, target=target,
        memory_headroom_gib=headroom_gib,
    )  # fmt: skip
    best = preferred(result.ranked, tolerance)
    others = [scored for scored in result.ranked if scored is not best]
    without_target = None
    if not target.is_planner:
        without_target = _without_target(model, limits, pins, lossy, headroom_gib, target, best)
    chunks, prediction = _refine_stages(
        model, best, blocks_only=blockless_chunk_refusal(target) is not None
    )
    strategy = best.strategy
    # A plan only another framework runs (experts beside sequence parallelism on
    # Megatron-LM) keeps no layout of this runtime's: the target lays its layers out.
    runs_here = strategy_refusal(PLANNER, strategy, training) is None and (
        limits.layout_blocker(strategy.tp, strategy.sequence_parallel) is None
    )
    layout = (
        layouts.layout(strategy.tp, strategy.sequence_parallel)
        if strategy.tp > 1 and runs_here
        else None
    )
    stats = result.stats.model_copy(update={"search_time_s": time.perf_counter() - started})
    if layout is not None:
        stats = layout.solution.solver_stats(stats)
    stages = [[fqn for i in chunk for fqn in graph.segments[i].modules] for chunk in chunks]
    plan = assemble_plan(
        handle,
        cluster,
        training,
        strategy,
        tp_layout=layout.modules if layout is not None else {},
        stages=stages if strategy.pp > 1 else None,
        prediction=prediction,
        runners_up=tuple(_runner_up(best, other) for other in _diverse(best, others, top_k)),
        solver=stats,
        tradeoffs=tuple(
            t for t in (tradeoff(model, strategy), expert_tradeoff(model, strategy)) if t
        ),
        target=str(target),
        without_target=without_target,
        model_digest=graph.digest if handle.spec is None else "",
    )
    validate_plan_for_world(plan, cluster.num_gpus)  # what the search emits must run
    check_model_against_plan(plan, handle.module, target)
    return PlanSearch(plan, result.costed)


def search_options(target: Target, gpu: str, options: CostOptions | None = None) -> CostOptions:
    """The cost options a search for ``target`` on ``gpu`` (a profile name or file) prices
    with: ``options`` (default: what the GPU's device runs) with the target's kernels
    where they leave them unset."""
    return framework_options(
        target.framework, options or device_options(load_profile(gpu).device_kind)
    )


def _without_target(
    model: CostModel, limits: ModelLimits, pins: Pins | None, lossy: LossyCompression | None,
    headroom_gib: float, target: Target, best: Scored,
) -> Candidate | None:  # fmt: skip
    """The fastest plan of this runtime's space that ``target`` cannot run, if faster than
    ``best``; ``None`` also when the pins leave that space nothing (they may pin what only
    the target runs, such as experts beside sequence parallelism on Megatron-LM)."""
    try:
        fastest = search(
            model, limits, pins=pins, top_k=1, lossy=lossy, memory_headroom_gib=headroom_gib
        ).ranked[0]
    except PlannerError:
        return None
    return _ruled_out(target, model.training, best, fastest)


def priced_model(
    handle: ModelHandle,
    graph: OpGraph,
    cluster: Cluster,
    training: Training,
    options: CostOptions | None = None,
    ilp_time_limit_s: float = 10.0,
) -> tuple[CostModel, ModelLayouts]:
    """The cost model of ``graph`` and the tensor-parallel layouts it prices.

    A zoo transformer is priced on its formula graph with Megatron-LM's layout (the
    layouts object traces it only to write the winner's ``tp_layout``); any other model
    on its trace, with the layouts the sharding ILP finds and the rehearsal accepts.
    The model is built as ``plan estimate`` builds it
    (:func:`~planner.cost.build.build_cost_model`): attention causality follows the
    spec (a traced model keeps the options' value, a decoder by default).
    """
    traced = handle.spec is None
    holder: list[ModelLayouts] = []
    model = build_cost_model(
        graph, cluster, training, causal=handle.spec.causal if handle.spec else None,
        options=options,
        tp_layouts=(lambda tp, sp: holder[0].assignment(tp, sp)) if traced else None,
    )  # fmt: skip
    layouts = ModelLayouts(
        handle, graph if traced else None,
        model.layout_pricer() if traced else FIXED_STYLE_PRICER,
        trace=lambda: trace_for_training(handle, training), time_limit_s=ilp_time_limit_s,
    )  # fmt: skip
    holder.append(layouts)
    return model, layouts


def model_limits(
    handle: ModelHandle, graph: OpGraph, cluster: Cluster, layouts: ModelLayouts
) -> ModelLimits:
    """What the runtime can do with ``handle``: heads, blocks, pipelines, CP, TP layouts."""
    heads, kv_heads = _heads(handle)
    traced = handle.spec is None
    return ModelLimits(
        num_blocks=len(graph.blocks) or 1,
        seq_len=graph.seq_len,
        num_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=handle.spec.vocab_size if handle.spec is not None else None,
        pipeline_problem=_pipeline_problem(handle, graph.seq_len),
        context_parallel_problem=context_parallel_blocker(
            handle.module, int(graph.total("attention_count"))
        ),
        selective_problem=selective_recompute_blocker(graph),
        ddp_over_tp=not shares_parameters(handle.module),
        max_tp=min(cluster.gpus_per_node, cluster.num_gpus) if traced else None,
        layout_problem=layouts.why_not,
        traced=traced,
        num_experts=graph.num_experts,
        expert_problem=expert_parallel_blocker(handle.module),
    )


def target_limits(limits: ModelLimits, target: Target, spec: ModelSpec | None) -> ModelLimits:
    """``limits`` with what ``target`` cannot run of the model besides: its pipelines
    (:func:`~planner.frameworks.pipeline_refusal`; none runs if two stages do not) and
    its context parallelism (:func:`~planner.frameworks.context_parallel_refusal`)."""
    pipeline = pipeline_refusal(target, spec, pp=2)
    if pipeline is not None and not limits.pipeline_problem:
        limits = replace(limits, pipeline_problem=f"{pipeline.why}; {pipeline.fix}")
    context = context_parallel_refusal(target, spec, cp=2)
    if context is not None and not limits.context_parallel_problem:
        limits = replace(limits, context_parallel_problem=f"{context.why}; {context.fix}")
    return limits


def selective_recompute_blocker(graph: OpGraph) -> str | None:
    """Why this runtime's selective recompute, which keeps every matmul output for
    backward (:mod:`strategies.checkpointing`), would train ``graph``'s model wrong: an
    operator writes into a matmul's output (or a view of it) in place, as OLMo's
    ``clip_qkv`` clamps its q/k/v projections, so the kept tensor is not the one
    backward needs. ``None`` when none does."""
    for segment in graph.segments:
        nodes = {node.name: node for node in graph.segment_type(segment).nodes}
        for node in nodes.values():
            if not writes_in_place(node.target) or not node.inputs:
                continue
            source = nodes.get(node.inputs[0])
            while source is not None and source.kind is OpKind.VIEW and source.inputs:
                source = nodes.get(source.inputs[0])
            if source is not None and source.kind is OpKind.MATMUL:
                where = ".".join(p for p in (graph.module_root(segment), node.module) if p)
                return (
                    f"{where!r} writes into the output of {source.module or source.name!r} in "
                    f"place ({node.target}), which selective recompute keeps for backward: "
                    "the gradients would be computed from the modified tensor; use recompute "
                    "'full' or 'none'"
                )
    return None


def _pipeline_problem(handle: ModelHandle, seq_len: int) -> str | None:
    """Why ``handle``'s model cannot run as pipeline stages: its structure, or its forward
    cut into stages on the meta device (:func:`planner.staging.stage_problem`; the zoo's
    transformer is written to be cut, so only its structure is checked)."""
    problem = pipeline_blocker(handle.module)
    if problem is None and handle.spec is None:
        problem = stage_problem(handle.module, handle.make_inputs(2, seq_len))
    return problem


def _heads(handle: ModelHandle) -> tuple[int | None, int | None]:
    """Query and key/value heads: the spec's, or a Hugging Face config's."""
    if handle.spec is not None:
        return handle.spec.num_heads, handle.spec.kv_heads
    config = getattr(handle.module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    return (
        heads if isinstance(heads, int) else None,
        kv_heads if isinstance(kv_heads, int) else None,
    )


def _refine_stages(
    model: CostModel, best: Scored, *, blocks_only: bool
) -> tuple[list[list[int]], Prediction]:
    """Stage split by the DP when it beats the even split (pp > 1, one chunk per rank);
    with ``blocks_only`` every stage holds a block (the target runs no stage without one)."""
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
            required=[s in model.graph.blocks for s in model.graph.segments]
            if blocks_only
            else None,
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


def _check_target(target: Target | str, handle: ModelHandle, training: Training) -> Target:
    """``target`` parsed, refused up front when it cannot build the model or train in
    ``training``'s precision at all."""
    if isinstance(target, str):
        target = parse_target(target)
    refusal = model_refusal(target, handle.spec) or training_refusal(target, training)
    if refusal is not None:
        raise SpecError(f"--for {target}: {refusal.describe()}; {refusal.fix}")
    return target


def _free_gib(scored: Scored) -> float:
    return scored.prediction.memory_limit_gib - scored.prediction.peak_memory_gib


def preferred(ranked: Sequence[Scored], tolerance: float = TOLERANCE) -> Scored:
    """The plan to run among ``ranked`` (fastest first): of those within ``tolerance``
    (a fraction) of the fastest step time, the fewest parallel dimensions, then the
    most free memory, then the fastest."""
    if not 0 <= tolerance < 1:
        raise SpecError(f"tolerance = {tolerance}: give a fraction in [0, 1), e.g. 0.01 for 1%")
    limit = ranked[0].prediction.step_time_s * (1 + tolerance)
    ties = [scored for scored in ranked if scored.prediction.step_time_s <= limit]
    return min(
        ties,
        key=lambda s: (s.strategy.parallel_dimensions, -_free_gib(s), s.prediction.step_time_s),
    )


def _ruled_out(
    target: Target, training: Training, chosen: Scored, fastest: Scored
) -> Candidate | None:
    """The fastest unrestricted plan as a :class:`Candidate`, when ``target`` ruled it out."""
    refusal = strategy_refusal(target, fastest.strategy, training)
    if refusal is None or fastest.prediction.step_time_s >= chosen.prediction.step_time_s:
        return None
    gain = chosen.prediction.step_time_s / fastest.prediction.step_time_s - 1
    return Candidate(
        strategy=fastest.strategy,
        prediction=fastest.prediction,
        lost_because=f"{gain:.1%} faster, but {target} cannot run it: {refusal.describe()}",
    )


def _diverse(best: Scored, others: Sequence[Scored], count: int) -> list[Scored]:
    """Up to ``count`` runners-up, fastest first, preferring other meshes and settings.

    The fastest candidate of each mesh (dp, tp, pp, cp) and sharding comes first, so the
    list shows real alternatives rather than the winner with another virtual-stage count.
    """

    def shape(s: Strategy) -> tuple[object, ...]:
        return (s.dp, s.tp, s.pp, s.cp, s.zero, s.recompute)

    seen = {shape(best.strategy)}
    picked: list[Scored] = []
    for scored in others:
        if shape(scored.strategy) not in seen:
            seen.add(shape(scored.strategy))
            picked.append(scored)
    rest = [s for s in others if s not in picked]
    chosen = (picked + rest)[:count]
    return sorted(chosen, key=lambda s: s.prediction.step_time_s)


def _share(fraction: float) -> str:
    """A step-time difference as a percentage, tiny ones as an upper bound."""
    return f"{fraction:.1%}" if fraction >= 0.0005 else "<0.05%"


def _tie_break(other: Scored, best: Scored) -> str:
    """What :func:`preferred` held against ``other``, a near tie of ``best``."""
    dims = other.strategy.parallel_dimensions, best.strategy.parallel_dimensions
    if dims[0] != dims[1]:
        return f"{dims[0]} parallel dimensions, not {dims[1]}"
    free = _free_gib(other), _free_gib(best)
    if round(free[0], 2) != round(free[1], 2):
        return f"{free[0]:.2f} GiB free, not {free[1]:.2f}"
    return "the same dimensions and free memory; the search priced it later"


def _runner_up(best: Scored, other: Scored) -> Candidate:
    """``other`` with the reason it lost: how much slower and the term that grew most,
    or, for a near tie that is faster, what :func:`preferred` held against it."""
    mine, theirs = best.prediction, other.prediction
    slower = theirs.step_time_s / mine.step_time_s - 1
    if slower <= 0:
        pace = "as fast" if slower == 0 else f"{_share(-slower)} faster"
        reason = f"{pace}, within the tie tolerance: {_tie_break(other, best)}"
        return Candidate(strategy=other.strategy, prediction=theirs, lost_because=reason)
    growth = {
        key: theirs.breakdown_s.get(key, 0.0) - mine.breakdown_s.get(key, 0.0)
        for key in set(mine.breakdown_s) | set(theirs.breakdown_s)
    }
    term, extra = max(sorted(growth.items()), key=lambda item: item[1])
    reason = f"{_share(slower)} slower"
    if extra > 0:
        reason += f": {term} +{extra:.3g} s"
    return Candidate(strategy=other.strategy, prediction=theirs, lost_because=reason)
