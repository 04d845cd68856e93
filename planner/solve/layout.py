"""From an operator graph to a sharding ILP, and from its solution to TP module layouts.

Every tensor on the tensor-parallel group has a *placement*: ``R`` (replicated),
``P`` (partial sums: the value is the sum over ranks) or ``S<d>`` (sharded on its
dim ``d``). Each operator offers strategies, each fixing the placements it needs on
its inputs, the one it gives its output, the placement of the gradients it sends back
and the one it accepts, and how far it divides its work (compute) and parameters:

- linear ``[out, in]``: ``replicate``; ``colwise`` (input R, output sharded on the
  last dim, input gradient partial); ``rowwise`` (input sharded on the last dim,
  output partial).
- embedding ``[vocab, hidden]``: ``replicate``; ``vocab`` (output partial); ``colwise``.
- attention: ``replicate``; ``heads`` (q, k, v and output sharded on the heads dim).
- norm, softmax: ``R`` or sharded on a non-normalised dim (sequence parallel).
- element-wise, reductions, views, parameter-free matmuls: follow their input (``R``
  or ``S<d>`` on any dim the op preserves); views also pass ``P`` through.
- convolutions, losses and matmuls with parameters that are not ``nn.Linear`` (GPT-2's
  ``Conv1D``, batched expert weights): replicate only (the runtime's TP styles cover
  ``nn.Linear`` and ``nn.Embedding``); ops of unknown kind too, and that is logged.

A node read by several consumers also offers its strategies followed by one
conversion to ``R`` (gradients accepted as ``R`` or ``P``), so one all-gather or
all-reduce serves every consumer instead of one per edge.

Edge costs are the forward resharding of the producer's output into the consumer's
placement plus the backward resharding of the consumer's gradient into the producer's
(``P -> R`` all-reduce, ``P -> S`` reduce-scatter, ``S -> R`` all-gather, ``S -> S``
all-to-all, ``R -> S`` free; a gradient becomes ``P`` for free, a forward value never
does), priced with an alpha-beta model of the
TP group's link. Compute is a roofline over forward and backward FLOPs and twice the
forward bytes. Memory per device is parameter bytes (times ``param_memory_factor``
for gradients and optimizer states) over the parameter split plus saved activations
over the compute split.

All segment types of a model are solved in one ILP, each type's variables shared by
every segment of that type (so the memory budget bounds one segment of each type);
consecutive segments are joined by boundary edges, so a block type feeding itself
forces the residual stream into one placement (``R``, or ``S1`` with sequence
parallelism). The trace names only producers inside a segment, so an op reads the
segment's entry when one of its input shapes is left over after its producers' and
equals the previous segment's output shape. Model inputs arrive replicated; the model
output may stay sharded on its last dim (loss parallel) or be replicated.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import numpy as np

from planner.errors import SpecError
from planner.graph import OpGraph, OpKind, OpNode, Segment, SegmentType
from planner.solve.sharding import (
    ShardingEdge,
    ShardingNode,
    ShardingProblem,
    ShardingSolution,
    solve_sharding,
)
from planner.spec import TPStyle

__all__ = [
    "Roofline",
    "OpStrategy",
    "TPLayout",
    "LayoutProblem",
    "build_layout_problem",
    "layout_from_solution",
    "solve_tp_layout",
    "weight_module_paths",
]

log = logging.getLogger(__name__)

_ELEMENT_BYTES = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,
    "fp16": 2,
    "bf16": 2,
    "fp8": 1,
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
}
_INTEGER_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8", "bool"})
_PERMUTING_TARGETS = ("transpose", "permute", "movedim", ".t", "swapaxes")
REPLICATE, PARTIAL = "R", "P"
ENTRY = "in"  # ILP name of a segment type's entry port: "<type key>/in:<shape>"


# how a traced nn.Linear appears: the module class (fx) or its aten op (export)
_LINEAR_TARGETS = frozenset({"Linear", "aten.linear.default"})


def shard(dim: int) -> str:
    return f"S{dim}"


def shard_dim(placement: str) -> int | None:
    return int(placement[1:]) if placement.startswith("S") else None


@dataclass(frozen=True)
class Roofline:
    """Plain hardware numbers for pricing strategies, independent of the cost model.

    ``peak_flops`` FLOP/s and ``memory_bandwidth_GBps`` (10^9 B/s) per device;
    ``link_bandwidth_GBps`` per device in one direction and ``link_latency_us`` per
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

    def compute_s(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops, nbytes / (self.memory_bandwidth_GBps * 1e9))

    def collective_s(self, volume_factor: float, nbytes: float, steps: int) -> float:
        """Seconds to move ``volume_factor * nbytes`` per device in ``steps`` latency steps."""
        return steps * self.link_latency_us * 1e-6 + volume_factor * nbytes / (
            self.link_bandwidth_GBps * 1e9
        )

    def reshard_s(self, src: str, dst: str, nbytes: float, tp: int) -> float:
        """Seconds to turn a tensor of ``nbytes`` (whole) from placement ``src`` into ``dst``."""
        if src == dst or dst == PARTIAL or (src == REPLICATE and dst.startswith("S")):
            return 0.0
        ring = (tp - 1) / tp
        if src == PARTIAL:
            factor = 2 * ring if dst == REPLICATE else ring  # all-reduce or reduce-scatter
            return self.collective_s(factor, nbytes, 2 * (tp - 1) if dst == REPLICATE else tp - 1)
        if dst == REPLICATE:
            return self.collective_s(ring, nbytes, tp - 1)  # all-gather
        return self.collective_s(ring / tp, nbytes, tp - 1)  # all-to-all between shard dims


