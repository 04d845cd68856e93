"""Gradient compression on the data-parallel reduction.

DDP communication hooks: ``fp16`` is the stock ``fp16_compress_hook``; ``bf16`` is
:func:`bfloat16_allreduce_hook` below, because the stock hook refuses to register off CUDA
(it checks the function's name), and it does the same thing: cast the bucket to bf16,
all-reduce the mean, cast back. (No ``from __future__ import annotations`` here: DDP
checks the hook's annotations at runtime.) ``powersgd`` is the stock ``powerSGD_hook`` with error
feedback (the batched variant fails on gloo), on gloo wrapped by
:func:`ordered_powersgd_hook` (several buckets otherwise race). Under FSDP the fp16/bf16 reduction is the
``MixedPrecisionPolicy`` reduce dtype (see :mod:`strategies.fsdp`).

``local_sgd`` is the stock ``post_localSGD_hook``: after ``warmup_steps`` steps DDP
all-reduces gradients only within groups of ``local_group`` consecutive data-parallel
ranks, and a ``PeriodicModelAverager`` averages the parameters over all of them every
``period`` optimizer steps. The averager must run after every optimizer step: a
training loop gets it from :func:`after_step_callback` (the
:class:`~strategies.runner.Trainer` does).

PowerSGD (its iteration and random state) and local SGD (its iteration and the
averager's step) carry state from step to step: :func:`carried_state` and
:func:`restore_carried_state` move it through checkpoints. Under local SGD the replicas
of different local groups differ (parameters between averaging steps, optimizer states
always), so checkpoints keep each rank's own as well (:mod:`strategies.state`).
"""

import io
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from planner.errors import SpecError
from planner.parallel_dims import ParallelDims
from planner.spec import Axis, CompressionKind, Plan
from planner.validate import check_powersgd_rank
from strategies.mesh import device_type

__all__ = [
    "apply",
    "after_step_callback",
    "bfloat16_allreduce_hook",
    "ordered_powersgd_hook",
    "POWERSGD_MIN_START_ITER",
    "PeriodicAveraging",
    "hook_states",
    "carried_state",
    "restore_carried_state",
]

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


