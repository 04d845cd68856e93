"""Rich tables for a plan: the chosen strategy, its breakdowns and the runners-up."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from planner.errors import PlannerError
from planner.parallel_dims import ParallelDims
from planner.spec import DType, Plan, Prediction, Strategy

__all__ = ["render_plan"]


def _strategy_rows(strategy: Strategy) -> list[tuple[str, str]]:
    s = strategy
    dims = ParallelDims.of(s)
    sharding = "none" if s.zero == 0 else f"ZeRO-{s.zero} over {dims.zero_shard_ranks} ranks"
    if s.zero and s.cp > 1:
        sharding += f" (dp_shard {s.shard_degree} x cp {s.cp})"
    if dims.hybrid_sharding:
        sharding += f" (hybrid: {s.replicate_degree} replicas)"
    rows = [
        ("mesh", " x ".join(f"{a.name.value}={a.size}" for a in s.mesh_axes()) or "single GPU"),
        ("data parallel", f"{s.dp}"),
        ("tensor parallel", f"{s.tp}" + (" + sequence parallel" if s.sequence_parallel else "")),
        ("pipeline parallel", f"{s.pp}"),
        ("context parallel", f"{s.cp}"),
    ]
    if s.ep > 1:
        expert_sharding = f", ZeRO over {dims.expert_shard_ranks}" if s.zero else ""
        group = "consecutive ranks" if s.etp == 1 else f"ranks {s.etp} apart"
        rows.append((
            "expert parallel",
            f"{s.ep} ({group}; experts replicated {dims.expert_replicas}x{expert_sharding})",
        ))  # fmt: skip
        if s.etp > 1:
            rows.append(("expert tensor parallel", f"{s.etp} (consecutive ranks)"))
    rows += [
        ("sharding", sharding),
        ("recompute", s.recompute.value),
        ("micro-batches", f"{s.num_microbatches} x {s.micro_batch_size} sequences per replica"),
    ]
    if s.pp > 1:
        v = f", {s.virtual_stages} virtual stages" if s.virtual_stages > 1 else ""
        rows.append(("schedule", f"{s.schedule.value}{v}"))
    if s.compression.kind.value != "none":
        rows.append(("gradient compression", s.compression.describe()))
    return rows


def _bf16_mfu(plan: Plan, p: Prediction) -> float | None:
    """An fp8 plan's MFU against the bf16 peak (its own MFU is against the fp8 peak)."""
    if plan.training.dtype is not DType.FP8:
        return None
    from planner.cost.flops import bf16_peak_mfu  # only fp8 plans pay for the import

    try:
        return bf16_peak_mfu(p, dtype=plan.training.dtype, gpu=plan.cluster.gpu)
    except PlannerError:  # the plan's profile file is gone: show the plan's own figures
        return None


def _prediction_rows(plan: Plan, p: Prediction) -> list[tuple[str, str]]:
    from planner.cost.error_band import describe_band

    fit = "fits" if p.fits else "does NOT fit"
    convention = p.flop_convention.split(" (")[0]
    bf16 = _bf16_mfu(plan, p)
    peak = f" of the {plan.training.dtype.value} peak" if bf16 is not None else ""
    rows = [
        ("step time", f"{p.step_time_s:.3f} s"),
        ("tokens/s per GPU", f"{p.tokens_per_s_per_gpu:,.0f}"),
        ("model TFLOP/s per GPU", f"{p.model_tflops_per_gpu:.1f}"),
        ("MFU / HFU", f"{p.mfu:.1%} / {p.hfu:.1%}{peak}  ({convention})"),
    ]
    if bf16 is not None:
        rows.append(("MFU of the bf16 peak", f"{bf16:.1%}"))
    rows.append(
        ("peak memory per GPU", f"{p.peak_memory_gib:.1f} of {p.memory_limit_gib:.1f} GiB ({fit})")
    )
    if p.reason:
        rows.append(("why it does not fit" if not p.fits else "note", p.reason))
    if p.error_band is not None:
        rows.append(("expected error", describe_band(p.error_band, plan.cluster.gpu)))
    return rows


def _layout(plan: Plan) -> Table:
    """Each module the tensor-parallel layout touches: how it runs, what it holds, where
    its input and output change placement."""
    sharded = sum(1 for m in plan.tp_layout.values() if m.shards_parameters)
    title = (
        f"Tensor-parallel layout (tp={plan.strategy.tp}, {sharded} of {len(plan.tp_layout)} "
        "modules shard parameters)"
    )
    if plan.loss_parallel:
        title += "; loss parallel: loss and backward inside loss_context(plan)"
    table = Table(title=title, title_justify="left")
    table.add_column("module")
    table.add_column("how it runs")
    for fqn, module in plan.tp_layout.items():
        table.add_row(fqn, module.describe())
    return table


