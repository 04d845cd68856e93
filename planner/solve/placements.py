"""Placements on the tensor-parallel group and the strategies each operator offers.

Every tensor has a *placement* over the ``tp`` ranks: ``R`` (replicated), ``P``
(partial sums: the value is the sum over ranks), ``S<d>`` (sharded on dim ``d``) or
``V`` (vocabulary-sharded logits kept as a DTensor for the loss: loss parallel).
Operators run on *local* tensors (as torchtitan's DTensor styles hand them on), so a
strategy fixes the placement each input must arrive in and the one the output leaves
in; between two operators a placement never changes. Conversions happen only at
module boundaries (:mod:`planner.solve.layout` inserts them), where the runtime can
place a DTensor redistribution.

A strategy also fixes the placement of the gradient it sends back to each input and
the one it accepts for its output, how far it divides its work (compute and kept
activations) and its parameters, and the collectives it runs itself (the
vocabulary-parallel loss's three all-reduces, a replicated DTensor parameter's
gradient all-reduce).

Operators:

- linear ``[out, in]`` (an ``nn.Linear`` the runtime can shard): ``replicate``;
  ``colwise`` (input ``R``, its gradient ``P``, output sharded on the last dim);
  ``rowwise`` (input sharded on the last dim, output ``P``).
- embedding ``[vocab, hidden]``: ``replicate``; ``vocab`` (output ``P``); ``colwise``.
- attention: ``replicate``; ``heads`` (q, k, v and the output sharded on the heads dim;
  a mask stays replicated).
- norm, softmax: ``R`` or sharded on a non-normalised dim (sequence parallel); a norm's
  parameters become replicated DTensors whose gradients are all-reduced.
- element-wise, reductions, views, parameter-free matmuls: follow their input (``R`` or
  ``S<d>`` on any dim the op preserves); views also pass ``P`` and ``V`` through.
- the token loss: ``replicate``, or ``vocab`` on ``V`` logits (loss parallel).
- convolutions, other losses, ops that mix positions along a dim (cumulative sums,
  sorting, flips) and matmuls with parameters the runtime cannot shard (GPT-2's
  ``Conv1D``, batched expert weights): replicate only; so are ops of unknown kind.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from planner.cost.communication import Collective
from planner.cost.tp import Comm, loss_parallel_comms, replicated_grad_comm
from planner.dtypes import ELEMENT_BYTES
from planner.errors import SpecError
from planner.graph import OpKind, OpNode
from planner.spec import TPStyle

__all__ = [
    "REPLICATE",
    "PARTIAL",
    "VOCAB",
    "shard",
    "shard_dim",
    "valid",
    "reshard_collectives",
    "torch_placement",
    "element_bytes",
    "OpStrategy",
    "TensorInfo",
    "StrategyBuilder",
    "dim_map",
    "is_cast",
    "tensor_of",
]

log = logging.getLogger(__name__)

REPLICATE, PARTIAL, VOCAB = "R", "P", "V"

_INTEGER_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8", "bool"})
_PERMUTING_TARGETS = ("transpose", "permute", "movedim", ".t", "swapaxes")
# Ops whose result at one position depends on other positions along a dim: sharding any
# dim would compute on a slice of what they scan, so they stay replicated.
_POSITION_MIXING = frozenset(
    {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort", "argsort", "topk",
     "flip", "roll", "diff", "kthvalue", "median", "searchsorted"}
)  # fmt: skip
_CAST_TARGETS = frozenset({"to", "float", "half", "bfloat16", "type_as", "type", "_to_copy"})
# How a traced nn.Linear appears: the module class (fx) or its aten op (export).
_LINEAR_TARGETS = frozenset({"Linear", "aten.linear.default"})
_TOKEN_LOSSES = ("cross_entropy",)


def shard(dim: int) -> str:
    return f"S{dim}"


def shard_dim(placement: str) -> int | None:
    return int(placement[1:]) if placement.startswith("S") else None


def valid(placement: str, shape: tuple[int, ...], tp: int) -> bool:
    """Whether ``placement`` fits ``shape``: a shard needs tp > 1 and a dim tp divides."""
    dim = shard_dim(placement)
    if dim is None:
        return placement != VOCAB or (tp > 1 and bool(shape) and shape[-1] % tp == 0)
    return tp > 1 and 0 <= dim < len(shape) and shape[dim] >= tp and shape[dim] % tp == 0


def reshard_collectives(src: str, dst: str) -> tuple[Collective, ...] | None:
    """The collective turning a tensor placed ``src`` into ``dst`` (``None``: impossible).

    ``R -> S`` is a local slice; a value never becomes partial, and ``V`` (loss-parallel
    logits) converts to nothing else.
    """
    if src == dst:
        return ()
    if dst == PARTIAL or VOCAB in (src, dst):
        return None
    if src == REPLICATE:
        return ()
    if src == PARTIAL:
        return (Collective.ALL_REDUCE,) if dst == REPLICATE else (Collective.REDUCE_SCATTER,)
    if dst == REPLICATE:
        return (Collective.ALL_GATHER,)
    return (Collective.ALL_TO_ALL,)


def torch_placement(placement: str, ndim: int) -> str:
    """``R`` -> ``Replicate()``, ``P`` -> ``Partial()``, ``S<d>`` -> ``Shard(d)`` (the last
    dim of an ``ndim``-dim tensor as ``Shard(-1)``), ``V`` -> ``Shard(-1)``."""
    if placement == REPLICATE:
        return "Replicate()"
    if placement == PARTIAL:
        return "Partial()"
    dim = shard_dim(placement)
    if dim is None or dim == ndim - 1:
        return "Shard(-1)"
    return f"Shard({dim})"


def element_bytes(node: OpNode) -> int:
    size = ELEMENT_BYTES.get(node.dtype.removeprefix("torch."))
    if size is None:
        raise SpecError(
            f"node {node.name!r} has dtype {node.dtype!r} of unknown size: "
            f"use one of {sorted(ELEMENT_BYTES)}"
        )
    return size


@dataclass(frozen=True)
class OpStrategy:
    """One way to run an operator (or a conversion) on the TP group.

    Placements are ``R``, ``P``, ``S<d>`` or ``V``. ``weight`` is the placement of the
    operator's weight (``R`` when it has none or keeps it whole): tied weights must agree.
    ``param_elements`` is the operator's parameter count per rank; ``saved_divisor`` how
    far the activations it keeps for backward are split.
    """

    name: str
    inputs: tuple[str, ...]  # forward placement required of each input
    input_grads: tuple[str, ...]  # placement of the gradient sent back to each input
    output: str
    output_grad: str  # placement of the output gradient this strategy's backward takes
    compute_divisor: int = 1
    param_elements: float = 0.0
    saved_divisor: int = 1
    comms: tuple[Comm, ...] = ()
    style: TPStyle | None = None  # module layout, for operators holding parameters
    weight: str = REPLICATE


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as the ILP sees it: shape, bytes of the whole array, needs a gradient."""

    shape: tuple[int, ...]
    nbytes: float
    needs_grad: bool
    batched: bool = True  # grows with the micro-batch (a position embedding does not)


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


