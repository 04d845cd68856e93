"""Plan rules: checks that a plan can run here, needing no model and no process group.

:func:`validate_plan_for_world` needs only the plan and the world size, so every rank
fails the same way at the same point and none waits in a collective for a rank that
raised; :func:`check_plan` checks a plan read from a file (perhaps edited by hand)
against itself before ``plan explain``, ``export`` or ``run`` use it. The rules are the
search's (:class:`~planner.parallel_dims.ParallelDims`). The checks that inspect the
``nn.Module`` live in :mod:`planner.modules`.
"""

from __future__ import annotations

from collections.abc import Mapping

from planner.cost.build import spec_graph
from planner.cost.compression import max_useful_rank, should_compress
from planner.errors import PlanMismatchError, SpecError
from planner.frameworks import ddp_blocker, parse_target
from planner.parallel_dims import ParallelDims
from planner.spec import (
    Activation,
    CompressionKind,
    Family,
    ModelSpec,
    Plan,
    RecomputeMode,
    Strategy,
    Training,
)

__all__ = [
    "validate_plan_for_world",
    "check_batch",
    "check_plan",
    "check_heads",
    "check_replication",
    "check_experts",
    "check_powersgd_rank",
]


def check_plan(plan: Plan) -> None:
    """Raise if ``plan`` disagrees with itself: its cluster's GPU count, the batch
    arithmetic, sequence, compression, schedule and stages (the search's rules), and for
    zoo and spec models the heads and the stage FQNs."""
    strategy = plan.strategy
    if plan.cluster.num_gpus != strategy.world_size:
        raise PlanMismatchError(
            f"cluster.num_gpus = {plan.cluster.num_gpus} but dp({strategy.dp}) * tp({strategy.tp}) "
            f"* pp({strategy.pp}) * cp({strategy.cp}) = {strategy.world_size}: the plan was "
            "edited inconsistently; make a new plan with 'plan' (or fix both)"
        )
    validate_plan_for_world(plan, strategy.world_size)
    if plan.model is not None:
        check_heads(plan)
        if strategy.pp > 1:
            _check_spec_stages(plan, plan.model)


def check_heads(plan: Plan) -> None:
    """Every tensor-parallel rank holds whole query and key/value heads of a spec model."""
    tp = plan.strategy.tp
    if plan.model is None or tp == 1:
        return
    for field, heads in (("num_heads", plan.model.num_heads), ("kv_heads", plan.model.kv_heads)):
        if heads % tp:
            raise SpecError(
                f"model {field} = {heads} is not divisible by tp({tp}): each tensor-parallel "
                f"rank needs whole heads; choose tp dividing {heads}"
            )


def _check_spec_stages(plan: Plan, spec: ModelSpec) -> None:
    """The stages place each of the spec model's modules once, tied ones in one chunk."""
    graph = spec_graph(spec, plan.training)
    known = [fqn for segment in graph.segments for fqn in segment.modules]
    placed = [fqn for chunk in plan.stages for fqn in chunk]
    unknown = sorted(set(placed) - set(known))
    missing = [fqn for fqn in known if fqn not in placed]
    for what, names in (("names unknown modules", unknown), ("leaves out", missing)):
        if names:
            raise SpecError(
                f"plan.stages {what} {', '.join(names[:6])} of model {spec.name!r} "
                f"(modules: {known[0]} ... {known[-1]}): make a new plan, or give every "
                "module exactly one chunk"
            )
    if spec.tied_embeddings:
        chunks = {i for i, chunk in enumerate(plan.stages) for fqn in chunk if fqn in known[:1]}
        chunks |= {i for i, chunk in enumerate(plan.stages) for fqn in chunk if fqn == known[-1]}
        if len(chunks) > 1:
            raise SpecError(
                f"model {spec.name!r} ties its embedding and output head, but plan.stages puts "
                f"them in chunks {sorted(chunks)}: the runtime does not all-reduce tied "
                "gradients across pipeline stages; use pp = 1 or untie them"
            )


def validate_plan_for_world(plan: Plan, world_size: int) -> None:
    """Raise if ``plan`` cannot run on ``world_size`` ranks; the message names every factor."""
    strategy = plan.strategy
    if strategy.world_size != world_size:
        raise PlanMismatchError(
            f"dp({strategy.dp}) * tp({strategy.tp}) * pp({strategy.pp}) * cp({strategy.cp}) "
            f"= {strategy.world_size} != world_size({world_size}): launch with "
            f"--nproc-per-node/--nnodes giving {strategy.world_size} ranks, or make a plan "
            f"for {world_size} GPUs"
        )
    check_batch(plan.training, plan.strategy)
    _check_sequence(plan)
    if plan.model is not None:
        check_experts(plan, plan.model.num_experts)
    check_replication(plan, tied=False)
    _check_compression(plan)
    _check_recompute(plan)
    _check_pipeline(plan)


def check_experts(plan: Plan, num_experts: int) -> None:
    """Raise if the plan's ``ep`` cannot split ``num_experts`` routed experts."""
    blocker = ParallelDims.of(plan.strategy).expert_blocker(num_experts)
    if blocker is not None:
        raise SpecError(f"strategy.{blocker}")


def check_batch(training: Training, strategy: Strategy) -> None:
    """Raise :class:`SpecError` unless ``strategy``'s replicas, micro-batch size and
    micro-batches make ``training``'s global batch."""
    blocker = ParallelDims.of(strategy).batch_blocker(
        training.global_batch_size, strategy.micro_batch_size, strategy.num_microbatches
    )
    if blocker is not None:
        raise SpecError(blocker)