@dataclass(frozen=True)
class OpStrategy:
    """One way to run an operator on the TP group (placements as ``R``, ``P``, ``S<d>``)."""

    name: str
    inputs: tuple[str, ...]  # forward placement required of each input
    input_grads: tuple[str, ...]  # placement of the gradient sent back to each input
    output: str
    output_grad: str  # placement of the output gradient this strategy's backward takes
    compute_divisor: int = 1
    param_divisor: int = 1
    comm_s: float = 0.0
    style: TPStyle | None = None  # module layout, for operators holding parameters


@dataclass(frozen=True)
class _Tensor:
    """A node's output as the ILP sees it."""

    shape: tuple[int, ...]
    nbytes: float
    needs_grad: bool


def _element_bytes(node: OpNode) -> int:
    size = _ELEMENT_BYTES.get(node.dtype.removeprefix("torch."))
    if size is None:
        raise SpecError(
            f"node {node.name!r} has dtype {node.dtype!r} of unknown size: "
            f"use one of {sorted(_ELEMENT_BYTES)}"
        )
    return size


def _valid(placement: str, shape: tuple[int, ...], tp: int) -> bool:
    """Whether ``placement`` fits ``shape``: a shard needs tp > 1 and a dim tp divides."""
    dim = shard_dim(placement)
    if dim is None:
        return True
    return tp > 1 and 0 <= dim < len(shape) and shape[dim] >= tp and shape[dim] % tp == 0


# --- which output dims an operator preserves from each input ---------------------


def _same_size_map(
    out: tuple[int, ...], src: tuple[int, ...], repeats: bool = False
) -> dict[int, int | None]:
    """Output dim -> input dim (``None``: broadcast) for ops aligned from the right.

    With ``repeats`` (``repeat_interleave``) a dim grown by a whole factor keeps its
    sharding: each rank's slice expands into its own slice.
    """
    offset = len(out) - len(src)
    mapping: dict[int, int | None] = {}
    for d, size in enumerate(out):
        j = d - offset
        if j < 0 or (src[j] == 1 and size > 1):
            mapping[d] = None
        elif src[j] == size or (repeats and size % src[j] == 0):
            mapping[d] = j
    return mapping


def _subsequence_map(out: tuple[int, ...], src: tuple[int, ...]) -> dict[int, int | None]:
    """Output dims matched in order to input dims of the same size (reductions, selects)."""
    mapping: dict[int, int | None] = {}
    j = 0
    for d, size in enumerate(out):
        while j < len(src) and src[j] != size:
            j += 1
        if j == len(src):
            break
        mapping[d] = j
        j += 1
    return mapping


def _permutation_map(out: tuple[int, ...], src: tuple[int, ...]) -> dict[int, int | None]:
    """Transposes: dims whose size is unique on both sides are traceable."""
    mapping: dict[int, int | None] = {}
    for d, size in enumerate(out):
        if out.count(size) == 1 and src.count(size) == 1:
            mapping[d] = src.index(size)
    return mapping


def _reshape_map(out: tuple[int, ...], src: tuple[int, ...]) -> dict[int, int | None]:
    """Views that split or merge dims: the outermost dims of matching groups correspond."""
    mapping: dict[int, int | None] = {}
    i = j = 0
    while i < len(src) and j < len(out):
        group_in, group_out = [i], [j]
        size_in, size_out = src[i], out[j]
        while size_in != size_out:
            if size_in < size_out and i + 1 < len(src):
                i += 1
                size_in *= src[i]
                group_in.append(i)
            elif j + 1 < len(out):
                j += 1
                size_out *= out[j]
                group_out.append(j)
            else:
                return mapping
        outer_in = next((k for k in group_in if src[k] > 1), None)
        outer_out = next((k for k in group_out if out[k] > 1), None)
        if outer_in is not None and outer_out is not None:
            mapping[outer_out] = outer_in
        i, j = i + 1, j + 1
    return mapping


