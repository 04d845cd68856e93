"""Tracing front ends for :mod:`planner.tracing`: torch.fx and torch.export to :class:`RawOp`.

Both front ends run on meta tensors and yield the model's operators in execution
order, with repeated blocks marked as :class:`BlockCall` items:

- :func:`trace_fx`: ``torch.fx`` symbolic tracing with blocks as leaf modules and
  shape propagation; each distinct block (structural hash plus input shapes) is then
  traced once on its own, so a 126-layer model costs one block trace.
- :func:`trace_export`: ``torch.export`` (non-strict, then ``draft_export``) of the
  whole model for models whose Python control flow defeats fx (Hugging Face); blocks
  are recovered from each node's ``nn_module_stack``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from planner.models.transformer import LayerNorm
from planner.torch_dtypes import dtype_name
from planner.tracing.ops import ATTENTION_FLAGS, RawOp, TensorRef

__all__ = [
    "BlockCall",
    "Traced",
    "structural_hash",
    "trace_fx",
    "trace_export",
    "error_summary",
]

logger = logging.getLogger(__name__)

_LEAF_MODULES: dict[type[nn.Module], str] = {
    nn.Linear: "linear",
    nn.Embedding: "embedding",
    nn.LayerNorm: "layer_norm",
    LayerNorm: "layer_norm",  # the zoo's: in autocast's dtype where it is on
    nn.RMSNorm: "rms_norm",
    nn.GroupNorm: "group_norm",
    nn.BatchNorm1d: "batch_norm",
    nn.BatchNorm2d: "batch_norm",
    nn.BatchNorm3d: "batch_norm",
    nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d",
    nn.Conv3d: "conv3d",
    nn.GELU: "gelu",
    nn.ReLU: "relu",
    nn.SiLU: "silu",
    nn.Tanh: "tanh",
    nn.Sigmoid: "sigmoid",
    nn.Softmax: "softmax",
    nn.LogSoftmax: "log_softmax",
    nn.Dropout: "dropout",
    nn.Identity: "identity",
    nn.Flatten: "flatten",
    nn.MaxPool2d: "max_pool2d",
    nn.AvgPool2d: "avg_pool2d",
    nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
}
_NOISY_TORCH_LOGGERS = ("torch._subclasses.fake_tensor", "torch.export", "torch._export")
# Per-layer counters such as HF's ``layer_idx`` differ between identical blocks.
_INDEX_ATTRIBUTE = re.compile(r"(^|_)(idx|index|id|number)$")


@dataclass(frozen=True)
class BlockCall:
    """One call of a repeated block at ``fqn``; ``ops`` is set for the first call of a type.

    ``ops`` module paths are relative to the block.
    """

    fqn: str
    key: str  # the segment type id: structural hash plus what the block was called with
    ops: tuple[RawOp, ...] | None


@dataclass(frozen=True)
class Traced:
    """A front end's result: ops and block calls in execution order."""

    items: tuple[RawOp | BlockCall, ...]
    tracer: str


def structural_hash(module: nn.Module) -> str:
    """Hash of class names, parameter and buffer shapes and scalar hyperparameters.

    Two modules with the same hash compute the same function of their inputs up to
    parameter values; layer-index counters (``layer_idx``) are ignored.
    """
    digest = hashlib.sha256()
    for name, sub in module.named_modules():
        cls = type(sub)
        digest.update(f"{name}|{cls.__module__}.{cls.__qualname__}|".encode())
        for pname, tensor in [
            *sub.named_parameters(recurse=False),
            *sub.named_buffers(recurse=False),
        ]:
            digest.update(
                f"{pname}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.requires_grad};".encode()
            )
        for attr, value in sorted(vars(sub).items()):
            if attr.startswith("_") or _INDEX_ATTRIBUTE.search(attr):
                continue
            if isinstance(value, (bool, int, float, str, tuple, type(None))):
                digest.update(f"{attr}={value!r};".encode())
    return digest.hexdigest()[:16]


