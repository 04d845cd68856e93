"""From a solved layout ILP to what the plan carries and what the cost model prices.

:func:`layout_from_solution` turns the ILP's choice into a :class:`TPLayout`:

- ``modules``: the plan's ``tp_layout``, one :class:`~planner.spec.ModuleTP` per module
  FQN pattern (``layers.*.attention.wq``): its style, its parameters' placements, the
  placement its input arrives in and runs on, the one its output leaves in and is
  handed on in, and whether it is handed on as a DTensor. Block boundaries where the
  residual stream changes placement (sequence parallelism starting at the first block)
  are entries of style ``boundary`` keyed by the blocks' FQNs.
- ``assignment``: the same layout as the cost model reads it
  (:class:`~planner.cost.tp.TPAssignment`): per operator its work, kept-activation and
  parameter split, and the collectives of its segment (the operators' own and the
  conversions').

:func:`constraints_from_modules` goes the other way: a plan's ``tp_layout`` as ILP
pins, so a hand-written (or re-read) plan is checked and priced by the same rules.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from planner.cost.tp import Comm, SegmentTP, TPAssignment
from planner.errors import SpecError
from planner.fqn import under_pattern
from planner.graph import OpGraph, OpKind, OpNode
from planner.solve.layout import (
    LayoutConstraints,
    LayoutPricer,
    LayoutProblem,
    ModuleInfo,
    build_layout_problem,
    root_patterns,
    solve_layout,
)
from planner.solve.placements import PARTIAL, REPLICATE, VOCAB, OpStrategy, shard, torch_placement
from planner.solve.sharding import ShardingSolution
from planner.spec import ModuleTP, TPStyle, shard_dim

__all__ = [
    "TPLayout",
    "layout_from_solution",
    "constraints_from_modules",
    "placement_from_torch",
    "solve_tp_layout",
]


@dataclass(frozen=True)
class TPLayout:
    """A solved tensor-parallel layout: for the plan, for the cost model, and how it was found."""

    modules: dict[str, ModuleTP]
    assignment: TPAssignment
    solution: ShardingSolution

    @property
    def styles(self) -> dict[str, TPStyle]:
        return {fqn: m.style for fqn, m in self.modules.items()}

    @property
    def shards_anything(self) -> bool:
        return any(
            m.style not in (TPStyle.REPLICATE, TPStyle.BOUNDARY) for m in self.modules.values()
        )

    @property
    def shards_parameters(self) -> bool:
        """Some parameter is split over the ranks (else every rank does the same work)."""
        return any(m.shards_parameters for m in self.modules.values())


def layout_from_solution(
    problem: LayoutProblem, solution: ShardingSolution, info: ModuleInfo | None = None
) -> TPLayout:
    """The plan's module layout and the cost model's assignment of ``solution``."""
    chosen = {name: problem.node_strategy(name, choice) for name, choice in solution.choice.items()}
    modules: dict[str, ModuleTP] = {}
    for type_id in problem.type_keys:
        modules.update(_type_modules(problem, type_id, chosen, info))
    modules.update(_boundary_modules(problem, chosen))
    assignment = _assignment(problem, chosen)
    return TPLayout(dict(sorted(modules.items())), assignment, solution)


# --- the plan's modules ----------------------------------------------------------------


def _type_modules(
    problem: LayoutProblem, type_id: str, chosen: dict[str, OpStrategy], info: ModuleInfo | None
) -> dict[str, ModuleTP]:
    key = problem.type_keys[type_id]
    ports = [p for p in problem.ports.get(type_id, "").split(",") if p]
    ops = [(name, node) for name, (t, node) in problem.ops.items() if t == type_id]
    roots = root_patterns(problem.graph, type_id)
    first = next(s for s in problem.graph.segments if s.type_id == type_id)
    concrete_root = problem.graph.module_root(first)
    out: dict[str, ModuleTP] = {}
    for module in ports:
        inside = [(n, node) for n, node in ops if node.module == module]
        if not inside:
            continue
        owner = _weight_owner(inside, chosen)
        style = chosen[owner[0]].style if owner else TPStyle.REPLICATE
        assert style is not None
        fqns = [".".join(p for p in (root, module) if p) for root in roots]
        concrete = ".".join(p for p in (concrete_root, module) if p)
        names = _param_names(info, concrete, owner[1] if owner else None)
        entry = ModuleTP(
            style=style,
            params=_params(style, chosen[owner[0]], owner[1], names) if owner else {},
            input=_io(problem, chosen, f"{key}/input:{module}"),
            output=_io(problem, chosen, f"{key}/output:{module}"),
            output_dtensor=_dtensor(problem, chosen, f"{key}/output:{module}"),
        )
        if entry.output is None and style is not TPStyle.REPLICATE:
            sink = inside[-1]
            placement = torch_placement(chosen[sink[0]].output, len(sink[1].output_shape))
            entry = entry.model_copy(update={"output": (placement, placement)})
        for fqn in fqns:
            out[fqn] = entry
    return out


def _weight_owner(
    inside: list[tuple[str, OpNode]], chosen: dict[str, OpStrategy]
) -> tuple[str, OpNode] | None:
    """The operator deciding a module's style: the one holding the most parameters."""
    styled = [(n, node) for n, node in inside if chosen[n].style is not None]
    if not styled:
        return None
    return max(styled, key=lambda item: item[1].param_count)


