"""The training loop behind ``plan run``: synthetic tokens, loss and step time per step.

:class:`Trainer` drives what :func:`strategies.apply.parallelize` returned (a
:class:`~strategies.parallel_model.ParallelModel`) with the optimizer and gradient
clipping. Every rank draws the same global batch from a seeded generator and keeps its
data-parallel slice (and, under context parallel, its sequence shard), so a run on N
ranks sees the same data as a run on one.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import SpecError
from planner.models import SMALL_MODELS, build, is_hf_model
from planner.spec import Optimizer, Plan
from planner.torch_dtypes import TORCH_DTYPES
from planner.validate import validate_plan_for_world
from strategies.apply import parallelize
from strategies.mesh import local_device
from strategies.parallel_model import ParallelModel

__all__ = [
    "Trainer",
    "StepRecord",
    "synthetic_batch",
    "run_plan",
    "RunModel",
    "model_to_run",
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


class Trainer:
    """One optimizer step per :meth:`step`: forward/backward, clip, update; returns the loss.

    ``parallel`` is what :func:`~strategies.apply.parallelize` returned. The loss
    returned is the mean over the global batch. Gradients are clipped to a global L2 norm
    of ``max_grad_norm`` when ``training.grad_clip`` is set.
    """

    def __init__(
        self, parallel: ParallelModel, *, lr: float = 1e-3, max_grad_norm: float = 1.0
    ) -> None:
        self.parallel = parallel
        self.plan = parallel.plan
        self.max_grad_norm = max_grad_norm if self.plan.training.grad_clip else None
        self.optimizer = _optimizer(self.plan.training.optimizer, list(parallel.parameters()), lr)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on this rank's share of the global batch."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.parallel.step(inputs, targets)
        if self.max_grad_norm is not None:
            self.parallel.clip_grad_norm_(self.max_grad_norm)
        self.optimizer.step()
        return float(loss)


def _optimizer(kind: Optimizer, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if kind is Optimizer.SGD:
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    if kind is Optimizer.ADAM:
        return torch.optim.Adam(params, lr=lr, foreach=False)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False)


@dataclass(frozen=True)
class RunModel:
    """What ``plan run`` and ``plan measure`` train: the plan's model on the meta device,
    its vocabulary and sequence length, and a Hugging Face model's ``config.json``."""

    module: nn.Module
    vocab_size: int
    seq_len: int
    hf_config: dict[str, Any] | None = None


def model_to_run(plan: Plan, command: str, host_seed: int | None = None) -> RunModel:
    """The plan's model built again: its zoo or spec-file transformer, the Hugging Face
    config it was planned from (``plan.model_source``, as given to ``plan --hf-config``),
    or the token model a ``module:function`` builds (its function called again; token
    ids as far as its embeddings and logits reach). On the meta device, each rank then
    initialising only its shards; ``host_seed``: on the CPU, seeded so on every rank,
    with the values its ``__init__`` gives (a module that sets its parameters there and
    has no ``reset_parameters``), each rank holding the whole model until the plan cuts it."""
    if plan.model is not None:
        seq_len = plan.seq_len
        assert seq_len is not None  # a plan with a model spec has one
        device = "meta" if host_seed is None else "cpu"
        zoo = build(plan.model, device=device, seed=host_seed)
        return RunModel(zoo, plan.model.vocab_size, seq_len)
    source = plan.model_source
    if not source or source in SMALL_MODELS:
        what = (
            "a built-in non-token model" if source in SMALL_MODELS else "a module given in Python"
        )
        raise SpecError(
            f"plan for {plan.model_name!r} was made for {what} ({source!r}): "
            f"'{command}' builds zoo and spec-file transformers, Hugging Face configs and "
            "token models given as module:function; train it with planner.parallelize() in "
            "your own loop"
        )
    from planner.priced_plan import traced_plan_model
    from planner.staging import token_vocab
    from planner.tracing import default_seq_len

    # in the config's torch_dtype; on meta, a module's buffers as its __init__ computes them
    handle, _ = traced_plan_model(plan, source=command, keep_buffers=True, host_seed=host_seed)
    seq_len = plan.training.seq_len or default_seq_len(handle)
    config: Any = handle.module.config if is_hf_model(handle.module) else None
    vocab = int(config.vocab_size) if config is not None else token_vocab(handle, seq_len)
    if vocab is None:
        raise SpecError(
            f"plan for {plan.model_name!r} was made for {source!r}, whose forward does not take "
            f"token ids alone (one integer tensor of shape (batch, seq) that reaches an "
            f"nn.Embedding; it takes {_described(handle.make_inputs(1, seq_len))}): "
            f"'{command}' feeds synthetic token ids and nothing else; train it with "
            "planner.parallelize() in your own loop"
        )
    module = _with_parameter_dtype(handle.module, TORCH_DTYPES[plan.training.param_dtype])
    return RunModel(module, vocab, seq_len, config.to_dict() if config is not None else None)


