"""Deferred initialisation: a model built on the meta device gets values only for this
rank's shards, after the plan cut and sharded it (as torchtitan does).

:func:`apply` runs between FSDP and DDP in :mod:`strategies.apply` (DDP broadcasts
values, so it needs them): ``to_empty`` allocates this rank's local shards on the
device, then every module that holds tensors of its own is initialised on a full-size
CPU twin (its own parameters and buffers, not its children's) under a seed drawn from
``seed`` and the module's name, and this rank's slice of each tensor is copied in. So
the same seed gives the same full weights under any plan and world size (each rank
draws the full tensors of the modules it holds: time grows with its pipeline stage,
memory with one module).

The default initialiser does what building the model normally does: the module's
``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, norms), then the root's
``_init_weights(module)`` (Hugging Face models, nanoGPT-style modules), which also
recomputes Hugging Face's rotary buffers. A tensor neither sets fails with its name and
the fix (``init=``). Buffers built with values beside meta parameters
(:func:`planner.models.parameters_on_meta`, Accelerate's ``init_empty_weights()``: a
rotary table computed in ``__init__``) keep those values.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from planner.errors import SpecError
from planner.models import random_state_kept
from strategies.state import local_part

__all__ = ["Init", "is_deferred", "check_deferrable", "check_same_weights", "apply", "module_seed"]

Init = Callable[[nn.Module], None]  # sets a module's own parameters and buffers in place


def is_deferred(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (its parameters hold no values)."""
    return any(p.is_meta for p in model.parameters())


def check_deferrable(model: nn.Module) -> None:
    """Raise unless every parameter is on the meta device or none is, and no buffer is
    on meta beside real parameters (buffers with values may sit beside meta parameters:
    they are kept, as :func:`planner.models.parameters_on_meta` builds them)."""
    params = list(model.named_parameters())
    on_meta = [name for name, t in params if t.is_meta]
    if on_meta and len(on_meta) != len(params):
        real = next(name for name, t in params if not t.is_meta)
        raise SpecError(
            f"parameter {on_meta[0]!r} is on the meta device but {real!r} is not: build the "
            "whole model under torch.device('meta') (or planner.parameters_on_meta()) for "
            "deferred initialisation, or on a real device"
        )
    buffer = next((name for name, t in model.named_buffers() if t.is_meta), None)
    if buffer is not None and params and not on_meta:
        raise SpecError(
            f"buffer {buffer!r} is on the meta device but the parameters are not: build the "
            "whole model on a real device, or its parameters on meta (torch.device('meta') "
            "or planner.parameters_on_meta()) for deferred initialisation"
        )


def check_same_weights(model: nn.Module, loaded: Collection[str] = ()) -> None:
    """Raise unless every rank built ``model``'s real tensors with the same values (a
    model built on meta: the buffers its ``__init__`` computed).

    Each rank's whole copy is what the plan cuts: a tensor replicated over ranks (a
    module kept whole under tensor parallelism, a norm's weight) that started apart would
    train apart without an error. Tensors named in ``loaded`` (a checkpoint sets them)
    are not compared. One checksum per tensor is gathered from every rank.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    named = [
        (name, t)
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if name not in loaded and not t.is_meta
    ]
    digests = [_checksum(t) for _, t in named]
    gathered: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digests)
    for index, (name, _) in enumerate(named):
        ranks = [
            r for r, theirs in enumerate(gathered) if theirs and theirs[index] != digests[index]
        ]
        if ranks:
            raise SpecError(
                f"the ranks built different weights: {name!r} on rank {ranks[0]} differs from "
                f"rank {dist.get_rank()}'s; seed every rank alike before building the model "
                "(torch.manual_seed(seed), the same seed on every rank), or build it under "
                "torch.device('meta') and let planner.parallelize(model, plan, seed=...) "
                "initialise it"
            )


def _checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes."""
    data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return zlib.crc32(data.numpy().data)


def module_seed(seed: int, name: str) -> int:
    """The seed of the module named ``name`` (its FQN in the whole model)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def apply(
    model: nn.Module,
    device: torch.device,
    *,
    seed: int,
    init: Init | None,
    loaded: Collection[str] = (),
) -> nn.Module:
    """Allocate this rank's shards of meta ``model`` on ``device`` and initialise them,
    but for the tensors named in ``loaded`` (FQNs whose values a checkpoint gives)."""
    tied = _tied_places(model)
    built = _built_buffers(model)
    model.to_empty(device=device)
    _retie(tied)
    for module, key, value in built.values():
        buffer = module._buffers[key]
        assert buffer is not None  # to_empty allocated it
        buffer.copy_(value)
    kept = {*loaded, *built}
    initialise = init if init is not None else _default_init(model)
    done: set[int] = set()  # a tied tensor is initialised once, by its first holder
    for name, module in _holders(model):
        _initialise_module(module, name, initialise, seed, kept, done)
    return model


Place = tuple[dict[str, Any], str]  # a module's parameters or buffers, and a name there


def _tied_places(model: nn.Module) -> list[list[Place]]:
    """Each tensor held by more than one module (tied embeddings, a shared rotary table),
    as its places."""
    places: dict[int, list[Place]] = {}
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for key, tensor in tensors.items():
                if tensor is not None:
                    places.setdefault(id(tensor), []).append((tensors, key))
    return [group for group in places.values() if len(group) > 1]


def _retie(tied: list[list[Place]]) -> None:
    """Point every place of a tied tensor at its first place's tensor again (``to_empty``
    gives each module a tensor of its own)."""
    for (first, first_key), *others in tied:
        for tensors, key in others:
            tensors[key] = first[first_key]


def _built_buffers(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """The buffers built with values beside meta parameters, by FQN: each with its module,
    its name there and its value (``to_empty`` drops values)."""
    return {
        f"{name}.{key}" if name else key: (module, key, buffer)
        for name, module in model.named_modules()
        for key, buffer in module._buffers.items()
        if buffer is not None and not buffer.is_meta
    }


def _holders(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules with parameters or buffers of their own, with their names."""
    for name, module in model.named_modules():
        if module._parameters or module._buffers:
            yield name, module


