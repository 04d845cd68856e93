"""Run tasks on spawned gloo ranks on 127.0.0.1; each task's result per rank, or its traceback."""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import socket
import sys
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, Self, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.spec import Plan

T = TypeVar("T")
R = TypeVar("R")
Task = Callable[[int], Any]  # rank -> JSON-able result; must pickle (a module-level function)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: dict[str, Task], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    results: dict[str, Any] = {}
    for name, task in tasks.items():
        try:
            results[name] = task(rank)
        except Exception:
            results[name] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()  # tearing gloo down under a peer's pending work aborts the process
    dist.destroy_process_group()
    # Skip interpreter teardown: on a loaded machine a gloo or DDP helper thread still
    # joinable at exit now and then ends the process in std::terminate (SIGABRT) after
    # the results are written (torch 2.13, CPU).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Ranks fork from one forkserver per test session that imported these once (torch,
# transformers and the project take seconds per process to import; a world of 8 on 2
# cores pays them 8 times per launch otherwise). The server runs no torch work, so the
# forked ranks start clean.
PRELOAD = ["torch", "torch.distributed", "transformers", "planner", "strategies", "tests.ranks"]


def run_on_ranks(world_size: int, tasks: dict[str, Task], out: Path) -> dict[str, list[Any]]:
    """Each task's result on every rank (rank order): what it returned, or the traceback (str)."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(
        _worker, args=(world_size, free_port(), tasks, str(out)), nprocs=world_size,
        start_method="forkserver",
    )  # fmt: skip
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    return {name: [results[name] for results in per_rank] for name in tasks}


def map_in_processes(function: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``function(item)`` for each item, in order, over one process per core (forked as
    the ranks are): a test's planning, which one process would do one plan at a time."""
    mp.set_forkserver_preload(PRELOAD)
    context = mp.get_context("forkserver")
    workers = os.cpu_count() or 1
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(function, items))


class PlannedOnce(ABC):
    """A test case (a frozen dataclass with a ``made`` field, ``(world size, plan JSON)``)
    whose plan the test makes once and every rank reads: each rank making it would trace
    the model again. Subclasses make the plan in :meth:`make_plan`."""

    made: tuple[int, str] | None

    @abstractmethod
    def make_plan(self, world_size: int) -> Plan: ...

    def planned(self, world_size: int) -> Self:
        """This case with its plan for ``world_size`` ranks made here."""
        return replace(self, made=(world_size, self.make_plan(world_size).model_dump_json()))

    def plan(self, world_size: int) -> Plan:
        if self.made is not None and self.made[0] == world_size:
            return Plan.model_validate_json(self.made[1])
        return self.make_plan(world_size)
