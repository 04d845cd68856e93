"""Pipeline parallelism with ``torch.distributed.pipelining``: manual stages from FQN lists.

Each pipeline chunk is a copy of the model cut by :func:`planner.staging.build_chunk`
(parameter names stay those of the whole model; other chunks' blocks become skips,
their other modules parameter-free stand-ins). Once the parallel dimensions wrapped a
chunk, :func:`install_stages` makes the model's own forward run that one stage: later
stages take the hidden state and, as the keyword ``stage_ids``, the micro-batch's token
ids. Rank ``r`` of the ``pp`` axis holds chunks ``r, r + pp, ...`` (loop order).
:class:`PipelineRunner` hides the schedule: ``step(inputs, targets)`` runs forward and
backward over all micro-batches and returns the mean loss on every pipeline rank.

Schedules: ``gpipe`` -> ``ScheduleGPipe``, ``1f1b`` -> ``Schedule1F1B``,
``interleaved-1f1b`` -> ``ScheduleInterleaved1F1B`` (``virtual_stages`` chunks per
rank), ``zero-bubble`` -> ``ScheduleInterleavedZeroBubble`` (backward split into input
and weight gradients to fill the bubble) over the plan's chunks; all run on gloo.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from planner.errors import SpecError
from planner.spec import Axis, Plan, Schedule
from planner.staging import STAGE_IDS, build_chunk, install_stage_forward, split_problem
from strategies.mesh import axis_rank, device_type

__all__ = [
    "check_split",
    "split",
    "install_stages",
    "chunk_indices",
    "PipelineRunner",
    "build_runner",
    "full_value",
]

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor: the whole value of a (replicated or partial) DTensor."""
    value = value.detach()
    return value.full_tensor() if isinstance(value, DTensor) else value


def chunk_indices(plan: Plan, pp_rank: int) -> list[int]:
    """The model chunks (indices into ``plan.stages``) held by pipeline rank ``pp_rank``."""
    return list(range(pp_rank, plan.strategy.num_stages, plan.strategy.pp))


def check_split(model: nn.Module, plan: Plan) -> None:
    """Raise unless ``plan.stages`` can run as a pipeline of ``model`` (pure: call it
    before any collective, so every rank fails alike)."""
    problem = split_problem(model, plan.stages) if plan.strategy.pp > 1 else None
    if problem is not None:
        raise SpecError(
            f"plan.stages cannot run as a pipeline of {type(model).__name__}: {problem}"
        )


def split(model: nn.Module, mesh: DeviceMesh, plan: Plan) -> list[tuple[int, nn.Module]]:
    """This rank's chunks of ``model`` as ``(chunk index, module)`` pairs."""
    pp_rank = axis_rank(mesh, Axis.PP)
    chunks = [
        (index, build_chunk(model, plan.stages[index])) for index in chunk_indices(plan, pp_rank)
    ]
    log.info("pipeline split: pp rank %d holds chunks %s", pp_rank, [i for i, _ in chunks])
    return chunks


def install_stages(chunks: list[tuple[int, nn.Module]], plan: Plan) -> None:
    """Make each chunk (wrapped by the parallel dimensions) run as its pipeline stage."""
    last = plan.strategy.num_stages - 1
    for index, chunk in chunks:
        inner = chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
        install_stage_forward(inner, first=index == 0, last=index == last)


def build_runner(
    chunks: list[tuple[int, nn.Module]],
    mesh: DeviceMesh,
    plan: Plan,
    loss_fn: LossFn,
    loss_context: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> PipelineRunner:
    """Pipeline stages for ``chunks`` and the plan's schedule, behind a :class:`PipelineRunner`.

    ``loss_context`` is entered around each schedule step (e.g. ``loss_parallel``).
    """
    group = mesh.get_group(Axis.PP.value)
    device = torch.device(device_type())
    num_stages = plan.strategy.num_stages
    stages: list[_PipelineStageBase] = [
        PipelineStage(module, index, num_stages, device, group=group) for index, module in chunks
    ]
    schedule = _schedule(plan, stages, loss_fn)
    indices = [index for index, _ in chunks]
    log.info(
        "pipeline: %s, %d chunks, %d micro-batches",
        plan.strategy.schedule.value,
        num_stages,
        plan.strategy.num_microbatches,
    )
    return PipelineRunner(
        [module for _, module in chunks],
        schedule,
        group,
        has_first=0 in indices,
        has_last=num_stages - 1 in indices,
        loss_context=loss_context,
    )


def _schedule(plan: Plan, stages: list[_PipelineStageBase], loss_fn: LossFn) -> _PipelineSchedule:
    n = plan.strategy.num_microbatches
    kind = plan.strategy.schedule
    if kind is Schedule.GPIPE:
        return ScheduleGPipe(stages[0], n, loss_fn=loss_fn)
    if kind is Schedule.ONE_F_ONE_B:
        return Schedule1F1B(stages[0], n, loss_fn=loss_fn)
    if kind is Schedule.INTERLEAVED_1F1B:
        return ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn)
    return ScheduleInterleavedZeroBubble(stages, n, loss_fn=loss_fn)


class PipelineRunner:
    """The pipeline-parallel model: ``step(inputs, targets) -> loss`` runs one schedule.

    ``inputs``/``targets`` are this data-parallel rank's whole batch, given on every
    pipeline rank; the schedule cuts them into micro-batches (stages after the first get
    their micro-batch's token ids as ``stage_ids``). Gradients are averaged over
    micro-batches.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        schedule: _PipelineSchedule,
        group: dist.ProcessGroup,
        *,
        has_first: bool,
        has_last: bool,
        loss_context: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.modules = modules
        self.schedule = schedule
        self.group = group
        self.has_first = has_first
        self.has_last = has_last
        self.loss_context = loss_context

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of all micro-batches; the mean loss, on every pp rank."""
        return self._run(
            functools.partial(self.schedule.step, return_outputs=False), inputs, targets
        )

    def _run(
        self, schedule: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """One pass of ``schedule`` (the schedule's step or eval) over this rank's batch;
        the mean micro-batch loss, on every pp rank."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs: dict[str, Any] = {STAGE_IDS: inputs}
        if self.has_last:
            kwargs |= {"target": targets, "losses": losses}
        with self.loss_context():
            schedule(*args, **kwargs)
        if self.has_last:
            loss = torch.stack([full_value(value) for value in losses]).mean().float()
        else:
            loss = torch.zeros((), device=torch.device(device_type()))
        dist.all_reduce(loss, group=self.group)
        return loss

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward of all micro-batches (the schedule's eval); the mean loss, on every pp
        rank. Call it under ``torch.no_grad()``."""
        return self._run(self.schedule.eval, inputs, targets)

    def parameters(self) -> Iterator[nn.Parameter]:
        return itertools.chain.from_iterable(module.parameters() for module in self.modules)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return itertools.chain.from_iterable(module.named_parameters() for module in self.modules)

    def train(self, mode: bool = True) -> PipelineRunner:
        for module in self.modules:
            module.train(mode)
        return self
