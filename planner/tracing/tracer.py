"""The profiler: a model traced on meta tensors into an :class:`~planner.graph.OpGraph`.

:func:`trace` copies the model onto the meta device in the requested dtype (no
memory, no compute), finds the repeated blocks (:func:`planner.modules.find_blocks`), traces it with
torch.fx (falling back to torch.export for models whose control flow defeats fx; the
graph's ``tracer`` says which ran) and prices every operator with
:mod:`planner.tracing.ops`. Token models (zoo transformers, Hugging Face causal LMs, and
a module of one's own that takes only token ids) are traced with their training loss:
``cross_entropy(logits.float(), targets)``, as torchtitan computes it and
``ParallelModel.step`` does by default.

The graph is a sequence of segments: the ops before the first block (kind
``embedding`` when they embed tokens), one segment per block (kind ``block``;
identical blocks share one segment type, traced once), and the ops after the last
block (kind ``head``). A model without repeated blocks is one ``other`` segment.

Mixture-of-experts layers are marked (:mod:`planner.tracing.roles`): every operator of a
router, experts or shared-experts module carries its :class:`~planner.graph.OpRole`,
and a block's segment type its ``num_experts``, ``top_k`` and ``hidden_size``; blocks
that differ in either are different types.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import math
import traceback
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from planner.errors import SpecError, TraceError
from planner.graph import OpGraph, OpKind, OpNode, OpRole, Segment, SegmentType
from planner.hf import expected_load_experts
from planner.models import ModelHandle, is_hf_model, resolve_model
from planner.modules import declared_causality, find_blocks
from planner.spec import DType, Family, TracedInput, Training
from planner.staging import logits_problem, output_logits, tensor_attributes
from planner.torch_dtypes import TORCH_DTYPES
from planner.tracing.fx import (
    BlockCall,
    Traced,
    error_summary,
    trace_export,
    trace_fx,
)
from planner.tracing.ops import (
    ATTENTION_FLAGS,
    CAST_OPS,
    VIEW_OPS,
    OpCost,
    RawOp,
    TensorRef,
    cost_of,
    is_known,
)
from planner.tracing.roles import MoEFacts, module_roles, moe_facts, role_of

__all__ = [
    "DTYPES",
    "trace",
    "trace_model",
    "trace_for_training",
    "traced_inputs",
    "default_seq_len",
    "summarize",
    "prepare_traced_module",
]

logger = logging.getLogger(__name__)

# The traceable dtypes by name (from :data:`planner.torch_dtypes.TORCH_DTYPES`).
DTYPES: dict[str, torch.dtype] = {
    dtype.value: TORCH_DTYPES[dtype] for dtype in (DType.BF16, DType.FP16, DType.FP32)
}
_WRAPPED = "model."  # FQN prefix of the traced model inside the loss wrapper


class _WithLoss(nn.Module):
    """Runs a token model and its cross-entropy loss, so the loss is traced too; its
    logits are found as at run time (:func:`planner.staging.output_logits`): a dict's
    ``"logits"``, a tuple's first item (nanoGPT's ``(logits, loss)``)."""

    def __init__(self, model: nn.Module, hf: bool) -> None:
        super().__init__()
        self.model = model
        self.hf = hf

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.hf:
            logits = self.model(input_ids=tokens, use_cache=False).logits
        else:  # structure only: an fx proxy answers any attribute (output_logits reads .logits)
            logits = self.model(tokens)
            if isinstance(logits, Mapping):
                logits = logits["logits"]
            elif isinstance(logits, tuple | list):
                logits = logits[0]
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _meta_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A training-mode copy of ``module`` on meta, floating tensors in ``dtype``.

    Shared parameters stay shared; the original is not touched. Tensors a module keeps
    as plain attributes (an auxiliary loss stashed by its last forward, which deepcopy
    refuses while it is part of an autograd graph) are copied as meta tensors too.
    """
    memo: dict[int, torch.Tensor] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        target = dtype if tensor.is_floating_point() else tensor.dtype
        meta = torch.empty_like(tensor, device="meta", dtype=target)
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    for value in tensor_attributes(module):
        memo[id(value)] = torch.empty_like(value, device="meta")
    return copy.deepcopy(module, memo).train()


def _meta_inputs(tensors: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
        for t in tensors
    )


