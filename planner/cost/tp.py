"""What tensor parallelism does to each operator: the cost model's view of a layout.

A :class:`TPAssignment` says, for one tensor-parallel degree and sequence-parallel
setting, how far each operator of each segment type divides its work, the activations
it keeps and its parameters, and which collectives run around it (per segment
occurrence and micro-batch). The cost model prices exactly that; nothing else in it
knows how a layout splits a model.

Two sources produce assignments:

- the sharding ILP's solution for a traced model (:mod:`planner.solve.program`), the
  layout the runtime applies module by module;
- :func:`megatron_assignment` for the formula graph of a zoo transformer
  (:mod:`planner.cost.spec_graph`): Megatron-LM's layout written as a rule on the zoo's
  module names, so ``plan estimate`` and the accuracy benchmark price a spec without
  tracing it. A test holds it equal to the ILP's solution of the same layout on the
  traced model (parameters per rank, tensor-core FLOPs per rank, collective bytes).

Megatron's rule (module paths relative to the segment: ``attention.wq``; the
embedding and head segments' read ``tok_embeddings``, ``output``):

- *split*: inside a block's ``attention`` or ``feed_forward`` sublayer (between the
  column-parallel and the row-parallel linear; norms excepted), the token embedding
  (vocabulary-parallel), the output head (column-parallel) and the loss (vocabulary-
  parallel): work, kept activations and parameters divide by ``tp`` (the row-parallel
  linear's bias stays whole).
- *sequence*: norms, residual adds, dropout and the position embedding: replicated, or
  split along the sequence under sequence parallelism inside the blocks and the head
  (parameters replicated; their gradients all-reduced once per micro-batch).
- a sequence-parallel sublayer keeps its gathered (whole-sequence) input for backward,
  as DTensor does, unless ``sp_regather_input`` (Megatron) gathers it again.
- collectives per sublayer: forward all-reduce of its output (reduce-scatter under SP,
  with an all-gather of its input first), backward all-reduce of its input's gradient
  (reduce-scatter, plus the output's all-gather, under SP, and the input's re-gather
  when ``sp_regather_input``); the embedding's output is all-reduced (sequence
  parallelism starts at the first block's input, which slices it: that slice's
  backward all-gathers, since models compute positions and masks from the embeddings'
  shape); the vocabulary-parallel loss all-reduces three fp32 values per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from planner.cost.communication import Collective
from planner.dtypes import FP32_BYTES
from planner.graph import OpGraph, OpKind, OpNode, OpRole, SegmentType
from planner.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from planner.spec import Strategy

__all__ = [
    "ShardKey",
    "Comm",
    "Scaling",
    "SegmentTP",
    "TPAssignment",
    "AssignmentSource",
    "unsharded",
    "loss_parallel_comms",
    "replicated_grad_comm",
    "megatron_assignment",
]

_SUBLAYERS = frozenset({"attention", "feed_forward"})
"""Zoo block children holding a column-parallel/row-parallel linear pair."""
_VOCAB_PARALLEL = frozenset({"tok_embeddings", "output", "loss"})
"""Zoo leaves split on the vocabulary: the token embedding, the output head, the loss."""
# Kinds doing tensor-core work: a run of split nodes without any is no TP sublayer.
_SUBLAYER_WORK = frozenset({OpKind.MATMUL, OpKind.ATTENTION, OpKind.EMBEDDING, OpKind.LOSS})
_LOSS_REDUCTIONS = 3  # vocabulary-parallel cross entropy: max, sum of exponentials, target


@dataclass(frozen=True)
class ShardKey:
    """What changes a segment's per-GPU cost: the split degrees and the micro-batch."""

    tp: int
    cp: int
    sequence_parallel: bool
    micro_batch_size: int
    ep: int = 1
    etp: int = 1

    @classmethod
    def of(cls, strategy: Strategy) -> ShardKey:
        """The key ``strategy``'s segments are priced at."""
        return cls(
            strategy.tp, strategy.cp, strategy.sequence_parallel, strategy.micro_batch_size,
            strategy.ep, strategy.etp,
        )  # fmt: skip

    @property
    def token_scale(self) -> float:
        """Tokens per GPU per micro-batch relative to the traced batch-1 graph."""
        return self.micro_batch_size / self.cp

    @property
    def dims(self) -> ParallelDims:
        """The tensor- and context-parallel part of the mesh."""
        return ParallelDims(
            tp=self.tp, cp=self.cp, sp=self.sequence_parallel, ep=self.ep, etp=self.etp
        )  # fmt: skip


Scaling = Literal["tokens", "sequence", "fixed"]