def _param_names(info: ModuleInfo | None, fqn: str, node: OpNode | None) -> tuple[str, ...]:
    if info is not None and fqn in info.params:
        return info.params[fqn]
    if node is None:
        return ()
    if node.kind is OpKind.MATMUL and node.gemm is not None:
        return ("weight", "bias") if node.bias_count else ("weight",)
    return ("weight",) if node.param_count else ()


def _params(
    style: TPStyle, strategy: OpStrategy, node: OpNode, names: tuple[str, ...]
) -> dict[str, str]:
    """Each direct parameter's placement under ``style`` (plain tensors when replicated)."""
    if style is TPStyle.REPLICATE:
        return {}
    if style is TPStyle.SEQUENCE_PARALLEL:
        return dict.fromkeys(names, "Replicate()")
    weight = strategy.weight
    placements = {}
    for name in names:
        if name == "weight":
            placements[name] = f"Shard({weight[1:]})"
        elif name == "bias":  # a column split splits the bias; a row split keeps it whole
            placements[name] = "Shard(0)" if style is TPStyle.COLWISE else "Replicate()"
        else:
            raise SpecError(
                f"module with parameter {name!r} cannot be laid out {style.value!r}: only "
                "an nn.Linear's or nn.Embedding's weight and bias shard"
            )
    return placements


def _conversion_choice(
    problem: LayoutProblem, chosen: dict[str, OpStrategy], name: str
) -> tuple[OpStrategy, int] | None:
    if name not in chosen:
        return None
    return chosen[name], len(problem.conversions[name].tensor.shape)


def _io(problem: LayoutProblem, chosen: dict[str, OpStrategy], name: str) -> tuple[str, str] | None:
    found = _conversion_choice(problem, chosen, name)
    if found is None:
        return None
    strategy, ndim = found
    return torch_placement(strategy.inputs[0], ndim), torch_placement(strategy.output, ndim)


def _dtensor(problem: LayoutProblem, chosen: dict[str, OpStrategy], name: str) -> bool:
    found = _conversion_choice(problem, chosen, name)
    return found is not None and found[0].name.endswith("*")


def _boundary_modules(problem: LayoutProblem, chosen: dict[str, OpStrategy]) -> dict[str, ModuleTP]:
    """Blocks whose input (or output) changes placement, keyed by their FQNs."""
    out: dict[str, ModuleTP] = {}
    segments = problem.graph.segments
    for name, (before, after) in problem.boundaries.items():
        strategy = chosen[name]
        src, dst = strategy.inputs[0], strategy.output
        if src == dst and not strategy.name.endswith("*"):
            continue
        ndim = len(problem.conversions[name].tensor.shape)
        pair = (torch_placement(src, ndim), torch_placement(dst, ndim))
        if after is None:  # the model's output leaves its last block
            out[segments[-1].fqn] = ModuleTP(style=TPStyle.BOUNDARY, output=pair)
            continue
        if before is None:  # the model's input enters its first block
            out[segments[0].fqn] = ModuleTP(style=TPStyle.BOUNDARY, input=pair)
            continue
        side_input = problem.graph.types[after].kind == "block"
        for a, b in itertools.pairwise(segments):
            if (a.type_id, b.type_id) != (before, after):
                continue
            if side_input:
                out[b.fqn] = ModuleTP(style=TPStyle.BOUNDARY, input=pair)
            else:
                out[a.fqn] = ModuleTP(style=TPStyle.BOUNDARY, output=pair)
    return out


# --- the cost model's assignment ----------------------------------------------------------


def _assignment(problem: LayoutProblem, chosen: dict[str, OpStrategy]) -> TPAssignment:
    comms: dict[str, list[Comm]] = {t: [] for t in problem.type_keys}
    per_node: dict[str, dict[str, OpStrategy]] = {t: {} for t in problem.type_keys}
    for name, (type_id, node) in problem.ops.items():
        strategy = chosen[name]
        per_node[type_id][node.name] = strategy
        comms[type_id] += strategy.comms
    for name, conversion in problem.conversions.items():
        owner = conversion.type_id
        if name in problem.boundaries:
            owner = _boundary_owner(problem, *problem.boundaries[name])
        comms[owner] += chosen[name].comms
    segments = {}
    for type_id in problem.type_keys:
        nodes = problem.graph.types[type_id].nodes
        picks = [per_node[type_id][node.name] for node in nodes]
        segments[type_id] = SegmentTP(
            work_divisor=tuple(s.compute_divisor for s in picks),
            saved_divisor=tuple(s.saved_divisor for s in picks),
            param_elements=tuple(s.param_elements for s in picks),
            comms=tuple(comms[type_id]),
        )
    return TPAssignment(segments)