def _tensor_meta(node: torch.fx.Node) -> tuple[tuple[int, ...], torch.dtype] | None:
    """Shape and dtype of a node's (first) tensor result, from ShapeProp or export."""
    meta: Any = node.meta.get("tensor_meta", node.meta.get("val"))
    if isinstance(meta, (tuple, list)) and not hasattr(meta, "shape"):
        meta = next((m for m in meta if hasattr(m, "shape") and hasattr(m, "dtype")), None)
    if meta is None or not hasattr(meta, "shape") or not isinstance(meta.dtype, torch.dtype):
        return None
    return tuple(int(d) for d in meta.shape), meta.dtype


def _ref(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    requires_grad: bool,
    producer: str | None = None,
    param: nn.Parameter | None = None,
    batched: bool = False,
) -> TensorRef:
    return TensorRef(
        shape=shape, dtype=dtype_name(dtype), itemsize=dtype.itemsize,
        requires_grad=requires_grad, producer=producer,
        param=id(param) if param is not None else None, batched=batched,
    )  # fmt: skip


def _param_ref(param: nn.Parameter) -> TensorRef:
    return _ref(tuple(param.shape), param.dtype, param.requires_grad, param=param)


def _op_name(node: torch.fx.Node, root: nn.Module) -> str:
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        return _LEAF_MODULES.get(type(module), type(module).__name__.lower())
    if node.op == "call_method":
        return str(node.target)
    target: Any = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return str(getattr(target, "__name__", target))


def _target_text(node: torch.fx.Node, root: nn.Module) -> str:
    if node.op == "call_module":
        return type(root.get_submodule(str(node.target))).__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target: Any = node.target
    return str(target) if isinstance(target, torch._ops.OpOverload) else _op_name(node, root)


def _module_of(node: torch.fx.Node) -> tuple[str, str]:
    """(FQN, class name) of the innermost module a node was traced in."""
    if node.op == "call_module":
        return str(node.target), ""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls_name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    return str(path), cls_name


def _attention_flags(node: torch.fx.Node, name: str) -> dict[str, float]:
    """``is_causal`` (1 or 0) and ``masked`` (1: a mask or bias tensor is passed) of an
    attention call; ``is_causal`` absent when it is not a constant."""
    causal_at, mask_at = ATTENTION_FLAGS[name]

    def argument(index: int | None, *keywords: str) -> object:
        for keyword in keywords:
            if keyword in node.kwargs:
                return node.kwargs[keyword]
        return node.args[index] if index is not None and len(node.args) > index else None

    causal = argument(causal_at, "is_causal")
    mask = argument(mask_at, "attn_mask", "attn_bias")
    flags = {"masked": float(mask is not None)}
    if isinstance(causal, bool) or causal is None:
        flags["is_causal"] = float(bool(causal))
    return flags


def _scalars(node: torch.fx.Node, root: nn.Module, name: str) -> dict[str, float]:
    if name in ATTENTION_FLAGS and node.op == "call_function":
        return _attention_flags(node, name)
    if name != "dropout":
        return {}
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        p: Any = module.p
        return {"p": float(p) if module.training else 0.0}
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return {"p": float(p) if training else 0.0}