def dim_map(node: OpNode, src: tuple[int, ...], first: bool) -> dict[int, int | None]:
    """Output dim -> the dim of input ``src`` it comes from (``None``: broadcast)."""
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


def is_cast(node: OpNode) -> bool:
    """A dtype cast (``x.float()``, ``aten._to_copy``): element-wise, any placement passes."""
    return not _CAST_TARGETS.isdisjoint(node.target.lower().split("."))


def _mixes_positions(node: OpNode) -> bool:
    """``aten.cumsum.default``, ``cumsum``, ``Tensor.flip``: any dotted part names such an op."""
    return not _POSITION_MIXING.isdisjoint(node.target.lower().split("."))


# --- strategies per operator kind ---------------------------------------------------


class StrategyBuilder:
    """The candidate strategies of one node, given its input tensors and the TP degree.

    ``weight_modules``: segment-relative module paths whose weight the runtime can shard
    (``nn.Linear``/``nn.Embedding``); ``None`` judges by the op. ``replicated_only``
    forces the replicate strategy (a region the runtime cannot shard).
    ``whole_activations`` keeps every operator but those holding a weight replicated
    (before the first block, where a model's own code computes positions, masks and
    output shapes from its embeddings' shape; after the blocks too when a rehearsal
    showed the model's code there needs whole tensors).
    """

    def __init__(
        self,
        node: OpNode,
        inputs: Sequence[TensorInfo],
        tp: int,
        *,
        weight_modules: Collection[str] | None,
        replicated_only: bool = False,
        whole_activations: bool = False,
    ) -> None:
        self.node, self.inputs, self.tp = node, inputs, tp
        self.weight_modules = weight_modules
        self.replicated_only = replicated_only
        self.whole_activations = whole_activations

    def build(self) -> list[OpStrategy]:
        kind, node = self.node.kind, self.node
        if self.replicated_only or self.tp == 1:
            return [self._replicate()]
        weighted = kind in (OpKind.MATMUL, OpKind.EMBEDDING) and self._holds_weight()
        if self.whole_activations and not weighted:
            return [self._replicate()]
        if weighted:
            if not self._shardable_weight():
                log.info("%s (%s): weight not shardable, replicated only", node.name, node.target)
                return [self._replicate()]
            if kind is OpKind.EMBEDDING:
                return self._embedding()
            if self.inputs:
                return self._linear()
        if kind is OpKind.ATTENTION and self.inputs:
            return self._attention()
        if kind is OpKind.LOSS and self.inputs:
            return self._loss()
        if kind is OpKind.OTHER and self.inputs:
            log.info("%s (%s): operator of unknown kind, replicated only", node.name, node.target)
        if kind in (OpKind.CONV, OpKind.LOSS, OpKind.OTHER, OpKind.EMBEDDING):
            return [self._replicate()]
        if not self.inputs:  # a parameter read on its own (Gemma's ``weight.float()``)
            return (
                [self._replicate(), self._partial_grad()]
                if node.param_count
                else [self._replicate()]
            )
        if _mixes_positions(node):
            log.info(
                "%s (%s): mixes positions along a dim, replicated only", node.name, node.target
            )
            return [self._replicate()]
        return self._follow()

    def _holds_weight(self) -> bool:
        """A parameter of its own, or (tied) the module of a weight another op counts."""
        if self.node.param_count:
            return True
        return self.weight_modules is not None and self.node.module in self.weight_modules

    def _shardable_weight(self) -> bool:
        """Whether the runtime can shard this node's weight: its module is an ``nn.Linear``
        or ``nn.Embedding`` (``weight_modules``, when given; else judged by the op)."""
        if self.weight_modules is not None and self.node.module:  # "": the segment's root
            return self.node.module in self.weight_modules
        return self.node.kind is OpKind.EMBEDDING or self.node.target in _LINEAR_TARGETS

    def _replicate(self) -> OpStrategy:
        count = len(self.inputs)
        style = TPStyle.REPLICATE if self.node.param_count or self._holds_weight() else None
        return OpStrategy(
            "R", (REPLICATE,) * count, (REPLICATE,) * count, REPLICATE, REPLICATE,
            param_elements=float(self.node.param_count), style=style,
        )  # fmt: skip

    def _rest(self, count: int) -> tuple[str, ...]:
        return (REPLICATE,) * (len(self.inputs) - count)

    def _valid(self, placement: str, shape: tuple[int, ...]) -> bool:
        return valid(placement, shape, self.tp)

    def _linear(self) -> list[OpStrategy]:
        tp, x, out = self.tp, self.inputs[0].shape, self.node.output_shape
        last_in, last_out = len(x) - 1, len(out) - 1
        params = self.node.param_count
        bias = self.node.bias_count
        strategies = [self._replicate()]
        if self._valid(shard(last_out), out):
            strategies.append(
                OpStrategy(
                    "colwise",
                    (REPLICATE, *self._rest(1)),
                    (PARTIAL, *self._rest(1)),
                    shard(last_out),
                    shard(last_out),
                    tp,
                    params / tp,
                    1,
                    style=TPStyle.COLWISE,
                    weight=shard(0),
                )
            )
        if self._valid(shard(last_in), x):
            strategies.append(
                OpStrategy(
                    "rowwise",
                    (shard(last_in), *self._rest(1)),
                    (shard(last_in), *self._rest(1)),
                    PARTIAL,
                    REPLICATE,
                    tp,
                    (params - bias) / tp + bias,
                    tp,
                    style=TPStyle.ROWWISE,
                    weight=shard(1),
                )
            )
        return strategies

    def _embedding(self) -> list[OpStrategy]:
        tp, out = self.tp, self.node.output_shape
        params = self.node.param_count
        vocab = self._vocab_size()
        rest = self._rest(0)
        strategies = [self._replicate()]
        if tp > 1 and vocab >= tp and vocab % tp == 0:
            strategies.append(
                OpStrategy(
                    "vocab",
                    rest,
                    rest,
                    PARTIAL,
                    REPLICATE,
                    tp,
                    params / tp,
                    style=TPStyle.VOCAB_PARALLEL,
                    weight=shard(0),
                )
            )
        last = shard(len(out) - 1)
        if self._valid(last, out):
            strategies.append(
                OpStrategy(
                    "colwise",
                    rest,
                    rest,
                    last,
                    last,
                    tp,
                    params / tp,
                    style=TPStyle.COLWISE,
                    weight=shard(1),
                )
            )
        return strategies

    def _vocab_size(self) -> int:
        """Rows of the embedding table (a tied table counted elsewhere: its 2-D input)."""
        hidden = self.node.output_shape[-1]
        if self.node.param_count and hidden:
            return self.node.param_count // hidden
        tables = [s for s in self.node.input_shapes if len(s) == 2 and s[1] == hidden]
        return max((s[0] for s in tables), default=0)

    def _attention(self) -> list[OpStrategy]:
        main = self.inputs[:3]
        heads = [shard(max(0, len(t.shape) - 3)) for t in main]
        out = shard(max(0, len(self.node.output_shape) - 3))
        strategies = [self._replicate()]
        legal = all(valid(p, t.shape, self.tp) for p, t in zip(heads, main, strict=True))
        if legal and valid(out, self.node.output_shape, self.tp):
            placements = (*heads, *self._rest(len(main)))
            strategies.append(
                OpStrategy(
                    "heads", placements, placements, out, out, self.tp, saved_divisor=self.tp
                )
            )
        return strategies

    def _loss(self) -> list[OpStrategy]:
        """The token loss on replicated logits, or vocabulary-parallel on ``V`` logits:
        max, sum of exponentials and the target logit all-reduced per token (fp32)."""
        strategies = [self._replicate()]
        logits = self.inputs[0].shape
        token_loss = any(name in self.node.target for name in _TOKEN_LOSSES)
        if token_loss and len(self.inputs) == 2 and valid(VOCAB, logits, self.tp):
            comms = loss_parallel_comms(math.prod(logits[:-1]))
            strategies.append(
                OpStrategy(
                    "vocab",
                    (VOCAB, REPLICATE),
                    (VOCAB, REPLICATE),
                    REPLICATE,
                    REPLICATE,
                    self.tp,
                    saved_divisor=self.tp,
                    comms=comms,
                )
            )
        return strategies

    def _shardable_dims(self) -> range:
        out = self.node.output_shape
        kind = self.node.kind
        if kind in (OpKind.NORM, OpKind.SOFTMAX) or self.node.param_count:
            return range(len(out) - 1)  # keep the normalised (or parameter) dim whole
        if kind is OpKind.MATMUL:
            return range(len(out) - 2)  # batch dims of a parameter-free matmul
        return range(len(out))

    def _partial_grad(self) -> OpStrategy:
        """Whole forward, partial gradient: a parameter, or what is computed from
        parameters alone (Gemma's ``1 + weight``), feeding operators that run on shards;
        its gradient is summed where it reaches a parameter (one all-reduce per
        micro-batch, as a sequence-parallel norm's weight)."""
        count, params = len(self.inputs), self.node.param_count
        return OpStrategy(
            "R/P", (REPLICATE,) * count, (PARTIAL,) * count, REPLICATE, PARTIAL,
            param_elements=float(params),
            comms=(replicated_grad_comm(self.node),) if params else (),
            style=TPStyle.SEQUENCE_PARALLEL if params else None,
        )  # fmt: skip

    def _follow(self) -> list[OpStrategy]:
        strategies = [self._replicate()]
        if all(not t.batched and t.needs_grad for t in self.inputs):  # parameters' own ops
            strategies.append(self._partial_grad())
        maps = [dim_map(self.node, t.shape, i == 0) for i, t in enumerate(self.inputs)]
        for d in self._shardable_dims():
            strategy = self._follow_dim(d, maps)
            if strategy is not None:
                strategies.append(strategy)
        if len(self.inputs) != 1:
            return strategies
        if self.node.kind is OpKind.VIEW:
            strategies.append(OpStrategy("P", (PARTIAL,), (REPLICATE,), PARTIAL, REPLICATE))
        out, src = self.node.output_shape, self.inputs[0].shape
        keeps_vocab = out and src and out[-1] == src[-1] and valid(VOCAB, out, self.tp)
        if keeps_vocab and (self.node.kind is OpKind.VIEW or is_cast(self.node)):
            strategies.append(OpStrategy("V", (VOCAB,), (VOCAB,), VOCAB, VOCAB))
        return strategies

    def _follow_dim(self, d: int, maps: list[dict[int, int | None]]) -> OpStrategy | None:
        placement = shard(d)
        if not self._valid(placement, self.node.output_shape):
            return None
        needs, grads = [], []
        for tensor, mapping in zip(self.inputs, maps, strict=True):
            if d not in mapping:
                return None
            source = mapping[d]
            if source is None:  # broadcast along d: every rank needs all of it
                needs.append(REPLICATE)
                grads.append(PARTIAL)
            elif valid(shard(source), tensor.shape, self.tp):
                needs.append(shard(source))
                grads.append(shard(source))
            else:
                return None
        params = self.node.param_count
        # A parameter used on a shard (a norm's weight under sequence parallelism) is a
        # replicated DTensor whose gradient is partial: all-reduced once per micro-batch.
        comms = (replicated_grad_comm(self.node),) if params else ()
        return OpStrategy(
            placement, tuple(needs), tuple(grads), placement, placement, self.tp,
            float(params), self.tp, comms,
            style=TPStyle.SEQUENCE_PARALLEL if params else None,
        )  # fmt: skip


def can_carry_grad(node: OpNode) -> bool:
    """Whether ``node``'s output may have a gradient: it is not integer or boolean."""
    return node.dtype.removeprefix("torch.") not in _INTEGER_DTYPES


def tensor_of(node: OpNode, inputs: Sequence[TensorInfo]) -> TensorInfo:
    """The output of ``node`` as the ILP sees it."""
    needs_grad = can_carry_grad(node) and (
        bool(node.param_count) or any(t.needs_grad for t in inputs)
    )
    nbytes = math.prod(node.output_shape) * element_bytes(node)
    return TensorInfo(node.output_shape, nbytes, needs_grad, node.batched)
