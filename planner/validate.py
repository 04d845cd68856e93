"""Checks that a plan can run here, before any process group or collective is touched.

:func:`validate_plan_for_world` needs only the plan and the world size;
:func:`check_model_against_plan` also inspects the ``nn.Module`` (names, shapes,
fingerprint). Both are pure: no ``torch.distributed``, so every rank fails the same way
at the same point and none waits in a collective for a rank that raised.

Module paths (FQNs) in layouts may use ``*`` for one path component, as in
``layers.*.attention.wq``; :func:`expand_layout` turns such keys into concrete FQNs.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from planner.cost.compression import should_compress
from planner.errors import PlanMismatchError, SpecError
from planner.fqn import match_fqns
from planner.models import fingerprint
from planner.models.transformer import Transformer
from planner.parallel_dims import ddp_blocker
from planner.spec import (
    Activation,
    CompressionKind,
    Family,
    ModelSpec,
    ModuleTP,
    Plan,
    RecomputeMode,
    Schedule,
    shard_dim,
)

__all__ = [
    "validate_plan_for_world",
    "check_model_against_plan",
    "expand_layout",
    "find_blocks",
    "pipeline_splittable",
    "shares_parameters",
    "check_powersgd_rank",
]


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
    _check_batch(plan)
    _check_context_parallel(plan)
    _check_replication(plan, tied=False)
    _check_compression(plan)
    _check_recompute(plan)
    _check_pipeline(plan)


def _check_batch(plan: Plan) -> None:
    strategy, training = plan.strategy, plan.training
    per_step = strategy.dp * strategy.micro_batch_size * strategy.num_microbatches
    if training.global_batch_size != per_step:
        raise SpecError(
            f"training.global_batch_size = {training.global_batch_size} != dp({strategy.dp}) * "
            f"micro_batch_size({strategy.micro_batch_size}) * "
            f"num_microbatches({strategy.num_microbatches}) = {per_step}: make them agree"
        )


def _check_context_parallel(plan: Plan) -> None:
    cp = plan.strategy.cp
    seq_len = plan.training.seq_len or (plan.model.seq_len if plan.model is not None else None)
    if cp > 1 and seq_len is not None and seq_len % cp:
        raise SpecError(
            f"training.seq_len = {seq_len} is not divisible by cp({cp}): every context-parallel "
            "rank holds an equal contiguous shard of the sequence; choose seq_len divisible by cp"
        )


def _check_compression(plan: Plan) -> None:
    strategy = plan.strategy
    kind = strategy.compression.kind
    if kind is CompressionKind.NONE:
        return
    if strategy.dp * strategy.cp == 1:
        raise SpecError(
            f"strategy.compression.kind = {kind.value!r} needs dp({strategy.dp}) * "
            f"cp({strategy.cp}) > 1 (there is no gradient reduction to compress); set "
            "compression kind 'none'"
        )
    if kind in (CompressionKind.POWERSGD, CompressionKind.LOCAL_SGD) and strategy.zero >= 1:
        raise SpecError(
            f"strategy.compression.kind = {kind.value!r} with zero = {strategy.zero}: it is a "
            "DDP communication hook; use zero = 0, or compression 'fp16'/'bf16' with FSDP"
        )
    if kind is CompressionKind.INT8 and strategy.shard_degree * strategy.cp == 1:
        raise SpecError(
            f"strategy.compression.kind = 'int8' with zero = {strategy.zero} and no sharded "
            "data-parallel axis: int8 replaces FSDP2's gradient reduce-scatter; use zero >= 1, "
            "or compression 'fp16'/'bf16' with DDP"
        )
    if kind is CompressionKind.LOCAL_SGD:
        _check_local_sgd(plan)
    if kind is CompressionKind.POWERSGD and plan.model is not None:
        check_powersgd_rank(plan.strategy.compression.rank or 1, _spec_matrices(plan.model))


def _check_local_sgd(plan: Plan) -> None:
    """Local groups of consecutive dp ranks: more than one group, all of one size."""
    strategy = plan.strategy
    group = strategy.compression.local_group
    if strategy.cp > 1:
        raise SpecError(
            f"strategy.compression.kind = 'local_sgd' with cp({strategy.cp}) > 1: context-"
            "parallel ranks must stay identical, but local SGD lets groups drift; use cp = 1"
        )
    if group is None or group >= strategy.dp or strategy.dp % group:
        raise SpecError(
            f"strategy.compression.local_group = {group} with dp({strategy.dp}): local SGD "
            "needs a local_group smaller than dp that divides it (dp ranks split into groups "
            "of consecutive ranks that reduce every step); e.g. local_group = "
            f"{_largest_proper_divisor(strategy.dp)}"
        )


def _largest_proper_divisor(n: int) -> int:
    return max((d for d in range(1, n) if n % d == 0), default=1)


def _spec_matrices(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """The 2-D gradients of the zoo model ``spec`` builds, as torch's PowerSGD sees them."""
    h, f, v = spec.hidden_size, spec.ffn_size, spec.vocab_size
    kv = spec.kv_heads * spec.head_dim
    block = {"wq": (h, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, h), "w1": (f, h), "w2": (h, f)}
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
    best = max(matrices, key=lambda name: _max_useful_rank(*matrices[name]), default=None)
    largest = f"{best} {matrices[best][0]} x {matrices[best][1]}" if best else "none"
    limit = _max_useful_rank(*matrices[best]) if best else 0
    raise SpecError(
        f"strategy.compression.rank = {rank} compresses no gradient: PowerSGD sends a matrix "
        f"uncompressed unless rank * (rows + columns) * 2 < rows * columns, and the model's "
        f"most compressible matrix ({largest}) allows rank <= {limit}; "
        + (f"choose rank <= {limit}" if limit else "use compression 'fp16' or 'bf16'")
    )