def _dim_map(node: OpNode, src: tuple[int, ...], first: bool) -> dict[int, int | None]:
    out = node.output_shape
    if node.kind is OpKind.VIEW and first:
        permutes = any(word in node.target.lower() for word in _PERMUTING_TARGETS)
        if sorted(out) == sorted(src) and (out != src or permutes):
            return _permutation_map(out, src)
        if math.prod(out) == math.prod(src):
            return _reshape_map(out, src)
    if len(src) > len(out):
        return _subsequence_map(out, src)
    return _same_size_map(out, src, repeats="repeat_interleave" in node.target)


# --- strategies per operator kind ---------------------------------------------------


class _StrategyBuilder:
    """The candidate strategies of one node, given its input tensors and the TP degree."""

    def __init__(
        self,
        node: OpNode,
        inputs: Sequence[_Tensor],
        tp: int,
        roofline: Roofline,
        weight_modules: Collection[str] | None,
    ):
        self.node, self.inputs, self.tp, self.roofline = node, inputs, tp, roofline
        self.weight_modules = weight_modules

    def build(self) -> list[OpStrategy]:
        kind, node = self.node.kind, self.node
        if node.param_count and kind in (OpKind.MATMUL, OpKind.EMBEDDING):
            if not self._shardable_weight():
                log.info("%s (%s): weight not shardable, replicated only", node.name, node.target)
                return [self._replicate()]
            if kind is OpKind.EMBEDDING:
                return self._embedding()
            if self.inputs:
                return self._linear()
        if kind is OpKind.ATTENTION and self.inputs:
            return self._attention()
        if kind is OpKind.OTHER and self.inputs:
            log.info("%s (%s): operator of unknown kind, replicated only", node.name, node.target)
        if kind in (OpKind.CONV, OpKind.LOSS, OpKind.OTHER, OpKind.EMBEDDING) or not self.inputs:
            return [self._replicate()]
        return self._follow()

    def _shardable_weight(self) -> bool:
        """Whether the runtime can shard this node's weight: its module is an ``nn.Linear``
        or ``nn.Embedding`` (``weight_modules``, when given; else judged by the op)."""
        if self.weight_modules is not None and self.node.module:  # "": the segment's root
            return self.node.module in self.weight_modules
        return self.node.kind is OpKind.EMBEDDING or self.node.target in _LINEAR_TARGETS

    def _replicate(self) -> OpStrategy:
        count = len(self.inputs)
        style = TPStyle.REPLICATE if self.node.param_count else None
        return OpStrategy(
            "R", (REPLICATE,) * count, (REPLICATE,) * count, REPLICATE, REPLICATE, style=style
        )

    def _rest(self, count: int) -> tuple[str, ...]:
        return (REPLICATE,) * (len(self.inputs) - count)

    def _linear(self) -> list[OpStrategy]:
        tp, x = self.tp, self.inputs[0].shape
        last_in, last_out = len(x) - 1, len(self.node.output_shape) - 1
        strategies = [self._replicate()]
        if _valid(shard(last_out), self.node.output_shape, tp):
            strategies.append(
                OpStrategy(
                    "colwise",
                    (REPLICATE, *self._rest(1)),
                    (PARTIAL, *self._rest(1)),
                    shard(last_out),
                    shard(last_out),
                    tp,
                    tp,
                    style=TPStyle.COLWISE,
                )
            )
        if _valid(shard(last_in), x, tp):
            strategies.append(
                OpStrategy(
                    "rowwise",
                    (shard(last_in), *self._rest(1)),
                    (shard(last_in), *self._rest(1)),
                    PARTIAL,
                    REPLICATE,
                    tp,
                    tp,
                    style=TPStyle.ROWWISE,
                )
            )
        return strategies

    def _embedding(self) -> list[OpStrategy]:
        tp, out = self.tp, self.node.output_shape
        vocab = self.node.param_count // out[-1]
        rest = self._rest(0)
        strategies = [self._replicate()]
        if tp > 1 and vocab >= tp and vocab % tp == 0:
            strategies.append(
                OpStrategy(
                    "vocab", rest, rest, PARTIAL, REPLICATE, tp, tp, style=TPStyle.VOCAB_PARALLEL
                )
            )
        if _valid(shard(len(out) - 1), out, tp):
            last = shard(len(out) - 1)
            strategies.append(
                OpStrategy("colwise", rest, rest, last, last, tp, tp, style=TPStyle.COLWISE)
            )
        return strategies

    def _attention(self) -> list[OpStrategy]:
        main = self.inputs[:3]
        heads = [shard(max(0, len(t.shape) - 3)) for t in main]
        out = shard(max(0, len(self.node.output_shape) - 3))
        strategies = [self._replicate()]
        legal = all(_valid(p, t.shape, self.tp) for p, t in zip(heads, main, strict=True))
        if legal and _valid(out, self.node.output_shape, self.tp):
            placements = (*heads, *self._rest(len(main)))
            strategies.append(OpStrategy("heads", placements, placements, out, out, self.tp))
        return strategies

    def _shardable_dims(self) -> range:
        out = self.node.output_shape
        kind = self.node.kind
        if kind in (OpKind.NORM, OpKind.SOFTMAX) or self.node.param_count:
            return range(len(out) - 1)  # keep the normalised (or parameter) dim whole
        if kind is OpKind.MATMUL:
            return range(len(out) - 2)  # batch dims of a parameter-free matmul
        return range(len(out))

    def _follow(self) -> list[OpStrategy]:
        strategies = [self._replicate()]
        maps = [_dim_map(self.node, t.shape, i == 0) for i, t in enumerate(self.inputs)]
        for d in self._shardable_dims():
            strategy = self._follow_dim(d, maps)
            if strategy is not None:
                strategies.append(strategy)
        if self.node.kind is OpKind.VIEW and len(self.inputs) == 1:
            strategies.append(OpStrategy("P", (PARTIAL,), (REPLICATE,), PARTIAL, REPLICATE))
        return strategies

    def _follow_dim(self, d: int, maps: list[dict[int, int | None]]) -> OpStrategy | None:
        placement = shard(d)
        if not _valid(placement, self.node.output_shape, self.tp):
            return None
        needs, grads = [], []
        for tensor, mapping in zip(self.inputs, maps, strict=True):
            if d not in mapping:
                return None
            source = mapping[d]
            if source is None:  # broadcast along d: every rank needs all of it
                needs.append(REPLICATE)
                grads.append(PARTIAL)
            elif _valid(shard(source), tensor.shape, self.tp):
                needs.append(shard(source))
                grads.append(shard(source))
            else:
                return None
        # Parameter gradients are partial; their all-reduce is bucketed once per step, so
        # it pays bandwidth, not a latency per operator.
        grad_sync = self.roofline.collective_s(
            2 * (self.tp - 1) / self.tp, self.node.param_bytes, steps=0
        )
        style = TPStyle.SEQUENCE_PARALLEL if self.node.param_count else None
        return OpStrategy(
            placement,
            tuple(needs),
            tuple(grads),
            placement,
            placement,
            self.tp,
            comm_s=grad_sync if self.node.param_count else 0.0,
            style=style,
        )


