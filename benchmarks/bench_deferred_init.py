"""Deferred initialisation and sharded loading against materialising the whole model on
every rank.

A 1B-class zoo model (``llama3.2-1b``, 1.24B parameters, bf16) under FSDP (ZeRO-3) on 4
gloo ranks on the CPU, each way in fresh processes:

- ``materialise``: every rank builds the whole model on the CPU, then applies the plan;
- ``deferred``: every rank builds it on the meta device and ``planner.parallelize``
  allocates and initialises only its shards;
- ``materialise + load``: every rank builds the whole model on the CPU and reads the
  whole Hugging Face checkpoint into it, a file at a time, then applies the plan;
- ``deferred + load hf``: built on meta, ``planner.parallelize(..., weights=HF_DIR)``
  reads only the rank's slices of the safetensors files;
- ``deferred + load dcp``: the same from a ``parallel.save`` checkpoint.

The checkpoints are written first, by one process (``parallel.save``, then
``export_hf`` for the Hugging Face directory). Prints, per way, the wall time of build +
parallelise (+ load) on the slowest rank and each rank's peak resident memory
(``VmHWM``, reset first) above what it held before building; loaded ways check that rank 0 holds
the same first and last values of its shard.

    python benchmarks/bench_deferred_init.py [--model llama3.2-1b] [--world 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
from planner.models.hf_layout import hf_llama_config, hf_name, zoo_name
from planner.spec import Cluster, Plan, Strategy, Training

WAYS = ("materialise", "deferred", "materialise + load", "deferred + load hf",
        "deferred + load dcp")  # fmt: skip


def _plan(model: str, world: int) -> Plan:
    spec = get_preset(model)
    training = Training(global_batch_size=world, seq_len=spec.seq_len, dtype="bf16")
    cluster = Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world)
    strategy = Strategy(dp=world, zero=3 if world > 1 else 0, micro_batch_size=1)
    return assemble_plan(resolve_model(model), cluster, training, strategy)


def _memory_gib(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak since the last reset), GiB."""
    text = Path("/proc/self/status").read_text()
    line = next(line for line in text.splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 2**20


def _load_whole(model: torch.nn.Module, directory: Path) -> None:
    """Every tensor of a Hugging Face directory into ``model``, a file at a time."""
    from safetensors.torch import load_file

    for path in sorted(directory.glob("*.safetensors")):
        part = {zoo_name(name): t for name, t in load_file(path).items()}
        model.load_state_dict(part, strict=False)


def _build_and_apply(way: str, plan: Plan, sources: dict[str, str]) -> object:
    from strategies.apply import parallelize

    assert plan.model is not None
    if way == "materialise":
        return parallelize(build(plan.model, device="cpu", seed=0), plan)
    if way == "deferred":
        return parallelize(build(plan.model, device="meta"), plan, seed=0)
    if way == "materialise + load":
        model = build(plan.model, device="cpu", seed=0)
        _load_whole(model, Path(sources["hf"]))
        return parallelize(model, plan)
    source = sources["hf" if way.endswith("hf") else "dcp"]
    return parallelize(build(plan.model, device="meta"), plan, weights=source)


def _worker(rank: int, world: int, port: int, way: str, plan_json: str, sources: dict[str, str],
            out: str) -> None:  # fmt: skip
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
    )
    plan = Plan.model_validate_json(plan_json)
    torch.set_default_dtype(torch.bfloat16)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from now
    before = _memory_gib("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    parallel = _build_and_apply(way, plan, sources)
    seconds = time.perf_counter() - start
    first = next(iter(parallel.parameters())).detach().to_local()  # type: ignore[attr-defined]
    Path(out, f"{rank}.json").write_text(json.dumps({
        "seconds": seconds, "peak_gib": _memory_gib("VmHWM") - before,
        "probe": [float(first.flatten()[0]), float(first.flatten()[-1])],
    }))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(way: str, plan: Plan, world: int, sources: dict[str, str]) -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory() as out:
        args = (world, _free_port(), way, plan.to_json(), sources, out)
        mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def write_checkpoints(model: str, directory: Path) -> dict[str, str]:
    """A ``parallel.save`` checkpoint and a Hugging Face directory of ``model``'s seeded
    weights (bf16), written by this process."""
    from strategies.apply import parallelize
    from strategies.state import export_hf

    plan = _plan(model, 1)
    assert plan.model is not None
    torch.set_default_dtype(torch.bfloat16)
    parallel = parallelize(build(plan.model, device="meta"), plan, seed=0)
    dcp = parallel.save(directory / "dcp", step=0)
    del parallel
    config = hf_llama_config(plan.model, dtype="bfloat16")
    hf = export_hf(dcp, directory / "hf", rename=hf_name, config=config)
    torch.set_default_dtype(torch.float32)
    return {"dcp": str(dcp), "hf": str(hf)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-1b")
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()
    plan = _plan(args.model, args.world)
    full_gib = get_preset(args.model).num_params() * 2 / 2**30
    largest_gib = max(p.numel() for p in build(get_preset(args.model)).parameters()) * 2 / 2**30
    print(f"{args.model}: {full_gib:.2f} GiB of bf16 weights; FSDP over {args.world} gloo ranks")
    print(f"per rank: its shard {full_gib / args.world:.2f} GiB; the largest tensor "
          f"{largest_gib:.2f} GiB")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        began = time.perf_counter()
        sources = write_checkpoints(args.model, Path(scratch))
        print(f"checkpoints written (dcp, then hf) in {time.perf_counter() - began:.1f} s")
        print(f"{'way':<22} {'seconds':>8}  peak RSS above start per rank, GiB")
        probes = {}
        for way in WAYS:
            ranks = run(way, plan, args.world, sources)
            seconds = max(float(r["seconds"]) for r in ranks)  # type: ignore[arg-type]
            peaks = "  ".join(f"{r['peak_gib']:.2f}" for r in ranks)
            print(f"{way:<22} {seconds:8.1f}  {peaks}")
            probes[way] = ranks[0]["probe"]
    loaded = {way: probe for way, probe in probes.items() if "load" in way}
    same = len({json.dumps(p) for p in loaded.values()}) == 1
    print(f"rank 0's first shard, first and last value, equal across loaded ways: {same}"
          + ("" if same else f" {loaded}"))  # fmt: skip


if __name__ == "__main__":
    main()