@dataclass(frozen=True)
class Comm:
    """One collective over the tensor-parallel group, per segment and micro-batch.

    ``nbytes`` is the whole array at the traced batch-1 shapes. ``scaling`` says how it
    grows with the micro-batch: ``tokens`` (activations: with its sequences and its
    context-parallel shard of each), ``sequence`` (position embeddings: with the shard
    only) or ``fixed`` (a replicated parameter's gradient).
    """

    kind: Collective
    nbytes: float
    backward: bool
    scaling: Scaling = "tokens"

    def bytes_for(self, key: ShardKey) -> float:
        """Bytes of the whole array for one micro-batch of ``key``."""
        if self.scaling == "tokens":
            return self.nbytes * key.token_scale
        if self.scaling == "sequence":
            return self.nbytes / key.cp
        return self.nbytes


@dataclass(frozen=True)
class SegmentTP:
    """Per-node divisors of one segment type (aligned with its nodes) and its collectives."""

    work_divisor: tuple[int, ...]
    saved_divisor: tuple[float, ...]  # below 1 where a rank keeps more (gathered rows)
    param_elements: tuple[float, ...]  # parameters each node holds per rank
    comms: tuple[Comm, ...] = ()
    gathered_bytes: float = 0.0  # kept inputs the graph does not show (batch 1, per rank)


@dataclass(frozen=True)
class TPAssignment:
    """A layout as the cost model sees it: one :class:`SegmentTP` per segment type."""

    segments: Mapping[str, SegmentTP]

    def segment(self, type_id: str) -> SegmentTP:
        return self.segments[type_id]


AssignmentSource = Callable[[int, bool], TPAssignment]
"""``(tp, sequence_parallel) -> TPAssignment``: where the cost model gets its layouts."""


def _replicated(seg_type: SegmentType) -> SegmentTP:
    ones = (1,) * len(seg_type.nodes)
    return SegmentTP(ones, ones, tuple(float(n.param_count) for n in seg_type.nodes))


def unsharded(graph: OpGraph) -> TPAssignment:
    """Every operator whole on every rank (``tp = 1``)."""
    return TPAssignment({t: _replicated(s) for t, s in graph.types.items()})


def loss_parallel_comms(tokens: int) -> tuple[Comm, ...]:
    """A vocabulary-parallel cross entropy's forward all-reduces: the max, the sum of
    exponentials and the target logit, one fp32 value per token each."""
    reduction = Comm(Collective.ALL_REDUCE, float(FP32_BYTES * tokens), backward=False)
    return (reduction,) * _LOSS_REDUCTIONS


def replicated_grad_comm(node: OpNode) -> Comm:
    """The all-reduce of a replicated parameter's gradient when ``node`` runs on shards
    (a norm under sequence parallelism): partial sums, once per micro-batch."""
    return Comm(Collective.ALL_REDUCE, node.param_bytes, backward=True, scaling="fixed")


# --- Megatron-LM's layout of the zoo transformer, by module name ------------------------


# A router and grouped-weight experts stay whole on every tensor-parallel rank, as the
# runtime keeps them (expert parallelism splits the experts' tokens, planner.cost.experts).
_WHOLE_ROLES = frozenset({OpRole.ROUTER, OpRole.EXPERTS})


def _is_split(node: OpNode, per_head: frozenset[str]) -> bool:
    parts = node.module.split(".") if node.module else []
    if node.kind is OpKind.LOSS or (parts and parts[-1] in _VOCAB_PARALLEL):
        return True
    if node.role in _WHOLE_ROLES:
        return False
    in_sublayer = bool(parts) and parts[0] in _SUBLAYERS
    return in_sublayer and (node.kind is not OpKind.NORM or node.module in per_head)


def _per_head_norms(nodes: Sequence[OpNode]) -> frozenset[str]:
    """Norms inside a sublayer whose weight is narrower than the rows they normalise
    (Qwen3's per-head q/k norms): they run on each rank's own heads, weight whole."""
    weights: dict[str, int] = {}
    for node in nodes:
        if node.kind is OpKind.NORM:
            weights[node.module] = weights.get(node.module, 0) + node.param_count
    return frozenset(
        node.module
        for node in nodes
        if node.kind is OpKind.NORM
        and node.module.split(".")[0] in _SUBLAYERS
        and 0 < weights[node.module] < node.output_shape[-1]
    )


def _split_runs(nodes: Sequence[OpNode], per_head: frozenset[str]) -> list[list[int]]:
    """Index runs of consecutive split nodes: one per tensor-parallel sublayer (or the
    embedding, or the head's output and loss), without views at either end."""
    runs: list[list[int]] = [[]]
    for index, node in enumerate(nodes):
        if _is_split(node, per_head):
            runs[-1].append(index)
        elif runs[-1]:
            runs.append([])
    trimmed = []
    for run in runs:
        moving = [i for i in run if nodes[i].kind is not OpKind.VIEW]
        kept = [i for i in run if moving and moving[0] <= i <= moving[-1]]
        if any(nodes[i].kind in _SUBLAYER_WORK for i in kept):
            trimmed.append(kept)
    return trimmed