def _with_parameter_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with its floating parameters in ``dtype``, what the plan keeps; buffers
    stay as built (``Module.to`` would drop a complex rotary table's imaginary part)."""
    for param in module.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return module


def _described(inputs: tuple[torch.Tensor, ...]) -> str:
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in inputs)


def run_plan(
    plan: Plan,
    *,
    steps: int,
    seed: int,
    lr: float = 1e-3,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    save_every: int | None = None,
    host_seed: int | None = None,
) -> Iterator[StepRecord]:
    """Build the plan's model on the meta device, apply the plan (each rank initialises only
    its shards, seeded by ``seed``) and train up to step ``steps`` on synthetic tokens
    (``host_seed``: built on the CPU, seeded so, :func:`model_to_run`).

    With ``checkpoint_dir``, the model and optimizer are saved there after the last step
    and every ``save_every`` steps; ``resume`` first loads its latest checkpoint (saved
    under any plan) and goes on from its step, with the data the uninterrupted run sees.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    validate_plan_for_world(plan, world)  # before building a model that may not fit here
    model = model_to_run(plan, "plan run", host_seed)
    parallel = parallelize(model.module, plan, seed=seed)
    trainer = Trainer(parallel, lr=lr)
    start = 0
    if resume:
        assert checkpoint_dir is not None  # the CLI asks for both
        start = parallel.load(checkpoint_dir, trainer.optimizer)
        if start >= steps:
            raise SpecError(
                f"steps = {steps} (plan run --steps), but the checkpoint in {checkpoint_dir} "
                f"is at step {start}: nothing is left to train; give more than {start} steps"
            )
    for step in range(start, steps):
        inputs, targets = parallel.local_batch(
            *synthetic_batch(
                model.vocab_size,
                plan.training.global_batch_size,
                model.seq_len,
                seed=seed,
                step=step,
            )
        )
        began = time.perf_counter()
        loss = trainer.step(inputs, targets)
        record = StepRecord(step=step, loss=loss, step_time_s=time.perf_counter() - began)
        done = step + 1
        if checkpoint_dir is not None and (
            done == steps or (save_every and done % save_every == 0)
        ):
            parallel.save(checkpoint_dir, trainer.optimizer, step=done)
        yield record


@contextlib.contextmanager
def process_group_from_env() -> Iterator[int]:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1); yield this rank.

    NCCL when CUDA is available, gloo otherwise. A single process (no ``WORLD_SIZE``
    or 1) runs without a process group and is rank 0.

    The run's garbage is collected before the group is destroyed: FSDP2 modules, device
    meshes and DTensors form reference cycles that hold the group's backend, which would
    otherwise be freed during interpreter finalisation, where gloo's threads can abort
    the process (pytorch/pytorch#179291).
    """
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        yield dist.get_rank() if dist.is_initialized() else 0
        return
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local_device()  # under NCCL: this rank's GPU becomes current before any collective
    log.info("process group: %s, world size %d", dist.get_backend(), dist.get_world_size())
    try:
        yield dist.get_rank()
        dist.barrier()  # no rank tears gloo down while another still has work in flight
    finally:
        gc.collect()
        dist.destroy_process_group()