def _default_init(root: nn.Module) -> Init:
    whole_model = getattr(root, "_init_weights", None)

    def initialise(module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if callable(whole_model):
            whole_model(module)

    return initialise


def _initialise_module(
    module: nn.Module,
    name: str,
    initialise: Init,
    seed: int,
    loaded: Collection[str],
    done: set[int],
) -> None:
    targets = [
        (key, where, target)
        for key, target in _own_tensors(module)
        if (where := f"{name}.{key}" if name else key) not in loaded and id(target) not in done
    ]
    done.update(id(target) for _, _, target in targets)
    if not targets:
        return
    twin = _full_twin(module)
    blank = {key: (tensor, tensor._version) for key, tensor in _own_tensors(twin)}
    with random_state_kept(), torch.no_grad():
        torch.manual_seed(module_seed(seed, name))
        initialise(twin)
    for key, where, target in targets:
        value = _tensor_of(twin, key)
        if _left_blank(value, *blank[key]):
            raise SpecError(_not_initialised(module, where, key in module._buffers))
        local, index = local_part(target)
        local.copy_(value[index])


def _left_blank(value: torch.Tensor, blank: torch.Tensor, version: int) -> bool:
    """Whether the initialiser left a twin's tensor without values: floating ones still
    hold NaN; others (an integer index, a boolean mask) are the same tensor, never
    written in place (its version counter unchanged)."""
    if value.is_floating_point():
        return bool(torch.isnan(value).any())
    return value is blank and value._version == version


def _not_initialised(module: nn.Module, where: str, buffer: bool) -> str:
    """Why ``where`` holds no values, and the fixes."""
    kind = type(module).__name__
    unset = f"{kind} has no reset_parameters() and the model's _init_weights does not set it"
    init = (
        "planner.parallelize(..., init=fn) where fn(module) sets a module's own parameters "
        "and buffers in place"
    )
    if buffer:
        return (
            f"{where!r} ({kind}) is a buffer built on the meta device, so it holds no values: "
            f"{unset}; build the model under planner.parameters_on_meta() (parameters on "
            "meta, buffers as __init__ computes them; plan run and plan measure build so), "
            f"give {kind} a reset_parameters() that computes it, or give {init}"
        )
    return (
        f"{where!r} ({kind}) was not initialised: {unset}; give {kind} a reset_parameters(), "
        f"or give {init}, or build the model on the CPU as its __init__ sets it (plan run "
        "and plan measure: --build-on cpu)"
    )


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = list(module._parameters.items()) + list(module._buffers.items())
    return [(key, tensor) for key, tensor in named if tensor is not None]


def _full_twin(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` without children whose own tensors are full-size CPU
    tensors (floating ones NaN, so an initialiser that skips one is caught:
    :func:`_left_blank`)."""
    twin = _shallow_copy(module)
    twin._modules = {}
    full: dict[str, torch.Tensor] = {}
    for key, tensor in _own_tensors(module):
        value = torch.empty(tensor.shape, dtype=tensor.dtype)
        if value.is_floating_point():
            value.fill_(float("nan"))
        full[key] = value
    twin._parameters = {
        key: nn.Parameter(full[key], requires_grad=p.requires_grad) if p is not None else None
        for key, p in module._parameters.items()
    }
    twin._buffers = {key: full.get(key) for key in module._buffers}
    return twin


def _shallow_copy(module: nn.Module) -> nn.Module:
    """``copy.copy(module)``, as its own class when FSDP2 wrapped it (an FSDP class cannot
    be copied: its ``__new__`` calls ``__init__`` without arguments; a module with
    parameters of its own under ``fully_shard``, such as an experts module, needs this)."""
    if not isinstance(module, FSDPModule):
        return copy.copy(module)
    kind = type(module)
    original = kind.__mro__[kind._orig_cls_mro_index]
    twin: nn.Module = object.__new__(original)
    twin.__dict__.update(module.__dict__)
    return twin


def _tensor_of(twin: nn.Module, key: str) -> torch.Tensor:
    """The twin's tensor ``key`` after initialisation (an initialiser may rebind it)."""
    param = twin._parameters.get(key)
    if param is not None:
        return param.data
    buffer = twin._buffers[key]
    assert buffer is not None  # _own_tensors lists only tensors that are set
    return buffer
