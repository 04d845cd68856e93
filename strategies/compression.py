"""Gradient compression on the data-parallel reduction.

DDP communication hooks: ``fp16`` is the stock ``fp16_compress_hook``; ``bf16`` is
:func:`bfloat16_allreduce_hook` below, because the stock hook refuses to register off CUDA
(it checks the function's name), and it does the same thing: cast the bucket to bf16,
all-reduce the mean, cast back. (No ``from __future__ import annotations`` here: DDP
checks the hook's annotations at runtime.) ``powersgd`` is the stock ``powerSGD_hook`` with error
feedback (the batched variant fails on gloo). Under FSDP the fp16/bf16 reduction is the
``MixedPrecisionPolicy`` reduce dtype (see :mod:`strategies.fsdp`).
"""

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from planner.errors import SpecError
from planner.spec import CompressionKind, Plan

__all__ = ["apply", "bfloat16_allreduce_hook", "POWERSGD_MIN_START_ITER"]

log = logging.getLogger(__name__)

# PowerSGDState rejects start_powerSGD_iter <= 1 with error feedback: DDP rebuilds its
# buckets after the first iteration, so compression can start at the second at earliest.
POWERSGD_MIN_START_ITER = 2


def bfloat16_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket's mean in bf16 and write it back in the bucket's dtype."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)


def apply(model: nn.Module, mesh: DeviceMesh | None, plan: Plan) -> nn.Module:
    """Register the plan's compression hook on a DDP model (FSDP handles it via dtypes)."""
    compression = plan.strategy.compression
    if compression.kind is CompressionKind.NONE:
        return model
    if not isinstance(model, DistributedDataParallel):
        if compression.kind is CompressionKind.POWERSGD:
            raise SpecError("strategy.compression.kind = 'powersgd' needs DDP (zero = 0, tp = 1)")
        log.info("compression: %s as the FSDP reduce dtype", compression.kind.value)
        return model
    group = model.process_group
    if compression.kind is CompressionKind.FP16:
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif compression.kind is CompressionKind.BF16:
        model.register_comm_hook(group, bfloat16_allreduce_hook)
    else:
        model.register_comm_hook(_powersgd_state(group, plan), powerSGD_hook.powerSGD_hook)
    log.info("compression: %s hook on DDP", compression.kind.value)
    return model


def _powersgd_state(group: dist.ProcessGroup, plan: Plan) -> powerSGD_hook.PowerSGDState:
    compression = plan.strategy.compression
    start = compression.warmup_steps
    if start < POWERSGD_MIN_START_ITER:
        log.warning(
            "powersgd warmup_steps=%d raised to %d: with error feedback PowerSGD starts at "
            "DDP's second iteration at the earliest",
            start,
            POWERSGD_MIN_START_ITER,
        )
        start = POWERSGD_MIN_START_ITER
    return powerSGD_hook.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=compression.rank or 1,
        start_powerSGD_iter=start,
        use_error_feedback=True,
    )
