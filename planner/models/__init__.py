"""The built-in model zoo and the ways to name a model.

A model is named by a preset (``llama3-70b``), a :class:`~planner.spec.ModelSpec` JSON
file, or an import path ``package.module:function``. :func:`resolve_model` turns any of
them into a :class:`ModelHandle`: the ``nn.Module`` (on the meta device by default, so
a 405B model costs no memory) and a way to make inputs for it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from planner.errors import SpecError, UnknownNameError, one_line
from planner.models.empty import parameters_on_meta
from planner.models.small import MLPMixer, MLPStack, SmallCNN
from planner.models.transformer import Block, Transformer
from planner.presets import ALIASES, PRESETS, get_preset
from planner.spec import ModelSpec, TracedInput, load_model_spec

__all__ = [
    "ALIASES",
    "PRESETS",
    "SMALL_MODELS",
    "ModelHandle",
    "Transformer",
    "Block",
    "build",
    "get_preset",
    "handle_for_module",
    "random_state_kept",
    "is_import_path",
    "list_models",
    "parameters_on_meta",
    "resolve_model",
    "fingerprint",
]


SMALL_MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLPStack,
    "cnn": SmallCNN,
    "mlp-mixer": MLPMixer,
}


@dataclass(frozen=True)
class ModelHandle:
    """A built model and how to feed it.

    ``make_inputs(batch_size, seq_len)`` returns the forward arguments on the model's
    device (random token ids or activations; meta tensors on meta). ``example_seq_len``
    is the sequence length of a user module's own example token ids (the default
    length to trace it at), ``None`` for specs, configs and non-token models.
    """

    name: str
    source: str
    module: nn.Module
    make_inputs: Callable[[int, int], tuple[torch.Tensor, ...]]
    spec: ModelSpec | None = None
    example_seq_len: int | None = None

    @property
    def device(self) -> torch.device:
        param = next(self.module.parameters(), None)
        return param.device if param is not None else torch.device("cpu")


def list_models() -> list[str]:
    """Every name :func:`resolve_model` accepts besides files and import paths."""
    return sorted([*PRESETS, *ALIASES, *SMALL_MODELS])


def build(
    spec: ModelSpec, *, device: str | torch.device = "meta", seed: int | None = None
) -> Transformer:
    """Construct the transformer for ``spec`` on ``device`` (seeded when ``seed`` is given)."""
    with torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        return Transformer(spec)


def _token_inputs(
    vocab_size: int, device: torch.device
) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def make(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        if device.type == "meta":
            return (torch.empty(batch_size, seq_len, dtype=torch.long, device=device),)
        return (torch.randint(0, vocab_size, (batch_size, seq_len), device=device),)

    return make


def _from_spec(spec: ModelSpec, source: str, device: torch.device, seed: int | None) -> ModelHandle:
    module = build(spec, device=device, seed=seed)
    return ModelHandle(spec.name, source, module, _token_inputs(spec.vocab_size, device), spec)


def _from_module(name: str, source: str, module: nn.Module, inputs: object) -> ModelHandle:
    if inputs is None:
        example = getattr(module, "example_inputs", None)
        if not callable(example):
            raise SpecError(_without_example_inputs(name, source))
        if _takes_seq_len(example):  # example_inputs(batch_size, seq_len): the user sizes them
            return ModelHandle(name, source, module, lambda b, s: tuple(example(b, s)))
        first = tuple(example(1))
        return ModelHandle(
            name, source, module, lambda b, s: _at_seq_len(source, tuple(example(b)), s),
            example_seq_len=_token_seq_len(first),
        )  # fmt: skip
    fixed = cast(tuple[torch.Tensor, ...], inputs if isinstance(inputs, tuple) else (inputs,))
    return ModelHandle(
        name, source, module, lambda b, s: _at_seq_len(source, fixed, s),
        example_seq_len=_token_seq_len(fixed),
    )  # fmt: skip


def _without_example_inputs(name: str, source: str) -> str:
    """Why a module without example inputs cannot be traced, and the fix for where it came
    from (``"module"``: built by the caller and handed over, else a ``module:function``)."""
    method = "an example_inputs(batch_size) method returning its forward's arguments"
    if source == "module":
        return (
            f"{name} has no example inputs to be traced with: give it {method} (token ids "
            "of shape (batch_size, seq_len) for a language model), or plan it from a "
            "module:function returning (module, example_inputs) and apply that plan"
        )
    return (
        f"model {source!r} returned a module without example inputs: return "
        f"(module, example_inputs) or give the module {method}"
    )


def _takes_seq_len(function: Callable[..., object]) -> bool:
    """Whether ``example_inputs`` takes a second (``seq_len``) argument."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _token_seq_len(tensors: tuple[torch.Tensor, ...]) -> int | None:
    """Dim 1 of the example's token ids (integer tensors of rank >= 2), if it has any."""
    lengths = {t.shape[1] for t in tensors if t.ndim >= 2 and not t.is_floating_point()}
    return lengths.pop() if len(lengths) == 1 else None