def _boundary_owner(problem: LayoutProblem, before: str | None, after: str | None) -> str:
    """The segment type that pays a boundary's collectives: the one that is not a block
    (it occurs once), else the block after it (or the last block, at the model's output)."""
    if before is None:
        assert after is not None
        return after
    if problem.graph.types[before].kind != "block" or after is None:
        return before
    return after


# --- a plan's modules back into ILP pins --------------------------------------------------


def placement_from_torch(text: str, ndim: int) -> str:
    """``Replicate()`` -> ``R``, ``Partial()`` -> ``P``, ``Shard(d)`` -> ``S<d>`` (``-1``: last)."""
    if text == "Replicate()":
        return REPLICATE
    if text == "Partial()":
        return PARTIAL
    dim = shard_dim(text)
    assert dim is not None, text
    return shard(dim % ndim) if ndim else shard(dim)


def constraints_from_modules(graph: OpGraph, modules: Mapping[str, ModuleTP]) -> LayoutConstraints:
    """A plan's ``tp_layout`` as pins: styles, and each boundary's placements and hand-off.

    Boundary entries (blocks) need no pin: the residual stream's placement follows from
    the strategy's sequence parallelism. A ``Shard(-1)`` handed on as a DTensor to the
    loss is the loss-parallel ``V``. A replicated entry for a module holding no parameter
    directly is a region kept whole (``LayoutConstraints.replicated``).
    """
    ndims = _tensor_ndims(graph)
    holders = {n.module for t in graph.types.values() for n in t.nodes if n.param_count}
    replicated: set[str] = set()
    styles: dict[str, TPStyle] = {}
    inputs: dict[str, tuple[str, str]] = {}
    outputs: dict[str, tuple[str, str]] = {}
    handoff: dict[str, bool] = {}
    loss_parallel = False
    for fqn, module in modules.items():
        if module.style is TPStyle.BOUNDARY:
            continue
        styles[fqn] = module.style
        relative = _relative_module(graph, fqn)
        if module.style is TPStyle.REPLICATE and relative not in holders:
            replicated.add(fqn)
        if module.input is not None:
            ndim = _ndim(ndims, relative, "input", fqn)
            arrives, runs = module.input
            inputs[fqn] = (placement_from_torch(arrives, ndim), placement_from_torch(runs, ndim))
        if module.output is not None:
            ndim = _ndim(ndims, relative, "output", fqn)
            produced = placement_from_torch(module.output[0], ndim)
            handed = placement_from_torch(module.output[1], ndim)
            if module.loss_parallel:
                handed, loss_parallel = VOCAB, True
            outputs[fqn] = (produced, handed)
            handoff[fqn] = module.output_dtensor
    return LayoutConstraints(
        styles=styles, inputs=inputs, outputs=outputs, handoff=handoff,
        replicated=frozenset(replicated), loss_parallel=loss_parallel if modules else None,
    )  # fmt: skip


def _ndim(ndims: Mapping[tuple[str, str], int], relative: str, side: str, fqn: str) -> int:
    if (relative, side) not in ndims:
        raise SpecError(
            f"plan.tp_layout[{fqn!r}] places its {side}, but the model's forward never runs "
            f"{fqn!r} (nothing of it was traced): remove its {side} placements"
        )
    return ndims[(relative, side)]


def _relative_module(graph: OpGraph, fqn: str) -> str:
    for segment in graph.segments:
        if graph.types[segment.type_id].kind == "block":
            root = segment.fqn
            if under_pattern(fqn, root):
                return fqn.split(".", root.count(".") + 1)[-1]
    return fqn


def _tensor_ndims(graph: OpGraph) -> dict[tuple[str, str], int]:
    """Rank of each module's input (its first operator's) and output (its last
    operator's), by relative module path."""
    ndims: dict[tuple[str, str], int] = {}
    for seg_type in graph.types.values():
        for node in seg_type.nodes:
            if not node.module:
                continue
            ndims.setdefault(
                (node.module, "input"), len(node.input_shapes[0]) if node.input_shapes else 0
            )
            ndims[(node.module, "output")] = len(node.output_shape)
    return ndims


def solve_tp_layout(
    graph: OpGraph,
    *,
    tp: int,
    pricer: LayoutPricer,
    sequence_parallel: bool = False,
    info: ModuleInfo | None = None,
    constraints: LayoutConstraints | None = None,
    memory_budget_bytes: float = math.inf,
    time_limit_s: float = 10.0,
) -> TPLayout:
    """Build the layout ILP of ``graph`` at ``tp``, solve it with CBC and map the answer."""
    problem = build_layout_problem(
        graph, tp=tp, pricer=pricer, sequence_parallel=sequence_parallel, info=info,
        constraints=constraints, memory_budget_bytes=memory_budget_bytes,
    )  # fmt: skip
    solution = solve_layout(problem, time_limit_s=time_limit_s)
    return layout_from_solution(problem, solution, info)