def default_seq_len(handle: ModelHandle) -> int:
    """The sequence length a model is traced at when none is given: its spec's, its
    config's ``max_position_embeddings``, its example token ids', else 1."""
    if handle.spec is not None:
        return handle.spec.seq_len
    config = getattr(handle.module, "config", None)
    seq = getattr(config, "max_position_embeddings", None)
    if isinstance(seq, int):
        logger.info("seq_len not given: using the config's max_position_embeddings (%d)", seq)
        return seq
    if handle.example_seq_len is not None:
        return handle.example_seq_len
    return 1  # not a sequence model


def _check_arguments(handle: ModelHandle, batch_size: int, seq_len: int, dtype: str) -> None:
    if dtype not in DTYPES:
        raise SpecError(f"dtype {dtype!r} is not traceable; use one of {', '.join(DTYPES)}")
    for field_name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value < 1:
            raise SpecError(f"{field_name} must be a positive integer, got {value}")
    spec = handle.spec
    if spec is not None and spec.family is not Family.LLAMA and seq_len > spec.seq_len:
        raise SpecError(
            f"seq_len {seq_len} exceeds {spec.name}'s position table ({spec.seq_len} positions); "
            f"use seq_len <= {spec.seq_len} or resolve the model with seq_len={seq_len}"
        )


def prepare_traced_module(
    handle: ModelHandle, batch_size: int, seq_len: int, dtype: torch.dtype
) -> tuple[nn.Module, tuple[torch.Tensor, ...], str]:
    """What :func:`trace` runs: a meta copy of the model (wrapped with its loss for token
    models), its meta inputs, and the FQN prefix the wrapper adds."""
    model = _meta_copy(handle.module, dtype)
    inputs = _meta_inputs(tuple(handle.make_inputs(batch_size, seq_len)), dtype)
    hf = is_hf_model(model)
    # experts at their expected load, whichever device the model was built on
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    expected_load_experts(model, model_type=str(kind))
    if handle.spec is None and not hf and not _trains_on_tokens(model, inputs, handle.module):
        return model, inputs, ""
    targets = torch.empty(inputs[0].shape, dtype=torch.long, device="meta")
    return _WithLoss(model, hf), (inputs[0], targets), _WRAPPED


def _trains_on_tokens(model: nn.Module, inputs: tuple[torch.Tensor, ...], built: nn.Module) -> bool:
    """Whether a module of one's own is a token model ``ParallelModel.step`` trains with
    its default loss: one input, token ids (batch, seq), and logits per token out (else
    that step refuses, :func:`planner.staging.logits_problem`, and a loss of one's own
    goes unpriced: said in a warning)."""
    if len(inputs) != 1 or inputs[0].is_floating_point() or inputs[0].ndim != 2:
        return False
    try:
        logits = output_logits(_eager_forward(model, inputs))
    except (NotImplementedError, RuntimeError) as exc:  # the model's own code, on meta
        raise TraceError(_meta_failure(type(model).__name__, exc)) from None
    problem = logits_problem(logits.shape, inputs[0].shape)
    if problem is not None:
        _warn_once(built, "loss", f"the training loss is not priced: {problem}")
    return problem is None


# what was said about each module built by the caller: a model is traced at several
# shapes (and again to check its plan), and one finding is said once
_SAID: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _warn_once(module: nn.Module, finding: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``finding`` is said about ``module``
    (at any shape)."""
    said = _SAID.setdefault(module, set())
    if finding not in said:
        said.add(finding)
        logger.warning("%s", message)


def _meta_failure(name: str, exc: BaseException) -> str:
    """Why a model's forward cannot run on meta tensors, and what to change."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    if "meta" not in first.lower():  # not the meta device's limits: the model's own error
        return (
            f"{name}: its forward fails ({type(exc).__name__}: {first[:160]}){_where(exc)}, "
            "whatever the tracer: check the model's code or its config (sizes that must "
            "agree, such as heads and key/value heads)"
        )
    routed = (
        " (tokens gathered per expert by torch.where or nonzero: hold the experts as "
        "grouped weights in transformers' layout, planner.models.moe.Experts, which the "
        "planner prices at their expected load)"
        if "nonzero" in first
        else ""
    )
    return (
        f"{name}: its forward fails on the meta device ({type(exc).__name__}: {first[:160]}); "
        "the planner prices a model from one forward on meta tensors, which hold shapes "
        f"but no values, so shapes that depend on values cannot be priced{routed}"
    )


_NOT_THE_MODELS = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))


