"""Compute microbenchmarks on this process's device: GEMMs, memory-bound kernels, attention.

Only plain ``torch`` (no ``torch.distributed``): the collectives live in
:mod:`strategies.microbench`. Each benchmark returns samples (work, seconds) that
:mod:`planner.calibrate.fit` turns into profile parameters. Times are the median of
``repeats`` runs after ``warmup`` runs, synchronised on CUDA.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "Sample",
    "time_call",
    "matmul_sweep",
    "memory_sweep",
    "attention_sweep",
    "DEFAULT_MATMUL_SHAPES",
    "DEFAULT_MEMORY_ELEMENTS",
    "DEFAULT_ATTENTION_SHAPES",
]

# (m, k, n) GEMMs from launch-bound to compute-bound; the CLI scales them on GPUs.
DEFAULT_MATMUL_SHAPES: tuple[tuple[int, int, int], ...] = (
    (16, 64, 64), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 256, 256),
    (512, 384, 384), (512, 384, 1536), (512, 512, 512), (1024, 512, 512), (1024, 1024, 1024),
)  # fmt: skip
DEFAULT_MEMORY_ELEMENTS: tuple[int, ...] = (1 << 8, 1 << 12, 1 << 15, 1 << 17, 1 << 19, 1 << 21)
# (batch * heads, seq, head_dim) for causal scaled-dot-product attention
DEFAULT_ATTENTION_SHAPES: tuple[tuple[int, int, int], ...] = (
    (8, 128, 64),
    (6, 256, 64),
    (12, 256, 32),
    (4, 512, 64),
    (8, 512, 64),
)


@dataclass(frozen=True)
class Sample:
    """One timed problem: its work (FLOPs or bytes), median seconds and a label."""

    label: str
    work: float
    seconds: float


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 3, repeats: int = 15
) -> float:
    """Median seconds of one ``fn()`` call over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_sweep(
    device: torch.device,
    dtype: torch.dtype,
    shapes: Sequence[tuple[int, int, int]] = DEFAULT_MATMUL_SHAPES,
    *,
    repeats: int = 15,
) -> list[Sample]:
    """Seconds per ``(m, k) @ (k, n)`` GEMM; work is ``2 m k n`` FLOPs."""
    samples = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = time_call(functools.partial(torch.matmul, a, b), device, repeats=repeats)
        samples.append(Sample(f"mm {m}x{k}x{n}", 2.0 * m * k * n, seconds))
    return samples


def memory_sweep(
    device: torch.device,
    dtype: torch.dtype,
    elements: Sequence[int] = DEFAULT_MEMORY_ELEMENTS,
    *,
    repeats: int = 15,
) -> list[Sample]:
    """Seconds per out-of-place ``x * y`` (two reads, one write); work is bytes moved.

    The smallest sizes measure the fixed per-kernel (launch, dispatch) overhead.
    """
    samples = []
    for count in elements:
        x = torch.randn(count, device=device, dtype=dtype)
        y = torch.randn(count, device=device, dtype=dtype)
        seconds = time_call(functools.partial(torch.mul, x, y), device, repeats=repeats)
        samples.append(Sample(f"mul {count}", 3.0 * count * x.element_size(), seconds))
    return samples


def attention_sweep(
    device: torch.device,
    dtype: torch.dtype,
    shapes: Sequence[tuple[int, int, int]] = DEFAULT_ATTENTION_SHAPES,
    *,
    repeats: int = 7,
) -> list[Sample]:
    """Seconds per causal attention forward plus backward; work is the causal FLOPs.

    Work counts ``4 b s^2 d`` forward FLOPs halved for the causal mask, times 3.5 for
    forward plus a FlashAttention backward of 2.5x the forward, as the cost model does.
    """
    samples = []
    for bh, seq, dim in shapes:
        q, k, v = (
            torch.randn(1, bh, seq, dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )

        def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        seconds = time_call(step, device, repeats=repeats)
        work = 3.5 * 0.5 * 4.0 * bh * seq * seq * dim
        samples.append(Sample(f"sdpa {bh}x{seq}x{dim}", work, seconds))
    return samples
