"""The built-in model zoo and the ways to name a model.

A model is named by a preset (``llama3-70b``), a :class:`~planner.spec.ModelSpec` JSON
file, or an import path ``package.module:function``. :func:`resolve_model` turns any of
them into a :class:`ModelHandle`: the ``nn.Module`` (on the meta device by default, so
a 405B model costs no memory) and a way to make inputs for it.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from planner.errors import SpecError, UnknownNameError
from planner.models.small import MLPMixer, MLPStack, SmallCNN
from planner.models.transformer import Block, Transformer
from planner.spec import Family, ModelSpec, load_document

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
    "list_models",
    "resolve_model",
    "fingerprint",
]


def _spec(
    name: str, family: Family, layers: int, hidden: int, heads: int, **kw: object
) -> ModelSpec:
    return ModelSpec.model_validate(
        {"name": name, "family": family, "num_layers": layers, "hidden_size": hidden,
         "num_heads": heads, **kw}
    )  # fmt: skip


# Vocabularies padded to a multiple of 128, as Megatron-LM does, so tensor parallelism
# splits the embedding and the output head evenly (GPT-2's 50257, BERT's 30522).
_GPT2 = {"vocab_size": 50304, "seq_len": 1024, "tied_embeddings": True}
_GPT3 = {"vocab_size": 51200, "seq_len": 2048}  # Megatron pads 50257 to 51200
_LLAMA2 = {"vocab_size": 32000, "seq_len": 4096}
_LLAMA3 = {"vocab_size": 128256, "seq_len": 8192, "rope_theta": 500000.0}
_BERT = {"vocab_size": 30592, "seq_len": 512, "tied_embeddings": True, "norm_eps": 1e-12}

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _spec("gpt2", Family.GPT, 12, 768, 12, **_GPT2),
        _spec("gpt2-medium", Family.GPT, 24, 1024, 16, **_GPT2),
        _spec("gpt2-large", Family.GPT, 36, 1280, 20, **_GPT2),
        _spec("gpt2-xl", Family.GPT, 48, 1600, 25, **_GPT2),
        _spec("gpt3-1.3b", Family.GPT, 24, 2048, 16, **_GPT3),
        _spec("gpt3-2.7b", Family.GPT, 32, 2560, 32, **_GPT3),
        _spec("gpt3-6.7b", Family.GPT, 32, 4096, 32, **_GPT3),
        _spec("gpt3-13b", Family.GPT, 40, 5120, 40, **_GPT3),
        _spec("gpt3-175b", Family.GPT, 96, 12288, 96, **_GPT3),
        _spec("llama2-7b", Family.LLAMA, 32, 4096, 32, ffn_hidden_size=11008, **_LLAMA2),
        _spec("llama2-13b", Family.LLAMA, 40, 5120, 40, ffn_hidden_size=13824, **_LLAMA2),
        _spec("llama2-70b", Family.LLAMA, 80, 8192, 64, num_kv_heads=8, ffn_hidden_size=28672,
              **_LLAMA2),
        _spec("llama3-8b", Family.LLAMA, 32, 4096, 32, num_kv_heads=8, ffn_hidden_size=14336,
              **_LLAMA3),
        _spec("llama3-70b", Family.LLAMA, 80, 8192, 64, num_kv_heads=8, ffn_hidden_size=28672,
              **_LLAMA3),
        _spec("llama3.1-405b", Family.LLAMA, 126, 16384, 128, num_kv_heads=8,
              ffn_hidden_size=53248, **_LLAMA3),
        _spec("bert-base", Family.ENCODER, 12, 768, 12, **_BERT),
        _spec("bert-large", Family.ENCODER, 24, 1024, 16, **_BERT),
        _spec("tiny-gpt", Family.GPT, 4, 64, 4, vocab_size=256, seq_len=32),
        _spec("tiny-llama", Family.LLAMA, 4, 64, 4, num_kv_heads=2, ffn_hidden_size=160,
              vocab_size=256, seq_len=32),
    )
}  # fmt: skip
ALIASES = {"llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3-405b": "llama3.1-405b"}

SMALL_MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLPStack,
    "cnn": SmallCNN,
    "mlp-mixer": MLPMixer,
}


@dataclass(frozen=True)
class ModelHandle:
    """A built model and how to feed it.

    ``make_inputs(batch_size, seq_len)`` returns the forward arguments on the model's
    device (random token ids or activations; meta tensors on meta).
    """

    name: str
    source: str
    module: nn.Module
    make_inputs: Callable[[int, int], tuple[torch.Tensor, ...]]
    spec: ModelSpec | None = None

    @property
    def device(self) -> torch.device:
        param = next(self.module.parameters(), None)
        return param.device if param is not None else torch.device("cpu")


def list_models() -> list[str]:
    """Every name :func:`resolve_model` accepts besides files and import paths."""
    return sorted([*PRESETS, *ALIASES, *SMALL_MODELS])


def get_preset(name: str) -> ModelSpec:
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise UnknownNameError("model preset", name, [*PRESETS, *ALIASES])
    return PRESETS[name]


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
            raise SpecError(
                f"model {source!r} returned a module without example inputs: return "
                "(module, example_inputs) or give the module an example_inputs(batch_size) method"
            )

        def make(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
            return tuple(example(batch_size))

        return ModelHandle(name, source, module, make)
    fixed = inputs if isinstance(inputs, tuple) else (inputs,)
    return ModelHandle(name, source, module, lambda batch_size, seq_len: fixed)


def is_hf_model(module: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel`` (it takes ``input_ids``)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def handle_for_module(module: nn.Module, *, name: str | None = None) -> ModelHandle:
    """A handle for a module built by the caller: zoo transformers and Hugging Face causal
    LMs take token ids, other modules need an ``example_inputs(batch_size)`` method."""
    if isinstance(module, Transformer):
        inputs = _token_inputs(module.spec.vocab_size, next(module.parameters()).device)
        return ModelHandle(name or module.spec.name, "module", module, inputs, module.spec)
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if is_hf_model(module) and isinstance(vocab, int):
        inputs = _token_inputs(vocab, next(module.parameters()).device)
        return ModelHandle(name or type(module).__name__, "module", module, inputs)
    return _from_module(name or type(module).__name__, "module", module, None)


def _import_function(path: str) -> Callable[[], object]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"cannot import {module_name!r} from model path {path!r}: {exc}") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise SpecError(f"model path {path!r}: {module_name!r} has no callable {attr!r}")
    return function


def resolve_model(
    source: str,
    *,
    seq_len: int | None = None,
    device: str | torch.device = "meta",
    seed: int | None = None,
) -> ModelHandle:
    """Build the model named by ``source``: preset, small model, spec file or ``mod:function``.

    ``seq_len`` overrides the spec's sequence length (position table size for GPT).
    """
    device = torch.device(device)
    if ":" in source and not Path(source).exists():
        with torch.device(device):
            if seed is not None:
                torch.manual_seed(seed)
            result = _import_function(source)()
        module, inputs = result if isinstance(result, tuple) else (result, None)
        if not isinstance(module, nn.Module):
            raise SpecError(
                f"model path {source!r} returned {type(module).__name__}, not an nn.Module"
            )
        return _from_module(source.rpartition(":")[2], source, module, inputs)
    if source.endswith(".json"):
        spec = load_document(ModelSpec, Path(source))
    elif source in SMALL_MODELS:
        with torch.device(device):
            if seed is not None:
                torch.manual_seed(seed)
            return _from_module(source, source, SMALL_MODELS[source](), None)
    elif ALIASES.get(source, source) in PRESETS:
        spec = get_preset(source)
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