def ordered_powersgd_hook(
    state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """``powerSGD_hook`` that finishes the bucket's reduction before returning (gloo).

    PowerSGD issues its P and Q all-reduces from future callbacks, on gloo's threads,
    while the autograd thread issues the next bucket's all-reduce: with several buckets
    the ranks can issue collectives in different orders, and gloo matches them by order
    (it aborted: "Received data size doesn't match expected size"). Waiting here keeps
    the order, at the price of not overlapping this bucket's reduction with backward.
    """
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    future.wait()
    return future


def apply(model: nn.Module, mesh: DeviceMesh | None, plan: Plan) -> nn.Module:
    """Register the plan's compression hook on a DDP model (FSDP handles it via dtypes)."""
    compression = plan.strategy.compression
    if compression.kind is CompressionKind.NONE:
        return model
    if not isinstance(model, DistributedDataParallel):
        if compression.kind in (CompressionKind.POWERSGD, CompressionKind.LOCAL_SGD):
            raise _refusal(plan, "needs DDP (zero = 0, pp = 1)")
        log.info("compression: %s in FSDP's gradient reduction", compression.kind.value)
        return model
    group = model.process_group
    if compression.kind is CompressionKind.FP16:
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif compression.kind is CompressionKind.BF16:
        model.register_comm_hook(group, bfloat16_allreduce_hook)
    elif compression.kind is CompressionKind.LOCAL_SGD:
        model.register_comm_hook(
            _local_sgd_state(group, mesh, plan), post_localSGD_hook.post_localSGD_hook
        )
    elif compression.kind is CompressionKind.POWERSGD:
        check_powersgd_rank(compression.rank or 1, _matrices(model.module))
        hook = powerSGD_hook.powerSGD_hook if device_type() == "cuda" else ordered_powersgd_hook
        model.register_comm_hook(_powersgd_state(group, plan), hook)
    else:
        raise _refusal(plan, "needs FSDP (zero >= 1), not DDP")
    log.info("compression: %s hook on DDP", compression.describe())
    if compression.kind is CompressionKind.LOCAL_SGD:
        log.info(
            "local_sgd: the training loop must call after_step_callback(model, plan)'s result "
            "after every optimizer step (strategies.runner.Trainer does), or replicas never "
            "average"
        )
    return model


def _refusal(plan: Plan, fallback: str) -> SpecError:
    """Why the plan's compression cannot run on the model :func:`apply` got: the mesh's
    reason (:meth:`planner.parallel_dims.ParallelDims.compression_blocker`, which
    validation raises first), else ``fallback``."""
    kind = plan.strategy.compression.kind
    blocker = ParallelDims.of(plan.strategy).compression_blocker(kind)
    if blocker is not None:
        return SpecError(f"strategy.{blocker}")
    return SpecError(f"strategy.compression.kind = {kind.value!r} {fallback}")


@dataclass(frozen=True)
class PeriodicAveraging:
    """Local SGD's parameter averaging, to call after every optimizer step."""

    averager: PeriodicModelAverager
    params: list[nn.Parameter]

    def __call__(self) -> None:
        self.averager.average_parameters(iter(self.params))


def after_step_callback(model: nn.Module, plan: Plan) -> PeriodicAveraging | None:
    """What a training loop must call after every optimizer step, or ``None``.

    For ``local_sgd`` it is the ``PeriodicModelAverager`` over ``model``'s data-parallel
    group (``warmup_steps`` and ``period`` from the plan); other options need nothing.
    """
    compression = plan.strategy.compression
    if compression.kind is not CompressionKind.LOCAL_SGD:
        return None
    if not isinstance(model, DistributedDataParallel):
        raise _refusal(plan, "needs DDP (zero = 0, pp = 1)")
    assert compression.period is not None
    averager = PeriodicModelAverager(
        period=compression.period,
        warmup_steps=compression.warmup_steps,
        process_group=model.process_group,
    )
    return PeriodicAveraging(averager, list(model.parameters()))


def hook_states(model: nn.Module) -> list[object]:
    """The states of the communication hooks registered on ``model`` (a DDP model)."""
    return [state for _hook, state in getattr(model, "_comm_hooks", [])]


def _carriers(model: nn.Module, averaging: PeriodicAveraging | None) -> list[object]:
    """What carries compression state from step to step: ``model``'s DDP hook states and
    the ``averaging``'s averager."""
    return hook_states(model) + ([averaging.averager] if averaging is not None else [])


def carried_state(model: nn.Module, averaging: PeriodicAveraging | None) -> bytes | None:
    """What ``model``'s compression (and local SGD's ``averaging``) carries from step to
    step, serialised (``None`` when it carries nothing), for a checkpoint: the iterations
    (PowerSGD's, local SGD's and its averager's) and PowerSGD's random state."""
    carried: dict[str, Any] = {}
    for carrier in _carriers(model, averaging):
        if isinstance(carrier, powerSGD_hook.PowerSGDState):
            carried["powersgd"] = {"iter": carrier.iter, "rng": carrier.rng.get_state()}
        elif isinstance(carrier, post_localSGD_hook.PostLocalSGDState):
            carried["local_sgd_iter"] = carrier.iter
        elif isinstance(carrier, PeriodicModelAverager):
            carried["averager_step"] = carrier.step
    if not carried:
        return None
    buffer = io.BytesIO()
    torch.save(carried, buffer)
    return buffer.getvalue()


def restore_carried_state(
    model: nn.Module, averaging: PeriodicAveraging | None, saved: bytes
) -> None:
    """Give ``model``'s compression (and ``averaging``) the state :func:`carried_state` saved.

    PowerSGD's error feedback and warm-start factors are not carried: they are flat
    per gradient bucket, and a new DDP lays its buckets out afresh (in another order
    until its first step rebuilds them), so they restart from zero, as at PowerSGD's
    first compressed step (logged); the run goes on close to, not equal to, the
    uninterrupted one.
    """
    carried = torch.load(io.BytesIO(saved), weights_only=False)
    for carrier in _carriers(model, averaging):
        if isinstance(carrier, powerSGD_hook.PowerSGDState) and "powersgd" in carried:
            carrier.iter = carried["powersgd"]["iter"]
            carrier.rng.set_state(carried["powersgd"]["rng"])
            if carrier.iter >= carrier.start_powerSGD_iter:
                log.warning(
                    "powersgd: resumed at iteration %d; its error feedback restarts from zero "
                    "(it is kept per DDP gradient bucket, which a new process lays out afresh)",
                    carrier.iter,
                )
        elif isinstance(carrier, post_localSGD_hook.PostLocalSGDState):
            carrier.iter = carried.get("local_sgd_iter", carrier.iter)
        elif isinstance(carrier, PeriodicModelAverager):
            carrier.step = carried.get("averager_step", carrier.step)


def _local_sgd_state(
    group: dist.ProcessGroup, mesh: DeviceMesh | None, plan: Plan
) -> post_localSGD_hook.PostLocalSGDState:
    """Global all-reduce for ``warmup_steps`` steps, then within this rank's local group.

    Every rank creates every local group (group creation is collective), for each
    data-parallel group of the mesh (one per tensor-parallel coordinate).
    """
    compression = plan.strategy.compression
    assert compression.local_group is not None
    size = compression.local_group
    local, _ = dist.new_subgroups_by_enumeration(
        [
            ranks[start : start + size]
            for ranks in _data_parallel_groups(group, mesh)
            for start in range(0, len(ranks), size)
        ]
    )
    return post_localSGD_hook.PostLocalSGDState(
        process_group=group, subgroup=local, start_localSGD_iter=compression.warmup_steps
    )


def _data_parallel_groups(group: dist.ProcessGroup, mesh: DeviceMesh | None) -> list[list[int]]:
    """Global ranks of every data-parallel group, each in data-parallel order: the rows of
    the mesh with the ``dp_replicate`` axis last (without a mesh: DDP's group alone)."""
    if mesh is None:
        return [dist.get_process_group_ranks(group)]
    ranks = mesh.mesh.movedim(list(mesh.mesh_dim_names or ()).index(Axis.DP_REPLICATE.value), -1)
    return ranks.reshape(-1, ranks.shape[-1]).tolist()


def _matrices(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Each gradient of 2+ dims as torch's PowerSGD views it: (dim 0, the rest)."""
    return {
        name: (param.shape[0], param[0].numel())
        for name, param in module.named_parameters()
        if param.requires_grad and param.dim() > 1
    }


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
