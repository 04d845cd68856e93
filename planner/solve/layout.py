"""The tensor-parallel sharding ILP of a traced model, built so its answer can run.

Operators offer strategies (:mod:`planner.solve.placements`); they run on local
tensors, so along an edge between two operators the placement never changes, forward
or backward. Placements change only where the runtime can redistribute a DTensor: at
the boundary of a module that holds parameters (an ``nn.Linear``, an embedding, a
norm) or of a region kept whole (``LayoutConstraints.replicated``), and at a block's
input or output. Each such boundary is a *conversion node*
whose strategies are the redistributions DTensor performs there:

- ``a>b``: the tensor arrives placed ``a`` and leaves placed ``b`` as a local tensor
  (``S -> R`` all-gather, ``P -> R`` all-reduce, ``P -> S`` reduce-scatter, ``R -> S``
  a local slice), its gradient arriving as ``b`` and converted back;
- ``a>R*``: the same, handed on as a DTensor (``*``): the consumers' partial
  gradients are summed before one collective (one all-reduce for q, k and v);
- ``R*``: a DTensor passing through (a column-parallel linear fed by such a hand-off);
- ``=a``: no conversion.

A module's input gets a conversion node when one tensor from outside enters it, its
output when one of its tensors leaves it (identity casts at its entry, which a fp32
trace records in place of the input, are looked through). A tensor that entered an
enclosing module on its way (``attention`` before ``attention.wq``) keeps its shape
there: that module's code may read it (``x.shape[:-1]``), so only the gradient may
change placement (a column-parallel linear's all-reduce). Identical segments share
one set of variables; consecutive segment types are joined by a conversion at the
block's input (or the last block's output). The residual stream entering a block is
``S1`` under sequence parallelism and ``R`` without; before the first block (where
models compute positions, masks and output shapes from the embeddings' shape)
activations stay whole: an embedding may shard its table, but its output is reduced
or gathered at its own boundary. The model's output is replicated (a token model's loss may
take vocabulary-sharded logits: loss parallel). Modules sharing a weight are tied to
one placement of it.

Costs: each operator's compute and each strategy's collectives, from a
:class:`LayoutPricer` (the cost model's compute and communication model, or a plain
:class:`Roofline`), times the segments of its type. Memory per device is parameter
bytes per rank plus kept activations over their split.
The solution maps to the plan's per-module layout (:mod:`planner.solve.program`).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from planner.cost.communication import Collective, LinkModel, collective_time
from planner.cost.tp import Comm, Scaling
from planner.errors import SpecError
from planner.fqn import fqn_matches
from planner.graph import OpGraph, OpKind, OpNode, SegmentType
from planner.solve.placements import (
    PARTIAL,
    REPLICATE,
    VOCAB,
    OpStrategy,
    StrategyBuilder,
    TensorInfo,
    can_carry_grad,
    element_bytes,
    is_cast,
    reshard_collectives,
    shard,
    tensor_of,
    valid,
)
from planner.solve.sharding import (
    ShardingEdge,
    ShardingInfeasibleError,
    ShardingNode,
    ShardingProblem,
    ShardingSolution,
    ShardingTie,
    solve_sharding,
)
from planner.spec import TPStyle

__all__ = [
    "LayoutPricer",
    "Roofline",
    "ModuleInfo",
    "LayoutConstraints",
    "Conversion",
    "LayoutProblem",
    "build_layout_problem",
    "solve_layout",
    "root_patterns",
]


_IDENTITY_TARGETS = frozenset({"alias", "contiguous", "detach", "clone"})


class LayoutPricer(Protocol):
    """Seconds for the ILP: an operator's forward + backward at the traced batch, its work
    divided ``divisor`` ways, and one collective of ``nbytes`` over ``tp`` ranks."""

    def op_seconds(self, node: OpNode, divisor: int) -> float: ...

    def comm_seconds(self, kind: Collective, nbytes: float, tp: int) -> float: ...


@dataclass(frozen=True)
class Roofline:
    """A plain :class:`LayoutPricer` from hardware numbers (tests, benchmarks).

    ``peak_flops`` FLOP/s and ``memory_bandwidth_GBps`` (10^9 B/s) per device;
    ``link_bandwidth_GBps`` bus bandwidth per device and ``link_latency_us`` per
    collective step on the TP group's link.
    """

    peak_flops: float
    memory_bandwidth_GBps: float
    link_bandwidth_GBps: float
    link_latency_us: float

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth_GBps", "link_bandwidth_GBps"):
            if not getattr(self, name) > 0:
                raise SpecError(f"Roofline.{name} = {getattr(self, name)} must be > 0")
        if self.link_latency_us < 0:
            raise SpecError(f"Roofline.link_latency_us = {self.link_latency_us} must be >= 0")

    @property
    def link(self) -> LinkModel:
        return LinkModel("tp", self.link_bandwidth_GBps * 1e9, self.link_latency_us * 1e-6)

    def op_seconds(self, node: OpNode, divisor: int) -> float:
        flops = node.flops_fwd + node.flops_bwd
        nbytes = 2 * (node.bytes_read + node.bytes_written)
        return max(flops / self.peak_flops, nbytes / (self.memory_bandwidth_GBps * 1e9)) / divisor

    def comm_seconds(self, kind: Collective, nbytes: float, tp: int) -> float:
        return collective_time(kind, nbytes, tp, self.link)


@dataclass(frozen=True)
class ModuleInfo:
    """What the ILP needs to know of the real ``nn.Module`` (model-level FQNs).

    ``weight_modules``: ``nn.Linear``/``nn.Embedding`` modules, whose weight the runtime
    can shard; ``port_modules``: modules holding parameters directly (where it can
    redistribute inputs and outputs); ``tied``: groups of modules sharing a parameter; ``params``: each port module's
    direct parameter names.
    """

    weight_modules: frozenset[str] = frozenset()
    port_modules: frozenset[str] = frozenset()
    tied: tuple[tuple[str, ...], ...] = ()
    params: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # direct parameter names


@dataclass(frozen=True)
class LayoutConstraints:
    """Restrictions on the ILP, keyed by model FQN or ``*`` pattern (``layers.*.attention.wq``).

    ``styles`` pins a module's style (Megatron's layout for the zoo); ``inputs`` and
    ``outputs`` pin its boundary conversions as ``(arrives, leaves)`` placement pairs
    (``R``, ``P``, ``S<d>``, ``V``) and ``handoff`` whether its output leaves as a
    DTensor (a hand-written plan, reproduced exactly); ``replicated`` keeps every
    operator under a module whole (a region whose code cannot run on shards);
    ``loss_parallel`` forces (``True``) or forbids (``False``) the vocabulary-parallel loss;
    ``exhaustive``: a module with parameters that ``styles`` does not name is replicated
    and its boundaries convert nothing (a plan's layout lists every module it touches);
    ``whole_after_blocks`` keeps activations after the last block whole too (for models
    whose own code reshapes the output to the whole sequence); ``shard_parameters``: some
    operator splits its weight over the group (a layout that splits nothing is no tensor
    parallelism, however cheap).
    """

    styles: Mapping[str, TPStyle] = field(default_factory=dict)
    inputs: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    outputs: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    handoff: Mapping[str, bool] = field(default_factory=dict)
    replicated: frozenset[str] = frozenset()
    loss_parallel: bool | None = None
    exhaustive: bool = False
    whole_after_blocks: bool = False
    shard_parameters: bool = False


@dataclass(frozen=True)
class Conversion:
    """A boundary where the runtime may redistribute: ``module`` (relative to its segment
    type) and ``side`` (``input``/``output``); ``module`` is ``""`` at a block boundary
    (the input of the blocks of ``type_id``, or the last block's output)."""

    type_id: str
    module: str
    side: str
    tensor: TensorInfo
    keep_shape: bool = False  # inside a module the tensor entered: its code sees its shape


@dataclass(frozen=True)
class _Strategy:
    """A conversion's choice: arrives ``src``, leaves ``dst``; gradients ``grad_in`` (from
    the consumers) and ``grad_out`` (sent on); ``dtensor``: handed on as a DTensor."""

    src: str
    dst: str
    grad_in: str
    grad_out: str
    dtensor: bool

    @property
    def name(self) -> str:
        if self.dtensor and self.grad_out == PARTIAL:
            return f"{self.src}*"  # a DTensor passing through
        if self.src == self.dst and not self.dtensor:
            return f"={self.src}"
        return f"{self.src}>{self.dst}" + ("*" if self.dtensor else "")


@dataclass
class LayoutProblem:
    """A sharding problem over a model's segment types and what its strategies mean."""

    graph: OpGraph
    tp: int
    sequence_parallel: bool
    problem: ShardingProblem
    strategies: dict[str, list[OpStrategy]]  # ILP node name -> strategies, in ILP order
    type_keys: dict[str, str]  # segment type id -> short prefix of its ILP node names
    ops: dict[str, tuple[str, OpNode]]  # ILP node name -> (segment type id, operator)
    conversions: dict[str, Conversion] = field(default_factory=dict)
    ports: dict[str, str] = field(default_factory=dict)  # type id -> port modules, comma-joined
    boundaries: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)

    def node_strategy(self, name: str, choice: str) -> OpStrategy:
        return self.strategies[name][self.problem.node(name).strategies.index(choice)]


# --- segment roots and FQN patterns --------------------------------------------------


def root_patterns(graph: OpGraph, type_id: str) -> list[str]:
    """The roots of a type's segments: one ``*`` pattern (``layers.*``) when it names them
    and no segment of another type, else each root."""
    roots = list(
        dict.fromkeys(graph.module_root(s) for s in graph.segments if s.type_id == type_id)
    )
    parts = [root.split(".") for root in roots]
    if len(parts) == 1 or len({len(p) for p in parts}) != 1:
        return roots
    pattern = ".".join(c[0] if len(set(c)) == 1 else "*" for c in zip(*parts, strict=True))
    others = (graph.module_root(s) for s in graph.segments if s.type_id != type_id)
    return roots if any(fqn_matches(pattern, other) for other in others) else [pattern]


def _relative(fqns: Iterable[str], root: str) -> set[str]:
    """``fqns`` under ``root`` as paths relative to it (all of them when ``root`` is "")."""
    if not root:
        return set(fqns)
    prefix = root + "."
    return {fqn[len(prefix) :] for fqn in fqns if fqn.startswith(prefix)}


def _within(module: str, region: str) -> bool:
    return module == region or module.startswith(region + ".") or region == ""


class _TypeModules:
    """Per segment type: its roots and the module paths (relative) of its ports and weights.

    Ports are the modules holding parameters directly, and the roots of ``replicated``
    regions: a region kept whole is entered whole and may hand its output on sharded
    (a slice; under sequence parallelism the residual stream after it is sharded).
    """

    def __init__(
        self, graph: OpGraph, type_id: str, info: ModuleInfo | None, replicated: frozenset[str]
    ) -> None:
        self.roots = [graph.module_root(s) for s in graph.segments if s.type_id == type_id]
        nodes = graph.types[type_id].nodes
        modules = {node.module for node in nodes if node.module}
        regions = {
            path
            for module in modules
            for path in _ancestors(module)
            if any(fqn_matches(region, fqn) for region in replicated for fqn in self.fqns(path))
        }
        if info is None:
            self.weights: set[str] | None = None
            self.ports = {n.module for n in nodes if n.param_count and n.module} | regions
            return
        self.weights = set().union(*(_relative(info.weight_modules, r) for r in self.roots))
        self.ports = set().union(*(_relative(info.port_modules, r) for r in self.roots)) | regions

    def fqns(self, module: str) -> list[str]:
        return [".".join(p for p in (root, module) if p) for root in self.roots]

    def port_of(self, module: str) -> list[str]:
        """Port modules containing ``module``, innermost first."""
        parts = module.split(".") if module else []
        paths = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        return [p for p in paths if p in self.ports]


def _constraint_for(mapping: Mapping[str, object], fqns: list[str]) -> object | None:
    for pattern, value in mapping.items():
        if any(fqn_matches(pattern, fqn) for fqn in fqns):
            return value
    return None


# --- the builder ---------------------------------------------------------------------


class _Builder:
    """Collects ILP nodes and edges for every segment type and the boundaries between them."""

    def __init__(
        self,
        graph: OpGraph,
        tp: int,
        pricer: LayoutPricer,
        *,
        sequence_parallel: bool,
        info: ModuleInfo | None,
        constraints: LayoutConstraints,
    ) -> None:
        self.graph, self.tp, self.pricer = graph, tp, pricer
        self.sp = sequence_parallel
        self.info = info
        self.constraints = constraints
        order = list(dict.fromkeys(s.type_id for s in graph.segments))
        self.type_keys = {type_id: f"t{i}" for i, type_id in enumerate(order)}
        self.counts = Counter(segment.type_id for segment in graph.segments)
        first_block = next(
            (i for i, s in enumerate(graph.segments) if graph.types[s.type_id].kind == "block"),
            0,  # a model without repeated blocks has no embedding run before them
        )
        self.before_blocks = {s.type_id for s in graph.segments[:first_block]}
        self.whole = set(self.before_blocks)  # segment types whose activations stay whole
        self.outputs = {t: _outputs(graph.types[t]) for t in order}
        self.after_blocks = {s.type_id for s in graph.segments[_last_block(graph) + 1 :]}
        if constraints.whole_after_blocks:
            self.whole |= self.after_blocks
        self.nodes: list[ShardingNode] = []
        self.edges: list[ShardingEdge] = []
        self.strategies: dict[str, list[OpStrategy]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.ops: dict[str, tuple[str, OpNode]] = {}
        self.conversions: dict[str, Conversion] = {}
        self.ports: dict[str, str] = {}
        self.boundaries: dict[str, tuple[str | None, str | None]] = {}
        self.entries: dict[str, dict[tuple[int, ...], str]] = {}
        self._type_modules: dict[str, _TypeModules] = {}
        self.exits: dict[str, dict[str, str]] = {}  # type id -> output op -> its ILP node

    def build(self, memory_budget_bytes: float) -> LayoutProblem:
        first = self.graph.segments[0].type_id
        for type_id, key in self.type_keys.items():
            self._add_segment_type(type_id, key, starts_model=type_id == first)
        self._add_boundaries()
        ties = self._ties()
        problem = ShardingProblem(
            tuple(self.nodes), tuple(self.edges), memory_budget_bytes, ties, self._shard_one_of()
        )
        return LayoutProblem(
            self.graph, self.tp, self.sp, problem, self.strategies, self.type_keys, self.ops,
            self.conversions, self.ports, self.boundaries,
        )  # fmt: skip

    # ----- one segment type ------------------------------------------------------------

    def _add_segment_type(self, type_id: str, key: str, *, starts_model: bool) -> None:
        segment = self.graph.types[type_id]
        modules = self._modules(type_id)
        self.ports[type_id] = ",".join(sorted(modules.ports))
        names = {node.name for node in segment.nodes}
        by_name = {node.name: node for node in segment.nodes}
        entry_shapes = self._entry_shapes(type_id)
        reads: dict[str, list[str]] = {}
        for node in segment.nodes:  # producers first, then the entry or model input port
            sources = [f"{key}/{src}" for src in node.inputs if src in names]
            produced = [by_name[src].output_shape for src in node.inputs if src in names]
            entry = _entry_read(node, produced, entry_shapes)
            if entry is not None:
                sources.append(self._entry_port(type_id, key, entry, node))
            elif starts_model and not sources and _reads_model_input(node):
                sources.append(self._model_input_port(key, node.input_shapes[0], node))
            reads[node.name] = sources
        wiring = _Wiring(key, modules, reads, by_name, self.outputs[type_id])
        count = self.counts[type_id]
        for node in segment.nodes:
            name = f"{key}/{node.name}"
            sources = wiring.sources(node)
            for src in sources:
                self._ensure(src, wiring, type_id, count)
            inputs = [self.tensors[src] for src in sources]
            strategies = self._strategies(type_id, node, inputs, modules)
            self._add_op(name, node, strategies, tensor_of(node, inputs), count)
            self.ops[name] = (type_id, node)
            for index, src in enumerate(sources):
                self._add_edge(src, name, index)
        for node_name, exit_node in wiring.exits.items():
            if exit_node != f"{key}/{node_name}":
                self._ensure(exit_node, wiring, type_id, count)
        self.exits[type_id] = wiring.exits

    def _modules(self, type_id: str) -> _TypeModules:
        if type_id not in self._type_modules:
            self._type_modules[type_id] = _TypeModules(
                self.graph, type_id, self.info, self.constraints.replicated
            )
        return self._type_modules[type_id]

    def _ensure(self, name: str, wiring: _Wiring, type_id: str, count: int) -> None:
        """Add conversion node ``name`` (and the conversions it reads) if not yet there."""
        if name in self.strategies:
            return
        module, side, src = wiring.conversions[name]
        self._ensure(src, wiring, type_id, count)
        conversion = Conversion(type_id, module, side, self.tensors[src], name in wiring.keep_shape)
        self.conversions[name] = conversion
        sources = {s.output for s in self.strategies[src]}
        self._add_conversion_node(name, conversion, sources, count)
        self._add_edge(src, name, 0)

    def _strategies(
        self, type_id: str, node: OpNode, inputs: list[TensorInfo], modules: _TypeModules
    ) -> list[OpStrategy]:
        fqns = modules.fqns(node.module)
        replicated = any(
            fqn_matches(region, ancestor)
            for fqn in fqns
            for ancestor in _ancestors(fqn)
            for region in self.constraints.replicated
        )
        strategies = StrategyBuilder(
            node, inputs, self.tp, weight_modules=modules.weights, replicated_only=replicated,
            whole_activations=type_id in self.whole,
        ).build()  # fmt: skip
        named = _constraint_for(self.constraints.styles, fqns) if node.module else None
        pinned = TPStyle(str(named)) if named is not None else None
        if pinned is None and self.constraints.exhaustive and node.module:
            pinned = TPStyle.REPLICATE
        if pinned is not None and any(s.style is not None for s in strategies):
            strategies = [s for s in strategies if s.style is pinned]
            if not strategies:
                raise SpecError(
                    f"module {fqns[0]!r}: style {pinned.value!r} is not possible for "
                    f"its operator {node.name!r} ({node.target}) at tp {self.tp}"
                )
        if node.kind is OpKind.LOSS and self.constraints.loss_parallel is not None:
            wanted = "vocab" if self.constraints.loss_parallel else "R"
            strategies = [s for s in strategies if s.name == wanted] or strategies
        return strategies

    def _conversion_strategies(self, conversion: Conversion, sources: set[str]) -> list[_Strategy]:
        tensor = conversion.tensor
        shape = tensor.shape
        whole = conversion.type_id in self.whole  # activations stay whole there
        dims = [] if whole else range(1, len(shape))
        targets = [REPLICATE, *(shard(d) for d in dims if valid(shard(d), shape, self.tp))]
        out: list[_Strategy] = []
        for src in sorted(sources):
            if not (valid(src, shape, self.tp) or src in (REPLICATE, PARTIAL)):
                continue
            back = REPLICATE if src == PARTIAL else src
            if src != PARTIAL and (src in targets or src == VOCAB):
                out.append(_Strategy(src, src, src, src, dtensor=False))
            if src == VOCAB:
                continue
            for dst in targets:
                if dst != src and reshard_collectives(src, dst) is not None:
                    out.append(_Strategy(src, dst, dst, back, dtensor=False))
            if tensor.needs_grad:
                out.append(_Strategy(src, REPLICATE, PARTIAL, back, dtensor=True))
                if src == REPLICATE:
                    out.append(_Strategy(REPLICATE, REPLICATE, PARTIAL, PARTIAL, dtensor=True))
            last = shard(len(shape) - 1)
            if (
                src == last
                and conversion.side == "output"
                and conversion.module
                and conversion.type_id in self.after_blocks
                and self.constraints.loss_parallel is not False
                and valid(VOCAB, shape, self.tp)
            ):
                out.append(_Strategy(last, VOCAB, VOCAB, last, dtensor=True))
        if conversion.keep_shape:
            out = [s for s in out if s.src == s.dst]
        return _pinned(out, *self._conversion_pins(conversion))

    def _conversion_pins(self, conversion: Conversion) -> tuple[object, object]:
        if not conversion.module:  # a block boundary: the strategy's SP decides it
            return None, None
        fqns = self._modules(conversion.type_id).fqns(conversion.module)
        pins = self.constraints.inputs if conversion.side == "input" else self.constraints.outputs
        placements = _constraint_for(pins, fqns)
        handoff = (
            _constraint_for(self.constraints.handoff, fqns) if conversion.side == "output" else None
        )
        unlisted = _constraint_for(self.constraints.styles, fqns) is None
        if placements is None and self.constraints.exhaustive and unlisted:
            return "plain", False
        return placements, handoff

    def _add_conversion_node(
        self, name: str, conversion: Conversion, sources: set[str], count: int
    ) -> None:
        strategies = self._conversion_strategies(conversion, sources)
        tensor = conversion.tensor
        if not strategies:
            pinned, _ = self._conversion_pins(conversion)
            fqn = self._modules(conversion.type_id).fqns(conversion.module)[0]
            raise SpecError(
                f"module {fqn!r}: its {conversion.side} is to go {_pair_text(pinned)}, but the "
                f"tensor reaching it can only be placed {', '.join(map(_placement_text, sorted(sources)))} "
                f"at tp {self.tp}: lay out the modules before it to match"
            )
        as_ops = [self._as_op(s, tensor) for s in strategies]
        zeros = np.zeros(len(as_ops))
        comm = count * np.array([self._comm_seconds(s.comms) for s in as_ops])
        self.nodes.append(
            ShardingNode(name, tuple(s.name for s in strategies), zeros, comm, zeros.copy())
        )
        self.strategies[name], self.tensors[name] = as_ops, tensor

    def _as_op(self, strategy: _Strategy, tensor: TensorInfo) -> OpStrategy:
        scaling = self._scaling(tensor)
        comms = [
            Comm(kind, tensor.nbytes, backward=False, scaling=scaling)
            for kind in reshard_collectives(strategy.src, strategy.dst) or ()
        ]
        if tensor.needs_grad:
            comms += [
                Comm(kind, tensor.nbytes, backward=True, scaling=scaling)
                for kind in reshard_collectives(strategy.grad_in, strategy.grad_out) or ()
            ]
        return OpStrategy(
            strategy.name, (strategy.src,), (strategy.grad_out,), strategy.dst, strategy.grad_in,
            comms=tuple(comms),
        )  # fmt: skip

    def _scaling(self, tensor: TensorInfo) -> Scaling:
        """How an array grows with the micro-batch: one derived from the model's input with
        every token, one derived from constants (positions) with the sequence only."""
        if tensor.batched:
            return "tokens"
        return "sequence" if self.graph.seq_len in tensor.shape else "fixed"

    def _comm_seconds(self, comms: Iterable[Comm]) -> float:
        return sum(self.pricer.comm_seconds(c.kind, c.nbytes, self.tp) for c in comms)

    # ----- operators, ports, edges ------------------------------------------------------

    def _add_op(
        self, name: str, op: OpNode, strategies: list[OpStrategy], tensor: TensorInfo, count: int
    ) -> None:
        """An operator of a type that ``count`` segments share: its costs count that often."""
        size = op.param_bytes / op.param_count if op.param_count else 0.0
        memory = [s.param_elements * size + op.saved_bytes / s.saved_divisor for s in strategies]
        compute = [self.pricer.op_seconds(op, s.compute_divisor) for s in strategies]
        comm = [self._comm_seconds(s.comms) for s in strategies]
        self.nodes.append(
            ShardingNode(
                name,
                tuple(s.name for s in strategies),
                count * np.array(compute),
                count * np.array(comm),
                count * np.array(memory),
            )
        )
        self.strategies[name], self.tensors[name] = strategies, tensor

    def _add_port(self, name: str, tensor: TensorInfo, placements: tuple[str, ...]) -> str:
        if name not in self.strategies:
            strategies = [OpStrategy(p, (p,), (p,), p, p) for p in placements]
            zeros = np.zeros(len(strategies))
            self.nodes.append(ShardingNode(name, placements, zeros, zeros, zeros))
            self.strategies[name], self.tensors[name] = strategies, tensor
        return name

    def _entry_shapes(self, type_id: str) -> set[tuple[int, ...]]:
        """Output shapes of the segments that come right before a segment of this type."""
        segments = self.graph.segments
        return {
            out.output_shape
            for before, after in itertools.pairwise(segments)
            if after.type_id == type_id
            for out in self.outputs[before.type_id]
        }

    def _entry_port(self, type_id: str, key: str, shape: tuple[int, ...], node: OpNode) -> str:
        """A segment's input. The residual stream (the one that needs a gradient) entering a
        block is ``S1`` under SP, else ``R``; what else arrives (positions, masks) is ``R``."""
        residual = self._entry_needs_grad(type_id, shape)
        nbytes = math.prod(shape) * element_bytes(node)
        tensor = TensorInfo(shape, nbytes, needs_grad=residual, batched=residual)
        kind = self.graph.types[type_id].kind
        sharded = valid(shard(1), shape, self.tp) and len(shape) >= 3 and residual
        sharded = sharded and type_id not in self.whole
        placements: tuple[str, ...] = (REPLICATE,)
        if self.sp and sharded:
            placements = (shard(1),) if kind == "block" else (REPLICATE, shard(1))
        name = f"{key}/in:{_shape_text(shape)}"
        self.entries.setdefault(key, {})[shape] = name
        return self._add_port(name, tensor, placements)

    def _entry_needs_grad(self, type_id: str, shape: tuple[int, ...]) -> bool:
        """Whether an entry of ``shape`` carries a gradient: some preceding segment's output
        of that shape does (one of a type not built yet, or the type itself, is assumed
        to unless it is integer or boolean: a mask)."""
        for before, after in itertools.pairwise(self.graph.segments):
            if after.type_id != type_id:
                continue
            for out in self.outputs[before.type_id]:
                if out.output_shape != shape or not can_carry_grad(out):
                    continue
                name = self.exits.get(before.type_id, {}).get(out.name)
                if name is None or self.tensors[name].needs_grad:
                    return True
        return False

    def _model_input_port(self, key: str, shape: tuple[int, ...], node: OpNode) -> str:
        tensor = TensorInfo(shape, math.prod(shape) * element_bytes(node), needs_grad=False)
        return self._add_port(f"{key}/model_input:{_shape_text(shape)}", tensor, (REPLICATE,))

    def _add_edge(self, src: str, dst: str, index: int) -> None:
        """A tensor from ``src`` read as input ``index`` of ``dst``: placements must match."""
        tensor = self.tensors[src]
        legal = np.array(
            [
                [self._compatible(s, t, index, tensor) for t in self.strategies[dst]]
                for s in self.strategies[src]
            ]
        )
        self.edges.append(ShardingEdge(src, dst, np.where(legal, 0.0, math.inf)))

    def _compatible(self, s: OpStrategy, t: OpStrategy, index: int, tensor: TensorInfo) -> bool:
        if not valid(s.output, tensor.shape, self.tp) and s.output not in (REPLICATE, PARTIAL):
            return False
        if s.output != t.inputs[index]:
            return False
        return not tensor.needs_grad or s.output_grad == t.input_grads[index]

    # ----- between segments --------------------------------------------------------------

    def _add_boundaries(self) -> None:
        """Join each segment type's output to the next one's entry through a conversion at
        the block's input (or the last block's output), and the last to the model output."""
        segments = self.graph.segments
        first = segments[0].type_id
        if self.graph.types[first].kind == "block":  # the model's input enters a block
            for entry in self.entries.get(self.type_keys[first], {}).values():
                tensor = replace(self.tensors[entry], needs_grad=False)
                port = self._add_port(f"model_input>{entry}", tensor, (REPLICATE,))
                self._convert(None, first, 1, port, entry)
        joins = Counter((a.type_id, b.type_id) for a, b in itertools.pairwise(segments))
        for (before, after), count in joins.items():
            pairs = [
                (sink, entry)
                for shape, entry in self.entries.get(self.type_keys[after], {}).items()
                if (sink := self._output_of(before, shape)) is not None
            ]
            self._join(before, after, count, pairs)
        last_type = segments[-1].type_id
        last = self.exits[last_type][self.outputs[last_type][-1].name]
        output = self._add_port("model_output", self.tensors[last], (REPLICATE,))
        if self.graph.types[last_type].kind == "block":  # the model ends with a block
            self._convert(last_type, None, 1, last, output)
        else:
            self._add_edge(last, output, 0)

    def _output_of(self, type_id: str, shape: tuple[int, ...]) -> str | None:
        """The ILP node of the last output of ``type_id`` with ``shape`` (``None``: none)."""
        found = [o for o in self.outputs[type_id] if o.output_shape == shape]
        return self.exits[type_id][found[-1].name] if found else None

    def _join(self, before: str, after: str, count: int, pairs: list[tuple[str, str]]) -> None:
        """The (sink, entry) tensors between consecutive segments: the residual stream (the
        largest that carries a gradient) converts at the block's input (or the last
        block's output), anything else (masks, rotary tables) must match."""
        kinds = (self.graph.types[before].kind, self.graph.types[after].kind)
        graded = [entry for _, entry in pairs if self.tensors[entry].needs_grad]
        residual = max(graded, key=lambda e: self.tensors[e].nbytes, default=None)
        for sink, entry in pairs:
            if "block" in kinds and entry == residual:
                self._convert(before, after, count, sink, entry)
            else:
                self._add_edge(sink, entry, 0)

    def _convert(
        self, before: str | None, after: str | None, count: int, sink: str, entry: str
    ) -> None:
        """A conversion at the block's input (``after`` a block; ``before`` ``None``: the
        model's input) or the last block's output (``after`` the head, or ``None``: the
        model's output)."""
        into_block = after is not None and self.graph.types[after].kind == "block"
        source = self.type_keys[before] if before is not None else "in"
        name = f"bd:{source}>{self.type_keys[after] if after is not None else 'out'}"
        side = "input" if into_block else "output"
        owner = after if into_block else before
        assert owner is not None
        conversion = Conversion(owner, "", side, self.tensors[sink])
        self.conversions[name] = conversion
        self.boundaries[name] = (before, after)
        sources = {s.output for s in self.strategies[sink]}
        self._add_conversion_node(name, conversion, sources, count)
        self._add_edge(sink, name, 0)
        self._add_edge(name, entry, 0)

    def _shard_one_of(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The strategies that split a weight (of the blocks' operators, where the model has
        blocks), when the layout must split one."""
        if not self.constraints.shard_parameters:
            return ()
        blocks = {t for t in self.type_keys if self.graph.types[t].kind == "block"}
        picks = (
            (name, tuple(i for i, s in enumerate(self.strategies[name]) if s.weight != REPLICATE))
            for name, (type_id, _) in self.ops.items()
            if type_id in blocks or not blocks  # a transformer's blocks hold its work
        )
        return tuple((name, indices) for name, indices in picks if indices)

    def _ties(self) -> tuple[ShardingTie, ...]:
        """Modules sharing a parameter: their weight-holding operators place it alike."""
        if self.info is None:
            return ()
        ties = []
        for group in self.info.tied:
            members = [name for fqn in group for name in self._weight_ops(fqn)]
            if len(set(members)) > 1:
                members = list(dict.fromkeys(members))
                labels = tuple(tuple(s.weight for s in self.strategies[m]) for m in members)
                ties.append(ShardingTie(tuple(members), labels))
        return tuple(ties)

    def _weight_ops(self, fqn: str) -> list[str]:
        found = []
        for name, (type_id, node) in self.ops.items():
            if node.kind not in (OpKind.MATMUL, OpKind.EMBEDDING):
                continue
            if fqn in self._modules(type_id).fqns(node.module) and any(
                s.style is not None for s in self.strategies[name]
            ):
                found.append(name)
        return found


class _Wiring:
    """Where one segment type's reads cross module boundaries, and the conversion nodes there.

    A read from producer ``u`` by consumer ``v`` leaves the innermost port module holding
    ``u`` but not ``v`` and enters the innermost one holding ``v`` but not ``u``. A module
    left by one producer gets an output conversion serving every consumer outside it;
    a module entered by one source gets an input conversion serving every consumer
    inside. Identity casts at a module's entry are looked through by readers outside.
    """

    def __init__(
        self,
        key: str,
        modules: _TypeModules,
        reads: dict[str, list[str]],
        by_name: dict[str, OpNode],
        outputs: list[OpNode],
    ) -> None:
        self.key, self.modules, self.reads, self.by_name = key, modules, reads, by_name
        self.routed = {
            name: [self._resolve(src, by_name[name]) for src in srcs]
            for name, srcs in reads.items()
        }
        exits: dict[str, set[str]] = {}
        enters: dict[str, set[str]] = {}
        reader: dict[tuple[str, str], OpNode] = {}  # (module entered, source) -> a consumer
        for name, srcs in self.routed.items():
            for src in srcs:
                out, inn = self._crossing(src, by_name[name])
                if out:
                    exits.setdefault(out, set()).add(src)
                if inn:
                    enters.setdefault(inn, set()).add(src)
                    reader.setdefault((inn, src), by_name[name])
        # the segment's outputs leave every module: a module that produces one converts it
        # there, so no partial sum crosses the model's own code to the next segment
        ports = {o.name: self._innermost(o.module, None) for o in outputs}
        for output in outputs:
            port = ports[output.name]
            if port:
                exits.setdefault(port, set()).add(f"{key}/{output.name}")
        self.conversions: dict[str, tuple[str, str, str]] = {}  # name -> (module, side, source)
        self.keep_shape: set[str] = set()  # input conversions inside a module the tensor entered
        self._out = {
            (m, next(iter(srcs))): f"{key}/output:{m}"
            for m, srcs in exits.items()
            if len(srcs) == 1
        }
        self._in = {
            (m, next(iter(srcs))): f"{key}/input:{m}"
            for m, srcs in enters.items()
            if len(srcs) == 1
        }
        for (module, src), name in self._out.items():
            self.conversions[name] = (module, "output", src)
        self.exits = {  # each output's ILP node: its module's conversion, if it has one
            o.name: self._out.get((ports[o.name] or "", f"{key}/{o.name}"), f"{key}/{o.name}")
            for o in outputs
        }
        for (module, src), name in self._in.items():
            out = self._crossing(src, reader[module, src])[0]
            upstream = self._out.get((out, src), src) if out else src
            self.conversions[name] = (module, "input", upstream)
            producer = self.module_of(src)
            if any(producer is None or not _within(producer, a) for a in _ancestors(module)[1:]):
                self.keep_shape.add(name)

    def module_of(self, src: str) -> str | None:
        """The producing operator's module; ``None`` for a port (outside every module)."""
        node = self.by_name.get(src.partition("/")[2]) if src.startswith(self.key + "/") else None
        return node.module if node is not None else None

    def _crossing(self, src: str, consumer: OpNode | None) -> tuple[str | None, str | None]:
        producer = self.module_of(src)
        inside = consumer.module if consumer is not None else None
        out = self._innermost(producer, inside) if producer is not None else None
        inn = self._innermost(inside, producer) if inside is not None else None
        return out, inn

    def _innermost(self, inside: str, outside: str | None) -> str | None:
        """The innermost port module holding ``inside`` but not ``outside``."""
        for port in self.modules.port_of(inside):
            if outside is None or not _within(outside, port):
                return port
        return None

    def _resolve(self, src: str, consumer: OpNode) -> str:
        """A read of an identity cast at a port module's entry, from outside the module,
        reads what the cast reads (a fp32 trace records ``x.float()`` in place of ``x``)."""
        while True:
            node = (
                self.by_name.get(src.partition("/")[2]) if src.startswith(self.key + "/") else None
            )
            if node is None or not _is_alias(node) or len(self.reads[node.name]) != 1:
                return src
            ports = self.modules.port_of(node.module)
            upstream = self.reads[node.name][0]
            above = self.module_of(upstream)
            if not ports or _within(consumer.module, ports[0]):
                return src
            if above is not None and _within(above, ports[0]):
                return src
            src = upstream

    def sources(self, consumer: OpNode) -> list[str]:
        """The ILP nodes ``consumer`` reads: producers, ports or conversions on the way."""
        row = []
        for src in self.routed[consumer.name]:
            out, inn = self._crossing(src, consumer)
            via = self._out.get((out, src), src) if out else src
            if inn and (inn, src) in self._in:
                via = self._in[inn, src]
            row.append(via)
        return row


def _pinned(strategies: list[_Strategy], placements: object, handoff: object) -> list[_Strategy]:
    """The strategies a pinned ``(arrives, leaves)`` pair (``"plain"``: no conversion)
    and hand-off allow."""
    if placements == "plain":
        return [s for s in strategies if s.src == s.dst and not s.dtensor]
    if placements is not None:
        strategies = [s for s in strategies if (s.src, s.dst) == tuple(placements)]  # type: ignore[arg-type]
    if handoff is not None:
        strategies = [s for s in strategies if s.dtensor is handoff]
    return strategies


def _placement_text(placement: str) -> str:
    return {REPLICATE: "Replicate()", PARTIAL: "Partial()", VOCAB: "Shard(-1) (loss parallel)"}.get(
        placement, f"Shard({placement[1:]})"
    )


def _pair_text(pair: object) -> str:
    if not isinstance(pair, tuple):  # "plain", or nothing pinned
        return "unconverted"
    src, dst = pair
    return f"{_placement_text(src)} -> {_placement_text(dst)}"


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _is_alias(node: OpNode) -> bool:
    """An identity view (a cast to the same dtype, an alias) that a trace may record in
    place of a module's input."""
    if node.kind is not OpKind.VIEW or len(node.input_shapes) != 1:
        return False
    if node.input_shapes[0] != node.output_shape:
        return False
    return is_cast(node) or not _IDENTITY_TARGETS.isdisjoint(node.target.lower().split("."))


def _outputs(segment: SegmentType) -> list[OpNode]:
    """The nodes of a segment type that no other node reads: what it hands on (the hidden
    states, and before the blocks also positions and masks); the last is its main output."""
    consumed = {src for node in segment.nodes for src in node.inputs}
    outputs = [node for node in segment.nodes if node.name not in consumed]
    if not outputs:
        raise SpecError(
            f"segment type {segment.type_id!r} has no output node: its inputs form a cycle"
        )
    return outputs


def _last_block(graph: OpGraph) -> int:
    blocks = [i for i, s in enumerate(graph.segments) if graph.types[s.type_id].kind == "block"]
    return blocks[-1] if blocks else -1


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(size) for size in shape)


def _reads_model_input(node: OpNode) -> bool:
    """Whether a producer-less op computes on a tensor (not only on parameters or constants)."""
    return bool(node.input_shapes) and node.kind not in (OpKind.EMBEDDING, OpKind.OTHER)


def _entry_read(
    node: OpNode, producer_shapes: list[tuple[int, ...]], entry_shapes: set[tuple[int, ...]]
) -> tuple[int, ...] | None:
    """The entry shape ``node`` reads, if an input shape is left after its producers'."""
    left = list(node.input_shapes)
    for shape in producer_shapes:
        if shape in left:
            left.remove(shape)
    return next((shape for shape in left if shape in entry_shapes), None)


def build_layout_problem(
    graph: OpGraph,
    *,
    tp: int,
    pricer: LayoutPricer,
    sequence_parallel: bool = False,
    memory_budget_bytes: float = math.inf,
    info: ModuleInfo | None = None,
    constraints: LayoutConstraints | None = None,
) -> LayoutProblem:
    """The sharding ILP of ``graph`` at TP degree ``tp``, one variable set per segment type.

    ``memory_budget_bytes`` bounds the per-device memory of the whole model (parameters
    plus kept activations, bytes). ``info`` describes the
    real module (without it, weights and ports are judged by the operators).
    """
    if tp < 1:
        raise SpecError(f"tp = {tp} must be >= 1")
    if not graph.segments:
        raise SpecError(f"graph of {graph.model_name!r} has no segments to shard")
    builder = _Builder(
        graph, tp, pricer, sequence_parallel=sequence_parallel, info=info,
        constraints=constraints or LayoutConstraints(),
    )  # fmt: skip
    return builder.build(memory_budget_bytes)


def solve_layout(problem: LayoutProblem, *, time_limit_s: float = 10.0) -> ShardingSolution:
    """Solve a layout problem with CBC; an infeasibility names modules, not ILP nodes."""
    try:
        return solve_sharding(problem.problem, time_limit_s=time_limit_s)
    except ShardingInfeasibleError as exc:
        raise ShardingInfeasibleError(exc.family, _readable(problem, str(exc))) from None


def _readable(problem: LayoutProblem, message: str) -> str:
    """``t1/mul_1`` -> ``op mul_1 of layers.*.ffn_norm`` in an ILP message."""
    names = {
        name: f"op {node.name} of {_where(problem, type_id, node.module)}"
        for name, (type_id, node) in problem.ops.items()
    }
    for name, conversion in problem.conversions.items():
        names[name] = (
            f"the {conversion.side} of {_where(problem, conversion.type_id, conversion.module)}"
        )
    text = message.split(": ", 1)[-1]  # ShardingInfeasibleError adds its prefix again
    for name in sorted(names, key=len, reverse=True):
        text = text.replace(name, names[name])
    return text


def _where(problem: LayoutProblem, type_id: str, module: str) -> str:
    roots = root_patterns(problem.graph, type_id)
    if problem.graph.types[type_id].kind != "block":
        return module or "the model"
    return ".".join(p for p in (roots[0], module) if p)