def _where(exc: BaseException) -> str:
    """Where in the model's code ``exc`` was raised: its last frame outside torch and
    the planner (" in function() at file:line"), or nothing."""
    frames = [
        frame for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith(_NOT_THE_MODELS)
    ]  # fmt: skip
    if not frames:
        return ""
    frame = frames[-1]
    return f" in {frame.name}() at {Path(frame.filename).name}:{frame.lineno}"


class _MetaAutocast(TorchFunctionMode):
    """``torch.autocast``'s lower-precision casts on meta tensors, which autocast skips:
    matmuls, attention and convolutions get their floating inputs in ``dtype``, as the
    runtime's autocast runs them (a model mixing fp32 rotary tables into half-precision
    queries traces as it trains). Nothing is cast for fp32."""

    _LOWER = frozenset({
        F.linear, F.scaled_dot_product_attention, F.conv1d, F.conv2d, F.conv3d, torch.matmul,
        torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.Tensor.matmul,
        torch.Tensor.__matmul__,
    })  # fmt: skip

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.dtype != torch.float32 and func in self._LOWER:
            args, kwargs = tree_map_only(torch.Tensor, self._cast, (args, kwargs))
        return func(*args, **kwargs)

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor


def _parameter_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the meta copy's floating parameters are in (the training dtype)."""
    floating = (p.dtype for p in model.parameters() if p.is_floating_point())
    return next(floating, torch.float32)


def _run_front_ends(
    root: nn.Module, inputs: tuple[torch.Tensor, ...], blocks: dict[str, nn.Module], name: str
) -> Traced:
    try:
        with _MetaAutocast(_parameter_dtype(root)):
            return trace_fx(root, inputs, blocks)
    except Exception as fx_error:  # fx fails on Python control flow: try the next tracer
        fx_reason = error_summary(fx_error)
    logger.info(  # the usual path of Hugging Face models: their forward branches on config
        "torch.fx could not trace %s (%s); tracing with torch.export", name, fx_reason
    )
    try:
        return trace_export(root, inputs, blocks)
    except Exception as export_error:
        broken = _eager_failure(root, inputs)
        if broken is not None:  # the model's own code fails, traced or not
            raise TraceError(_meta_failure(name, broken)) from None
        raise TraceError(
            f"could not trace model {name!r}.\n  torch.fx: {fx_reason}\n"
            f"  torch.export: {error_summary(export_error)}\n"
            "  Fix: make forward() traceable (no Python branches on tensor values: use "
            "torch.where; return tensors), check that the example inputs match forward()'s "
            "arguments, or describe the model as a ModelSpec JSON file."
        ) from None


def _eager_forward(root: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Any:
    """One eager forward of a module (the traced one, or the model it wraps) on its meta
    inputs, and its output. A Hugging Face model keeps a KV cache, which builds the same
    masks: without one transformers reads the positions' values to find packed
    sequences, which meta tensors do not hold."""
    with torch.no_grad(), _MetaAutocast(_parameter_dtype(root)):
        if isinstance(root, _WithLoss) and root.hf:
            return root.model(input_ids=inputs[0], use_cache=True)
        return root(*inputs)


def _eager_failure(root: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Exception | None:
    """What the model's own forward raises on the meta inputs, if anything (a config
    whose shapes disagree fails there too, not only in the tracers)."""
    try:
        _eager_forward(root, inputs)
    except Exception as exc:  # the model's own code: any error it raises is the answer
        return exc
    return None


def _check_learned_positions(model: nn.Module, seq_len: int) -> None:
    """Refuse a sequence longer than a Hugging Face model's learned position table (an
    embedding beside the token embedding with the config's ``max_position_embeddings``
    rows, after OPT's offset): its positions come from a cumulative sum (OPT) or a
    sliced buffer (BERT), which meta tensors pass through; the cluster's lookup fails."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not is_hf_model(model) or not isinstance(limit, int) or seq_len <= limit:
        return
    tokens = cast(Any, model).get_input_embeddings()
    for fqn, module in model.named_modules():
        rows = getattr(module, "num_embeddings", 0) - getattr(module, "offset", 0)
        if isinstance(module, nn.Embedding) and module is not tokens and rows == limit:
            raise _too_long(seq_len, seq_len, fqn, type(module).__name__, limit)


# Ops between an arange and a position embedding that keep one position per token: views,
# casts and a scalar offset (Hugging Face's ``arange(...) + past_seen_tokens``)
_POSITION_KEEPING = VIEW_OPS | CAST_OPS | {"add", "long"}


def _check_position_tables(traced: Traced, seq_len: int, prefix: str) -> None:
    """Refuse a sequence longer than a position table: an embedding, or a constant tensor
    such as a rotary ``cos_cached`` buffer, looked up at indices an ``arange`` made
    (through views, casts, a scalar offset), with more positions than rows (on meta
    tensors the lookup cannot fail; on the cluster it would)."""
    ops = {op.name: op for op in _raw_ops(traced)}
    for op in ops.values():
        lookup = _table_lookup(op)
        if lookup is None:
            continue
        rows, indices = lookup
        source = ops.get(indices.producer or "")
        while (
            source is not None and source.op in _POSITION_KEEPING and len(source.activations) == 1
        ):
            source = ops.get(source.activations[0].producer or "")
        if source is None or source.op != "arange" or math.prod(source.out.shape) <= rows:
            continue
        module = op.module.removeprefix(prefix) or op.module
        raise _too_long(
            seq_len, math.prod(source.out.shape), module, op.module_class or op.target, rows
        )


def _too_long(seq_len: int, positions: int, table: str, kind: str, rows: int) -> SpecError:
    """A sequence that looks up ``positions`` positions in a table of ``rows``."""
    return SpecError(
        f"seq_len {seq_len} looks up positions 0..{positions - 1} in {table!r} ({kind}), a "
        f"table of {rows} positions: use seq_len <= {rows}, or give the model a longer "
        "position table"
    )


def _table_lookup(op: RawOp) -> tuple[int, TensorRef] | None:
    """The rows of the table ``op`` looks up and the indices it looks up: an embedding's
    weight, or a constant tensor (not computed from the inputs) indexed by a tensor."""
    if op.op == "embedding" and op.params and op.activations:
        return op.params[0].shape[0], op.activations[0]
    if op.op not in ("index", "getitem", "__getitem__") or len(op.args) < 2:
        return None
    table, indices = op.args[0], op.args[1]
    if table.batched or table.param is not None or not table.shape:
        return None
    return table.shape[0], indices


def _top_module(fqn: str, blocks: frozenset[str]) -> str | None:
    """The outermost module on ``fqn``'s path that contains no block.

    ``None`` when ``fqn`` itself holds blocks (ops of a model's own ``forward``, such as
    mask building): a pipeline stage cannot name such a module as its own.
    """
    parts = fqn.split(".")
    for end in range(1, len(parts) + 1):
        candidate = ".".join(parts[:end])
        if not any(b == candidate or b.startswith(candidate + ".") for b in blocks):
            return candidate
    return None


@dataclass
class _SavedTensors:
    """Tensors kept for backward within one segment, each counted once.

    A view shares its base's storage, so a tensor saved by several ops, or saved
    through views, adds its bytes once (to the first op that saves it), and a saved
    part of a tensor (a split of a fused projection's output, say) keeps the whole
    base alive: it adds the base's bytes, or its own where it is larger (a reshape of
    an expanded tensor copies it).
    """

    base: dict[str, str] = field(default_factory=dict)  # view name -> base tensor name
    sizes: dict[str, int] = field(default_factory=dict)  # op name -> bytes of its output
    seen: set[str] = field(default_factory=set)

    def add(self, op: RawOp, cost: OpCost) -> float:
        """Record ``op``; return the bytes it newly keeps for backward."""
        source = op.activations[0].producer if op.activations else None
        if cost.kind is OpKind.VIEW and source is not None:
            self.base[op.name] = self.base.get(source, source)
        self.sizes[op.name] = op.out.nbytes
        nbytes = cost.saved_extra
        for tensor in cost.saved:
            name = tensor.producer or f"anonymous{id(tensor)}"
            key = self.base.get(name, name)
            if key not in self.seen:
                self.seen.add(key)
                nbytes += max(tensor.nbytes, self.sizes.get(key, 0))
        return nbytes


@dataclass
class _GraphBuilder:
    """Assembles segments and segment types; counts each parameter once.

    ``roles`` marks routers, experts and shared experts by module FQN and ``moe`` gives
    each block's MoE facts, both keyed as the traced root names them (with ``prefix``).
    """

    blocks: frozenset[str]  # block FQNs without the wrapper prefix
    prefix: str
    roles: dict[str, OpRole] = field(default_factory=dict)
    moe: dict[str, MoEFacts] = field(default_factory=dict)
    owned_params: set[int] = field(default_factory=set)
    types: dict[str, SegmentType] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # block key -> equal earlier type

    def add_block(self, call: BlockCall) -> None:
        fqn = call.fqn.removeprefix(self.prefix)
        type_id = self.aliases.get(call.key, call.key)
        if call.ops is not None and call.key not in self.types:
            nodes = self._nodes(call.ops, in_block=True, root=call.fqn)
            experts, top_k, hidden = self.moe.get(call.fqn, (0, 0, 0))
            new = SegmentType(call.key, "block", nodes, experts, top_k, hidden)
            same = next((t for t in self.types.values() if _same_type(t, new)), None)
            if same is None:  # a block that differs only in what it was called with may match
                self.types[call.key] = new
            else:
                self.aliases[call.key] = type_id = same.type_id
        self.segments.append(Segment(fqn, type_id, (fqn,)))

    def add_run(self, ops: list[RawOp], kind: str) -> None:
        nodes = self._nodes(ops, in_block=False, root="")
        signature = ";".join(
            f"{n.target}|{n.module}|{n.input_shapes}" + (f"|{n.role}" if n.role else "")
            for n in nodes
        )
        type_id = hashlib.sha256(f"{kind}|{signature}".encode()).hexdigest()[:16]
        self.types.setdefault(type_id, SegmentType(type_id, kind, nodes))
        paths = (self._local(op.module) for op in ops)
        tops = (_top_module(path, self.blocks) for path in paths if path)
        modules = dict.fromkeys(top for top in tops if top is not None)
        count = sum(1 for s in self.segments if s.fqn.split(".")[0] == kind)
        fqn = kind if count == 0 else f"{kind}.{count}"
        self.segments.append(Segment(fqn, type_id, tuple(modules)))

    def _nodes(self, ops: Sequence[RawOp], *, in_block: bool, root: str) -> tuple[OpNode, ...]:
        """Price ``ops``; block ops already carry module paths relative to ``root``."""
        names = {op.name for op in ops}
        saved = _SavedTensors()
        nodes = []
        for op in ops:
            cost = cost_of(op)
            saved_bytes = saved.add(op, cost)
            param_count, param_bytes = self._own_params(op)
            producers = dict.fromkeys(
                a.producer for a in op.args if a.producer in names and a.producer != op.name
            )
            nodes.append(
                OpNode(
                    name=op.name, kind=cost.kind, target=op.target,
                    module=op.module if in_block else self._local(op.module),
                    inputs=tuple(p for p in producers if p is not None),
                    input_shapes=tuple(a.shape for a in op.args), output_shape=op.out.shape,
                    dtype=op.out.dtype, flops_fwd=cost.flops_fwd, flops_bwd=cost.flops_bwd,
                    bytes_read=cost.bytes_read, bytes_written=cost.bytes_written,
                    param_count=param_count, param_bytes=param_bytes, saved_bytes=saved_bytes,
                    gemm=cost.gemm, batched=op.out.batched,
                    role=role_of(_join(root, op.module), self.roles),
                )
            )  # fmt: skip
        return tuple(nodes)

    def _local(self, fqn: str) -> str:
        """``fqn`` relative to the traced model (without the loss wrapper's prefix)."""
        return "" if fqn == self.prefix.rstrip(".") else fqn.removeprefix(self.prefix)

    def _own_params(self, op: RawOp) -> tuple[int, float]:
        """Parameters ``op`` uses that no earlier op owns: (count, bytes)."""
        count, nbytes = 0, 0.0
        for ref in op.params:
            if ref.param is not None and ref.param not in self.owned_params:
                self.owned_params.add(ref.param)
                count += ref.numel
                nbytes += ref.nbytes
        return count, nbytes


def _join(root: str, module: str) -> str:
    return f"{root}.{module}" if root and module else root or module


def _same_type(a: SegmentType, b: SegmentType) -> bool:
    """Whether two traced blocks compute the same: operators (with their roles) and MoE facts."""
    facts = (a.num_experts, a.top_k, a.hidden_size) == (b.num_experts, b.top_k, b.hidden_size)
    return facts and a.nodes == b.nodes


def _split(items: tuple[RawOp | BlockCall, ...]) -> list[list[RawOp] | BlockCall]:
    """Runs of consecutive ops between block calls, in order."""
    groups: list[list[RawOp] | BlockCall] = []
    for item in items:
        if isinstance(item, BlockCall):
            groups.append(item)
        elif groups and isinstance(groups[-1], list):
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def _run_kind(ops: list[RawOp], blocks_before: bool, blocks_after: bool) -> str:
    if not blocks_before and not blocks_after:
        return "other"
    if not blocks_before:
        embeds = any(op.op == "embedding" for op in ops)
        return "embedding" if embeds else "other"
    return "other" if blocks_after else "head"


def _assemble(traced: Traced, builder: _GraphBuilder) -> None:
    groups = _split(traced.items)
    block_positions = [i for i, g in enumerate(groups) if isinstance(g, BlockCall)]
    first = block_positions[0] if block_positions else len(groups)
    last = block_positions[-1] if block_positions else -1
    for position, group in enumerate(groups):
        if isinstance(group, BlockCall):
            builder.add_block(group)
        else:
            builder.add_run(group, _run_kind(group, position > first, position < last))


def _raw_ops(traced: Traced) -> list[RawOp]:
    ops = [item for item in traced.items if isinstance(item, RawOp)]
    for item in traced.items:
        if isinstance(item, BlockCall) and item.ops is not None:
            ops.extend(item.ops)
    return ops


def _attention_causal(ops: Sequence[RawOp], module: nn.Module) -> bool | None:
    """Whether the model's attention is causal as its own calls say: every attention call
    passes ``is_causal=True`` (True) or every one passes ``is_causal=False`` without a
    mask (False); where a mask or a computed flag leaves the calls silent, as its
    attention modules declare it (:func:`~planner.modules.declared_causality`: Hugging
    Face's); ``None`` when it has no attention, or nothing says, which leaves it to the
    options (a decoder by default)."""
    flags = [op.scalars for op in ops if op.op in ATTENTION_FLAGS]
    if not flags:
        return None
    if any(f.get("masked", 1.0) or "is_causal" not in f for f in flags):
        return declared_causality(module)
    causal = {f["is_causal"] for f in flags}
    return bool(causal.pop()) if len(causal) == 1 else None


def _masked_attention_share(
    ops: Sequence[RawOp], root: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> float:
    """The share of the model's attention calls that hand the kernel a mask tensor: a
    module of one's own as its traced calls say; a Hugging Face model as its eager
    forward makes them, counted on one forward on the meta ``inputs`` (traced by
    torch.export it builds every mask its eager forward skips for ``is_causal``, but not
    a sliding window's once the sequence outgrows it). A model whose forward reads
    values (BioGPT's positions) is priced unmasked, with a warning."""
    if isinstance(root, _WithLoss) and root.hf:
        try:
            with _MaskedCalls() as calls:
                _eager_forward(root, inputs)
        except Exception as exc:  # the model's own code, on meta tensors
            logger.warning(
                "%s: its attention masks could not be counted on meta tensors (%s: %s); "
                "it is priced as if it handed SDPA none (is_causal)",
                type(root.model).__name__, type(exc).__name__, str(exc).split("\n")[0],
            )  # fmt: skip
            return 0.0
        return calls.share
    flags = [bool(op.scalars.get("masked")) for op in ops if op.op in ATTENTION_FLAGS]
    return sum(flags) / len(flags) if flags else 0.0


class _MaskedCalls(TorchFunctionMode):
    """Counts ``F.scaled_dot_product_attention`` calls and those given an ``attn_mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.masked = 0

    @property
    def share(self) -> float:
        return self.masked / self.calls if self.calls else 0.0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls += 1
            self.masked += mask is not None
        return func(*args, **kwargs)


def _warn_unknown_ops(ops: Sequence[RawOp], handle: ModelHandle) -> None:
    unknown = sorted({op.op for op in ops if not is_known(op)})
    if unknown:
        _warn_once(
            handle.module,
            f"unknown {unknown}",
            f"{handle.name}: no pricing rule for {', '.join(unknown)}; counted as element-wise "
            "ops (bytes only, 0 FLOPs, nothing saved for backward)",
        )


def trace(
    handle: ModelHandle, *, batch_size: int = 1, seq_len: int | None = None, dtype: str = "bf16"
) -> OpGraph:
    """Trace one forward pass (and loss, for token models) of ``handle`` into an OpGraph.

    Shapes are per micro-batch of ``batch_size`` sequences of ``seq_len`` tokens (the
    model's own length by default); bytes are as if the model ran in ``dtype``
    ("bf16", "fp16" or "fp32"). Raises :class:`TraceError` when no tracer succeeds.
    """
    seq = seq_len if seq_len is not None else default_seq_len(handle)
    _check_arguments(handle, batch_size, seq, dtype)
    _check_learned_positions(handle.module, seq)
    root, inputs, prefix = prepare_traced_module(handle, batch_size, seq, DTYPES[dtype])
    blocks = dict(find_blocks(root))
    traced = _run_front_ends(root, inputs, blocks, handle.name)
    _check_position_tables(traced, seq, prefix)
    block_fqns = frozenset(fqn.removeprefix(prefix) for fqn in blocks)
    moe = {fqn: moe_facts(block, fqn.removeprefix(prefix)) for fqn, block in blocks.items()}
    builder = _GraphBuilder(block_fqns, prefix, module_roles(root), moe)
    _assemble(traced, builder)
    ops = _raw_ops(traced)
    _warn_unknown_ops(ops, handle)
    logger.info(
        "traced %s with %s: %d segments, %d types", handle.name, traced.tracer,
        len(builder.segments), len(builder.types),
    )  # fmt: skip
    return OpGraph(
        model_name=handle.name, batch_size=batch_size, seq_len=seq, dtype=dtype,
        tracer=traced.tracer, segments=tuple(builder.segments), types=builder.types,
        attention_causal=_attention_causal(ops, root),
        masked_attention_share=_masked_attention_share(ops, root, inputs),
    )  # fmt: skip


def trace_for_training(handle: ModelHandle, training: Training) -> OpGraph:
    """The model's graph at batch 1 and the training sequence length and dtype (fp8
    training traces bf16 activations)."""
    seq = training.seq_len or (handle.spec.seq_len if handle.spec else None)
    dtype = {DType.FP32: "fp32", DType.FP16: "fp16"}.get(training.dtype, "bf16")
    return trace(handle, batch_size=1, seq_len=seq, dtype=dtype)


def traced_inputs(handle: ModelHandle, training: Training) -> tuple[TracedInput, ...]:
    """The forward arguments :func:`trace_for_training` traces a module of the user's own
    with, as its plan records them; none for zoo and Hugging Face models."""
    if handle.spec is not None or is_hf_model(handle.module):
        return ()
    seq = training.seq_len or default_seq_len(handle)
    return tuple(
        TracedInput(dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
        for t in handle.make_inputs(1, seq)
    )


def trace_model(
    source: str, *, batch_size: int = 1, seq_len: int | None = None, dtype: str = "bf16"
) -> OpGraph:
    """Resolve ``source`` (preset, spec file or ``module:function``) and trace it."""
    handle = resolve_model(source, seq_len=seq_len)
    return trace(handle, batch_size=batch_size, seq_len=seq_len, dtype=dtype)


def summarize(graph: OpGraph) -> dict[str, Any]:
    """Totals and one entry per segment type, in order of first appearance (JSON-ready).

    Per-type figures are for one segment (one micro-batch); ``share_of_flops`` is the
    fraction of the model's forward FLOPs spent in all segments of that type.
    """
    counts: dict[str, int] = {}
    first_fqn: dict[str, str] = {}
    for segment in graph.segments:
        counts[segment.type_id] = counts.get(segment.type_id, 0) + 1
        first_fqn.setdefault(segment.type_id, segment.fqn)
    total_flops = graph.flops_fwd or 1.0
    per_type = [
        {
            "type_id": type_id, "kind": graph.types[type_id].kind, "first": first_fqn[type_id],
            "count": count, "params": graph.types[type_id].param_count,
            "flops_fwd": graph.types[type_id].flops_fwd,
            "flops_bwd": graph.types[type_id].flops_bwd,
            "saved_bytes": graph.types[type_id].saved_bytes,
            "ops": len(graph.types[type_id].nodes),
            "share_of_flops": count * graph.types[type_id].flops_fwd / total_flops,
        }
        for type_id, count in counts.items()
    ]  # fmt: skip
    return {
        "model": graph.model_name, "tracer": graph.tracer, "batch_size": graph.batch_size,
        "seq_len": graph.seq_len, "dtype": graph.dtype, "segments": len(graph.segments),
        "params": graph.param_count, "param_bytes": graph.total("param_bytes"),
        "flops_fwd": graph.flops_fwd, "flops_bwd": graph.flops_bwd,
        "saved_bytes": graph.total("saved_bytes"), "types": per_type,
    }  # fmt: skip
