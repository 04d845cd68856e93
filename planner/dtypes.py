"""Bytes per element by dtype name: the one table every layer reads (torch-free).

Names are the trace's (``OpNode.dtype``: ``fp32``, ``bf16``...) and torch's
(``float32``, ``bfloat16``...). Mixed-precision training keeps fp32 master weights,
gradients and optimizer moments, and half-precision (bf16/fp16) weights and
activations.
"""

from __future__ import annotations

__all__ = ["ELEMENT_BYTES", "FP32_BYTES", "HALF_BYTES", "RUNTIME_DTYPES"]

# What the tracer and the runtime run in; fp8 is priced (fp8 GEMMs), not run here.
RUNTIME_DTYPES = ("fp32", "bf16", "fp16")

FP32_BYTES = 4
HALF_BYTES = 2

ELEMENT_BYTES: dict[str, int] = {
    "fp64": 8, "fp32": FP32_BYTES, "tf32": FP32_BYTES, "fp16": HALF_BYTES,
    "bf16": HALF_BYTES, "fp8": 1,
    "float64": 8, "float32": FP32_BYTES, "float16": HALF_BYTES, "bfloat16": HALF_BYTES,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
}  # fmt: skip