def _max_useful_rank(m: int, n: int) -> int:
    """The largest rank at which torch's PowerSGD still compresses an ``m x n`` matrix."""
    return max(0, (m * n - 1) // (2 * (m + n)))


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
    if strategy.schedule is Schedule.ONE_F_ONE_B and strategy.num_microbatches < strategy.pp:
        raise SpecError(
            f"strategy.num_microbatches = {strategy.num_microbatches} < pp({strategy.pp}): the "
            "1f1b schedule needs at least one micro-batch per stage; raise num_microbatches "
            "or use gpipe"
        )


def expand_layout(module: nn.Module, layout: Mapping[str, ModuleTP]) -> dict[str, ModuleTP]:
    """Concrete ``{fqn: layout}`` for ``module``; raise naming any key that matches nothing
    or places a parameter the module does not have."""
    modules = dict(module.named_modules())
    expanded: dict[str, ModuleTP] = {}
    for pattern, entry in layout.items():
        matches = match_fqns(pattern, modules)
        if not matches:
            raise SpecError(
                f"plan.tp_layout[{pattern!r}] ({entry.style.value}) names no module of "
                f"{type(module).__name__}; known modules include {_sample(modules)}. Fix the key"
            )
        for fqn in matches:
            own = dict(modules[fqn].named_parameters(recurse=False))
            missing = [name for name in entry.params if name not in own]
            if missing:
                raise SpecError(
                    f"plan.tp_layout[{pattern!r}] places {', '.join(map(repr, missing))}, but "
                    f"{fqn!r} ({type(modules[fqn]).__name__}) holds {sorted(own) or 'no parameters'}"
                )
            expanded[fqn] = entry
    return expanded


def _sample(modules: dict[str, nn.Module], limit: int = 8) -> str:
    names = [name for name in modules if name]
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def _check_tp_divides(expanded: dict[str, ModuleTP], module: nn.Module, tp: int) -> None:
    """Every sharded parameter dim has a size tp divides."""
    for fqn, entry in expanded.items():
        own = dict(module.get_submodule(fqn).named_parameters(recurse=False))
        for name, placement in entry.params.items():
            dim = shard_dim(placement)
            if dim is None:
                continue
            size = own[name].shape[dim]
            if size % tp:
                raise SpecError(
                    f"plan.tp_layout[{fqn!r}] shards {name} on dim {dim} of size {size}, not "
                    f"divisible by tp({tp}); choose a tp that divides it or replicate this module"
                )


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks: children of the largest ModuleDict/ModuleList of one class
    whose children are made of modules (a list of bare layers, such as ``nn.Linear``, is
    not a list of blocks: a block's layers are what tensor parallelism lays out).

    Returns ``(fqn, block)`` pairs in order; empty when the model has no such container.
    """
    best: list[tuple[str, nn.Module]] = []
    for name, container in module.named_modules():
        if not isinstance(container, nn.ModuleDict | nn.ModuleList):
            continue
        children = list(container.named_children())
        if len({type(child) for _, child in children}) != 1 or len(children) <= len(best):
            continue
        if not any(True for _ in children[0][1].children()):
            continue
        prefix = f"{name}." if name else ""
        best = [(prefix + key, child) for key, child in children]
    return best


def shares_parameters(module: nn.Module) -> bool:
    """Whether two of ``module``'s submodules hold the same parameter (tied weights)."""
    every = [param for _, param in module.named_parameters(remove_duplicate=False)]
    return len({id(param) for param in every}) < len(every)


def pipeline_splittable(module: nn.Module) -> bool:
    """Whether the runtime can split ``module`` into pipeline stages: its blocks sit in an
    ``nn.ModuleDict`` (deleting blocks keeps FQNs) and it shares no parameters."""
    blocks = find_blocks(module)
    if not blocks:
        return False
    container = module.get_submodule(blocks[0][0].rpartition(".")[0])
    return isinstance(container, nn.ModuleDict) and not shares_parameters(module)


def check_model_against_plan(plan: Plan, module: nn.Module) -> dict[str, ModuleTP]:
    """Raise if ``module`` is not the model ``plan`` was made for, or cannot take its layout.

    Checks the fingerprint, the layout keys (and that tp divides every sharded
    dimension), the heads of zoo models, and the stage FQN lists. Returns the layout
    expanded to concrete module FQNs.
    """
    found = fingerprint(module)
    if found != plan.model_fingerprint:
        raise PlanMismatchError(
            f"plan.model_fingerprint = {plan.model_fingerprint!r} (model {plan.model_name!r}) "
            f"but the model given has fingerprint {found!r}: this plan was made for another "
            "model; make a plan for this model"
        )
    tp = plan.strategy.tp
    if plan.model is not None and tp > 1:
        _check_heads(plan, tp)
    expanded = expand_layout(module, plan.tp_layout) if tp > 1 else {}
    _check_tp_divides(expanded, module, tp)
    if plan.strategy.pp > 1:
        _check_stages(plan, module)
    if plan.strategy.cp > 1:
        _check_context_parallel_model(plan, module)
    _check_tied(plan, module, expanded)
    _check_replication(plan, tied=shares_parameters(module))
    return expanded


def _check_replication(plan: Plan, tied: bool) -> None:
    """Plain data parallelism (ZeRO-0) only where DDP runs; elsewhere ZeRO >= 1 does.
    ``tied``: the model shares parameters (known once the module is at hand)."""
    s = plan.strategy
    if s.zero >= 1:
        return
    blocker = ddp_blocker(dp=s.dp, cp=s.cp, tp=s.tp, pp=s.pp, tied=tied)
    if blocker is not None:
        raise SpecError(
            f"strategy.zero = 0 with dp({s.dp}) x cp({s.cp}) replicas: {blocker}; use zero >= 1 "
            "(FSDP2 averages the same gradients)"
        )


def _check_context_parallel_model(plan: Plan, module: nn.Module) -> None:
    if not any(isinstance(m, Transformer) for m in module.modules()):
        raise SpecError(
            f"strategy.cp = {plan.strategy.cp} but {type(module).__name__} is not a zoo "
            "Transformer: context parallel needs attention that gathers keys and values over "
            "the cp group (planner.models.transformer); use cp = 1 for this model"
        )


def _check_tied(plan: Plan, module: nn.Module, expanded: dict[str, ModuleTP]) -> None:
    """Modules sharing a parameter must place it alike under TP and sit in one pipeline chunk."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        owners.setdefault(id(param), []).append((owner, attr))
    for group in (names for names in owners.values() if len(names) > 1):
        tied = [owner for owner, _ in group]
        placements = {
            owner: expanded[owner].params.get(attr, "plain") if owner in expanded else "plain"
            for owner, attr in group
        }
        if len(set(placements.values())) > 1:
            given = ", ".join(f"{m!r} {p}" for m, p in placements.items())
            raise SpecError(
                f"{' and '.join(tied)} share a parameter (tied weights), but plan.tp_layout "
                f"places it differently ({given}): place it alike (an embedding sharded on "
                "the vocabulary, Shard(0), with a column-parallel head), or replicate both"
            )
        chunks = {_chunk_of(plan, m) for m in tied} if plan.strategy.pp > 1 else set()
        if len(chunks) > 1:
            raise SpecError(
                f"{' and '.join(tied)} share a parameter (tied weights) but sit in pipeline "
                f"chunks {sorted(chunks)}: the runtime does not all-reduce tied gradients "
                "across pipeline stages; put them in one chunk or untie them "
                "(tied_embeddings = false)"
            )


def _chunk_of(plan: Plan, fqn: str) -> int:
    for index, chunk in enumerate(plan.stages):
        if any(fqn == kept or fqn.startswith(kept + ".") for kept in chunk):
            return index
    return -1


def _check_heads(plan: Plan, tp: int) -> None:
    assert plan.model is not None
    for field, heads in (("num_heads", plan.model.num_heads), ("kv_heads", plan.model.kv_heads)):
        if heads % tp:
            raise SpecError(
                f"model {field} = {heads} is not divisible by tp({tp}): each tensor-parallel "
                f"rank needs whole heads; choose tp dividing {heads}"
            )


def _check_stages(plan: Plan, module: nn.Module) -> None:
    strategy = plan.strategy
    blocks = find_blocks(module)
    if len(blocks) < strategy.num_stages:
        raise SpecError(
            f"model has {len(blocks)} blocks but pp({strategy.pp}) * virtual_stages"
            f"({strategy.virtual_stages}) = {strategy.num_stages} pipeline chunks need at least "
            "one block each; lower pp or virtual_stages"
        )
    known = {name for name, _ in module.named_modules() if name}
    for index, chunk in enumerate(plan.stages):
        if not chunk:
            raise SpecError(f"plan.stages[{index}] is empty: every chunk needs a module")
        missing = [fqn for fqn in chunk if fqn not in known]
        if missing:
            raise SpecError(
                f"plan.stages[{index}] names {', '.join(map(repr, missing))}, not modules of "
                f"{type(module).__name__}; fix the FQNs (e.g. 'layers.0')"
            )
    placed = [fqn for chunk in plan.stages for fqn in chunk]
    twice = sorted({fqn for fqn in placed if placed.count(fqn) > 1})
    if twice:
        raise SpecError(f"plan.stages places {', '.join(twice)} in more than one chunk")