def _rowwise(nodes: Sequence[OpNode], run: list[int]) -> int | None:
    """The row-parallel linear closing a sublayer run (the last matmul with parameters)."""
    if nodes[run[-1]].kind is OpKind.LOSS or nodes[run[0]].kind is OpKind.EMBEDDING:
        return None
    linears = [i for i in run if nodes[i].kind is OpKind.MATMUL and nodes[i].param_count]
    return linears[-1] if len(linears) > 1 else None


def _partial_inputs(nodes: Sequence[OpNode], run: list[int]) -> int:
    """Backward all-reduces of a split run's input gradient: one, or, for shared experts
    beside whole routed experts, one per column-parallel linear (each partial gradient
    is reduced before it meets the routed experts' whole one)."""
    if nodes[run[0]].role is not OpRole.SHARED_EXPERTS:
        return 1
    if not any(n.role is OpRole.EXPERTS for n in nodes):
        return 1
    return sum(nodes[i].kind is OpKind.MATMUL for i in run) - 1


def _run_comms(nodes: Sequence[OpNode], run: list[int], sp: bool, regather: bool) -> list[Comm]:
    """A split run's collectives (a sublayer, the embedding, or the head and loss)."""
    first, last = nodes[run[0]], nodes[run[-1]]
    comms: list[Comm] = []
    if first.kind is not OpKind.EMBEDDING:  # the input is replicated: gather it, or not
        entry = first.input_bytes
        if sp:
            comms += [Comm(Collective.ALL_GATHER, entry, False),
                      Comm(Collective.REDUCE_SCATTER, entry, True)]  # fmt: skip
            if regather:
                comms.append(Comm(Collective.ALL_GATHER, entry, True))
        else:
            comms += [Comm(Collective.ALL_REDUCE, entry, True)] * _partial_inputs(nodes, run)
    if last.kind is OpKind.LOSS:
        comms += loss_parallel_comms(math.prod(last.input_shapes[0][:-1]))
    elif sp and first.kind is not OpKind.EMBEDDING:
        out = last.bytes_written
        comms += [Comm(Collective.REDUCE_SCATTER, out, False),
                  Comm(Collective.ALL_GATHER, out, True)]  # fmt: skip
    else:
        comms.append(Comm(Collective.ALL_REDUCE, last.bytes_written, False))
    return comms


def _megatron_segment(
    seg_type: SegmentType, tp: int, sp: bool, regather: bool, *, before_blocks: bool
) -> SegmentTP:
    nodes = seg_type.nodes
    on_sequence = sp and not before_blocks  # sequence parallelism starts at the first block
    per_head = _per_head_norms(nodes)
    work, params, comms = [], [], []
    for node in nodes:
        split, whole = _is_split(node, per_head), node.module in per_head
        work.append(tp if split or on_sequence else 1)
        params.append(node.param_count / tp if split and not whole else float(node.param_count))
        reduced_per_pass = node.role is not OpRole.EXPERTS  # EP reduces experts per step
        if (whole or (on_sequence and not split)) and node.param_count and reduced_per_pass:
            comms.append(replicated_grad_comm(node))
    gathered = 0.0
    for run in _split_runs(nodes, per_head):
        comms += _run_comms(nodes, run, sp, regather)
        rowwise = _rowwise(nodes, run)
        if rowwise is not None:  # its bias stays whole on every rank
            node = nodes[rowwise]
            params[rowwise] = (node.param_count - node.bias_count) / tp + node.bias_count
        if on_sequence and not regather and nodes[run[0]].kind is not OpKind.EMBEDDING:
            gathered += nodes[run[0]].input_bytes * (1 - 1 / tp)
    divisors = tuple(work)
    return SegmentTP(divisors, divisors, tuple(params), tuple(comms), gathered)


def megatron_assignment(
    graph: OpGraph, tp: int, sequence_parallel: bool, *, regather: bool = False
) -> TPAssignment:
    """Megatron-LM's layout of a zoo transformer's formula graph (see the module docstring).

    ``regather`` adds Megatron's backward re-gather of a sequence-parallel linear's
    input (DTensor keeps the gathered input instead; the cost model adds its memory).
    """
    if tp == 1:
        return unsharded(graph)
    sp = sequence_parallel
    first_block = next(
        (i for i, s in enumerate(graph.segments) if graph.segment_type(s).kind == "block"), 0
    )
    before = {s.type_id for s in graph.segments[:first_block]}
    segments = {
        type_id: _megatron_segment(seg, tp, sp, regather, before_blocks=type_id in before)
        for type_id, seg in graph.types.items()
    }
    if sp and before:  # the first block slices the replicated stream: backward gathers it
        embedding = graph.segments[first_block - 1].type_id
        sink = graph.types[embedding].nodes[-1]
        seg = segments[embedding]
        gather = Comm(Collective.ALL_GATHER, sink.bytes_written, True)
        segments[embedding] = SegmentTP(
            seg.work_divisor, seg.saved_divisor, seg.param_elements, (*seg.comms, gather),
            seg.gathered_bytes,
        )  # fmt: skip
    return TPAssignment(segments)