def _with_gathered_outputs(
    strategies: list[OpStrategy], out: _Tensor, tp: int, roofline: Roofline
) -> list[OpStrategy]:
    """Add, for a node with several consumers, each strategy followed by one conversion to R."""
    variants = []
    for base in strategies:
        for grad in (REPLICATE, PARTIAL):
            if (base.output, base.output_grad) == (REPLICATE, grad):
                continue
            extra = roofline.reshard_s(base.output, REPLICATE, out.nbytes, tp)
            if out.needs_grad:
                extra += roofline.reshard_s(grad, base.output_grad, out.nbytes, tp)
            name = f"{base.name}>R" + ("~" if grad == PARTIAL else "")
            variants.append(
                OpStrategy(
                    name,
                    base.inputs,
                    base.input_grads,
                    REPLICATE,
                    grad,
                    base.compute_divisor,
                    base.param_divisor,
                    base.comm_s + extra,
                    base.style,
                )
            )
    return strategies + variants


# --- the joint problem over segment types --------------------------------------------


@dataclass(frozen=True)
class _Port:
    """A virtual node: an input of a segment type, or the model's output."""

    name: str
    tensor: _Tensor
    placements: tuple[str, ...]


@dataclass
class LayoutProblem:
    """A sharding problem over a model's segment types and what its strategies mean."""

    graph: OpGraph
    tp: int
    problem: ShardingProblem
    strategies: dict[str, list[OpStrategy]]  # ILP node name -> strategies, in ILP order
    type_keys: dict[str, str]  # segment type id -> short prefix of its ILP node names
    ops: dict[str, tuple[str, OpNode]]  # ILP node name -> (segment type id, operator)
    consumers: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    producers: dict[str, list[str]] = field(default_factory=dict)