def _at_seq_len(
    source: str, tensors: tuple[torch.Tensor, ...], seq_len: int
) -> tuple[torch.Tensor, ...]:
    """``tensors`` with their token ids made ``seq_len`` long (zeros: only shapes matter).

    Raises when the length cannot be changed safely: a non-token model asked for a
    sequence length, or other tensors of the example's length (masks, features).
    """
    native = _token_seq_len(tensors)
    if native is None:
        if seq_len > 1:
            raise SpecError(
                f"seq_len = {seq_len}, but model {source!r} takes no token ids (its example "
                "inputs have no integer tensor of shape (batch, seq)); leave --seq out, or "
                "give the module example_inputs(batch_size, seq_len)"
            )
        return tensors
    if seq_len == native:
        return tensors
    others = [t for t in tensors if t.is_floating_point() and t.ndim >= 2 and t.shape[1] == native]
    if others:
        raise SpecError(
            f"seq_len = {seq_len}, but model {source!r}'s example inputs are {native} tokens "
            "long and hold other tensors of that length; give the module "
            "example_inputs(batch_size, seq_len) so it can be traced at any length"
        )
    return tuple(_resized(t, native, seq_len) for t in tensors)


def _resized(value: torch.Tensor, native: int, seq_len: int) -> torch.Tensor:
    if value.is_floating_point() or value.ndim < 2 or value.shape[1] != native:
        return value
    return value.new_zeros((value.shape[0], seq_len, *value.shape[2:]))


def is_hf_model(module: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel`` (it takes ``input_ids``)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def is_import_path(source: str) -> bool:
    """Whether a model source names a ``module:function`` (not a file)."""
    return ":" in source and not Path(source).exists()


@contextmanager
def random_state_kept() -> Iterator[None]:
    """Planning code running a caller's module (its example inputs, a trace, a layout
    rehearsal) leaves the process's random streams as it found them (CPU, and every GPU
    already in use): ranks seeded alike stay alike, and training draws what it would
    have drawn without the plan."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


def handle_for_module(
    module: nn.Module, *, name: str | None = None, inputs: Sequence[TracedInput] = ()
) -> ModelHandle:
    """A handle for a module built by the caller: zoo transformers and Hugging Face causal
    LMs take token ids, other modules their ``example_inputs(batch_size)`` method, else
    the ``inputs`` their plan traced (:func:`planner.tracing.traced_inputs`)."""
    if isinstance(module, Transformer):
        tokens = _token_inputs(module.spec.vocab_size, next(module.parameters()).device)
        return ModelHandle(name or module.spec.name, "module", module, tokens, module.spec)
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if is_hf_model(module) and isinstance(vocab, int):
        tokens = _token_inputs(vocab, next(module.parameters()).device)
        return ModelHandle(name or type(module).__name__, "module", module, tokens)
    example = None
    if inputs and not callable(getattr(module, "example_inputs", None)):
        device = next(module.parameters()).device
        example = tuple(
            torch.zeros(i.shape, dtype=getattr(torch, i.dtype), device=device) for i in inputs
        )
    return _from_module(name or type(module).__name__, "module", module, example)


def _import_function(path: str) -> Callable[[], object]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise SpecError(
            f"model path {path!r} is not module:function: give e.g. my_pkg.models:build"
        )
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` and uvicorn: the user's project
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(
            f"cannot import {module_name!r} from model path {path!r}: {exc} (searched: the "
            "current directory, PYTHONPATH and the installed packages)"
        ) from None
    except Exception as exc:  # the user's module failed while it was imported
        raise SpecError(
            f"importing {module_name!r} from model path {path!r} raised {one_line(exc)}; "
            f"fix the module (python -c 'import {module_name}' shows the traceback)"
        ) from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise SpecError(f"model path {path!r}: {module_name!r} has no callable {attr!r}")
    return function


def _call_model_function(path: str) -> object:
    """Call the user's ``module:function``; its failure is an ``error:`` line."""
    function = _import_function(path)
    try:
        return function()
    except Exception as exc:
        module_name, _, attr = path.partition(":")
        raise SpecError(
            f"model function {path!r} raised {one_line(exc)}; fix the function (call "
            f"{module_name}.{attr}() in Python to see the traceback)"
        ) from None


def _building_on(device: torch.device, keep_buffers: bool) -> AbstractContextManager[object]:
    """Where a model function builds: on ``device``; on the meta device with
    ``keep_buffers``, its parameters alone (:mod:`planner.models.empty`)."""
    return parameters_on_meta() if keep_buffers else torch.device(device)


def resolve_model(
    source: str | ModelSpec,
    *,
    seq_len: int | None = None,
    device: str | torch.device = "meta",
    seed: int | None = None,
    keep_buffers: bool = False,
) -> ModelHandle:
    """Build the model named by ``source``: preset, small model, spec file, ``mod:function``
    or a :class:`ModelSpec`.

    ``seq_len`` overrides the spec's sequence length (position table size for GPT).
    ``keep_buffers`` (on the meta device): a ``mod:function`` model's buffers keep what its
    ``__init__`` computes (rotary tables: what training needs, planning does not; each
    parameter is still allocated on the host for a moment as it is built).
    """
    device = torch.device(device)
    if keep_buffers and device.type != "meta":
        raise ValueError(f"keep_buffers builds on the meta device, not {device}")
    if isinstance(source, ModelSpec):
        spec = source if seq_len is None else source.with_seq_len(seq_len)
        return _from_spec(spec, spec.name, device, seed)
    if is_import_path(source):
        with _building_on(device, keep_buffers):
            if seed is not None:
                torch.manual_seed(seed)
            result = _call_model_function(source)
        module, inputs = result if isinstance(result, tuple) else (result, None)
        if not isinstance(module, nn.Module):
            raise SpecError(
                f"model path {source!r} returned {type(module).__name__}, not an nn.Module"
            )
        return _from_module(source, source, module, inputs)  # named by its path: "pkg:build"
    if source.endswith(".json"):
        spec = load_model_spec(source)
    elif source in SMALL_MODELS:
        with torch.device(device):
            if seed is not None:
                torch.manual_seed(seed)
            return _from_module(source, source, SMALL_MODELS[source](), None)
    elif ALIASES.get(source, source) in PRESETS:
        spec = get_preset(source)
    elif source.endswith(".py"):
        module_name = Path(source).stem
        raise SpecError(
            f"model {source!r} is a Python file: name the function in it that builds the "
            f"model as module:function (e.g. {module_name}:build), run from its directory "
            f"({Path(source).parent or '.'}) or with it on PYTHONPATH"
        )
    else:
        raise UnknownNameError("model", source, list_models())
    if seq_len is not None:
        spec = spec.with_seq_len(seq_len)
    return _from_spec(spec, source, device, seed)


def fingerprint(module: nn.Module) -> str:
    """A short hash of parameter names and shapes: equal for the same architecture.

    Computed before any parallelisation; shards and dtypes do not enter it.
    """
    digest = hashlib.sha256()
    for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        digest.update(f"{name}:{tuple(param.shape)};".encode())
    return digest.hexdigest()[:16]
