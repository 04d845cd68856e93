"""Collective microbenchmarks over the current process group (the ``plan calibrate`` part
that needs ``torch.distributed``).

Every rank must call :func:`collective_sweep` with the same arguments: each collective
runs ``warmup`` times, then at least ``repeats`` timed times between barriers, and more
while the timed runs add up to less than ``MIN_TIMED_S`` (up to ``MAX_REPEATS``): small
collectives take microseconds, and a median over a handful of them is whatever the OS
scheduler did. The time of one repeat is the slowest rank's (a max all-reduce of the
local times), so every rank sees the same times and repeats as often. A sample is the
lower quartile over repeats: other processes only ever slow a collective down, and on a
shared or virtual machine they do so in bursts of milliseconds (a thread woken on an idle
core waits for its tick) that leave a median of microsecond calls at either mode. Sizes
are the whole array in bytes (nccl-tests' ``S``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from planner.cost.communication import Collective
from planner.measured import MeasuredProfile
from planner.spec import Plan
from strategies.data_parallel import ddp
from strategies.measure import measure_plan

__all__ = [
    "CollectiveSample", "DEFAULT_COLLECTIVE_BYTES", "collective_sweep", "data_parallel",
    "probe_runs",
]  # fmt: skip

log = logging.getLogger(__name__)

# seconds of timed runs a sample gathers at least, and the most repeats it takes for them
MIN_TIMED_S = 0.05
MAX_REPEATS = 101
DEFAULT_COLLECTIVE_BYTES: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
SWEPT = (
    Collective.ALL_REDUCE,
    Collective.ALL_GATHER,
    Collective.REDUCE_SCATTER,
    Collective.ALL_TO_ALL,
    Collective.SEND_RECV,
)
# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CollectiveSample:
    """One collective over ``ranks`` ranks of an array of ``size_bytes``: seconds (the
    lower quartile of its timed runs)."""

    kind: Collective
    ranks: int
    size_bytes: int
    seconds: float


def _operation(kind: Collective, size_bytes: int, device: torch.device) -> Callable[[], None]:
    world, rank = dist.get_world_size(), dist.get_rank()
    elements = max(world, size_bytes // 4 // world * world)
    whole = torch.ones(elements, device=device)
    shard = torch.ones(elements // world, device=device)
    if kind is Collective.ALL_REDUCE:
        return lambda: dist.all_reduce(whole)
    if kind is Collective.ALL_GATHER:
        return lambda: _ALL_GATHER(whole, shard)
    if kind is Collective.REDUCE_SCATTER:
        return lambda: _REDUCE_SCATTER(shard, whole)
    if kind is Collective.ALL_TO_ALL:
        out = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(out, whole)
    peer = rank ^ 1  # pairs (0,1), (2,3)...: one message each way, as a pipeline boundary

    def exchange() -> None:
        if peer >= world:
            return
        ops = [dist.P2POp(dist.isend, whole, peer), dist.P2POp(dist.irecv, shard_full, peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    shard_full = torch.empty_like(whole)
    return exchange


def _timed(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < MIN_TIMED_S and len(times) < MAX_REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.quantiles(times, n=4, method="inclusive")[0]


def collective_sweep(
    device: torch.device,
    sizes_bytes: Sequence[int] = DEFAULT_COLLECTIVE_BYTES,
    kinds: Sequence[Collective] = SWEPT,
    *,
    warmup: int = 2,
    repeats: int = 9,
) -> list[CollectiveSample]:
    """Seconds of each collective in ``kinds`` at each size over the whole world
    (``repeats``: the fewest timed runs of each; small ones run more, see the module)."""
    world = dist.get_world_size()
    samples = []
    for kind in kinds:
        for size in sizes_bytes:
            fn = _operation(kind, size, device)
            seconds = _timed(fn, device, warmup, repeats)
            # send/recv moves the whole array once each way at the same time: one "step"
            samples.append(CollectiveSample(kind, 2 if kind is Collective.SEND_RECV else world,
                                            size, seconds))  # fmt: skip
            log.info("%s %d B over %d ranks: %.1f us", kind.value, size, world, seconds * 1e6)
    return samples


def data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as this runtime runs data parallelism over the process group (DDP): what
    the calibration's training-step probe times."""
    return ddp(model)


def probe_runs(plans: Sequence[Plan], *, steps: int, warmup: int) -> list[MeasuredProfile]:
    """Each of ``plans`` measured as ``plan measure`` measures it (every rank must call
    this with the same plans; every rank gets the same profiles)."""
    return [
        measure_plan(plan, steps=steps, warmup=warmup, command="plan calibrate (probe run)")
        for plan in plans
    ]
