"""Gradient compression on this CPU: bytes sent and compute overhead, measured and predicted.

    python benchmarks/bench_compression_cpu.py [--world 2] [--profile my-cpu.json]
                                               [--steps 8] [--rounds 5] [--workdir DIR]

Model: a zoo GPT with 4 layers, hidden 256, 4 heads, vocabulary 2048, sequence 128;
fp32, AdamW, global batch 4 (``--world`` ranks, one thread each, gloo). Options:
none, fp16, bf16, PowerSGD rank 1 and 4 (2 uncompressed warm-up steps), local SGD
with period 4 over local groups of ``world / 2`` ranks (1 rank at world 2: no
per-step gradient reduction at all).

Bytes (per rank per optimizer step): each option's plan is applied with
``planner.parallelize`` on ``--world`` gloo ranks; after the warm-up, every call of
``torch.distributed.all_reduce`` during ``--steps`` steps (a multiple of the local SGD
period) is counted, payload = elements x element size, on groups of more than one rank
(a ring moves 2 (n - 1) / n of it per rank). That covers every DDP hook (PowerSGD's
three all-reduces per bucket) and local SGD's parameter averaging. DDP's built-in
reduction runs in C++ where Python cannot count it, so 'none' registers the stock
``allreduce_hook`` instead (the same buckets, in fp32). Predicted: the elements of
``planner.cost.compression`` on the model's cost graph (``gradient_shapes``,
``powersgd_work``, ``half_wire_bytes``); local SGD: fp32 gradients within the local
group every step plus the parameters every ``period`` steps. A second table shows the
share sent on the whole data-parallel group: what crosses the slow tier when the
local groups are its fast domains.

Overhead (ms per step): in one process on a 1-rank gloo group, where an all-reduce
moves nothing, the same hooks (``strategies.compression.apply``) and after-step
callback run on DDP, each call timed directly (a hook until its future is done). The
overhead is the mean time per step in those calls with the option minus that with
``allreduce_hook``: the median over ``--rounds`` interleaved rounds of ``--steps``
steps (local SGD's averaging is amortised over the round); the spread is the range
of the baseline's round means. Step-time differences were too noisy on a shared
2-core machine (a 50 ms interquartile range on a ~250 ms step).
Predicted: ``breakdown_s['compression']`` of the cost model for
the plan (:func:`planner.calibrate.predict_plan`) with the CPU profile ``--profile``,
or, without one, a profile from ``plan calibrate --quick`` run here first (about
20 s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import planner
from planner.assemble import assemble_plan
from planner.calibrate import measured_run_options, predict_plan
from planner.cost.compression import gradient_shapes, half_wire_bytes, powersgd_work
from planner.cost.tp import unsharded
from planner.errors import PlannerError
from planner.hardware import load_profile
from planner.models import ModelHandle, build
from planner.planning import cost_graph
from planner.spec import (
    Cluster,
    Compression,
    CompressionKind,
    DType,
    Family,
    ModelSpec,
    Optimizer,
    Plan,
    Strategy,
    Training,
)
from strategies import compression
from strategies.parallel_model import local_slice
from strategies.runner import synthetic_batch

MODEL = ModelSpec(name="gpt-4x256", family=Family.GPT, num_layers=4, hidden_size=256,
                  num_heads=4, vocab_size=2048, seq_len=128)  # fmt: skip
GLOBAL_BATCH = 4
WARMUP = 2  # PowerSGD's earliest start with error feedback; local SGD starts there too
PERIOD = 4
LR = 1e-3
FP32_BYTES = 4


def options(world: int) -> dict[str, dict[str, Any]]:
    """Compression settings by option name."""
    local = {"kind": "local_sgd", "period": PERIOD, "local_group": world // 2,
             "warmup_steps": WARMUP}  # fmt: skip
    return {
        "none": {"kind": "none"},
        "fp16": {"kind": "fp16"},
        "bf16": {"kind": "bf16"},
        "powersgd r1": {"kind": "powersgd", "rank": 1, "warmup_steps": WARMUP},
        "powersgd r4": {"kind": "powersgd", "rank": 4, "warmup_steps": WARMUP},
        f"local_sgd H{PERIOD} g{world // 2}": local,
    }


def make_plan(settings: dict[str, Any], world: int) -> Plan:
    strategy = Strategy(
        dp=world,
        micro_batch_size=GLOBAL_BATCH // world,
        compression=Compression.model_validate(settings),
    )
    training = Training(global_batch_size=GLOBAL_BATCH, dtype=DType.FP32, optimizer=Optimizer.ADAMW)
    cluster = Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world)
    handle = ModelHandle(MODEL.name, "spec", build(MODEL, device="meta"), lambda b, s: (), MODEL)
    return assemble_plan(handle, cluster, training, strategy)


@contextmanager
def counting_all_reduce(counter: dict[int, int]) -> Iterator[None]:
    """Add the payload bytes of every ``dist.all_reduce`` on a group of > 1 rank to
    ``counter[group size]``."""
    original = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        size = dist.get_world_size(group)
        if size > 1:
            counter[size] = counter.get(size, 0) + tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def _model(plan: Plan) -> DistributedDataParallel:
    """``plan`` applied by ``planner.parallelize``; 'none' gets the stock allreduce_hook."""
    parallel = planner.parallelize(build(MODEL, device="cpu", seed=0), plan).module
    assert isinstance(parallel, DistributedDataParallel)
    if plan.strategy.compression.kind is CompressionKind.NONE:
        parallel.register_comm_hook(parallel.process_group, default_hooks.allreduce_hook)
    return parallel


def _stepper(
    model: DistributedDataParallel,
    plan: Plan,
    rank: int,
    *,
    after_step: Callable[[], None] | None = None,
) -> Callable[[int], None]:
    """One optimizer step on this rank's share of the global batch (no loss all-reduce),
    then ``after_step`` (default: the plan's after-step callback)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    if after_step is None:
        after_step = compression.after_step_callback(model, plan)

    def step(index: int) -> None:
        batch = synthetic_batch(MODEL.vocab_size, GLOBAL_BATCH, MODEL.seq_len, seed=0, step=index)
        inputs, targets = local_slice(plan, rank, *batch)
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        if after_step is not None:
            after_step()

    return step


def _bytes_worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    sent = {}
    for name, settings in options(world).items():
        plan = make_plan(settings, world)
        # planner.parallelize's model averages after every optimizer step (a global
        # post-step hook) as the plan says: the stepper adds no averaging of its own
        step = _stepper(_model(plan), plan, rank, after_step=lambda: None)
        for index in range(WARMUP):
            step(index)
        counter: dict[int, int] = {}
        with counting_all_reduce(counter):
            for index in range(WARMUP, WARMUP + steps):
                step(index)
        sent[name] = (sum(counter.values()) / steps, counter.get(world, 0) / steps)
    Path(out, f"bytes{rank}.json").write_text(json.dumps(sent))
    dist.barrier()
    dist.destroy_process_group()


def measure_bytes(world: int, steps: int, workdir: Path) -> dict[str, tuple[float, float]]:
    """Payload bytes per rank per step by option: in all, and on the whole data-parallel
    group (rank 0; all ranks send alike)."""
    mp.start_processes(_bytes_worker, args=(world, _free_port(), steps, str(workdir)),
                       nprocs=world, start_method="spawn")  # fmt: skip
    return json.loads((workdir / "bytes0.json").read_text())


def measure_overhead(world: int, steps: int, rounds: int) -> tuple[dict[str, float], float]:
    """Compression seconds per step by option (median of round means over 'none'), on a
    1-rank group; the spread (max - min of the baseline's round means, s)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        timers = {name: _HookTimer(settings, world) for name, settings in options(world).items()}
        for index in range(WARMUP):
            for timer in timers.values():
                timer.step(index)
        means: dict[str, list[float]] = {name: [] for name in timers}
        for round_index in range(rounds):
            for name, timer in timers.items():
                timer.seconds.clear()
                for index in range(steps):
                    timer.step(WARMUP + round_index * steps + index)
                means[name].append(sum(timer.seconds) / steps)
    finally:
        dist.destroy_process_group()
    base = statistics.median(means["none"])
    overhead = {name: statistics.median(values) - base for name, values in means.items()}
    return overhead, max(means["none"]) - min(means["none"])


class _HookTimer:
    """DDP on a 1-rank group with the option's hook (as planned for ``world`` ranks) and
    after-step callback, both timed: ``seconds`` collects each call's wall time, the
    hook's until its future is done (the all-reduce of one rank moves nothing)."""

    def __init__(self, settings: dict[str, Any], world: int) -> None:
        plan = make_plan(settings, world)
        self.seconds: list[float] = []
        model = DistributedDataParallel(build(MODEL, device="cpu", seed=0))
        register = model.register_comm_hook
        model.register_comm_hook = lambda state, hook: register(state, self._timed(hook))  # type: ignore[method-assign]
        if plan.strategy.compression.kind is CompressionKind.NONE:
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        else:
            compression.apply(model, None, plan)
        after_step = compression.after_step_callback(model, plan)
        timed_after_step = None if after_step is None else self._timed_call(after_step)
        self.step = _stepper(model, plan, 0, after_step=timed_after_step)

    def _timed(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def timed_hook(state, bucket):  # no annotations: DDP checks them at runtime
            start = time.perf_counter()
            future = hook(state, bucket)
            future.wait()
            self.seconds.append(time.perf_counter() - start)
            return future

        return timed_hook

    def _timed_call(self, callback: Callable[[], None]) -> Callable[[], None]:
        def timed_callback() -> None:
            start = time.perf_counter()
            callback()
            self.seconds.append(time.perf_counter() - start)

        return timed_callback


def predicted_bytes(plan: Plan) -> tuple[float, float]:
    """Payload bytes per rank per step from the cost model's compression arithmetic: in
    all, and on the whole data-parallel group."""
    graph = cost_graph(ModelHandle(MODEL.name, "spec", build(MODEL, device="meta"),
                                   _meta_tokens, MODEL), plan.training)  # fmt: skip
    shapes = gradient_shapes(graph, unsharded(graph))
    settings = plan.strategy.compression
    if settings.kind is CompressionKind.POWERSGD:
        work = powersgd_work(shapes, settings.rank or 1)
        sent = (work.uncompressed_elements + work.p_elements + work.q_elements) * FP32_BYTES
    elif settings.kind in (CompressionKind.FP16, CompressionKind.BF16):
        sent = shapes.elements * half_wire_bytes(FP32_BYTES)
    elif settings.kind is CompressionKind.LOCAL_SGD:
        assert settings.period is not None
        averaging = shapes.elements * FP32_BYTES / settings.period
        local = shapes.elements * FP32_BYTES if (settings.local_group or 1) > 1 else 0.0
        return local + averaging, averaging
    else:
        sent = shapes.elements * FP32_BYTES
    return sent, sent


def _meta_tokens(batch: int, seq: int) -> tuple[torch.Tensor, ...]:
    return (torch.empty(batch, seq, dtype=torch.long, device="meta"),)


def predicted_overhead(plan: Plan, profile_path: str) -> float | str:
    """The cost model's 'compression' seconds per step, or why it has none."""
    profile = load_profile(profile_path)
    try:
        prediction = predict_plan(plan, profile, measured_run_options(profile))
    except PlannerError as error:
        return f"n/a ({error})"
    return prediction.breakdown_s.get("compression", 0.0)


def _calibrate(workdir: Path) -> str:
    """A CPU profile from ``plan calibrate --quick`` on 2 ranks; its path."""
    path = workdir / "my-cpu-quick.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "-m", "planner", "calibrate", "--quick", "-o", str(path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, capture_output=True, env=env)
    return str(path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _error(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+7.1%}" if measured else "    n/a"


def print_table(
    world: int,
    sent: dict[str, tuple[float, float]],
    overhead: dict[str, float],
    spread: float,
    predictions: dict[str, tuple[tuple[float, float], float | str]],
) -> None:
    print(f"\nper rank per step, {world} ranks; overhead baseline spread {spread * 1e3:.2f} ms")
    print(f"{'option':<16} {'pred bytes':>12} {'meas bytes':>12} {'error':>7}   "
          f"{'pred ms':>8} {'meas ms':>8} {'error':>7}")  # fmt: skip
    for name, ((bytes_pred, _), seconds_pred) in predictions.items():
        bytes_meas = sent[name][0]
        line = (
            f"{name:<16} {bytes_pred:12,.0f} {bytes_meas:12,.0f} {_error(bytes_pred, bytes_meas)}"
        )
        measured_ms = overhead[name] * 1e3
        if isinstance(seconds_pred, str):
            print(f"{line}   {'':>8} {measured_ms:8.1f}  {seconds_pred}")
            continue
        print(f"{line}   {seconds_pred * 1e3:8.1f} {measured_ms:8.1f} "
              f"{_error(seconds_pred, overhead[name]) if name != 'none' else '':>7}")  # fmt: skip
    print("\nof which across the whole data-parallel group (the slow tier's share):")
    for name, ((_, global_pred), _) in predictions.items():
        global_meas = sent[name][1]
        print(f"{name:<16} {global_pred:12,.0f} {global_meas:12,.0f} "
              f"{_error(global_pred, global_meas)}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, choices=(2, 4), help="gloo ranks")
    parser.add_argument("--profile", help="CPU hardware profile (default: plan calibrate --quick)")
    parser.add_argument("--steps", type=int, default=8, help="steps per count / timing round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--workdir", type=Path, help="keep the calibrated profile here")
    args = parser.parse_args()
    if args.steps % PERIOD:
        parser.error(f"--steps must be a multiple of the local SGD period {PERIOD}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_compression."))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    profile = args.profile or _calibrate(workdir)
    plans = {
        name: make_plan(settings, args.world) for name, settings in options(args.world).items()
    }
    predictions = {name: (predicted_bytes(plan), predicted_overhead(plan, profile))
                   for name, plan in plans.items()}  # fmt: skip
    sent = measure_bytes(args.world, args.steps, workdir)
    overhead, spread = measure_overhead(args.world, args.steps, args.rounds)
    print_table(args.world, sent, overhead, spread, predictions)
    print(f"\nprofile {profile}; benchmark took {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