class _GraphReader:
    """Turns the nodes of one shape-propagated graph into :class:`RawOp` records."""

    def __init__(
        self,
        root: nn.Module,
        input_grads: Sequence[bool],
        param_of: Callable[[torch.fx.Node], nn.Parameter | None],
    ) -> None:
        self.root = root
        self.input_grads = list(input_grads)
        self.param_of = param_of
        self.values: dict[str, TensorRef] = {}

    def read(self, graph: torch.fx.Graph) -> Iterator[tuple[torch.fx.Node, RawOp]]:
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                self._read_source(node)
            elif node.op in ("call_module", "call_function", "call_method"):
                op = self._read_op(node)
                if op is not None:
                    yield node, op

    def _read_source(self, node: torch.fx.Node) -> None:
        param = self.param_of(node)
        if param is not None:
            self.values[node.name] = _param_ref(param)
            return
        meta = _tensor_meta(node)
        if meta is None:
            return
        grad = self.input_grads.pop(0) if node.op == "placeholder" and self.input_grads else False
        self.values[node.name] = _ref(
            *meta, requires_grad=grad and meta[1].is_floating_point, producer=node.name,
            batched=node.op == "placeholder",
        )  # fmt: skip

    def _args(self, node: torch.fx.Node) -> list[TensorRef]:
        refs: list[TensorRef] = []
        torch.fx.node.map_arg(
            (node.args, node.kwargs),
            lambda arg: refs.append(self.values[arg.name]) if arg.name in self.values else None,
        )
        if node.op == "call_module":
            module = self.root.get_submodule(str(node.target))
            refs += [_param_ref(p) for p in module.parameters()]
        return refs

    def _read_op(self, node: torch.fx.Node) -> RawOp | None:
        meta = _tensor_meta(node)
        if meta is None:
            return None  # shape arithmetic, asserts: no tensor result
        args = tuple(self._args(node))
        grad = meta[1].is_floating_point and any(a.requires_grad for a in args)
        batched = any(a.batched for a in args)
        out = _ref(*meta, requires_grad=grad, producer=node.name, batched=batched)
        self.values[node.name] = out
        name = _op_name(node, self.root)
        module, module_class = _module_of(node)
        return RawOp(
            name=node.name, op=name, target=_target_text(node, self.root), module=module,
            module_class=module_class, args=args, out=out,
            scalars=_scalars(node, self.root, name),
        )  # fmt: skip