def _two_columns(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def _breakdown(p: Prediction) -> Table:
    table = Table(title="Where the time and memory go", title_justify="left")
    table.add_column("time (exposed)")
    table.add_column("s", justify="right")
    table.add_column("share", justify="right")
    table.add_column("memory")
    table.add_column("GiB", justify="right")
    times = [(k, v) for k, v in p.breakdown_s.items() if v > 0]
    memory = list(p.memory_gib.items())
    for i in range(max(len(times), len(memory))):
        t = times[i] if i < len(times) else ("", None)
        m = memory[i] if i < len(memory) else ("", None)
        table.add_row(
            t[0],
            f"{t[1]:.3f}" if t[1] is not None else "",
            f"{t[1] / p.step_time_s:.1%}" if t[1] is not None and p.step_time_s > 0 else "",
            m[0],
            f"{m[1]:.2f}" if m[1] is not None else "",
        )
    return table


def _runners_up(plan: Plan) -> Table:
    table = Table(title="Runners-up", title_justify="left")
    for column in ("strategy", "step s", "MFU", "peak GiB", "lost because"):
        table.add_column(
            column, justify="right" if column in ("step s", "MFU", "peak GiB") else "left"
        )
    for c in plan.runners_up:
        p = c.prediction
        table.add_row(
            c.strategy.describe(), f"{p.step_time_s:.3f}", f"{p.mfu:.1%}",
            f"{p.peak_memory_gib:.1f}", c.lost_because,
        )  # fmt: skip
    return table


def _target_line(plan: Plan) -> str:
    """Which runtime the plan was searched for, and what keeping to it cost."""
    if plan.target == "planner":
        return "[bold]runs on[/bold]: this planner's runtime (plan run, planner.parallelize)"
    line = f"[bold]runs on[/bold]: {plan.target} (the search kept to what it runs)"
    faster = plan.without_target
    if faster is None:
        return f"{line}; the restriction cost nothing: no faster plan was ruled out"
    return (
        f"{line}; without it: {faster.strategy.describe()}, "
        f"{faster.prediction.step_time_s:.3f} s/step, {faster.lost_because}"
    )


def _own_layout_line(plan: Plan) -> str:
    """Why a tensor-parallel plan carries no layout: only its target runs it."""
    from planner.frameworks import PLANNER, strategy_refusal

    refusal = strategy_refusal(PLANNER, plan.strategy, plan.training)
    why = f": this runtime cannot run the plan ({refusal.describe()})" if refusal else ""
    return f"[bold]tensor-parallel layout[/bold]: {plan.target}'s own{why}"


def render_plan(plan: Plan, console: Console) -> None:
    """Print the plan as tables: strategy, prediction, breakdown, runners-up, solver."""
    cluster, training = plan.cluster, plan.training
    pure = ", states in bf16" if training.param_dtype is DType.BF16 else ""
    where = f" in {cluster.name}" if cluster.name else ""  # a cluster profile's links
    title = (
        f"Plan for {plan.model_name} on {cluster.num_gpus} x {cluster.gpu}{where} "
        f"(global batch {training.global_batch_size}, {training.dtype.value}{pure})"
    )
    console.print(_two_columns(title, _strategy_rows(plan.strategy)))
    if plan.prediction is not None:
        console.print(_two_columns("Predicted", _prediction_rows(plan, plan.prediction)))
        console.print(_breakdown(plan.prediction))
    if plan.stages:
        spans = "; ".join(f"{chunk[0]}..{chunk[-1]} ({len(chunk)})" for chunk in plan.stages)
        console.print(f"[bold]pipeline stages[/bold] (first..last module, count): {spans}")
    if plan.tp_layout:
        console.print(_layout(plan))
    elif plan.strategy.tp > 1:
        console.print(_own_layout_line(plan))
    for tradeoff in plan.tradeoffs:
        console.print(f"[bold]trade-off[/bold]: {tradeoff}")
    if plan.runners_up:
        console.print(_runners_up(plan))
    console.print(_target_line(plan))
    s = plan.solver
    ilp = (
        f"; sharding ILP {s.ilp_status} in {s.ilp_time_s:.2f} s" if s.ilp_time_s is not None else ""
    )
    console.print(
        f"searched {s.candidates_enumerated:,} candidates ({s.pruned_by_memory:,} pruned by "
        f"memory, {s.candidates_costed:,} costed) in {s.search_time_s:.2f} s{ilp}"
    )
