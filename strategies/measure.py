"""``plan measure``: run a plan for some steps and record what it cost.

After ``warmup`` untimed steps, ``steps`` steps are timed (one step's time is the
slowest rank's); one more step runs under ``torch.profiler`` for the phase breakdown
and one under a memory tracker for the peak memory of every rank. Phases are the
exclusive CPU time of the training thread's profiler events, classified as forward
(inside the model's ``forward``), backward (autograd), optimizer (``Optimizer.step``)
and communication (c10d/gloo/NCCL calls, per mesh axis when the plan has one axis), and
"other": the rest of the step's wall time (Python outside operators, waits). Their
shares are scaled to the median step time because profiling slows a step down.
Peak memory: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the peak of live
tensor storages (:class:`TensorMemoryTracker`; ``MemTracker`` refuses modules called
more than once per step, as pipelines and gradient accumulation do), counting DDP's
buckets through the gradients (views into them) and the state DDP comm hooks keep
between steps (PowerSGD's error feedback, P, Q).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import platform
import re
import time
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler_util import FunctionEvent
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from planner.errors import SpecError
from planner.measured import MeasuredProfile, Provenance, plan_fingerprint, step_statistics
from planner.spec import Plan
from planner.validate import validate_plan_for_world
from strategies.apply import parallelize
from strategies.compression import hook_states
from strategies.mesh import device_type
from strategies.parallel_model import ParallelModel, local_slice
from strategies.runner import RunModel, Trainer, model_to_run, synthetic_batch

__all__ = [
    "measure_plan",
    "classify_phases",
    "TensorMemoryTracker",
    "COMM_PATTERN",
    "FORWARD_LABEL",
]

log = logging.getLogger(__name__)

FORWARD_LABEL = "planner::forward"
COMM_PATTERN = re.compile(
    r"c10d|gloo|nccl|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
    r"broadcast|barrier|isend|irecv|send|recv",
    re.IGNORECASE,
)
_BACKWARD_PATTERN = re.compile(r"autograd::engine::evaluate_function|Backward\d*$")


def _category(event: FunctionEvent) -> str | None:
    if COMM_PATTERN.search(event.name):
        return "comm"
    if event.name.startswith("Optimizer."):
        return "optimizer"
    if _BACKWARD_PATTERN.search(event.name):
        return "backward"
    if event.name == FORWARD_LABEL:
        return "forward"
    return None


def _phase_of(event: FunctionEvent) -> str:
    """Communication wins over any enclosing phase; otherwise the nearest labelled ancestor."""
    found: str | None = None
    current: FunctionEvent | None = event
    while current is not None:
        category = _category(current)
        if category == "comm":
            return "comm"
        if found is None:
            found = category
        current = current.cpu_parent
    return found or "other"


def classify_phases(events: list[FunctionEvent], thread: int) -> dict[str, float]:
    """Exclusive seconds per phase of the events that ran on ``thread``."""
    phases: dict[str, float] = {}
    for event in events:
        if event.thread != thread:
            continue
        phase = _phase_of(event)
        phases[phase] = phases.get(phase, 0.0) + event.self_cpu_time_total * 1e-6
    return phases


@contextlib.contextmanager
def _forward_labels(parallel: ParallelModel) -> Iterator[None]:
    """Wrap every root module's forward in a profiler range named :data:`FORWARD_LABEL`."""
    open_ranges: list[Any] = []

    def enter(module: nn.Module, args: object) -> None:
        scope = torch.profiler.record_function(FORWARD_LABEL)
        scope.__enter__()
        open_ranges.append(scope)

    def leave(module: nn.Module, args: object, output: object) -> None:
        open_ranges.pop().__exit__(None, None, None)

    handles = []
    for root in parallel.modules:
        handles.append(root.register_forward_pre_hook(enter))
        handles.append(root.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _Batches:
    """This rank's share of the seeded synthetic global batch of each step."""

    def __init__(self, plan: Plan, model: RunModel, seed: int) -> None:
        self.plan, self.model, self.seed = plan, model, seed
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def __call__(self, step: int) -> tuple[torch.Tensor, ...]:
        tokens = synthetic_batch(
            self.model.vocab_size, self.plan.training.global_batch_size, self.model.seq_len,
            seed=self.seed, step=step,
        )  # fmt: skip
        return local_slice(self.plan, self.rank, *tokens)


def _slowest(seconds: float) -> float:
    """The slowest rank's value (every rank calls this)."""
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=device_type())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _timed_step(trainer: Trainer, batches: _Batches, step: int) -> float:
    if dist.is_initialized():
        dist.barrier()
    inputs, targets = batches(step)
    start = time.perf_counter()
    trainer.step(inputs, targets)
    if device_type() == "cuda":
        torch.cuda.synchronize()
    return _slowest(time.perf_counter() - start)


