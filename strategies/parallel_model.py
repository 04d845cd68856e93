"""What :func:`planner.parallelize` returns: the parallel model, which knows its plan.

A :class:`ParallelModel` feeds, steps and clips the model the way the plan was priced:

- :meth:`~ParallelModel.local_batch` cuts the global batch (the same on every rank) to
  this rank's data-parallel share and, under context parallel, its sequence shard
  (:meth:`~ParallelModel.sequence_shard` cuts the share a loader sharded by
  :attr:`~ParallelModel.dp_rank` gives);
- :meth:`~ParallelModel.step` runs forward and backward over the plan's micro-batches
  (the pipeline schedule when ``pp > 1``) and returns the global mean loss;
- :meth:`~ParallelModel.clip_grad_norm_` clips by the norm of the whole model on every
  mesh (stock ``clip_grad_norm_`` raises where it would be wrong:
  :mod:`strategies.clipping`);
- calling it (``parallel(inputs)``, not for pipelines) runs the forward as usual;
- :meth:`~ParallelModel.save` and :meth:`~ParallelModel.load` write and read a
  checkpoint (model and optimizer) that any other plan can load (:mod:`strategies.state`).

The first training step checks the local batch and sequence lengths against the plan, so
a loop that feeds every rank the whole batch, or the whole sequence under context
parallel, fails with the fix instead of training wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import register_optimizer_step_post_hook

from planner.errors import SpecError
from planner.parallel_dims import ParallelDims
from planner.spec import Axis, CompressionKind, Plan
from planner.torch_dtypes import mixed_precision_dtype
from strategies import clipping, expert_parallel, state
from strategies.compression import after_step_callback, carried_state, restore_carried_state
from strategies.context_parallel import sequence_slice
from strategies.mesh import coordinates, device_type, dp_rank_of
from strategies.pipeline import LossFn, PipelineRunner, full_value
from strategies.random_state import check_same_random_state, has_dropout

__all__ = ["ParallelModel", "local_slice", "sequence_shards", "loss_context"]


_LOSS_PARALLEL_ACTIVE: ContextVar[bool] = ContextVar("loss_parallel_active", default=False)


def loss_context(plan: Plan) -> contextlib.AbstractContextManager[object]:
    """Where vocabulary-sharded logits meet the loss: ``loss_parallel()`` when the plan's
    layout hands the head's logits on sharded (``plan.loss_parallel``)."""
    return _loss_parallel_once() if plan.loss_parallel else contextlib.nullcontext()


@contextlib.contextmanager
def _loss_parallel_once() -> Iterator[None]:
    """torch's ``loss_parallel()``, entered once however the contexts nest: its exit
    unregisters the loss operators, which a nested exit would take from the outer one."""
    if _LOSS_PARALLEL_ACTIVE.get():
        yield
        return
    token = _LOSS_PARALLEL_ACTIVE.set(True)
    try:
        with loss_parallel():
            yield
    finally:
        _LOSS_PARALLEL_ACTIVE.reset(token)


