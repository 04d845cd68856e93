"""Hugging Face models from a ``config.json``: built with ``transformers`` on the meta device.

An optional extra (``pip install torch-parallel-planner[hf]``): ``transformers`` is
imported only when a config is resolved. No weights are downloaded; the model is
``AutoModelForCausalLM.from_config`` with SDPA attention, on meta, so any size costs
no memory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from planner.errors import SpecError, UnknownNameError
from planner.models import ModelHandle

__all__ = ["resolve_hf_config"]

logger = logging.getLogger(__name__)


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
            f"hf-config {str(path)!r}: no such file; give a config.json or a directory holding one"
        )
    return file


def _read_config(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"hf-config {str(file)!r} is not readable JSON: {exc}") from None
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
    except (ValueError, TypeError) as exc:
        raise SpecError(f"hf-config {str(file)!r}: invalid {model_type} config: {exc}") from None


def _build_model(transformers: ModuleType, config: Any, device: torch.device) -> torch.nn.Module:
    auto = transformers.AutoModelForCausalLM
    with torch.device(device):
        try:
            return auto.from_config(config, attn_implementation="sdpa")
        except ValueError as exc:
            if "sdpa" not in str(exc).lower():
                raise SpecError(
                    f"{config.model_type} config does not build a causal LM: {exc}"
                ) from None
            logger.warning(
                "%s has no SDPA attention; using its default attention", config.model_type
            )
            return auto.from_config(config)


def _token_inputs(device: torch.device) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def make(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(batch_size, seq_len, dtype=torch.long, device=device),)

    return make


def resolve_hf_config(path: str | Path, *, device: str | torch.device = "meta") -> ModelHandle:
    """Build the causal LM a Hugging Face ``config.json`` (or its directory) describes.

    Raises :class:`SpecError` for a missing or invalid file and when transformers is
    not installed, :class:`UnknownNameError` for an unknown ``model_type``.
    """
    file = _config_file(path)
    data = _read_config(file)
    transformers = _transformers()
    config = _build_config(transformers, data, file)
    device = torch.device(device)
    model = _build_model(transformers, config, device)
    name = str(data.get("_name_or_path") or file.parent.name or data["model_type"])
    return ModelHandle(name, str(path), model, _token_inputs(device))