def _port_strategy(placement: str) -> OpStrategy:
    return OpStrategy(placement, (placement,), (placement,), placement, placement)


class _ProblemBuilder:
    """Collects ILP nodes and edges for every segment type and the boundaries between them.

    The trace lists only producers inside a segment as inputs; a node reads the
    segment's entry (the previous segment's output) when one of its input shapes is
    left over after its producers' shapes and equals that output's shape.
    """

    def __init__(
        self,
        graph: OpGraph,
        tp: int,
        roofline: Roofline,
        *,
        sequence_parallel: bool,
        param_memory_factor: float,
        weight_modules: Collection[str] | None,
    ) -> None:
        self.graph, self.tp, self.roofline = graph, tp, roofline
        self.weight_modules = weight_modules
        self.sequence_parallel = sequence_parallel
        self.param_memory_factor = param_memory_factor
        self.type_keys = {type_id: f"t{i}" for i, type_id in enumerate(_types_in_order(graph))}
        self.nodes: list[ShardingNode] = []
        self.edges: list[ShardingEdge] = []
        self.strategies: dict[str, list[OpStrategy]] = {}
        self.tensors: dict[str, _Tensor] = {}
        self.ops: dict[str, tuple[str, OpNode]] = {}
        self.consumers: dict[str, list[tuple[str, int]]] = {}
        self.producers: dict[str, list[str]] = {}
        self.sinks = {t: _sink(graph.types[t]) for t in self.type_keys}
        self.counts = Counter(segment.type_id for segment in graph.segments)
        self.entries: dict[str, dict[tuple[int, ...], str]] = {}

    def build(self, memory_budget_bytes: float) -> LayoutProblem:
        first = self.graph.segments[0].type_id
        for type_id, key in self.type_keys.items():
            segment = self.graph.types[type_id]
            reads = self._wire_inputs(segment, key, self._entry_shapes(type_id), type_id == first)
            self._add_segment_type(segment, key, reads)
        self._add_boundaries()
        problem = ShardingProblem(tuple(self.nodes), tuple(self.edges), memory_budget_bytes)
        return LayoutProblem(
            self.graph,
            self.tp,
            problem,
            self.strategies,
            self.type_keys,
            self.ops,
            self.consumers,
            self.producers,
        )

    def _entry_shapes(self, type_id: str) -> set[tuple[int, ...]]:
        """Output shapes of the segments that come right before a segment of this type."""
        segments = self.graph.segments
        return {
            self.sinks[before.type_id].output_shape
            for before, after in itertools.pairwise(segments)
            if after.type_id == type_id
        }

    def _wire_inputs(
        self,
        segment: SegmentType,
        key: str,
        entry_shapes: set[tuple[int, ...]],
        starts_model: bool,
    ) -> dict[str, list[str]]:
        """ILP names of what each node reads: producers in the segment, then entry ports.

        Ops of the model's first segment that read no producer read the model's input,
        which arrives replicated (a port with ``R`` only).
        """
        shapes = {node.name: node.output_shape for node in segment.nodes}
        ports: dict[str, _Port] = {}
        reads: dict[str, list[str]] = {}
        for node in segment.nodes:
            sources = [f"{key}/{src}" for src in node.inputs if src in shapes]
            produced = [shapes[src] for src in node.inputs if src in shapes]
            entry = _entry_read(node, produced, entry_shapes)
            if entry is not None:
                port = self._entry_port(key, entry, node, segment)
            elif starts_model and not sources and _reads_model_input(node):
                port = self._model_input_port(key, node.input_shapes[0], node)
            else:
                reads[node.name] = sources
                continue
            ports.setdefault(port.name, port)
            reads[node.name] = [*sources, port.name]
        for port in ports.values():
            self._add_port(port)
        self.entries[key] = {port.tensor.shape: port.name for port in ports.values()}
        return reads

    def _add_segment_type(
        self, segment: SegmentType, key: str, reads: dict[str, list[str]]
    ) -> None:
        fan_out = Counter(src for sources in reads.values() for src in set(sources))
        for node in segment.nodes:
            name = f"{key}/{node.name}"
            inputs = [self.tensors[src] for src in reads[node.name]]
            strategies = _StrategyBuilder(
                node, inputs, self.tp, self.roofline, self.weight_modules
            ).build()
            tensor = self._output_tensor(node, inputs)
            if fan_out[name] > 1:
                strategies = _with_gathered_outputs(strategies, tensor, self.tp, self.roofline)
            count = self.counts[segment.type_id]
            self._add_node(name, node, strategies, tensor, count)
            self.ops[name] = (segment.type_id, node)
            for index, src in enumerate(reads[node.name]):
                self._add_edge(src, name, index, count)

    def _entry_port(
        self, key: str, shape: tuple[int, ...], node: OpNode, segment: SegmentType
    ) -> _Port:
        tensor = _Tensor(shape, math.prod(shape) * _element_bytes(node), needs_grad=True)
        if segment.kind == "block":
            candidates = [shard(1)] if self.sequence_parallel and len(shape) >= 3 else []
        else:
            candidates = [shard(d) for d in range(len(shape))]
        placements = [REPLICATE, *(p for p in candidates if _valid(p, shape, self.tp))]
        return _Port(f"{key}/{ENTRY}:{_shape_text(shape)}", tensor, tuple(placements))

    def _model_input_port(self, key: str, shape: tuple[int, ...], node: OpNode) -> _Port:
        tensor = _Tensor(shape, math.prod(shape) * _element_bytes(node), needs_grad=False)
        return _Port(f"{key}/model_input:{_shape_text(shape)}", tensor, (REPLICATE,))

    def _output_tensor(self, node: OpNode, inputs: Sequence[_Tensor]) -> _Tensor:
        is_float = node.dtype.removeprefix("torch.") not in _INTEGER_DTYPES
        needs_grad = is_float and (bool(node.param_count) or any(t.needs_grad for t in inputs))
        nbytes = math.prod(node.output_shape) * _element_bytes(node)
        return _Tensor(node.output_shape, nbytes, needs_grad)

    def _add_node(
        self, name: str, op: OpNode, strategies: list[OpStrategy], tensor: _Tensor, count: int
    ) -> None:
        """An operator of a type that ``count`` segments share: its costs count that often."""
        full = self.roofline.compute_s(
            op.flops_fwd + op.flops_bwd, 2 * (op.bytes_read + op.bytes_written)
        )
        params = op.param_bytes * self.param_memory_factor
        memory = [params / s.param_divisor + op.saved_bytes / s.compute_divisor for s in strategies]
        self.nodes.append(
            ShardingNode(
                name,
                tuple(s.name for s in strategies),
                compute_s=count * np.array([full / s.compute_divisor for s in strategies]),
                comm_s=count * np.array([s.comm_s for s in strategies]),
                memory_bytes=count * np.array(memory),
            )
        )
        self.strategies[name], self.tensors[name] = strategies, tensor

    def _add_port(self, port: _Port) -> None:
        strategies = [_port_strategy(p) for p in port.placements]
        zeros = np.zeros(len(strategies))
        self.nodes.append(ShardingNode(port.name, port.placements, zeros, zeros, zeros))
        self.strategies[port.name], self.tensors[port.name] = strategies, port.tensor

    def _add_edge(self, src: str, dst: str, index: int, count: int) -> None:
        """A tensor passed ``count`` times per step (once per segment of the type)."""
        tensor = self.tensors[src]
        cost = count * np.array(
            [
                [self._edge_cost(s, t, index, tensor) for t in self.strategies[dst]]
                for s in self.strategies[src]
            ]
        )
        self.edges.append(ShardingEdge(src, dst, cost))
        self.consumers.setdefault(src, []).append((dst, index))
        self.producers.setdefault(dst, []).append(src)

    def _edge_cost(self, s: OpStrategy, t: OpStrategy, index: int, tensor: _Tensor) -> float:
        need, grad = t.inputs[index], t.input_grads[index]
        if not (_valid(need, tensor.shape, self.tp) and _valid(s.output, tensor.shape, self.tp)):
            return math.inf
        if s.output != need and need == PARTIAL:
            return math.inf  # a forward value cannot be made partial usefully
        cost = self.roofline.reshard_s(s.output, need, tensor.nbytes, self.tp)
        if tensor.needs_grad:
            cost += self.roofline.reshard_s(grad, s.output_grad, tensor.nbytes, self.tp)
        return cost

    def _add_boundaries(self) -> None:
        """Join each segment's output to the entry of the next segment, and to the model output."""
        segments = self.graph.segments
        joins = Counter((a.type_id, b.type_id) for a, b in itertools.pairwise(segments))
        for (before, after), count in joins.items():
            sink = self.sinks[before]
            entry = self.entries[self.type_keys[after]].get(sink.output_shape)
            if entry is not None:
                self._add_edge(f"{self.type_keys[before]}/{sink.name}", entry, 0, count)
        last_sink = self.sinks[segments[-1].type_id]
        last = f"{self.type_keys[segments[-1].type_id]}/{last_sink.name}"
        tensor = self.tensors[last]
        placements = [REPLICATE] + ([shard(len(tensor.shape) - 1)] if tensor.shape else [])
        valid = tuple(p for p in placements if _valid(p, tensor.shape, self.tp))
        self._add_port(_Port("model_output", tensor, valid))
        self._add_edge(last, "model_output", 0, 1)