def _check_sequence(plan: Plan) -> None:
    seq_len = plan.seq_len
    blocker = None if seq_len is None else ParallelDims.of(plan.strategy).sequence_blocker(seq_len)
    if blocker is not None:
        raise SpecError(f"training.{blocker}")


def _check_compression(plan: Plan) -> None:
    strategy = plan.strategy
    compression = strategy.compression
    dims = ParallelDims.of(strategy)
    blocker = dims.compression_blocker(compression.kind)
    if blocker is None and compression.kind is CompressionKind.LOCAL_SGD:
        blocker = dims.local_sgd_blocker(compression.local_group)
    if blocker is not None:
        raise SpecError(f"strategy.{blocker}")
    if compression.kind is CompressionKind.POWERSGD and plan.model is not None:
        check_powersgd_rank(compression.rank or 1, _spec_matrices(plan.model))


def _spec_matrices(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """The 2-D gradients of the zoo model ``spec`` builds, as torch's PowerSGD sees them."""
    h, f, v = spec.hidden_size, spec.ffn_size, spec.vocab_size
    q, kv = spec.num_heads * spec.head_size, spec.kv_heads * spec.head_size
    block = {"wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q), "w1": (f, h), "w2": (h, f)}
    if spec.act is Activation.SWIGLU:
        block["w3"] = (f, h)
    matrices = {f"layers.*.{name}": shape for name, shape in block.items()}
    matrices["tok_embeddings"] = (v, h)
    if spec.family is not Family.LLAMA:
        matrices["pos_embeddings"] = (spec.seq_len, h)
    if not spec.tied_embeddings:
        matrices["output"] = (v, h)
    return matrices


def check_powersgd_rank(rank: int, matrices: Mapping[str, tuple[int, int]]) -> None:
    """Raise if PowerSGD of ``rank`` compresses none of ``matrices`` (name: rows, columns).

    torch's ``powerSGD_hook`` sends a matrix uncompressed unless its factors are less
    than half its size (``rank * (m + n) * 2 < m * n``); a rank that compresses nothing
    only adds the hook's overhead.
    """
    if any(should_compress(m, n, rank) for m, n in matrices.values()):
        return
    best = max(matrices, key=lambda name: max_useful_rank(*matrices[name]), default=None)
    largest = f"{best} {matrices[best][0]} x {matrices[best][1]}" if best else "none"
    limit = max_useful_rank(*matrices[best]) if best else 0
    raise SpecError(
        f"strategy.compression.rank = {rank} compresses no gradient: PowerSGD sends a matrix "
        f"uncompressed unless rank * (rows + columns) * 2 < rows * columns, and the model's "
        f"most compressible matrix ({largest}) allows rank <= {limit}; "
        + (f"choose rank <= {limit}" if limit else "use compression 'fp16' or 'bf16'")
    )


def _check_recompute(plan: Plan) -> None:
    strategy = plan.strategy
    modes = [strategy.recompute_for_stage(stage) for stage in range(strategy.pp)]
    if strategy.recompute_blocks is not None and all(m is RecomputeMode.NONE for m in modes):
        raise SpecError(
            f"strategy.recompute_blocks = {strategy.recompute_blocks} but recompute is 'none': "
            "set recompute to 'full' or 'selective', or drop recompute_blocks"
        )


def _check_pipeline(plan: Plan) -> None:
    strategy = plan.strategy
    if strategy.pp == 1:
        return
    if plan.stages and len(plan.stages) != strategy.num_stages:
        raise SpecError(
            f"plan.stages has {len(plan.stages)} chunks, but pp({strategy.pp}) * "
            f"virtual_stages({strategy.virtual_stages}) = {strategy.num_stages}: give one FQN "
            "list per chunk"
        )
    if not plan.stages:
        raise SpecError(
            f"strategy.pp = {strategy.pp} but plan.stages is empty: give one FQN list per "
            "pipeline chunk (planner.assemble.assemble_plan fills an even split)"
        )
    placed = [fqn for chunk in plan.stages for fqn in chunk]
    twice = sorted({fqn for fqn in placed if placed.count(fqn) > 1})
    if twice:
        raise SpecError(f"plan.stages places {', '.join(twice)} in more than one chunk")
    selective = any(
        strategy.recompute_for_stage(stage) is RecomputeMode.SELECTIVE
        for stage in range(strategy.pp)
    )
    blocker = ParallelDims.of(strategy).schedule_blocker(
        strategy.schedule, strategy.num_microbatches, selective=selective
    )
    if blocker is not None:
        raise SpecError(blocker)


def check_replication(plan: Plan, tied: bool) -> None:
    """Plain data parallelism (ZeRO-0) only where the plan's target runs it
    (:func:`~planner.frameworks.ddp_blocker`); elsewhere ZeRO >= 1 does. ``tied``: the
    model shares parameters (known once the module is at hand)."""
    s = plan.strategy
    if s.zero >= 1:
        return
    blocker = ddp_blocker(parse_target(plan.target), ParallelDims.of(s), tied=tied)
    if blocker is not None:
        raise SpecError(
            f"strategy.zero = 0 with dp({s.dp}) x cp({s.cp}) replicas: {blocker}; use zero >= 1 "
            "(FSDP2 averages the same gradients)"
        )
