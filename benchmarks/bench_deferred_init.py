"""Deferred initialisation against materialising the whole model on every rank.

A 1B-class zoo model (``gpt3-1.3b``, 1.42B parameters, bf16) under FSDP (ZeRO-3) on 4
gloo ranks on the CPU, two ways, each in fresh processes:

- ``materialise``: every rank builds the whole model on the CPU, then applies the plan;
- ``deferred``: every rank builds it on the meta device and ``planner.parallelize``
  allocates and initialises only its shards.

Prints, per way, the wall time of build + parallelise (slowest rank) and each rank's
peak resident memory (``ru_maxrss``) above what it held before building.

    python benchmarks/bench_deferred_init.py [--model gpt3-1.3b] [--world 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.assemble import assemble_plan
from planner.models import build, get_preset, resolve_model
from planner.spec import Cluster, Plan, Strategy, Training


def _plan(model: str, world: int) -> Plan:
    spec = get_preset(model)
    training = Training(global_batch_size=world, seq_len=spec.seq_len, dtype="bf16")
    cluster = Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world)
    strategy = Strategy(dp=world, zero=3, micro_batch_size=1)
    return assemble_plan(resolve_model(model), cluster, training, strategy)


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _current_rss_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _worker(rank: int, world: int, port: int, way: str, plan_json: str, out: str) -> None:
    from strategies.apply import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
    )
    plan = Plan.model_validate_json(plan_json)
    assert plan.model is not None
    torch.set_default_dtype(torch.bfloat16)
    before = _current_rss_gib()
    dist.barrier()
    start = time.perf_counter()
    if way == "materialise":
        parallel = parallelize(build(plan.model, device="cpu", seed=0), plan)
    else:
        parallel = parallelize(build(plan.model, device="meta"), plan, seed=0)
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() for p in parallel.parameters())  # type: ignore[attr-defined]
    Path(out, f"{rank}.json").write_text(
        json.dumps({"seconds": seconds, "peak_gib": _rss_gib() - before, "local": local})
    )
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(way: str, plan: Plan, world: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as out:
        args = (world, _free_port(), way, plan.to_json(), out)
        mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-1.3b")
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()
    plan = _plan(args.model, args.world)
    full_gib = get_preset(args.model).num_params() * 2 / 2**30
    print(f"{args.model}: {full_gib:.2f} GiB of bf16 weights; FSDP over {args.world} gloo ranks")
    print(f"{'way':<12} {'seconds':>8}  peak RSS above start per rank, GiB")
    for way in ("materialise", "deferred"):
        ranks = run(way, plan, args.world)
        seconds = max(r["seconds"] for r in ranks)
        peaks = "  ".join(f"{r['peak_gib']:.2f}" for r in ranks)
        print(f"{way:<12} {seconds:8.1f}  {peaks}")


if __name__ == "__main__":
    main()