class _ShapeProp(torch.fx.Interpreter):
    """Runs a graph on meta tensors and stores each node's result in ``meta["tensor_meta"]``.

    Unlike ``torch.fx.passes.shape_prop.ShapeProp`` it prints nothing and names the
    node that failed. A call of a block whose structure (``block_hashes``: module id ->
    structural hash) and inputs match an earlier call is not run again: its output is a
    fresh meta tensor shaped like the earlier one, so 126 identical blocks run once.
    """

    def __init__(self, module: torch.fx.GraphModule, block_hashes: dict[int, str] | None = None):
        super().__init__(module)
        self.block_hashes = block_hashes or {}
        self.block_outputs: dict[tuple[object, ...], torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            result = self._repeated_block(n)
            if result is None:
                result = super().run_node(n)
                self._remember_block(n, result)
        except Exception as exc:
            target = getattr(n.target, "__name__", n.target)
            raise RuntimeError(
                f"node {n.name!r} ({n.op} {target}) failed on meta tensors: {error_summary(exc)}"
            ) from exc
        n.meta["tensor_meta"] = result
        return result

    def _block_key(self, n: torch.fx.Node) -> tuple[object, ...] | None:
        if n.op != "call_module" or n.kwargs:
            return None
        block_hash = self.block_hashes.get(id(self.fetch_attr(str(n.target))))
        args = [self.env.get(a) if isinstance(a, torch.fx.Node) else a for a in n.args]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if block_hash is None or len(tensors) != len(args):
            return None
        return (block_hash, *((t.shape, t.dtype, t.requires_grad) for t in tensors))

    def _repeated_block(self, n: torch.fx.Node) -> torch.Tensor | None:
        key = self._block_key(n)
        earlier = self.block_outputs.get(key) if key is not None else None
        if earlier is None:
            return None
        return torch.empty(
            earlier.shape, dtype=earlier.dtype, device="meta", requires_grad=earlier.requires_grad
        )

    def _remember_block(self, n: torch.fx.Node, result: Any) -> None:
        key = self._block_key(n)
        if key is not None and isinstance(result, torch.Tensor):
            self.block_outputs[key] = result


class _Tracer(torch.fx.Tracer):
    """Keeps blocks and the standard layers of :data:`_LEAF_MODULES` as single nodes."""

    def __init__(self, block_ids: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.block_ids = block_ids

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.block_ids or type(m) in _LEAF_MODULES


def _fx_param_of(root: nn.Module) -> Callable[[torch.fx.Node], nn.Parameter | None]:
    def param_of(node: torch.fx.Node) -> nn.Parameter | None:
        if node.op != "get_attr":
            return None
        value = functools.reduce(getattr, str(node.target).split("."), root)
        return value if isinstance(value, nn.Parameter) else None

    return param_of


def _symbolic_trace(root: nn.Module, block_ids: frozenset[int], given: int) -> torch.fx.GraphModule:
    """``root`` traced for a call with ``given`` positional inputs: later ``forward``
    parameters that default to ``None`` (such as ``position_ids``) are traced as ``None``."""
    parameters = list(inspect.signature(root.forward).parameters.values())[given:]
    unset = {p.name: None for p in parameters if p.default is None}
    graph = _Tracer(block_ids).trace(root, concrete_args=unset)
    return torch.fx.GraphModule(root, graph)


def _trace_block(
    block: nn.Module, inputs: tuple[torch.Tensor, ...], grads: Sequence[bool]
) -> tuple[RawOp, ...]:
    gm = _symbolic_trace(block, frozenset(), len(inputs))
    _ShapeProp(gm).run(*inputs)
    reader = _GraphReader(block, grads, _fx_param_of(block))
    return tuple(op for _, op in reader.read(gm.graph))


def _block_key(block: nn.Module, args: tuple[TensorRef, ...]) -> str:
    signature = ",".join(f"{a.shape}:{a.dtype}:{a.requires_grad}" for a in args)
    return hashlib.sha256(f"{structural_hash(block)}|{signature}".encode()).hexdigest()[:16]


def _sharing_key(key: str, block: nn.Module, held: set[int]) -> str:
    """``key`` marked with the names of ``block``'s parameters that earlier operators or
    blocks already use (``held``, their ids; updated with this block's): a block sharing
    a weight with an earlier one (ALBERT-style) is a segment type of its own, priced
    without that weight, so every parameter counts once."""
    shared = sorted(name for name, param in block.named_parameters() if id(param) in held)
    held.update(id(param) for param in block.parameters())
    return f"{key}|shares:{','.join(shared)}" if shared else key


def trace_fx(
    root: nn.Module, inputs: tuple[torch.Tensor, ...], blocks: dict[str, nn.Module]
) -> Traced:
    """Trace ``root`` with torch.fx; each distinct block is traced once on its own.

    Raises whatever fx or shape propagation raises; :func:`planner.trace` turns
    that into a fallback or a :class:`~planner.errors.TraceError`.
    """
    gm = _symbolic_trace(root, frozenset(id(b) for b in blocks.values()), len(inputs))
    _ShapeProp(gm, {id(b): structural_hash(b) for b in blocks.values()}).run(*inputs)
    reader = _GraphReader(root, [t.requires_grad for t in inputs], _fx_param_of(root))
    items: list[RawOp | BlockCall] = []
    seen: set[str] = set()
    held: set[int] = set()  # parameters used so far (ids)
    for node, op in reader.read(gm.graph):
        block = blocks.get(op.module) if node.op == "call_module" else None
        if block is None:
            items.append(op)
            held.update(a.param for a in op.params if a.param is not None)
            continue
        key = _sharing_key(_block_key(block, op.activations), block, held)
        ops = None
        if key not in seen:
            seen.add(key)
            inputs = _block_inputs(node)
            ops = _trace_block(block, inputs, [t.requires_grad for t in inputs])
        items.append(BlockCall(op.module, key, ops))
    return Traced(tuple(items), "fx")


def _block_inputs(node: torch.fx.Node) -> tuple[torch.Tensor, ...]:
    """Fresh meta tensors like the ones a block call received, for tracing it alone.

    Only calls with positional tensor arguments can be replayed; anything else raises,
    which sends the model to the torch.export front end.
    """
    values: list[Any] = [
        arg.meta.get("tensor_meta") if isinstance(arg, torch.fx.Node) else arg for arg in node.args
    ]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if node.kwargs or len(tensors) != len(values):
        raise TypeError(
            f"block {node.target} is called with keyword or non-tensor arguments; "
            "the fx front end replays blocks with positional tensors only"
        )
    return tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Mute torch's own error logs (tracebacks of failed meta kernels) while exporting.

    A failure still raises; :func:`planner.trace` reports it in one line.
    """
    loggers = [logging.getLogger(name) for name in _NOISY_TORCH_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Trace without a Python stack trace per graph node (``node.meta["stack_trace"]``,
    which nothing here reads): about a quarter less time to export the Hugging Face
    configs of ``benchmarks/bench_trace.py``."""
    config = torch.fx.config
    kept = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = kept


def _export(root: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[Any, str]:
    """``torch.export`` non-strict, then ``draft_export`` (with the stack traces its report
    of what failed points at); returns (program, tracer name)."""
    with _quiet_torch_logs():
        try:
            with _no_stack_traces():
                return torch.export.export(root, inputs, strict=False), "export"
        except Exception as exc:  # any failure sends us to the next front end
            logger.warning(
                "non-strict torch.export failed (%s); trying draft_export", error_summary(exc)
            )
            return torch.export.draft_export(root, inputs), "draft_export"


def error_summary(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters), for one-line reports."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _block_of_node(node: torch.fx.Node, block_fqns: frozenset[str]) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    return next((path for path, _ in stack.values() if path in block_fqns), None)


def _relative(op: RawOp, root: str) -> RawOp:
    module = (
        op.module.removeprefix(root).removeprefix(".") if op.module.startswith(root) else op.module
    )
    return RawOp(op.name, op.op, op.target, module, op.module_class, op.args, op.out, op.scalars)


def _group_blocks(
    pairs: list[tuple[str | None, RawOp]], blocks: dict[str, nn.Module]
) -> list[RawOp | BlockCall]:
    """Collapse runs of ops inside one block into a :class:`BlockCall` each."""
    items: list[RawOp | BlockCall] = []
    runs: list[tuple[str | None, list[RawOp]]] = []
    for fqn, op in pairs:
        if fqn is not None and runs and runs[-1][0] == fqn:
            runs[-1][1].append(op)
        else:
            runs.append((fqn, [op]))
    seen: set[str] = set()
    held: set[int] = set()  # parameters used so far (ids)
    for fqn, ops in runs:
        if fqn is None:
            items.extend(ops)
            held.update(a.param for op in ops for a in op.params if a.param is not None)
            continue
        relative = tuple(_relative(op, fqn) for op in ops)
        signature = ";".join(f"{o.op}{o.module}{[a.shape for a in o.args]}" for o in relative)
        key = hashlib.sha256(f"{structural_hash(blocks[fqn])}|{signature}".encode()).hexdigest()[
            :16
        ]
        key = _sharing_key(key, blocks[fqn], held)
        items.append(BlockCall(fqn, key, None if key in seen else relative))
        seen.add(key)
    return items


def trace_export(
    root: nn.Module, inputs: tuple[torch.Tensor, ...], blocks: dict[str, nn.Module]
) -> Traced:
    """Trace ``root`` with torch.export (non-strict, then draft_export)."""
    program, tracer = _export(root, inputs)
    signature = program.graph_signature
    param_names = dict(signature.inputs_to_parameters)

    def param_of(node: torch.fx.Node) -> nn.Parameter | None:
        if node.op != "placeholder" or node.name not in param_names:
            return None
        return root.get_parameter(param_names[node.name])

    user_inputs = set(signature.user_inputs)
    grads = [t.requires_grad for t in inputs]
    graph = program.graph
    reader = _ExportReader(root, grads, param_of, user_inputs)
    block_fqns = frozenset(blocks)
    pairs = [(_block_of_node(node, block_fqns), op) for node, op in reader.read(graph)]
    return Traced(tuple(_group_blocks(pairs, blocks)), tracer)


class _ExportReader(_GraphReader):
    """A reader whose placeholders are parameters, constants or user inputs (in order)."""

    def __init__(
        self,
        root: nn.Module,
        input_grads: Sequence[bool],
        param_of: Callable[[torch.fx.Node], nn.Parameter | None],
        user_inputs: set[str],
    ) -> None:
        super().__init__(root, input_grads, param_of)
        self.user_inputs = user_inputs

    def _read_source(self, node: torch.fx.Node) -> None:
        param = self.param_of(node)
        meta = _tensor_meta(node)
        if param is not None or meta is None:
            super()._read_source(node)
            return
        if node.name in self.user_inputs:
            super()._read_source(node)
        else:
            self.values[node.name] = _ref(*meta, requires_grad=False, producer=node.name)
