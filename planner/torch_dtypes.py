"""Training dtypes as torch dtypes: the one map from :class:`~planner.spec.DType` to
``torch.dtype`` and its inverse, torch dtype to the trace's names (``OpNode.dtype``).

The runtime (:mod:`strategies`), the tracer and calibration read these; none restates
them. ``fp8`` has no entry in :data:`TORCH_DTYPES`: fp8 training keeps bf16 weights
and activations and the runtime does not run it. Imports torch, never
``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from planner.spec import DType

__all__ = ["TORCH_DTYPES", "DTYPE_NAMES", "dtype_name", "mixed_precision_dtype"]

TORCH_DTYPES: Mapping[DType, torch.dtype] = MappingProxyType(
    {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}
)
"""The torch dtype of each training dtype the runtime runs (not fp8)."""

DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType(
    {
        **{torch_dtype: dtype.value for dtype, torch_dtype in TORCH_DTYPES.items()},
        torch.float64: "fp64",
        torch.float8_e4m3fn: DType.FP8.value,
    }
)
"""The trace's name of a torch dtype: the inverse of :data:`TORCH_DTYPES`, plus fp64
and fp8 (``float8_e4m3fn``)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The trace's name of ``dtype`` (``fp32``, ``bf16``...), else torch's (``int64``)."""
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def mixed_precision_dtype(dtype: DType) -> torch.dtype | None:
    """The half-precision dtype that ``dtype`` training computes in (autocast, FSDP2's
    parameter dtype): bf16's and fp16's, ``None`` for fp32 (and for fp8, which the
    runtime does not run)."""
    if dtype is DType.FP32:
        return None
    return TORCH_DTYPES.get(dtype)