def local_slice(plan: Plan, rank: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``rank``'s data-parallel share (dim 0) and context-parallel shard (dim 1) of each
    tensor of a global batch."""
    index = dp_rank_of(plan, rank)
    return sequence_shards(plan, rank, *(t.chunk(plan.strategy.dp)[index] for t in tensors))


def sequence_shards(plan: Plan, rank: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``rank``'s context-parallel shard (dim 1) of each tensor (the tensors themselves when
    ``cp = 1``)."""
    cp = plan.strategy.cp
    if cp == 1:
        return tensors
    cp_index = coordinates(plan, rank).get(Axis.CP, 0)
    return tuple(sequence_slice(t, cp_index, cp) for t in tensors)


class ParallelModel:
    """The model with ``plan`` applied on this rank: ``module`` (``pp = 1``) or ``runner``."""

    def __init__(
        self,
        plan: Plan,
        parallel: nn.Module | PipelineRunner,
        *,
        mesh: DeviceMesh | None,
        loss_fn: LossFn,
    ) -> None:
        self.plan = plan
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._parallel = parallel
        self._checked = False
        # Taken once, before any forward: DDP over tensor-parallel shards swaps the modules'
        # parameters for new objects each forward (torch's _pre_dp_module_transform); the
        # ones here are those gradients reach, and carry the shard layout (_st_info).
        self._named_parameters = [
            (name, param) for m in self.modules for name, param in _unwrapped(m).named_parameters()
        ]
        strategy = plan.strategy
        self._dropout_group = (
            mesh.get_group(Axis.TP.value)
            if mesh is not None and strategy.tp > 1 and any(map(has_dropout, self.modules))
            else None
        )
        problem = clipping.stock_clipping_problem(strategy.pp, strategy.tp, strategy.ep)
        if problem is not None:
            clipping.guard_stock_clipping(self.parameters(), problem)
        self._after_step = (
            None if isinstance(parallel, PipelineRunner) else after_step_callback(parallel, plan)
        )
        if self._after_step is not None:
            register_optimizer_step_post_hook(self._after_optimizer_step)

    # ---- what the model is on this rank

    @property
    def runner(self) -> PipelineRunner | None:
        """The pipeline schedule's runner when ``pp > 1``."""
        return self._parallel if isinstance(self._parallel, PipelineRunner) else None

    @property
    def module(self) -> nn.Module:
        """The parallel module (DDP/FSDP/TP-wrapped); pipelines have :attr:`modules`."""
        if isinstance(self._parallel, PipelineRunner):
            raise SpecError(
                f"plan.strategy.pp = {self.plan.strategy.pp}: this rank holds pipeline chunks, "
                "not one module; use parallel.modules or parallel.step(inputs, targets)"
            )
        return self._parallel

    @property
    def modules(self) -> list[nn.Module]:
        """This rank's root modules: the model, or its pipeline chunks."""
        runner = self.runner
        return list(runner.modules) if runner is not None else [self.module]

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: give ``DistributedSampler(num_replicas=dp_size, rank=dp_rank)``."""
        return self.plan.strategy.dp

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas."""
        return dp_rank_of(self.plan, self.rank)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters: what to give the optimizer."""
        return (param for _, param in self._named_parameters)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the whole model's FQNs (no wrapper prefixes)."""
        return iter(self._named_parameters)

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers under the whole model's FQNs."""
        merged: dict[str, Any] = {}
        for module in self.modules:
            merged.update(_unwrapped(module).state_dict())
        return merged

    @property
    def model_state(self) -> state.ModelState:
        """This rank's parameters and persistent buffers as checkpoints see them, taken now
        (local SGD's averaging gives parameters new storage)."""
        modules = [_unwrapped(m) for m in self.modules]
        return state.model_state(modules, self._named_parameters)

    def save(
        self,
        directory: str | Path,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step: int,
        scheduler: LRScheduler | None = None,
    ) -> Path:
        """Checkpoint the model (and ``optimizer`` and its learning-rate ``scheduler``)
        after ``step`` optimizer steps, on every rank: ``directory/step-<step>`` becomes
        ``directory``'s latest once complete (a save cut short leaves the previous one
        latest). Returns the checkpoint's path."""
        local_sgd = self.plan.strategy.compression.kind is CompressionKind.LOCAL_SGD
        return state.save(
            directory, self.model_state, optimizer=optimizer, step=step, plan=self._layout,
            scheduler=scheduler, carried=self._carried(), per_rank=local_sgd,
        )  # fmt: skip

    def load(
        self,
        directory: str | Path,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step: int | None = None,
        scheduler: LRScheduler | None = None,
    ) -> int:
        """Load the latest checkpoint of ``directory`` (or the one at ``step``) into the
        model (and ``optimizer``, built over :meth:`parameters`, and its ``scheduler``)
        in place, on every rank, whatever plan saved it; returns its step."""
        return state.load(
            directory, self.model_state, optimizer=optimizer, step=step, plan=self._layout,
            scheduler=scheduler, restore=self._restore_carried,
        )  # fmt: skip

    @property
    def _layout(self) -> str:
        """The plan and world size, as checkpoints record what saved them."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return f"{self.plan.strategy.describe()} on {world} ranks"

    def _carried(self) -> bytes | None:
        """What this rank's gradient compression carries between steps (DDP only)."""
        return None if self.runner is not None else carried_state(self.module, self._after_step)

    def _restore_carried(self, carried: bytes) -> None:
        if self.runner is None:
            restore_carried_state(self.module, self._after_step, carried)

    def train(self, mode: bool = True) -> ParallelModel:
        for module in self.modules:
            module.train(mode)
        return self

    def eval(self) -> ParallelModel:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.modules[0].training

    # ---- data

    def local_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's share of a global batch (``global_batch_size`` sequences, equal on
        every rank): its data-parallel slice, and under context parallel its sequence shard."""
        expected = self.plan.training.global_batch_size
        for index, tensor in enumerate(tensors):
            if tensor.ndim == 0 or tensor.shape[0] != expected:
                raise SpecError(
                    f"local_batch: tensor {index} has shape {tuple(tensor.shape)}, but "
                    f"plan.training.global_batch_size = {expected}: pass the whole global batch "
                    "(the same on every rank); a loader that already shards by "
                    "parallel.dp_rank and parallel.dp_size gives its batches to "
                    "parallel.sequence_shard"
                )
        return local_slice(self.plan, self.rank, *tensors)

    def sequence_shard(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's shard of each sequence (context parallel; unchanged when ``cp = 1``)
        of its data-parallel share (``global_batch_size / dp`` sequences), as a loader
        sharded by :attr:`dp_rank` over :attr:`dp_size` yields it."""
        expected = self._local_batch_size
        for index, tensor in enumerate(tensors):
            if tensor.ndim < 2 or tensor.shape[0] != expected:
                raise SpecError(
                    f"sequence_shard: tensor {index} has shape {tuple(tensor.shape)}, but this "
                    f"rank's share of the global batch {self.plan.training.global_batch_size} "
                    f"over dp({self.plan.strategy.dp}) is {expected} sequences: pass this "
                    "rank's share (batch, seq), or the global batch to parallel.local_batch"
                )
        return sequence_shards(self.plan, self.rank, *tensors)

    def _check_local(self, tensor: torch.Tensor, where: str, *, whole: bool) -> None:
        """On the first training call, :meth:`_check_share`."""
        if self._checked or not self.training:
            return
        self._checked = True
        self._check_share(tensor, where, whole=whole)

    def _check_share(self, tensor: torch.Tensor, where: str, *, whole: bool) -> None:
        """At most this rank's share of the global batch (all of it when ``whole``), and
        under context parallel its share of each sequence (:meth:`_check_length`)."""
        strategy, local = self.plan.strategy, self._local_batch_size
        batch = tensor.shape[0] if tensor.ndim else 0
        if batch > local or (whole and batch != local):
            raise SpecError(
                f"{where}: inputs have batch {batch} but this rank's share of the global batch "
                f"{self.plan.training.global_batch_size} over dp({strategy.dp}) is {local} "
                "sequences; cut each global batch with parallel.local_batch(inputs, targets)"
            )
        self._check_length(tensor, where)

    def _check_sequence_split(self, tensor: torch.Tensor, where: str) -> None:
        """Every call: sequence parallelism splits each sequence of the inputs over the
        tensor-parallel ranks (:meth:`~planner.parallel_dims.ParallelDims.sequence_blocker`;
        under context parallel or a pipeline the length is the plan's, checked legal)."""
        strategy = self.plan.strategy
        if not strategy.sequence_parallel or strategy.cp > 1 or tensor.ndim < 2:
            return
        problem = ParallelDims.of(strategy).sequence_blocker(tensor.shape[1])
        if problem is not None:
            raise SpecError(
                f"{where}: inputs have shape {tuple(tensor.shape)}: {problem} (pad the "
                "sequences, or plan with --no-sequence-parallel)"
            )

    def _check_length(self, tensor: torch.Tensor, where: str) -> None:
        """Under context parallel or a pipeline, sequences of the plan's length: context
        parallel cuts the plan's sequences, and pipeline stages pass on activations of
        the shape of their first call (any other fails in the transfer, on some ranks)."""
        strategy, seq = self.plan.strategy, self.plan.seq_len
        cp = strategy.cp
        if seq is None or (cp == 1 and strategy.pp == 1):
            return
        length = tensor.shape[1] if tensor.ndim >= 2 else None
        if length == seq // cp:
            return
        if cp > 1 and length == seq:
            raise SpecError(
                f"{where}: inputs have shape {tuple(tensor.shape)} but under cp({cp}) each "
                f"rank holds {seq // cp} of the {seq} tokens of a sequence; cut each global "
                "batch with parallel.local_batch(inputs, targets)"
            )
        what = f"context parallel over cp({cp}) cuts" if cp > 1 else "pipeline stages run"
        held = f" ({seq // cp} tokens on each rank, as parallel.local_batch cuts them)"
        raise SpecError(
            f"{where}: inputs have shape {tuple(tensor.shape)} but {what} sequences of the "
            f"plan's seq_len, {seq} tokens{held if cp > 1 else ''}: give sequences of "
            f"{seq} tokens (pad or cut them), or plan with that length (plan --seq)"
        )

    @property
    def _local_batch_size(self) -> int:
        return self.plan.training.global_batch_size // self.plan.strategy.dp

    # ---- forward, step, clip

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The forward of this rank's inputs as :meth:`step` runs it: in the plan's
        precision (its autocast) and loss-parallel context, so a model that computes its
        loss in forward (from labels it is given) computes it on sharded logits too; its
        backward goes in :meth:`loss_context`, as every loss's."""
        module = self.module  # raises for pipelines
        if args and isinstance(args[0], torch.Tensor):
            self._check_local(args[0], "parallel(inputs)", whole=False)
            self._check_sequence_split(args[0], "parallel(inputs)")
        self._check_dropout()
        with self._autocast(), loss_context(self.plan):
            return module(*args, **kwargs)

    @contextlib.contextmanager
    def loss_context(self) -> Iterator[None]:
        """Enter around the loss and backward when calling the model yourself: the plan's
        autocast, as :meth:`step` computes its loss, and the loss-parallel context where
        the head hands on vocabulary-sharded logits."""
        with self._autocast(), loss_context(self.plan):
            yield

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's batch over the plan's micro-batches (the
        pipeline schedule when ``pp > 1``), in the plan's precision; returns the mean loss
        of the global batch (a detached float32 scalar, equal on every rank)."""
        where = "parallel.step(inputs, targets)"
        if self.runner is not None:  # every call: the schedule keeps its first call's shapes
            self._check_share(inputs, where, whole=True)
        else:
            self._check_local(inputs, where, whole=True)
        self._check_sequence_split(inputs, where)
        self._check_dropout()
        return self._global_loss(inputs, targets, PipelineRunner.step, self._accumulate)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of this rank's share of a global batch (as :meth:`step` takes
        it), forward only: without gradients, in eval mode (no dropout, batch norms on
        their running statistics; the model's mode is restored after), over the plan's
        micro-batches (the pipeline schedule's forwards when ``pp > 1``) in the plan's
        precision; a detached float32 scalar, equal on every rank."""
        where = "parallel.evaluate(inputs, targets)"
        self._check_share(inputs, where, whole=True)
        self._check_sequence_split(inputs, where)
        training = self.training
        self.eval()
        try:
            with torch.no_grad():
                return self._global_loss(inputs, targets, PipelineRunner.evaluate, self._mean_loss)
        finally:
            self.train(training)

    def _global_loss(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        pipelined: Callable[[PipelineRunner, torch.Tensor, torch.Tensor], torch.Tensor],
        local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The global batch's mean loss of ``pipelined`` (with this rank's runner) or
        ``local``, run on this rank's batch on its device under the plan's autocast."""
        device = torch.device(device_type())
        inputs, targets = inputs.to(device), targets.to(device)
        with self._autocast():
            runner = self.runner
            loss = (
                pipelined(runner, inputs, targets) if runner is not None else local(inputs, targets)
            )
        return _global_mean(loss)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip gradients to a global L2 norm of ``max_norm`` (the whole model's, on every
        mesh); returns the norm before clipping, equal on every rank."""
        runner = self.runner
        groups = (runner.group,) if runner is not None else ()
        return clipping.clip_grad_norm_(self.parameters(), max_norm, extra_groups=groups)

    def _check_dropout(self) -> None:
        """Before a training forward of a model with dropout under tp: the tp ranks'
        random states agree (:mod:`strategies.random_state`)."""
        if self._dropout_group is not None and self.training:
            device = torch.device(device_type())
            check_same_random_state(self._dropout_group, device, self.plan.strategy.tp)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        """The plan's autocast on this rank's device (none for fp32 plans)."""
        dtype = mixed_precision_dtype(self.plan.training.dtype)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type(), dtype=dtype)

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Gradient accumulation over the plan's micro-batches; the mean micro-batch loss."""
        model, count = self.module, self.plan.strategy.num_microbatches
        losses = []
        for index, (x, y) in enumerate(zip(inputs.chunk(count), targets.chunk(count), strict=True)):
            with _gradient_sync(model, sync=index == count - 1), loss_context(self.plan):
                loss = self.loss_fn(model(x), y) / count
                loss.backward()
            losses.append(full_value(loss).float())
        return torch.stack(losses).sum()

    def _mean_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean micro-batch loss of a forward over the plan's micro-batches."""
        model, count = self.module, self.plan.strategy.num_microbatches
        losses = []
        with loss_context(self.plan):
            for x, y in zip(inputs.chunk(count), targets.chunk(count), strict=True):
                losses.append(full_value(self.loss_fn(model(x), y)).float())
        return torch.stack(losses).mean()

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Local SGD's periodic averaging, after any optimizer step over this model."""
        ours = {id(p) for p in self.parameters()}
        steps_ours = any(id(p) in ours for g in optimizer.param_groups for p in g["params"])
        if steps_ours and self._after_step is not None:
            self._after_step()


def _unwrapped(module: nn.Module) -> nn.Module:
    """The model inside DDP's wrapper (whose names carry a ``module.`` prefix)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Average gradients over the replicas only on the last micro-batch (DDP's
    ``no_sync``, HSDP's all-reduce, expert replicas' averaging). FSDP2 reduce-scatters
    every micro-batch's gradients into its shards, as torchtitan runs it, so no rank holds
    a whole unsharded gradient between micro-batches (what the cost model prices)."""
    expert_parallel.set_gradient_sync(_unwrapped(model), sync)
    if isinstance(model, DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(sync)
    yield


def _global_mean(loss: torch.Tensor) -> torch.Tensor:
    total = loss.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total
