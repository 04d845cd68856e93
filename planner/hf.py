"""Hugging Face models from a ``config.json``: built with ``transformers`` on the meta device.

An optional extra (``pip install torch-parallel-planner[hf]``): ``transformers`` is
imported only when a config is resolved. No weights are downloaded; the model is
``AutoModelForCausalLM.from_config`` with SDPA attention, on meta, so any size costs
no memory.

Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3: transformers'
grouped experts modules, a ``gate`` router and, for DeepSeek, ``shared_experts``, which
the tracer marks by role) route tokens with
data-dependent shapes, which a meta trace cannot follow, and transformers' grouped
kernel carries no FLOP count. On meta each experts module therefore runs a static
dispatch at the *expected* load: the ``tokens * top_k`` routed (token, expert) pairs
are sorted by expert and cut into ``num_experts`` equal slots of
``ceil(tokens * top_k / num_experts)`` rows, and the expert products are two batched
matmuls. Total expert FLOPs equal the real ones (every routed pair costs one expert
MLP, whatever the balance; the ceiling adds at most one row per expert); per-expert
GEMM sizes are the balanced ones. The tracer switches the copy it traces
(:func:`expected_load_experts`), never the model built here: materialised for
training (``plan run``, deferred initialisation), it routes every token as transformers
does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import MethodType, ModuleType
from typing import Any

import torch
from torch import nn

from planner.errors import SpecError, UnknownNameError, one_line
from planner.io import read_json
from planner.models import ModelHandle
from planner.models.moe import expected_load_forward, is_experts

__all__ = ["resolve_hf_config", "expected_load_experts"]

logger = logging.getLogger(__name__)
# How transformers' refusal of SDPA attention names it (the message varies by model).
_SDPA_WORDS = ("sdpa", "scaled_dot_product_attention")
_ATTENTION_WORDS = (*_SDPA_WORDS, "attn_implementation", "attention implementation", "flex")
_FLASH_KERNELS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")  # as SDPA


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise SpecError(
            "Hugging Face configs need the transformers package: "
            "pip install torch-parallel-planner[hf]"
        ) from None
    return transformers


def _config_file(path: str | Path) -> Path:
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise SpecError(
            f"hf-config {str(path)!r}: no such file; give a config.json or a directory "
            f"holding one{_hub_hint(path)}"
        )
    return file


def _hub_hint(path: str | Path) -> str:
    """What a missing ``owner/name`` most likely is: a Hub id, never downloaded here."""
    if Path(path).is_absolute() or str(path).count("/") != 1:
        return ""
    return (
        " (a Hugging Face Hub id is not downloaded here: fetch its config with "
        f"'hf download {path} config.json --local-dir DIR' and give DIR)"
    )


def _read_config(file: Path) -> dict[str, Any]:
    # Hugging Face writes Infinity in some configs (e.g. clamp values): allowed here
    data = read_json(file, what="hf-config", finite=False)
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise SpecError(
            f"hf-config {str(file)!r} has no 'model_type' field; "
            'add one such as "model_type": "llama"'
        )
    return data


def _build_config(transformers: ModuleType, data: dict[str, Any], file: Path) -> Any:
    model_type = data["model_type"]
    known = transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    if model_type not in known:
        raise UnknownNameError("Hugging Face model_type", model_type, known)
    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # transformers' and huggingface_hub's validators alike
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise SpecError(
            f"hf-config {str(file)!r}: invalid {model_type} config: {one_line(cause)}"
        ) from None


def _build_model(
    transformers: ModuleType, config: Any, device: torch.device, file: Path, requested: str | None
) -> torch.nn.Module:
    """The causal LM as ``AutoModelForCausalLM.from_config(config)`` builds it: with the
    attention implementation the config asks for, else SDPA where the family has it and
    eager where it does not (transformers' own default). FlashAttention kernels, which
    need a GPU and their package, are traced as SDPA: the same fused attention, priced
    alike (``CostOptions.flash_impl``)."""
    auto = transformers.AutoModelForCausalLM
    traced = "sdpa" if requested is None or requested in _FLASH_KERNELS else requested
    with torch.device(device):
        try:
            return auto.from_config(config, attn_implementation=traced)
        except (ValueError, ImportError) as exc:
            if requested is not None and any(w in str(exc).lower() for w in _ATTENTION_WORDS):
                raise SpecError(
                    f"hf-config {str(file)!r}: attn_implementation = {requested!r}: "
                    f"{str(exc).splitlines()[0]}; remove attn_implementation (transformers "
                    "then builds SDPA attention where the family has it, else eager) or set "
                    "it to 'eager'"
                ) from None
            if not any(word in str(exc).lower() for word in _SDPA_WORDS):
                raise SpecError(
                    f"{config.model_type} config does not build a causal LM "
                    f"({str(exc).splitlines()[0]}): --hf-config plans "
                    "decoder-only token models; give an encoder-decoder or another model "
                    "as a module:function that builds it"
                ) from None
            logger.warning("%s has no SDPA attention; using eager attention", config.model_type)
            return auto.from_config(config, attn_implementation="eager")


def _token_inputs(device: torch.device) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def make(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(batch_size, seq_len, dtype=torch.long, device=device),)

    return make


def resolve_hf_config(
    path: str | Path, *, device: str | torch.device = "meta", seed: int | None = None
) -> ModelHandle:
    """Build the causal LM a Hugging Face ``config.json`` (or its directory) describes
    (on ``device``, its initialisation seeded with ``seed`` when given).

    Raises :class:`SpecError` for a missing or invalid file and when transformers is
    not installed, :class:`UnknownNameError` for an unknown ``model_type``.
    """
    file = _config_file(path)
    data = _read_config(file)
    transformers = _transformers()
    config = _build_config(transformers, data, file)
    device = torch.device(device)
    if seed is not None:
        torch.manual_seed(seed)
    requested = data.get("attn_implementation") or data.get("_attn_implementation")
    model = _build_model(transformers, config, device, file, requested)
    check_expert_layouts(model, model_type=data["model_type"])  # priceable, or refused now
    name = str(data.get("_name_or_path") or file.parent.name or data["model_type"])
    return ModelHandle(name, str(path), model, _token_inputs(device))


# Layout flags of transformers' experts modules (``use_experts_implementation``) that
# the expected-load dispatch supports, with the value it needs.
_EXPERT_LAYOUT = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "has_post_expert_norm": False,
    "is_concatenated": True,  # gate_up_proj holds gate and up rows in one tensor
}


def _check_expert_layout(module: nn.Module, fqn: str, model_type: str) -> None:
    wrong = {
        flag: getattr(module, flag, needed)
        for flag, needed in _EXPERT_LAYOUT.items()
        if getattr(module, flag, needed) != needed
    }
    if wrong:
        found = ", ".join(f"{flag}={value}" for flag, value in wrong.items())
        raise SpecError(
            f"{model_type}: experts module {fqn!r} ({type(module).__name__}) is laid out "
            f"{found}; the "
            "planner prices gated, bias-free experts with [experts, 2*intermediate, hidden] "
            "weights (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3): describe this model as a "
            "ModelSpec JSON file instead"
        )


def check_expert_layouts(model: nn.Module, *, model_type: str) -> list[nn.Module]:
    """``model``'s experts modules; raises :class:`SpecError` naming ``model_type`` for an
    experts layout the expected-load dispatch cannot price."""
    experts = []
    for fqn, module in model.named_modules():
        if is_experts(module):
            _check_expert_layout(module, fqn, model_type)
            experts.append(module)
    return experts


def expected_load_experts(model: nn.Module, *, model_type: str) -> int:
    """Make every experts module of ``model`` (the tracer's meta copy: never a model that
    trains) run the expected-load dispatch.

    Returns how many modules were switched (0 for a dense model). Raises
    :class:`SpecError` naming ``model_type`` for an experts layout it cannot price.
    """
    switched = 0
    for module in check_expert_layouts(model, model_type=model_type):
        module.forward = MethodType(expected_load_forward, module)
        switched += 1
    if switched:
        logger.info(
            "%s: %d experts modules priced at the expected load, tokens * top_k / num_experts "
            "rows per expert",
            model_type,
            switched,
        )
    return switched
