"""A tensor-parallel layout rehearsed on fake tensors: the model's own code on one rank.

Before a layout is priced or emitted, one rank's view of it runs under
``FakeTensorMode`` (shapes only: no memory, no values). Parameters take their local
shapes, each module boundary the layout redistributes gives its tensor the local
shape the redistribution would (an all-gather grows the sharded dim ``tp``-fold, a
slice or reduce-scatter shrinks it), and the model's forward runs as written. Code
that cannot run on shards (a view with a hard-coded head count, a fused projection
split by the full width, positions computed from a sequence shard) fails here, not on
the cluster; so does a module whose output does not have the local shape the layout
promises, and an attention call whose queries lost their sequence length or head width
(a view with ``-1`` for the sequence beside a head count written out folds a head
shard into the sequence: OPT's ``view(bsz, -1, num_heads, head_dim)``, which runs and
trains a different model). The failure names the innermost module that was running.

Blocks of one kind (traced type and layout) run the same code on the same shapes, so
only the first of each kind runs; the others hand on its output and their modules stay
on meta (a 126-block model rehearses about as fast as a one-block one). The first block
to fail is always such a first one; a failure is confirmed by running every block.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from planner.fqn import expand_patterns
from planner.graph import OpGraph, OpKind
from planner.models import ModelHandle
from planner.spec import ModuleTP, shard_dim
from planner.tracing import DTYPES, prepare_traced_module

__all__ = ["RehearsalFailure", "rehearse"]


@dataclass(frozen=True)
class RehearsalFailure:
    """Where a layout failed on one rank's shards: the innermost running module's FQN
    (``""``: the model's own forward), the modules around it, and what went wrong."""

    module: str
    stack: tuple[str, ...]
    message: str

    def describe(self) -> str:
        where = f"module {self.module!r}" if self.module else "the model's forward"
        return f"{where}: {self.message}"


def rehearse(
    handle: ModelHandle, graph: OpGraph, layout: Mapping[str, ModuleTP], *, tp: int
) -> RehearsalFailure | None:
    """Run ``handle``'s forward on one rank's shards of ``layout``; ``None`` when it runs.

    ``graph`` is the model's trace (batch 1, the training sequence length): it gives the
    inputs' length and each module's global output shape. A failure found running one
    block of each kind is confirmed by running them all (its report is that run's).
    """
    if _run(handle, graph, layout, tp, repeats=False) is None:
        return None
    return _run(handle, graph, layout, tp, repeats=True)


def _run(
    handle: ModelHandle, graph: OpGraph, layout: Mapping[str, ModuleTP], tp: int, repeats: bool
) -> RehearsalFailure | None:
    """One rehearsal; without ``repeats``, only the first block of each kind runs."""
    root, inputs, prefix = prepare_traced_module(handle, 1, graph.seq_len, DTYPES[graph.dtype])
    expected = _output_shapes(graph)
    stack: list[str] = []
    with FakeTensorMode(allow_non_fake_inputs=True), _quiet(_FAKE_TENSOR_LOG):
        names = [name.removeprefix(prefix) for name, _ in root.named_modules()]
        concrete = expand_patterns(layout, [n for n in names if n])
        idle = () if repeats else _hand_on_first_outputs(root, prefix, graph, concrete)
        concrete = {fqn: how for fqn, how in concrete.items() if not fqn.startswith(idle)}
        for name, module in root.named_modules():  # an idle block's modules stay on meta
            if not name.removeprefix(prefix).startswith(idle):
                module.to_empty(device="cpu", recurse=False)
        try:
            _shard_parameters(root, prefix, concrete, tp)
            with _hooks(root, prefix, concrete, tp, expected, stack), _Attention(graph, stack):
                fake = tuple(torch.zeros(t.shape, dtype=t.dtype) for t in inputs)
                root(*fake)
        except _Mismatch as exc:
            return RehearsalFailure(exc.module, tuple(stack), str(exc))
        except Exception as exc:  # the model's own code failed on its shards
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if _LocalView.__name__ in message:
                message = (
                    "it modifies in place a tensor the layout moved between ranks, which "
                    "the runtime hands on as DTensor.to_local(): a view autograd does not "
                    "let it modify"
                )
            return RehearsalFailure(stack[-1] if stack else "", tuple(stack), message)
    return None


def _hand_on_first_outputs(
    root: nn.Module, prefix: str, graph: OpGraph, layout: dict[str, ModuleTP]
) -> tuple[str, ...]:
    """Make each block after the first of its kind (traced type and the layout of its
    modules) hand on that first block's output without running; the prefixes (``fqn.``)
    of the modules inside those blocks, which then never run."""
    outputs: dict[tuple[str, str], Any] = {}
    idle: list[str] = []
    for segment in graph.blocks:
        inside = segment.fqn + "."
        placed = sorted(
            (fqn.removeprefix(segment.fqn), repr(module_layout))
            for fqn, module_layout in layout.items()
            if fqn == segment.fqn or fqn.startswith(inside)
        )
        kind = (segment.type_id, repr(placed))
        if kind in outputs:
            idle.append(inside)
        else:
            outputs[kind] = None
        block = root.get_submodule(prefix + segment.fqn)
        block.forward = _first_output(block.forward, outputs, kind)
    return tuple(idle)


def _first_output(forward: Any, outputs: dict[tuple[str, str], Any], kind: tuple[str, str]) -> Any:
    def run_once(*args: Any, **kwargs: Any) -> Any:
        if outputs[kind] is None:
            outputs[kind] = forward(*args, **kwargs)
        return outputs[kind]

    return run_once


# torch logs the traceback of every operator that fails on fake tensors before raising
# it; here a failure is an answer (the region is kept whole), reported by the caller
_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _Mismatch(Exception):
    def __init__(self, module: str, message: str) -> None:
        super().__init__(message)
        self.module = module


def _shard_parameters(root: nn.Module, prefix: str, layout: dict[str, ModuleTP], tp: int) -> None:
    """Give each sharded parameter its local shape (shared parameters stay shared).

    ``replaced`` keeps the original parameters alive, so no new tensor reuses their ids.
    """
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for fqn, module_layout in layout.items():
        module = root.get_submodule(prefix + fqn)
        for name, placement in module_layout.params.items():
            param = module._parameters.get(name)
            if param is None:
                raise _Mismatch(fqn, f"plan places parameter {name!r}, which {fqn!r} does not have")
            dim = shard_dim(placement)
            if dim is None:
                continue
            if id(param) not in replaced:
                shape = list(param.shape)
                if shape[dim] % tp:
                    raise _Mismatch(
                        fqn, f"{name} dim {dim} has size {shape[dim]}, not divisible by tp {tp}"
                    )
                shape[dim] //= tp
                local = torch.empty(shape, dtype=param.dtype)
                new = nn.Parameter(local, requires_grad=param.requires_grad)
                replaced[id(param)] = (param, new)
            module._parameters[name] = replaced[id(param)][1]
    for module in root.modules():  # a parameter shared with a module the layout skipped
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                module._parameters[name] = replaced[id(param)][1]


def _convert(x: torch.Tensor, src: str, dst: str, tp: int) -> torch.Tensor:
    """The local tensor after redistributing ``x`` from ``src`` to ``dst`` (shapes only)."""
    src_dim, dst_dim = shard_dim(src), shard_dim(dst)
    if src == dst:
        return x
    if src_dim is not None:  # gather the sharded dim
        x = torch.cat([x] * tp, dim=src_dim)
    if dst_dim is not None:
        x = x.narrow(dst_dim, 0, x.shape[dst_dim] // tp)
    return x


def _local_shape(shape: tuple[int, ...], placement: str, tp: int) -> tuple[int, ...]:
    dim = shard_dim(placement)
    if dim is None:
        return shape
    local = list(shape)
    local[dim] //= tp
    return tuple(local)


def _output_shapes(graph: OpGraph) -> dict[str, tuple[int, ...]]:
    """Each module's global output shape (its last operator's), by concrete FQN."""
    shapes: dict[str, tuple[int, ...]] = {}
    for segment in graph.segments:
        root = graph.module_root(segment)
        for node in graph.segment_type(segment).nodes:
            if node.module:
                shapes[".".join(p for p in (root, node.module) if p)] = node.output_shape
    return shapes


@contextlib.contextmanager
def _hooks(
    root: nn.Module,
    prefix: str,
    layout: dict[str, ModuleTP],
    tp: int,
    expected: dict[str, tuple[int, ...]],
    stack: list[str],
) -> Iterator[None]:
    handles = []
    for name, module in root.named_modules():
        fqn = name.removeprefix(prefix) if name.startswith(prefix) else ""
        handles.append(module.register_forward_pre_hook(_enter(fqn, stack, layout.get(fqn), tp)))
        handles.append(
            module.register_forward_hook(_leave(fqn, stack, layout.get(fqn), tp, expected))
        )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _enter(fqn: str, stack: list[str], module_layout: ModuleTP | None, tp: int) -> Any:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        stack.append(fqn)
        if module_layout is None or module_layout.input is None:
            return None
        src, dst = module_layout.input
        if not args or not isinstance(args[0], torch.Tensor):
            raise _Mismatch(fqn, "its first argument is not a tensor: the layout converts it")
        converted = _convert(args[0], src, dst, tp)
        if src != dst and not module_layout.params:
            converted = _LocalView.apply(converted)
        return (converted, *args[1:])

    return hook


def _leave(
    fqn: str,
    stack: list[str],
    module_layout: ModuleTP | None,
    tp: int,
    expected: dict[str, tuple[int, ...]],
) -> Any:
    def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
        if stack and stack[-1] == fqn:
            stack.pop()
        if module_layout is None or module_layout.output is None:
            return None
        if not isinstance(output, torch.Tensor):
            raise _Mismatch(fqn, "its output is not a tensor: the layout converts it")
        src, dst = module_layout.output
        converted = _convert(output, src, dst, tp)
        if fqn in expected:
            want = _local_shape(expected[fqn], dst, tp)
            got = tuple(converted.shape)
            if got != want and math.prod(got) > 0:
                raise _Mismatch(
                    fqn, f"output has local shape {got}, the layout promises {want} ({dst})"
                )
        if (src != dst or module_layout.params) and not module_layout.output_dtensor:
            converted = _LocalView.apply(converted)
        return converted

    return hook


class _Attention(TorchFunctionMode):
    """Checks each SDPA call's queries against the trace's: a layout splits attention by
    heads only, so a rank's queries keep the sequence length and head width they have in
    the trace (the other dims multiply to the trace's, or a tp-th of it)."""

    def __init__(self, graph: OpGraph, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.traced = {
            tuple(node.input_shapes[0][-2:])
            for segment in graph.segments
            for node in graph.segment_type(segment).nodes
            if node.kind is OpKind.ATTENTION and node.input_shapes
        }

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.traced:
            query = args[0] if args else kwargs["query"]
            if tuple(query.shape[-2:]) not in self.traced:
                module = self.stack[-1] if self.stack else ""
                raise _Mismatch(
                    module,
                    f"attention gets queries of local shape {tuple(query.shape)}, whose "
                    f"(sequence, head width) the trace has as {sorted(self.traced)}: its code "
                    "folds the heads' shard into another dimension (a view with -1 beside a "
                    "head count written out)",
                )
        return func(*args, **kwargs)


class _LocalView(torch.autograd.Function):
    """What the runtime hands the model's code after moving a tensor: ``DTensor.to_local()``,
    which autograd counts as a view made inside a custom Function, so the model's own
    in-place ops on it (Falcon's ``mlp_output += attention_output``) fail here as there."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad
