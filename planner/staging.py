"""Pipeline stages cut from any model with repeated blocks, torchtitan-style.

``plan.stages[i]`` names the modules of chunk ``i`` (torchtitan's
``module_fqns_per_model_part``). :func:`build_chunk` copies the model keeping them under
their whole-model FQNs:

- blocks of other chunks leave the blocks' container, which still iterates and indexes
  in whole-model positions (``self.layers[:n]``, ``enumerate``, ``.values()``): there a
  block of another chunk is a skip that hands its hidden-state input on unchanged;
- any other module that holds parameters and is not kept becomes a stand-in without
  parameters that returns zeros shaped like the module's output (worked out on a meta
  copy of it). A stage that starts mid-model never uses those values: its first block's
  input is replaced by the hidden state it receives;
- parameter-free modules (rotary embeddings, dropout) stay on every chunk.

:func:`install_stage_forward`, called once the parallel dimensions wrapped the chunk,
makes the model's own, unmodified forward run one stage: the first stage takes token
ids; a later one takes the previous stage's hidden state, and the token ids of the same
micro-batch as the keyword ``stage_ids`` (the schedule splits keyword tensors into
micro-batches as it splits the batch); a hook on its first block swaps the received
hidden state in, a hook on its last block ends the forward with that block's output;
the last stage returns the logits.

:func:`stage_problem` proves at plan time, on the meta device and with this same code,
that a model's stages run; :func:`split_problem` checks that a stage split places every
parameter once, the blocks in order, the embeddings first and the head last.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from planner.errors import SpecError, one_line
from planner.hf import expected_load_experts
from planner.models import ModelHandle, is_hf_model
from planner.models.moe import is_experts
from planner.modules import find_blocks
from planner.torch_dtypes import dtype_name

__all__ = [
    "STAGE_IDS",
    "StagedForward",
    "build_chunk",
    "install_stage_forward",
    "logits_problem",
    "modules_around",
    "output_logits",
    "split_problem",
    "stage_problem",
    "token_vocab",
]

STAGE_IDS = "stage_ids"  # the keyword that hands a later stage its micro-batch's token ids


# ---- chunks


def build_chunk(model: nn.Module, fqns: Sequence[str]) -> nn.Module:
    """A copy of ``model`` keeping the modules named in ``fqns`` under their FQNs.

    Modules of other chunks are not copied: other chunks' blocks become skips of the
    blocks' container, other modules holding parameters become stand-ins.
    """
    keep = set(fqns)
    blocks = find_blocks(model)
    holder = blocks[0][0].rpartition(".")[0] if blocks else None
    cuts = list(_cuts(model, keep, _ancestors(keep), {fqn for fqn, _ in blocks}))
    memo: dict[int, Any] = {id(t): t.detach() for t in tensor_attributes(model)}
    chunk = copy.deepcopy(model, memo | {id(module): None for _, module in cuts})
    for fqn, module in cuts:
        parent_fqn, _, name = fqn.rpartition(".")
        parent = chunk.get_submodule(parent_fqn)
        del parent._modules[name]
        if parent_fqn != holder:
            object.__setattr__(parent, name, _StandIn(fqn, module))
    if holder is not None:
        _keep_positions(chunk.get_submodule(holder), tuple(model.get_submodule(holder)._modules))
    return chunk


def _ancestors(fqns: set[str]) -> set[str]:
    return {fqn.rsplit(".", depth)[0] for fqn in fqns for depth in range(1, fqn.count(".") + 1)}


def _cuts(
    module: nn.Module, keep: set[str], ancestors: set[str], blocks: set[str], prefix: str = ""
) -> Iterator[tuple[str, nn.Module]]:
    """``(fqn, module)`` of each module the chunk does not copy."""
    for name, child in module.named_children():
        fqn = prefix + name
        if fqn in keep:
            continue
        if fqn in ancestors:
            yield from _cuts(child, keep, ancestors, blocks, fqn + ".")
        elif fqn in blocks or next(child.parameters(), None) is not None:
            yield fqn, child


def _skip(*args: Any, **kwargs: Any) -> Any:
    """A block of another chunk: hands its hidden-state input on."""
    return _hidden_input(args, kwargs)


class _Positions:
    """The blocks' container of a chunk (list-like): whole-model positions, skips for
    other chunks' blocks. ``holds_blocks`` tells :func:`~planner.modules.find_blocks`
    that its children are the blocks, however few this chunk keeps."""

    holds_blocks = True
    _order: tuple[str, ...]
    _modules: dict[str, nn.Module | None]

    def _entry(self, key: str) -> Callable[..., Any]:
        kept = self._modules.get(key)
        return _skip if kept is None else kept

    def __iter__(self) -> Iterator[Callable[..., Any]]:
        return (self._entry(key) for key in self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._entry(key) for key in self._order[index]]
        return self._entry(self._order[index])


class _Keyed(_Positions):
    """The blocks' container of a chunk (dict-like), in whole-model key order."""

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]
        return iter(self._order)

    def __getitem__(self, key: str) -> Any:  # type: ignore[override]
        if key not in self._order:
            raise KeyError(key)
        return self._entry(key)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def keys(self) -> list[str]:
        return list(self._order)

    def values(self) -> list[Callable[..., Any]]:
        return [self._entry(key) for key in self._order]

    def items(self) -> list[tuple[str, Callable[..., Any]]]:
        return [(key, self._entry(key)) for key in self._order]


_STAGE_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _keep_positions(container: nn.Module, order: tuple[str, ...]) -> None:
    """Make ``container`` a :class:`_Positions` (or :class:`_Keyed`) of the blocks ``order``."""
    cls = type(container)
    if cls not in _STAGE_CLASSES:
        mixin = _Keyed if issubclass(cls, nn.ModuleDict) else _Positions
        _STAGE_CLASSES[cls] = type(f"Stage{cls.__name__}", (mixin, cls), {})
    container.__class__ = _STAGE_CLASSES[cls]
    object.__setattr__(container, "_order", order)


class _StandIn:
    """A module of another chunk: no parameters; zeros shaped like its output."""

    def __init__(self, fqn: str, module: nn.Module) -> None:
        self.fqn = fqn
        self.twin = _meta_twin(module)
        self.handed: list[torch.Tensor] | None = None  # set by stage_problem: zeros handed out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise SpecError(
                f"{self.fqn!r} sits on another pipeline stage, and this stage's forward calls "
                "it without a tensor input"
            )
        with torch.no_grad():
            shaped = self.twin(*_on_meta(args), **_on_meta(kwargs))
        return tree_map_only(
            torch.Tensor, functools.partial(self._zeros, tensors[0].device), shaped
        )

    def _zeros(self, device: torch.device, like: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(like.shape, dtype=like.dtype, device=device)
        if self.handed is not None and zeros.is_floating_point():
            self.handed.append(zeros.requires_grad_())
        return zeros

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self.fqn!r} sits on another pipeline stage, but this stage's forward reads "
            f"its {name!r}"
        )


def _meta_twin(module: nn.Module, *, copy_always: bool = False) -> nn.Module:
    """``module`` itself when it is on the meta device (unless ``copy_always``: the caller
    changes the twin), else a copy of it there."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.is_meta for t in tensors) and not copy_always:
        return module
    memo: dict[int, Any] = {id(t): _meta_like(t) for t in [*tensors, *tensor_attributes(module)]}
    return copy.deepcopy(module, memo)


def tensor_attributes(module: nn.Module) -> list[torch.Tensor]:
    """The tensors ``module``'s submodules keep as plain attributes and not also as
    parameters or buffers (a loss its last forward stashed, which deepcopy refuses while
    it is part of an autograd graph): a copy takes them detached, or as meta tensors."""
    registered = {id(t) for t in [*module.parameters(), *module.buffers()]}
    return [
        value for child in module.modules() for value in vars(child).values()
        if isinstance(value, torch.Tensor) and id(value) not in registered
    ]  # fmt: skip


def _priced_twin(module: nn.Module, *, copy_always: bool = False) -> nn.Module:
    """The meta twin a check runs: its experts, if any, run the expected-load dispatch
    the tracer prices (a dispatch that gathers tokens per expert, as transformers' and
    many of one's own do, needs values meta tensors do not hold)."""
    experts = any(is_experts(m) for m in module.modules())
    twin = _meta_twin(module, copy_always=copy_always or experts)
    if experts:
        kind = getattr(getattr(twin, "config", None), "model_type", type(twin).__name__)
        expected_load_experts(twin, model_type=str(kind))
    return twin


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(t, device="meta")
    return nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty


def _on_meta(tree: Any) -> Any:
    return tree_map_only(
        torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), tree
    )


# ---- the staged forward


class _StageEnd(Exception):
    """Raised by the last block of a stage that is not the last: its output ends the forward."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("end of pipeline stage")
        self.hidden = hidden


class StagedForward:
    """A chunk's ``forward``: the model's own forward, run as one pipeline stage."""

    def __init__(self, forward: Callable[..., Any], *, first: bool, last: bool) -> None:
        self.forward = forward
        self.first = first
        self.last = last
        self.received: torch.Tensor | None = None

    def __call__(self, *args: Any, stage_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """First stage: ``(token ids)``; later stages: ``(hidden state, stage_ids=token ids)``.
        Returns the hidden state for the next stage, or the last stage's logits."""
        if not self.first:
            if stage_ids is None or len(args) != 1:
                raise SpecError(
                    f"a pipeline stage after the first takes (hidden state, {STAGE_IDS}=token "
                    f"ids); got {len(args)} positional arguments and {STAGE_IDS}={stage_ids!r}"
                )
            self.received, args = args[0], (stage_ids,)
        try:
            output = self.forward(*args, **kwargs)
        except _StageEnd as end:
            return end.hidden
        finally:
            self.received = None
        if not self.last:
            raise SpecError("the model's forward returned before this stage's last block ran")
        return output_logits(output)

    def take_received(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook of the stage's first block: its input is the received state."""
        received, self.received = self.received, None
        if received is None:
            raise SpecError(
                f"{type(module).__name__}, this stage's first block, ran without a hidden state "
                "received from the previous stage (called twice, or outside the stage)"
            )
        if args:
            return (received, *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": received}
        raise SpecError(
            f"{type(module).__name__}, this stage's first block, takes no positional input "
            "or hidden_states: there is no place for the received hidden state"
        )

    def end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of the stage's last block (not on the last stage)."""
        raise _StageEnd(_first_tensor(output))


def install_stage_forward(chunk: nn.Module, *, first: bool, last: bool) -> StagedForward:
    """Make ``chunk`` (from :func:`build_chunk`, after FSDP/TP/recompute wrapped it; not
    a DDP wrapper) run as a pipeline stage; returns its new ``forward``. The hooks are
    registered after FSDP's, so FSDP's own post-forward hook still runs; the input swap
    runs before any other pre-hook (FSDP and TP then see the received state)."""
    blocks = [block for _, block in find_blocks(chunk)]
    if not blocks:
        raise SpecError(f"pipeline chunk {type(chunk).__name__} holds no block")
    staged = StagedForward(chunk.forward, first=first, last=last)
    if not first:
        blocks[0].register_forward_pre_hook(staged.take_received, prepend=True, with_kwargs=True)
    if not last:
        blocks[-1].register_forward_hook(staged.end)
    chunk.forward = staged
    return staged


def _hidden_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


def _first_tensor(output: Any) -> torch.Tensor:
    found = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
    if found is None:
        raise SpecError(f"a block returned {type(output).__name__} without a tensor")
    return found


def output_logits(output: Any) -> torch.Tensor:
    """The logits in a model's output: its ``.logits`` (Hugging Face) or ``["logits"]``
    (a dict), the output itself, or the first tensor of a tuple (nanoGPT's
    ``(logits, loss)``)."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    return logits if isinstance(logits, torch.Tensor) else _first_tensor(output)


def token_vocab(handle: ModelHandle, seq_len: int) -> int | None:
    """The token ids (``0 <= id < vocab``) a model that takes token ids alone trains on:
    the fewest rows of the ``nn.Embedding`` modules its ids (or views of them) reach and
    the width of its logits, found by one forward on the meta device. ``None`` when its
    input is not token ids (an integer tensor of shape (batch, seq)) or they reach no
    embedding."""
    inputs = handle.make_inputs(1, seq_len)
    if len(inputs) != 1 or inputs[0].is_floating_point() or inputs[0].ndim != 2:
        return None
    rows: list[int] = []
    model = _priced_twin(handle.module)
    with _Derived(inputs[0]) as derived:

        def reached(module: nn.Module, args: tuple[Any, ...]) -> None:
            if args and derived.holds(args[0]):
                rows.append(cast(nn.Embedding, module).num_embeddings)

        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        hooks = [m.register_forward_pre_hook(reached) for m in embeddings]
        try:
            with torch.no_grad():
                logits = output_logits(model(*inputs))
        except Exception as exc:  # the user's forward: its failure is an error line
            raise SpecError(
                f"model {handle.source!r}: its forward on the meta device raised "
                f"{one_line(exc)}, so the range of its token ids is unknown"
            ) from None
        finally:
            for hook in hooks:
                hook.remove()
    return min(*rows, logits.shape[-1]) if rows else None


class _Derived(TorchFunctionMode):
    """Tensors computed from ``source`` (views, reshapes, arithmetic) while active."""

    def __init__(self, source: torch.Tensor) -> None:
        super().__init__()
        self._kept = [source]  # held, so their ids stay theirs
        self._ids = {id(source)}

    def holds(self, value: object) -> bool:
        return id(value) in self._ids

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(id(t) in self._ids for t in tree_leaves((args, kwargs))):
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._kept.append(tensor)
                    self._ids.add(id(tensor))
        return out


def logits_problem(logits: torch.Size, tokens: torch.Size) -> str | None:
    """Why logits shaped ``logits`` are not one row per token of ``tokens`` (batch, seq),
    as the training loss needs, or ``None``."""
    rows = math.prod(logits[:-1]) if len(logits) >= 2 else 0
    if rows == math.prod(tokens):
        return None
    return (
        f"the model's forward returns logits of shape {tuple(logits)} for token ids of shape "
        f"{tuple(tokens)}, not one row of logits per token (a forward that returns only the "
        "last position's logits when called without targets, as nanoGPT's does, cannot be "
        "trained that way); return the logits of every position"
    )


# ---- stage splits


def modules_around(module: nn.Module) -> tuple[list[str], list[str]]:
    """FQNs of the modules registered before the blocks' container (embeddings) and after
    it (final norm, head): its siblings on the path from the root."""
    blocks = find_blocks(module)
    container = blocks[0][0].rpartition(".")[0] if blocks else ""
    before: list[str] = []
    after: list[str] = []
    current, prefix = module, ""
    for part in container.split(".") if container else []:
        names = [name for name, _ in current.named_children()]
        position = names.index(part)
        before += [prefix + name for name in names[:position]]
        after = [prefix + name for name in names[position + 1 :]] + after
        current = current.get_submodule(part)
        prefix += f"{part}."
    return before, after


def split_problem(module: nn.Module, stages: Sequence[Sequence[str]]) -> str | None:
    """Why ``stages`` (FQN lists) cannot run as a pipeline of ``module``, or ``None``.

    Every parameter sits in exactly one stage; each stage holds a run of whole blocks
    following the previous stage's; modules before the blocks (embeddings) sit on the
    first stage, those after them (final norm, head) on the last.
    """
    named: dict[str, set[int]] = {}
    for index, fqns in enumerate(stages):
        for fqn in fqns:
            named.setdefault(fqn, set()).add(index)
    before, after = modules_around(module)
    edges = {**dict.fromkeys(before, 0), **dict.fromkeys(after, len(stages) - 1)}
    for name, _ in module.named_parameters():
        owner = name.rpartition(".")[0]
        if not owner:
            return (
                f"parameter {name!r} belongs to the model itself, not to a submodule a stage "
                "can hold; hold it in one (learned positions: an nn.Embedding the model calls "
                "before its blocks) or use pp = 1"
            )
        held = _holding(owner, named)
        if len(held) != 1:
            where = f"stages {sorted(held)}" if held else "no stage"
            return f"parameter {name!r} is in {where}; every parameter belongs to exactly one"
        edge = next((e for e in _lineage(owner) if e in edges), None)
        if edge is not None and held != {edges[edge]}:
            side = "before" if edges[edge] == 0 else "after"
            return (
                f"{edge!r} comes {side} the blocks but sits on stage {held.pop()}; put it on "
                f"the {'first' if side == 'before' else 'last'} stage"
            )
    return _block_order_problem([fqn for fqn, _ in find_blocks(module)], named, len(stages))


def _block_order_problem(blocks: list[str], named: dict[str, set[int]], count: int) -> str | None:
    """Each block in one stage; stage indices rising by at most one from 0 to ``count - 1``."""
    previous = 0
    for fqn in blocks:
        held = _holding(fqn, named) | {
            i for name, stages in named.items() if name.startswith(fqn + ".") for i in stages
        }
        if len(held) != 1:
            where = f"stages {sorted(held)}" if held else "no stage"
            return f"block {fqn!r} is in {where}; each block belongs to exactly one stage"
        (index,) = held
        if index not in (previous, previous + 1) or (fqn == blocks[0] and index != 0):
            return (
                f"block {fqn!r} sits on stage {index} after a block on stage {previous}: each "
                "stage holds the run of blocks that follows the previous stage's"
            )
        previous = index
    if previous != count - 1:
        return f"the blocks fill stages 0 to {previous} of {count}: every stage needs a block"
    return None


def _lineage(fqn: str) -> list[str]:
    """``fqn`` and its ancestors (``a.b.c``: ``a``, ``a.b``, ``a.b.c``)."""
    parts = fqn.split(".") if fqn else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _holding(fqn: str, named: dict[str, set[int]]) -> set[int]:
    """The stages naming ``fqn`` or one of its ancestors."""
    return {index for name in _lineage(fqn) for index in named.get(name, ())}


# ---- the plan-time check


def stage_problem(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> str | None:
    """Why ``module`` cannot run as pipeline stages, or ``None``; one line naming its class.

    On the meta device (``module`` and ``inputs`` are copied there when they are not;
    fake tensors for Hugging Face models): one forward records that the blocks run once
    each, in order, each taking the previous block's output as its first input and no
    other tensor computed from trained parameters; a first/middle/last split must place
    every parameter (:func:`split_problem`); then a first, a middle and a last chunk are
    built and chained by :func:`build_chunk` and :func:`install_stage_forward`, as the
    runtime does, and no stage may use the output of a module another stage holds.
    """
    name = type(module).__name__
    blocks = [fqn for fqn, _ in find_blocks(module)]
    if len(blocks) < 2:
        return f"{name} has no repeated blocks to split into stages"
    if len(inputs) != 1:
        return (
            f"{name}'s forward takes {len(inputs)} inputs; pipeline stages hand on token ids only"
        )
    if inputs[0].is_floating_point() or inputs[0].ndim != 2:
        return (
            f"{name} takes a {dtype_name(inputs[0].dtype)} input of shape "
            f"{tuple(inputs[0].shape)}, not token ids (batch, seq): pipeline stages run "
            "token models, trained with a loss per token"
        )
    hf = is_hf_model(module)
    model, ids = _priced_twin(module, copy_always=hf), _on_meta(inputs[0])
    try:
        with _traced(fake=hf):
            problem = _flow_problem(model, ids, blocks)
        if problem is None:
            problem = split_problem(model, _probe_stages(model, blocks)) or _chain_problem(
                model, ids, blocks, fake=hf
            )
    except Exception as exc:  # the user's forward failed as a stage: that is the reason
        return f"{name}: a pipeline stage's forward fails on the meta device ({one_line(exc)})"
    return None if problem is None else f"{name}: {problem}"


@dataclass
class _Call:
    fqn: str
    hidden: Any
    trained: list[str] = field(default_factory=list)  # other inputs computed from parameters
    output: torch.Tensor | None = None


def _flow_problem(model: nn.Module, ids: torch.Tensor, blocks: list[str]) -> str | None:
    """Record one forward: each block once, in order, fed by the previous one."""
    calls: list[_Call] = []
    fqn_of = {id(model.get_submodule(fqn)): fqn for fqn in blocks}

    def before(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = _hidden_input(args, kwargs)
        others = {**{f"argument {i}": a for i, a in enumerate(args[1:], 1)}, **kwargs}
        others.pop("hidden_states", None) if not args else None
        trained = [
            key
            for key, value in others.items()
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(value))
        ]
        calls.append(_Call(fqn_of[id(block)], hidden, trained))

    def after(block: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        next(c for c in reversed(calls) if c.fqn == fqn_of[id(block)]).output = _first_tensor(
            output
        )

    handles = []
    for fqn in blocks:
        block = model.get_submodule(fqn)
        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(block.register_forward_hook(after))
    try:
        model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return _calls_problem(calls, blocks)


def _calls_problem(calls: list[_Call], blocks: list[str]) -> str | None:
    order = [call.fqn for call in calls]
    repeated = next((fqn for fqn in blocks if order.count(fqn) > 1), None)
    if repeated is not None:
        return (
            f"block {repeated!r} runs {order.count(repeated)} times in one forward; a "
            "pipeline stage runs each block once"
        )
    if order != blocks:
        return (
            f"its forward runs the blocks {_few(order)}, not each once in the order they "
            f"are registered ({_few(blocks)})"
        )
    for previous, call in zip([None, *calls], calls, strict=False):
        if call.hidden is None or not isinstance(call.hidden, torch.Tensor):
            return f"block {call.fqn!r} takes no tensor as its first input (hidden state)"
        if previous is not None and call.hidden is not previous.output:
            return (
                f"block {call.fqn!r} does not take block {previous.fqn!r}'s output as its "
                "first input (the forward changes the hidden state between blocks), so no "
                "stage can start there"
            )
        if call.trained:
            return (
                f"block {call.fqn!r} takes {call.trained[0]} computed from trained parameters "
                "outside the blocks, which a stage that starts later does not have"
            )
    return None


def _few(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"


def _probe_stages(model: nn.Module, blocks: list[str]) -> list[list[str]]:
    """A split into first (embeddings, block 0), middle (the blocks between) and last
    (last block, head) stages."""
    before, after = modules_around(model)
    middle = [blocks[1:-1]] if len(blocks) > 2 else []
    return [[*before, blocks[0]], *middle, [blocks[-1], *after]]


def _traced(*, fake: bool) -> contextlib.ExitStack:
    """Gradients on; with ``fake``, fake tensors (Hugging Face reads them as traced, not as
    values to ``.item()``; plain meta tensors run about 3x faster)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.enable_grad())
    if fake:
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    return stack


def _chain_problem(
    model: nn.Module, ids: torch.Tensor, blocks: list[str], *, fake: bool
) -> str | None:
    """Run a first stage (embeddings, block 0), a middle one (block 1) and a last one (last
    block, head) one after the other as the runtime does (the blocks between are skips:
    a few blocks, whatever the depth); none may use a module of another stage, and the
    last hands on a row of logits per token."""
    before, after = modules_around(model)
    middle = [("a middle stage", [blocks[1]])] if len(blocks) > 2 else []
    stages = [("the first stage", [*before, blocks[0]]), *middle,
              ("the last stage", [blocks[-1], *after])]  # fmt: skip
    chunks = [build_chunk(model, fqns) for _, fqns in stages]  # copies: outside fake tensors
    hidden: torch.Tensor | None = None
    for index, ((role, _), chunk) in enumerate(zip(stages, chunks, strict=True)):
        install_stage_forward(chunk, first=index == 0, last=index == len(stages) - 1)
        stand_ins = _watch_stand_ins(chunk)
        with _traced(fake=fake):
            if hidden is None:
                output = chunk(ids)
            else:
                output = chunk(hidden.detach().requires_grad_(), **{STAGE_IDS: ids})
        if not isinstance(output, torch.Tensor):
            return f"{role} hands on {type(output).__name__}, not a tensor"
        used = _uses(output, stand_ins)
        if used is not None:
            return (
                f"{role} uses the output of {used!r}, which sits on another stage (a "
                "connection that bypasses the blocks)"
            )
        hidden = output
    assert hidden is not None  # at least a first and a last stage ran
    return logits_problem(hidden.shape, ids.shape)


def _watch_stand_ins(chunk: nn.Module) -> list[_StandIn]:
    found = [v for m in chunk.modules() for v in vars(m).values() if isinstance(v, _StandIn)]
    for stand_in in found:
        stand_in.handed = []
    return found


def _uses(output: torch.Tensor, stand_ins: list[_StandIn]) -> str | None:
    """The stand-in whose zeros ``output``'s autograd graph reaches, if any."""
    owners = {id(t): s.fqn for s in stand_ins for t in s.handed or ()}
    pending, seen = [output.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in owners:
            return owners[id(variable)]
        pending.extend(next_node for next_node, _ in node.next_functions)
    return None
