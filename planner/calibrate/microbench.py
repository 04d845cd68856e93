"""Compute microbenchmarks on this process's device: GEMMs, memory-bound kernels,
attention, and an eager training step of a small zoo model (the framework time that a
bare kernel call does not pay).

Only plain ``torch`` (no ``torch.distributed``): the collectives live in
:mod:`strategies.microbench`. Each benchmark returns samples (work, seconds) that
:mod:`planner.calibrate.fit` turns into profile parameters. Times are the median of
``repeats`` runs after ``warmup`` runs, synchronised on CUDA.
"""

from __future__ import annotations

import functools
import logging
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from planner.calibrate.fit import Sample, StepSample
from planner.models import build, get_preset

__all__ = [
    "Sample",
    "time_call",
    "matmul_sweep",
    "memory_sweep",
    "last_level_cache_bytes",
    "attention_sweep",
    "StepSample",
    "training_step_sample",
    "PROBE_MODEL",
    "PROBE_MICRO_BATCH",
    "DEFAULT_MATMUL_SHAPES",
    "DEFAULT_MEMORY_ELEMENTS",
    "DEFAULT_ATTENTION_SHAPES",
]

log = logging.getLogger(__name__)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# (m, k, n) GEMMs from launch-bound to compute-bound; the CLI scales them on GPUs.
DEFAULT_MATMUL_SHAPES: tuple[tuple[int, int, int], ...] = (
    (16, 64, 64), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 256, 256),
    (512, 384, 384), (512, 384, 1536), (512, 512, 512), (1024, 512, 512), (1024, 1024, 1024),
)  # fmt: skip
# Elements per operand of the memory-bound sweep: tiny sizes measure the per-kernel
# overhead, the rest stream from DRAM (fp32: 96-384 MB per multiply, beyond CPU caches
# of up to ~100 MB; cache-resident sizes would report the cache's bandwidth instead).
DEFAULT_MEMORY_ELEMENTS: tuple[int, ...] = (1 << 8, 1 << 10, 1 << 12, 1 << 23, 1 << 24, 1 << 25)
# (batch * heads, seq, head_dim) for causal scaled-dot-product attention
DEFAULT_ATTENTION_SHAPES: tuple[tuple[int, int, int], ...] = (
    (8, 128, 64),
    (6, 256, 64),
    (12, 256, 32),
    (4, 512, 64),
    (8, 512, 64),
)


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


NARROW_MATMUL_SHAPE = (1024, 1024, 4)  # (m, k, n): a rank-4 product, as PowerSGD's


def narrow_matmul_sample(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int] = NARROW_MATMUL_SHAPE,
    *,
    repeats: int = 15,
) -> Sample:
    """Seconds per ``(m, k) @ (k, n)`` GEMM with a narrow output (``n`` columns); work is
    ``2 m k`` FLOPs per output column (:func:`planner.calibrate.profile.build_profile`
    reads the width it runs at from it)."""
    m, k, n = shape
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    seconds = time_call(functools.partial(torch.matmul, a, b), device, repeats=repeats)
    return Sample(f"mm {m}x{k}x{n}", 2.0 * m * k, seconds)


def memory_sweep(
    device: torch.device,
    dtype: torch.dtype,
    elements: Sequence[int] = DEFAULT_MEMORY_ELEMENTS,
    *,
    repeats: int = 15,
) -> list[Sample]:
    """Seconds per ``x * y`` into a preallocated output (two reads, one write); work is
    bytes moved.

    The smallest sizes measure the fixed per-kernel (launch, dispatch) overhead, the
    largest the streaming bandwidth; the output is allocated once so that page faults
    of fresh allocations are not timed. Warns when the largest size fits in twice the
    CPU's last-level cache (it would measure the cache, not memory).
    """
    samples = []
    for count in elements:
        x = torch.randn(count, device=device, dtype=dtype)
        y = torch.randn(count, device=device, dtype=dtype)
        out = torch.empty_like(x)
        seconds = time_call(functools.partial(torch.mul, x, y, out=out), device, repeats=repeats)
        samples.append(Sample(f"mul {count}", 3.0 * count * x.element_size(), seconds))
    cache = last_level_cache_bytes() if device.type == "cpu" else None
    largest = max((s.work for s in samples), default=0.0)
    if cache is not None and largest < 2 * cache:
        log.warning(
            "memory sweep: the largest multiply moves %.0f MB, less than twice the %.0f MB "
            "last-level cache; the fitted bandwidth is the cache's: pass larger sizes",
            largest / 1e6, cache / 1e6,
        )  # fmt: skip
    return samples


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """Size of CPU 0's largest cache in bytes from sysfs (None where sysfs does not say)."""
    sizes = []
    for entry in root.glob("index*/size"):
        text = entry.read_text().strip()
        match = re.fullmatch(r"(\d+)([KMG]?)", text)
        if match:
            sizes.append(int(match.group(1)) * _UNITS[match.group(2)])
    return max(sizes, default=None)


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


PROBE_MODEL = "tiny-llama"  # the zoo model whose eager training step is timed
PROBE_MICRO_BATCH = 4


def training_step_sample(
    device: torch.device,
    *,
    repeats: int = 15,
    data_parallel: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    ranks: int = 1,
) -> StepSample:
    """Time the training step of :data:`PROBE_MODEL` as ``plan run`` runs one on a rank:
    eager forward and backward (under ``data_parallel`` over ``ranks`` processes, the
    runtime's DDP, when given), then global-norm clipping and ``AdamW(foreach=False)``."""
    spec = get_preset(PROBE_MODEL)
    model: torch.nn.Module = build(spec, device=device, seed=0)
    if data_parallel is not None:
        model = data_parallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)
    tokens = torch.randint(0, spec.vocab_size, (PROBE_MICRO_BATCH, spec.seq_len + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    passes, updates = [], []
    for attempt in range(3 + repeats):
        start = time.perf_counter()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        _synchronize(device)
        middle = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(device)
        if attempt >= 3:  # after warm-up
            passes.append(middle - start)
            updates.append(time.perf_counter() - middle)
    return StepSample(
        PROBE_MODEL, PROBE_MICRO_BATCH, statistics.median(passes), statistics.median(updates),
        ranks,
    )  # fmt: skip