def _sink(segment: SegmentType) -> OpNode:
    """The last node of a segment type that no other node reads: its output."""
    consumed = {src for node in segment.nodes for src in node.inputs}
    sinks = [node for node in segment.nodes if node.name not in consumed]
    if not sinks:
        raise SpecError(
            f"segment type {segment.type_id!r} has no output node: its inputs form a cycle"
        )
    return sinks[-1]


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


def _types_in_order(graph: OpGraph) -> list[str]:
    return list(dict.fromkeys(segment.type_id for segment in graph.segments))


def build_layout_problem(
    graph: OpGraph,
    *,
    tp: int,
    roofline: Roofline,
    sequence_parallel: bool = False,
    memory_budget_bytes: float = math.inf,
    param_memory_factor: float = 1.0,
    weight_modules: Collection[str] | None = None,
) -> LayoutProblem:
    """The sharding ILP of ``graph`` at TP degree ``tp``, one variable set per segment type.

    ``memory_budget_bytes`` bounds the per-device memory of one segment of each type
    (parameters times ``param_memory_factor`` plus saved activations, bytes).
    ``weight_modules``: module paths, relative to their segment (as ``OpNode.module``),
    whose weights the runtime can shard (see :func:`weight_module_paths`); ``None``
    judges by the op (an ``nn.Linear`` or embedding).
    """
    if tp < 1:
        raise SpecError(f"tp = {tp} must be >= 1")
    if not graph.segments:
        raise SpecError(f"graph of {graph.model_name!r} has no segments to shard")
    if param_memory_factor <= 0:
        raise SpecError(f"param_memory_factor = {param_memory_factor} must be > 0")
    builder = _ProblemBuilder(
        graph,
        tp,
        roofline,
        sequence_parallel=sequence_parallel,
        param_memory_factor=param_memory_factor,
        weight_modules=weight_modules,
    )
    return builder.build(memory_budget_bytes)