def _profiled_phases(
    trainer: Trainer, batches: _Batches, step: int
) -> tuple[dict[str, float], float]:
    # kineto (torch 2.13) logs a line on stderr at each profiler start and stop, which
    # every measured plan would add to the user's terminal; level 6 silences its log (a
    # failed profile still fails below: no forward measured). Read at kineto's first
    # start; a level the user set stays.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with (
        _forward_labels(trainer.parallel),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        wall = _timed_step(trainer, batches, step)
    events = list(prof.events())
    labelled = [e for e in events if e.name == FORWARD_LABEL]
    if not labelled:
        raise SpecError("the profiled step ran no forward: nothing to measure")
    phases = classify_phases(events, labelled[0].thread)
    phases.pop("other", None)
    phases["other"] = max(0.0, wall - sum(phases.values()))  # incl. Python outside operators
    return phases, wall


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages :meth:`add`-ed or output by an operator
    under it (DTensors by their local shard).

    Each storage counts at its current size until it is freed: FSDP2 frees and
    re-allocates its unsharded parameters by resizing their storages, which it then
    fills through operators. Storages never passed to :meth:`add` nor output by an
    operator (gloo's buffers) are not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    @property
    def current(self) -> int:
        """Bytes of the live storages now. Read from a copy: another thread (gloo's, the
        autograd engine's) frees storages, whose callbacks drop them from the map."""
        refs = list(self._storages.values())
        return sum(storage.nbytes() for ref in refs if (storage := ref()))

    def add(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        local = getattr(tensor, "_local_tensor", tensor)
        if local.is_meta:
            return
        storage = local.untyped_storage()
        key = storage._cdata
        if key not in self._storages:
            self._storages[key] = weakref.ref(storage, partial(self._free, key))
            self.peak = max(self.peak, self.current)

    def _free(self, key: int, _: weakref.ref[torch.UntypedStorage]) -> None:
        self._storages.pop(key, None)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            self.add(leaf)
        self.peak = max(self.peak, self.current)
        return out


def _peak_memory_gib(trainer: Trainer, batches: _Batches, step: int) -> tuple[float, str]:
    if device_type() == "cuda":
        torch.cuda.reset_peak_memory_stats()
        _timed_step(trainer, batches, step)
        return torch.cuda.max_memory_allocated() / 2**30, "torch.cuda.max_memory_allocated"
    tracker = TensorMemoryTracker()
    for param in trainer.parallel.parameters():
        tracker.add(param)
        tracker.add(param.grad)
    for state in trainer.optimizer.state.values():
        for value in state.values():
            tracker.add(value)
    for tensor in _comm_hook_tensors(trainer.parallel.modules):
        tracker.add(tensor)
    with tracker:
        _timed_step(trainer, batches, step)
    method = (
        "peak of live tensor storages during one step (parameters, gradients with DDP's "
        "buckets they are views into, optimizer states and DDP comm-hook state such as "
        "PowerSGD's error feedback and P, Q held at its start, plus every operator output)"
    )
    return tracker.peak / 2**30, method


def _comm_hook_tensors(roots: list[nn.Module]) -> list[torch.Tensor]:
    """Tensors kept by DDP comm hooks' states between steps (PowerSGD's error feedback,
    P and Q), which persist from earlier steps and so are not seen being allocated."""
    tensors = []
    for root in roots:
        for state in hook_states(root):
            slots = getattr(type(state), "__slots__", ())
            fields = [getattr(state, name, None) for name in slots]
            fields += list(getattr(state, "__dict__", {}).values())
            tensors += [leaf for leaf in tree_leaves(fields) if isinstance(leaf, torch.Tensor)]
    return tensors


def _gather(value: object) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _phases_per_axis(plan: Plan, phases: dict[str, float]) -> dict[str, float]:
    """Rename "comm" to "comm_<axis>" when the plan has a single mesh axis."""
    if "comm" in phases and len(plan.mesh) == 1:
        phases = dict(phases)
        phases[f"comm_{plan.mesh[0].name.value}"] = phases.pop("comm")
    return phases


def _run(
    plan: Plan, steps: int, warmup: int, seed: int, lr: float, host_seed: int | None
) -> tuple[list[float], dict[str, float], float, float, str]:
    """Step times, profiled phases and their step's wall time, peak GiB and its method."""
    model = model_to_run(plan, "plan measure", host_seed)  # on meta: each rank its shards
    trainer = Trainer(parallelize(model.module, plan, seed=seed), lr=lr)
    batches = _Batches(plan, model, seed)
    for step in range(warmup):
        _timed_step(trainer, batches, step)
    times = [_timed_step(trainer, batches, warmup + i) for i in range(steps)]
    phases, profiled_wall = _profiled_phases(trainer, batches, warmup + steps)
    peak, memory_method = _peak_memory_gib(trainer, batches, warmup + steps + 1)
    return times, phases, profiled_wall, peak, memory_method


def measure_plan(
    plan: Plan, *, steps: int, warmup: int, seed: int = 0, lr: float = 1e-3, command: str = "",
    host_seed: int | None = None,
) -> MeasuredProfile:  # fmt: skip
    """Run ``plan`` (on the current process group) and return what it measured
    (``host_seed``: its model built on the CPU, seeded so: :func:`~strategies.runner.model_to_run`).

    Every rank must call this; every rank returns the same profile.
    """
    if steps < 1 or warmup < 0:
        raise SpecError(f"steps = {steps}, warmup = {warmup}: need steps >= 1 and warmup >= 0")
    world = dist.get_world_size() if dist.is_initialized() else 1
    validate_plan_for_world(plan, world)  # before building a model that may not fit here
    times, phases, profiled_wall, peak, memory_method = _run(
        plan, steps, warmup, seed, lr, host_seed
    )
    gc.collect()  # free FSDP's module cycles while the process group lives (else: abort at exit)
    if dist.is_initialized():
        dist.barrier()
    median, p10, p90 = step_statistics(times)
    scale = median / profiled_wall
    phases = {name: seconds * scale for name, seconds in phases.items()}
    return MeasuredProfile(
        model_name=plan.model_name,
        model_fingerprint=plan.model_fingerprint,
        plan_fingerprint=plan_fingerprint(plan),
        plan=plan,
        world_size=world,
        warmup_steps=warmup,
        step_times_s=tuple(times),
        step_time_median_s=median,
        step_time_p10_s=p10,
        step_time_p90_s=p90,
        phases_s=_phases_per_axis(plan, _gather(phases)[0]),
        peak_memory_gib=tuple(_gather(peak)),
        memory_method=memory_method,
        provenance=_provenance(world, command),
    )


def _provenance(world: int, command: str) -> Provenance:
    if device_type() == "cuda":
        device = f"{torch.cuda.get_device_name()} (nccl, {world} ranks)"
    else:
        device = f"cpu (gloo, {world} ranks, {torch.get_num_threads()} thread(s) each)"
    return Provenance(
        host=platform.node(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        torch_version=torch.__version__,
        device=device,
        method=(
            "step time: slowest rank's wall time per step after warm-up; phases: exclusive "
            "profiler time of rank 0's training thread, scaled to the median step; "
            + (command and f"command: {command}")
        ).rstrip("; "),
    )
