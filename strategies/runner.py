"""The training loop behind ``plan run``: synthetic tokens, loss and step time per step.

:class:`Trainer` wraps what :func:`strategies.apply.parallelize` returned (a model or a
:class:`~strategies.pipeline.PipelineRunner`) with the optimizer, gradient
accumulation over micro-batches and gradient clipping. Every rank draws the same
global batch from a seeded generator and keeps its data-parallel slice (and, under
context parallel, its sequence shard), so a run on N ranks sees the same data as a run
on one.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel._data_parallel_utils import _unflatten_tensor
from torch.nn.parallel import DistributedDataParallel

from planner.errors import SpecError
from planner.models import build
from planner.spec import Axis, Optimizer, Plan
from planner.torch_dtypes import mixed_precision_dtype
from planner.validate import validate_plan_for_world
from strategies.apply import loss_context, parallelize, token_cross_entropy
from strategies.compression import after_step_callback
from strategies.context_parallel import sequence_slice
from strategies.mesh import coordinates, device_type, dp_rank_of
from strategies.pipeline import PipelineRunner, full_value

__all__ = [
    "Trainer",
    "StepRecord",
    "synthetic_batch",
    "local_slice",
    "run_plan",
    "process_group_from_env",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step: global mean loss (before the update) and wall time in seconds."""

    step: int
    loss: float
    step_time_s: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def synthetic_batch(
    vocab_size: int, batch_size: int, seq_len: int, *, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable token ids (batch, seq) and next-token targets, equal on every rank.

    Each sequence counts from a random start with a random stride (mod ``vocab_size``),
    so the next token follows from the previous two and the loss can fall.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 8, (batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def local_slice(plan: Plan, rank: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's data-parallel share (dim 0) and context-parallel shard (dim 1) of each tensor."""
    dp, cp = plan.strategy.dp, plan.strategy.cp
    index = dp_rank_of(plan, rank)
    shards = tuple(t.chunk(dp)[index] for t in tensors)
    if cp == 1:
        return shards
    cp_index = coordinates(plan, rank).get(Axis.CP, 0)
    return tuple(sequence_slice(t, cp_index, cp) for t in shards)


class Trainer:
    """One optimizer step per :meth:`step`: forward/backward, clip, update; returns the loss.

    ``parallel`` is the result of :func:`~strategies.apply.parallelize`. The loss
    returned is the mean over the global batch (averaged over all ranks). Gradients are
    clipped to a global L2 norm of ``max_grad_norm`` when ``training.grad_clip`` is set.
    After each optimizer step it runs the compression's after-step callback (local SGD's
    periodic parameter averaging), if the plan has one.
    """

    def __init__(
        self,
        parallel: nn.Module | PipelineRunner,
        plan: Plan,
        *,
        lr: float = 1e-3,
        max_grad_norm: float = 1.0,
    ) -> None:
        self.parallel = parallel
        self.plan = plan
        self.device = torch.device(device_type())
        self.max_grad_norm = max_grad_norm if plan.training.grad_clip else None
        self.optimizer = _optimizer(plan.training.optimizer, list(parallel.parameters()), lr)
        self.after_step = (
            None if isinstance(parallel, PipelineRunner) else after_step_callback(parallel, plan)
        )

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on this rank's share of the global batch."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            if isinstance(self.parallel, PipelineRunner):
                loss = self.parallel.step(inputs, targets)
            else:
                loss = self._accumulate(self.parallel, inputs, targets)
        if self.max_grad_norm is not None:
            self._clip(self.max_grad_norm)
        self.optimizer.step()
        if self.after_step is not None:
            self.after_step()
        return _global_mean(loss)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        dtype = mixed_precision_dtype(self.plan.training.dtype)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _accumulate(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """Gradient accumulation over the plan's micro-batches; the mean micro-batch loss."""
        count = self.plan.strategy.num_microbatches
        losses = []
        for index, (x, y) in enumerate(zip(inputs.chunk(count), targets.chunk(count), strict=True)):
            with _gradient_sync(model, sync=index == count - 1), loss_context(self.plan):
                loss = token_cross_entropy(model(x), y) / count
                loss.backward()
            losses.append(full_value(loss).float())
        return torch.stack(losses).sum()

    def _clip(self, max_norm: float) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grads = [_sharded_grad(p) for p in params if p.grad is not None]
        squares = _squared_norm(grads, self.device)
        if isinstance(self.parallel, PipelineRunner):
            dist.all_reduce(squares, group=self.parallel.group)
        scale = max_norm / (math.sqrt(float(squares)) + 1e-6)
        if scale < 1.0:
            for grad in grads:
                grad.mul_(scale)


def _sharded_grad(param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient, as the DTensor it is a shard of when DDP runs over tensor-parallel
    shards (``_pre_dp_module_transform`` keeps the layout in ``_st_info``); scaling it in
    place scales the local gradient."""
    assert param.grad is not None
    info = getattr(param, "_st_info", None)
    return param.grad if info is None else _unflatten_tensor(param.grad, info)


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all gradients, whole (not per shard): one all-reduce per sharding.

    Partial-sum DTensor gradients (sequence-parallel norms) are reduced first. Local
    shards are then summed per set of sharded mesh axes, and each sum is all-reduced over
    those axes only; replicated gradients need no communication.
    """
    sums: dict[tuple[dist.ProcessGroup, ...], torch.Tensor] = {}
    for grad in grads:
        groups: tuple[dist.ProcessGroup, ...] = ()
        local = grad
        if isinstance(grad, DTensor):
            whole = _without_partial(grad)
            mesh = whole.device_mesh
            groups = tuple(
                mesh.get_group(dim)
                for dim, placement in enumerate(whole.placements)
                if not placement.is_replicate()
            )
            local = whole.to_local()
        squares = local.detach().float().pow(2).sum()
        sums[groups] = sums[groups] + squares if groups in sums else squares
    total = torch.zeros((), device=device)
    for groups, value in sums.items():
        for group in groups:
            dist.all_reduce(value, group=group)
        total += value
    return total


def _without_partial(grad: DTensor) -> DTensor:
    """``grad`` with partial-sum placements reduced to replicated ones."""
    if not any(placement.is_partial() for placement in grad.placements):
        return grad
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    return grad.redistribute(placements=placements)


def _optimizer(kind: Optimizer, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if kind is Optimizer.SGD:
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    if kind is Optimizer.ADAM:
        return torch.optim.Adam(params, lr=lr, foreach=False)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False)


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Reduce gradients only on the last micro-batch (DDP ``no_sync``, FSDP2 flag)."""
    if isinstance(model, DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    yield


def _global_mean(loss: torch.Tensor) -> float:
    if not dist.is_initialized():
        return float(loss)
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def run_plan(plan: Plan, *, steps: int, seed: int, lr: float = 1e-3) -> Iterator[StepRecord]:
    """Build the plan's model, apply the plan and train ``steps`` steps on synthetic tokens."""
    if plan.model is None:
        raise SpecError(
            f"plan for {plan.model_name!r} has no model spec: 'plan run' trains zoo or "
            "spec-file transformers; call planner.parallelize() for other models"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    validate_plan_for_world(plan, world)  # before building a model that may not fit here
    seq_len = plan.training.seq_len or plan.model.seq_len
    model = build(plan.model, device="cpu", seed=seed)
    parallel = parallelize(model, plan)
    trainer = Trainer(parallel, plan, lr=lr)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(steps):
        inputs, targets = synthetic_batch(
            plan.model.vocab_size, plan.training.global_batch_size, seq_len, seed=seed, step=step
        )
        inputs, targets = local_slice(plan, rank, inputs, targets)
        start = time.perf_counter()
        loss = trainer.step(inputs, targets)
        yield StepRecord(step=step, loss=loss, step_time_s=time.perf_counter() - start)


@contextlib.contextmanager
def process_group_from_env() -> Iterator[int]:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1); yield this rank.

    NCCL when CUDA is available, gloo otherwise. A single process (no ``WORLD_SIZE``
    or 1) runs without a process group and is rank 0.
    """
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        yield dist.get_rank() if dist.is_initialized() else 0
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    log.info("process group: %s, world size %d", backend, dist.get_world_size())
    try:
        yield dist.get_rank()
        dist.barrier()  # no rank tears gloo down while another still has work in flight
    finally:
        dist.destroy_process_group()