# --- from the solution to module layouts ---------------------------------------------


_TORCH_PLACEMENT = {REPLICATE: "Replicate()", PARTIAL: "Partial()"}


def torch_placement(placement: str) -> str:
    """``R`` -> ``Replicate()``, ``S1`` -> ``Shard(1)``, ``P`` -> ``Partial()``."""
    dim = shard_dim(placement)
    return f"Shard({dim})" if dim is not None else _TORCH_PLACEMENT[placement]


@dataclass(frozen=True)
class TPLayout:
    """Module layouts for the runtime, keyed by FQN or ``*`` pattern (``layers.*.attention.wq``).

    ``styles`` is the plan's ``tp_layout``; ``input_layouts``/``output_layouts`` give,
    per module, the placement its input arrives in and the one its output must take
    (``Replicate()``, ``Shard(d)``), for ``ColwiseParallel(input_layouts=...)``,
    ``RowwiseParallel(output_layouts=...)`` and ``PrepareModuleInput``.
    ``sequence_parallel`` says whether the residual stream between blocks is sharded
    on the sequence dim (norms may still be sequence-sharded inside a block without it).
    """

    styles: dict[str, TPStyle]
    input_layouts: dict[str, str]
    output_layouts: dict[str, str]
    sequence_parallel: bool
    solution: ShardingSolution


def _segment_root(graph: OpGraph, segment: Segment) -> str:
    """A block segment is rooted at its module (``layers.3``); the runs before and after
    the blocks (``embedding``, ``head``) at the model, their names being labels (a label
    may equal a module's name, as a head module called ``head``)."""
    return segment.fqn if graph.types[segment.type_id].kind == "block" else ""


def _root_patterns(graph: OpGraph, type_id: str) -> list[str]:
    """The roots of a type's segments: one ``*`` pattern (``layers.*``) when it names them
    and no segment of another type, else each root."""
    roots = list(
        dict.fromkeys(_segment_root(graph, s) for s in graph.segments if s.type_id == type_id)
    )
    parts = [root.split(".") for root in roots]
    if len(parts) == 1 or len({len(p) for p in parts}) != 1:
        return roots
    pattern = ".".join(c[0] if len(set(c)) == 1 else "*" for c in zip(*parts, strict=True))
    others = (_segment_root(graph, s) for s in graph.segments if s.type_id != type_id)
    return roots if any(fnmatchcase(other, pattern) for other in others) else [pattern]


