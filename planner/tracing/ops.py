"""Per-operator accounting for :mod:`planner.tracing`: kind, FLOPs, bytes, saved bytes.

The tracing front ends (:mod:`planner.tracing.fx`) turn every graph node into a
:class:`RawOp`: a normalised op name (``linear``, ``scaled_dot_product_attention``,
``mul``...) with its tensor arguments as :class:`TensorRef`. This module prices one
such op without torch.

Conventions (the cost model relies on them):

- FLOPs are counted for tensor-core work only (matmuls, convolutions, attention), as
  ``torch.utils.flop_counter.FlopCounterMode`` and the Megatron formula do; a
  multiply-add is 2 FLOPs. Element-wise, norm, softmax and loss ops carry 0 FLOPs and
  are priced by their bytes.
- Backward FLOPs: one product per operand that needs a gradient (a linear layer with
  trainable weight and an input that requires grad costs 2x forward). Attention
  backward is 2x forward (model FLOPs, as the math path's matmuls and Megatron count;
  torch's flash-backward formula adds the recomputed scores, 2.5x, which are
  hardware FLOPs); causal masking is not halved.
- Bytes read/written are the tensors an op touches (views touch nothing; an embedding
  reads only the gathered rows).
- Saved bytes are what eager autograd keeps for backward, per tensor, counted once
  even when several ops save the same tensor or views of it. Fused SDPA (flash or
  memory-efficient) keeps q, k, v, its output and an fp32 logsumexp per query row,
  not the s x s score matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.graph import CROSS_ENTROPY_BYTES, OpKind

__all__ = [
    "TensorRef", "RawOp", "OpCost", "VIEW_OPS", "CAST_OPS", "classify", "cost_of", "is_known",
    "writes_in_place",
]  # fmt: skip

_MATMUL_OPS = frozenset({"linear", "addmm", "mm", "bmm", "matmul", "baddbmm"})
_CONV_OPS = frozenset({"conv1d", "conv2d", "conv3d"})
# attention ops, with the positions of their is_causal and mask arguments in their
# schemas (None: the op takes no mask); the keywords are read by name too
ATTENTION_FLAGS: dict[str, tuple[int, int | None]] = {
    "scaled_dot_product_attention": (5, 3),
    "_scaled_dot_product_flash_attention": (4, None),
    "_scaled_dot_product_flash_attention_for_cpu": (4, None),
    "_scaled_dot_product_efficient_attention": (6, 3),
    "_scaled_dot_product_cudnn_attention": (6, 3),
}
_ATTENTION_OPS = frozenset(ATTENTION_FLAGS)
_SOFTMAX_OPS = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})
_NORM_OPS = frozenset(
    {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
     "native_group_norm", "batch_norm", "_native_batch_norm_legit_functional",
     "instance_norm"}
)  # fmt: skip
_LOSS_OPS = frozenset(
    {"cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d",
     "nll_loss_nd", "mse_loss", "l1_loss", "binary_cross_entropy_with_logits"}
)  # fmt: skip
_REDUCTION_OPS = frozenset(
    {"sum", "mean", "amax", "amin", "max", "min", "max_pool1d", "max_pool2d", "max_pool3d",
     "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
     "max_pool2d_with_indices", "var", "std", "norm", "cumsum"}
)  # fmt: skip
VIEW_OPS = frozenset(
    {"view", "reshape", "_unsafe_view", "transpose", "permute", "flatten", "unflatten",
     "unsqueeze", "squeeze", "expand", "expand_as", "contiguous", "getitem", "split",
     "chunk", "unbind", "t", "alias", "slice", "select", "narrow", "detach", "view_as",
     "identity", "dropout_p0", "movedim", "as_strided", "split_with_sizes", "numpy_T"}
)  # fmt: skip
CAST_OPS = frozenset({"float", "half", "bfloat16", "to", "type_as", "type", "_to_copy"})
_IN_PLACE_OPERATORS = frozenset({"iadd", "isub", "imul", "itruediv"})  # x += y, ... (fx)
_EMBEDDING_OPS = frozenset({"embedding"})
# Ops whose backward needs their output (y = f(x), dy/dx from y).
_SAVES_OUTPUT = frozenset(
    {"relu", "sigmoid", "tanh", "exp", "rsqrt", "sqrt", "softmax", "_softmax", "log_softmax",
     "_log_softmax", "elu"}
)  # fmt: skip
# Ops whose backward needs their (tensor) inputs.
_SAVES_INPUTS = frozenset(
    {"gelu", "silu", "pow", "log", "sin", "cos", "erf", "leaky_relu", "hardswish", "mish",
     "softplus", "abs", "reciprocal", "square", "max_pool2d", "max_pool1d", "max_pool3d",
     "index", "gather", "masked_fill", "where", "clamp"}
)  # fmt: skip
# Element-wise ops that need no gradient bookkeeping of their own.
_PLAIN_ELEMENTWISE = frozenset(
    {"add", "sub", "rsub", "neg", "cat", "stack", "repeat_interleave", "repeat", "clone",
     "copy", "fill", "zeros_like", "ones_like", "full_like", "arange", "zeros", "ones",
     "full", "empty", "new_ones", "new_zeros", "new_empty", "outer", "triu", "tril", "eq",
     "ne", "lt", "le", "gt", "ge", "__and__", "__or__", "logical_not", "bitwise_not",
     "diff", "floordiv", "floor_divide", "masked_fill_", "mul_", "add_", "argsort", "sort",
     "topk", "pad", "constant_pad_nd", "div_", "copy_", "scatter_", "histc", "bincount",
     "concat", "scatter", "empty_like", "rand_like", "uniform_", "exponential_",
     "logical_or", "logical_and", "one_hot"}
)  # fmt: skip
_LOGSUMEXP_BYTES = 4  # fp32 per query row and head
_NORM_STATS_BYTES = 8  # fp32 mean and rstd per normalised row


@dataclass(frozen=True)
class TensorRef:
    """A tensor argument or result: shape, element size and where it came from.

    ``producer`` names the op that made it (``None`` for graph inputs, parameters and
    constants); ``param`` identifies a parameter (shared parameters share it).
    """

    shape: tuple[int, ...]
    dtype: str
    itemsize: int  # bytes per element
    requires_grad: bool
    producer: str | None = None
    param: int | None = None
    batched: bool = False  # derived from a model input (grows with the batch), not a constant

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


# (forward FLOPs, backward FLOPs, tensors saved for backward, gemm shape)
_Priced = tuple[float, float, tuple[TensorRef, ...], tuple[int, int, int, int]]


@dataclass(frozen=True)
class RawOp:
    """One traced operator before pricing; ``module`` is its FQN from the traced root."""

    name: str
    op: str  # normalised op name: "linear", "mul", "scaled_dot_product_attention"...
    target: str
    module: str
    module_class: str
    args: tuple[TensorRef, ...]
    out: TensorRef
    scalars: dict[str, float] = field(default_factory=dict)

    @property
    def activations(self) -> tuple[TensorRef, ...]:
        """Tensor arguments that are not parameters."""
        return tuple(a for a in self.args if a.param is None)

    @property
    def params(self) -> tuple[TensorRef, ...]:
        return tuple(a for a in self.args if a.param is not None)


@dataclass(frozen=True)
class OpCost:
    """What one op costs: FLOPs, traffic in bytes, and the tensors it saves for backward.

    ``saved`` lists the saved tensors (deduplicated later across ops); ``saved_extra``
    is bytes of tensors the op creates only for backward (logsumexp, norm statistics,
    dropout masks).
    """

    kind: OpKind
    flops_fwd: float
    flops_bwd: float
    bytes_read: float
    bytes_written: float
    saved: tuple[TensorRef, ...]
    saved_extra: float
    gemm: tuple[int, int, int, int] | None


def classify(op: RawOp) -> OpKind:
    """The :class:`OpKind` of ``op``; pieces of a norm module count as norm."""
    name = op.op
    for ops, kind in (
        (_MATMUL_OPS, OpKind.MATMUL),
        (_CONV_OPS, OpKind.CONV),
        (_ATTENTION_OPS, OpKind.ATTENTION),
        (_EMBEDDING_OPS, OpKind.EMBEDDING),
        (_LOSS_OPS, OpKind.LOSS),
        (_NORM_OPS, OpKind.NORM),
    ):
        if name in ops:
            return kind
    if _is_view(op):
        return OpKind.VIEW
    if "norm" in op.module_class.lower():
        return OpKind.NORM
    if name in _SOFTMAX_OPS:
        return OpKind.SOFTMAX
    if name in _REDUCTION_OPS:
        return OpKind.REDUCTION
    if not op.activations:
        return OpKind.OTHER  # constructors (arange, ones) and parameter-only math
    return OpKind.ELEMENTWISE


def _is_view(op: RawOp) -> bool:
    if op.op in VIEW_OPS or (op.op == "dropout" and op.scalars.get("p", 0.0) == 0.0):
        return True
    inputs = op.activations
    return op.op in CAST_OPS and bool(inputs) and inputs[0].dtype == op.out.dtype


def _any_grad(refs: tuple[TensorRef, ...]) -> bool:
    return any(r.requires_grad for r in refs)


def _linear_gemm(op: RawOp) -> tuple[int, int, int, int]:
    x, weight = op.args[0], op.args[1]
    return 1, x.numel // x.shape[-1], weight.shape[0], weight.shape[1]


def _addmm_gemm(op: RawOp) -> tuple[int, int, int, int]:
    a, b = op.args[-2], op.args[-1]
    return 1, a.shape[0], b.shape[1], a.shape[1]


def _matmul_gemm(op: RawOp) -> tuple[int, int, int, int]:
    a_shape, b_shape = op.args[-2].shape, op.args[-1].shape
    a = a_shape if len(a_shape) > 1 else (1, *a_shape)
    b = b_shape if len(b_shape) > 1 else (*b_shape, 1)
    batch = math.prod(op.out.shape[:-2]) if len(a) > 2 or len(b) > 2 else 1
    return batch, a[-2], b[-1], a[-1]


def _gemm(op: RawOp) -> tuple[int, int, int, int]:
    if op.op == "linear":
        return _linear_gemm(op)
    if op.op in ("addmm", "mm"):
        return _addmm_gemm(op)
    return _matmul_gemm(op)


def _attention_gemm(op: RawOp) -> tuple[int, int, int, int]:
    q, k = op.args[0], op.args[1]
    return math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1]


def _conv_gemm(op: RawOp) -> tuple[int, int, int, int]:
    """Implicit GEMM: (1, output positions, output channels, input channels x kernel)."""
    weight = op.args[1]
    out = op.out.shape
    return 1, math.prod(out) // out[1], weight.shape[0], math.prod(weight.shape[1:])


def _matmul_cost(op: RawOp) -> _Priced:
    gemm = _gemm(op)
    fwd = 2.0 * math.prod(gemm)
    a, b = (op.args[0], op.args[1]) if op.op == "linear" else (op.args[-2], op.args[-1])
    products = int(a.requires_grad) + int(b.requires_grad)
    saved = tuple(t for t, other in ((a, b), (b, a)) if other.requires_grad and t.param is None)
    return fwd, fwd * products, saved, gemm


def _conv_cost(op: RawOp) -> _Priced:
    gemm = _conv_gemm(op)
    fwd = 2.0 * math.prod(gemm)
    x, weight = op.args[0], op.args[1]
    products = int(x.requires_grad) + int(weight.requires_grad)
    saved = (x,) if weight.requires_grad else ()
    return fwd, fwd * products, saved, gemm


def _attention_cost(op: RawOp) -> _Priced:
    q, k, v = op.args[0], op.args[1], op.args[2]
    batch, seq_q, seq_k, head_dim = _attention_gemm(op)
    fwd = 2.0 * batch * seq_q * seq_k * (head_dim + v.shape[-1])
    grad = _any_grad((q, k, v))
    saved = (q, k, v, op.out) if grad else ()
    return fwd, 2.0 * fwd if grad else 0.0, saved, (batch, seq_q, seq_k, head_dim)


def _tensor_core_cost(op: RawOp, kind: OpKind) -> OpCost:
    pricing: dict[OpKind, Callable[[RawOp], _Priced]] = {
        OpKind.MATMUL: _matmul_cost,
        OpKind.CONV: _conv_cost,
        OpKind.ATTENTION: _attention_cost,
    }
    fwd, bwd, saved, gemm = pricing[kind](op)
    extra = 0.0
    if kind is OpKind.ATTENTION and saved:
        extra = float(math.prod(op.args[0].shape[:-1]) * _LOGSUMEXP_BYTES)
    return OpCost(kind, fwd, bwd, _bytes_read(op), float(op.out.nbytes), saved, extra, gemm)


def _bytes_read(op: RawOp) -> float:
    if op.op == "embedding":  # a gather reads the rows it returns, not the whole table
        return float(op.out.nbytes + sum(a.nbytes for a in op.activations))
    return float(sum(a.nbytes for a in op.args))


def _saved_by_elementwise(op: RawOp) -> tuple[tuple[TensorRef, ...], float]:
    """Tensors an element-wise, norm, softmax, embedding or loss op keeps for backward."""
    if not op.out.requires_grad:
        return (), 0.0
    name, inputs = op.op, op.activations
    if name in _NORM_OPS:
        rows = op.out.numel // max(1, op.out.shape[-1]) if op.out.shape else 1
        return inputs[:1], float(rows * _NORM_STATS_BYTES)
    if name in ("mul", "div", "truediv"):
        tensors = op.args
        if len(tensors) != 2:  # times a Python scalar: nothing to keep
            return (), 0.0
        return tuple(
            t for t, other in zip(tensors, reversed(tensors), strict=True)
            if other.requires_grad and t.param is None
        ), 0.0  # fmt: skip
    if name == "dropout":
        return (), float(op.out.numel)  # one byte of mask per element
    if name in _LOSS_OPS:  # log-softmax of the logits, and the targets
        return tuple(inputs), 0.0
    if name in _EMBEDDING_OPS:
        return tuple(inputs), 0.0
    if name in _SAVES_OUTPUT:
        return (op.out,), 0.0
    if name in _SAVES_INPUTS:
        return tuple(inputs), 0.0
    return (), 0.0


def writes_in_place(target: str) -> bool:
    """Whether an operator target (``aten.clamp_.default``, ``Tensor.add_``, ``iadd``) writes
    into its first input."""
    return any(
        (part.endswith("_") and not part.startswith("_")) or part in _IN_PLACE_OPERATORS
        for part in target.split(".")
    )


def is_known(op: RawOp) -> bool:
    """Whether ``op`` is priced by a rule made for it (else as a plain element-wise op)."""
    known = (
        _MATMUL_OPS | _CONV_OPS | _ATTENTION_OPS | _SOFTMAX_OPS | _NORM_OPS | _LOSS_OPS
        | _REDUCTION_OPS | VIEW_OPS | CAST_OPS | _EMBEDDING_OPS | _SAVES_OUTPUT
        | _SAVES_INPUTS | _PLAIN_ELEMENTWISE | {"mul", "div", "truediv", "dropout"}
    )  # fmt: skip
    return op.op in known or "norm" in op.module_class.lower()


def cost_of(op: RawOp) -> OpCost:
    """Price one op (see the module docstring for the conventions)."""
    kind = classify(op)
    if kind in (OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION):
        return _tensor_core_cost(op, kind)
    if kind is OpKind.VIEW:
        return OpCost(kind, 0.0, 0.0, 0.0, 0.0, (), 0.0, None)
    saved, extra = _saved_by_elementwise(op)
    if kind is OpKind.LOSS:  # the chain F.cross_entropy runs over the logits
        logits = op.activations[0].numel
        read, written = (logits * size for size in CROSS_ENTROPY_BYTES)
        return OpCost(kind, 0.0, 0.0, float(read), float(written), saved, extra, None)
    return OpCost(kind, 0.0, 0.0, _bytes_read(op), float(op.out.nbytes), saved, extra, None)