def _module_fqns(graph: OpGraph, type_id: str, module: str) -> list[str]:
    """Model-level FQNs (or patterns) of ``module`` in the segments of a type."""
    return [
        ".".join(part for part in (root, module) if part) for root in _root_patterns(graph, type_id)
    ]


def layout_from_solution(problem: LayoutProblem, solution: ShardingSolution) -> TPLayout:
    """Module FQN (pattern) -> :class:`TPStyle`, plus input/output placements per module."""
    chosen = {
        name: problem.strategies[name][problem.problem.node(name).strategies.index(choice)]
        for name, choice in solution.choice.items()
    }
    styles: dict[str, TPStyle] = {}
    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    for pattern, (name, style) in sorted(_module_styles(problem, chosen).items()):
        styles[pattern] = style
        inputs[pattern], outputs[pattern] = _io_placements(problem, chosen, name)
    return TPLayout(styles, inputs, outputs, _residual_sharded(problem, solution), solution)


def _module_styles(
    problem: LayoutProblem, chosen: dict[str, OpStrategy]
) -> dict[str, tuple[str, TPStyle]]:
    """Per module pattern, the deciding ILP node (most parameter bytes) and its style."""
    candidates: dict[str, list[tuple[float, str, TPStyle]]] = {}
    for name, strategy in chosen.items():
        if strategy.style is None:
            continue
        type_id, op = problem.ops[name]
        for pattern in _module_fqns(problem.graph, type_id, op.module):
            candidates.setdefault(pattern, []).append((op.param_bytes, name, strategy.style))
    decided = {}
    for pattern, entries in candidates.items():
        _, name, style = max(entries, key=lambda entry: entry[0])
        if len({entry[2] for entry in entries}) > 1:
            log.warning("module %s: its operators disagree; using %s from %s", pattern, style, name)
        decided[pattern] = (name, style)
    return decided


def _residual_sharded(problem: LayoutProblem, solution: ShardingSolution) -> bool:
    """Whether a block type's entry (the residual stream) is sharded."""
    blocks = {k for t, k in problem.type_keys.items() if problem.graph.types[t].kind == "block"}
    return any(
        choice != REPLICATE
        for name, choice in solution.choice.items()
        if name.partition("/")[0] in blocks and name.partition("/")[2].startswith(f"{ENTRY}:")
    )


def _io_placements(
    problem: LayoutProblem, chosen: dict[str, OpStrategy], name: str
) -> tuple[str, str]:
    producers = problem.producers.get(name, [])
    arriving = chosen[producers[0]].output if producers else REPLICATE
    consumers = problem.consumers.get(name, [])
    if consumers:
        consumer, index = consumers[0]
        leaving = chosen[consumer].inputs[index]
    else:
        leaving = chosen[name].output
    return torch_placement(arriving), torch_placement(leaving)


def solve_tp_layout(
    graph: OpGraph,
    *,
    tp: int,
    roofline: Roofline,
    sequence_parallel: bool = False,
    memory_budget_bytes: float = math.inf,
    param_memory_factor: float = 1.0,
    time_limit_s: float = 10.0,
    tmp_dir: str | None = None,
    weight_modules: Collection[str] | None = None,
) -> TPLayout:
    """Build the sharding ILP of ``graph``, solve it with CBC and map it to module layouts."""
    problem = build_layout_problem(
        graph,
        tp=tp,
        roofline=roofline,
        sequence_parallel=sequence_parallel,
        memory_budget_bytes=memory_budget_bytes,
        param_memory_factor=param_memory_factor,
        weight_modules=weight_modules,
    )
    solution = solve_sharding(problem.problem, time_limit_s=time_limit_s, tmp_dir=tmp_dir)
    return layout_from_solution(problem, solution)


def weight_module_paths(names: Iterable[str]) -> frozenset[str]:
    """Every dotted suffix of ``names`` (FQNs of the ``nn.Linear`` and ``nn.Embedding``
    modules of a model): ``weight_modules`` for :func:`build_layout_problem`, which
    matches the module paths of ``OpNode`` relative to their segment."""
    suffixes: set[str] = set()
    for name in names:
        parts = name.split(".")
        suffixes.update(".".join(parts[i:]) for i in range(len(parts)))
    return frozenset(suffixes)
