"""Proof of the calibrate -> plan -> measure -> compare loop on this CPU machine.

    python benchmarks/bench_cpu_loop.py [--workdir DIR] [--steps 8] [--warmup 3]

CPU, gloo, 2 ranks with one thread each (``OMP_NUM_THREADS=1``). The benchmark

1. runs ``plan calibrate`` (microbenchmarks) under torchrun;
2. measures plans of two *other* GPT sizes with ``plan measure`` and refits the
   profile to them with ``plan calibrate --from`` (the target model is never seen);
3. predicts, with the refitted profile, seven plans of a GPT with 6 layers, hidden
   384, sequence 256 (DP, FSDP, TP, TP+SP, PP 1F1B with 4 micro-batches, DP with
   PowerSGD, full recompute), measures each with ``plan measure`` in ``--passes``
   interleaved passes (the lowest median counts: other processes on a shared machine
   slow whole runs down, never speed them up) and prints the
   table: plan, predicted, measured, error, rank by prediction, rank by measurement,
   and the peak-memory error; then whether the targets are met (step time within
   15% for every plan, memory within 10%, the top-ranked plan measured fastest or
   within 5% of it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from planner.assemble import assemble_plan
from planner.calibrate import measured_run_options, predict_plan
from planner.hardware import load_profile
from planner.measured import MeasuredProfile
from planner.models import ModelHandle, build
from planner.spec import (
    Cluster,
    ModelSpec,
    Plan,
    Prediction,
    Strategy,
    Training,
    load_document,
)  # fmt: skip

VOCAB = 2048
TARGET = ModelSpec(name="gpt-6x384", family="gpt", num_layers=6, hidden_size=384,
                   num_heads=6, vocab_size=VOCAB, seq_len=256)  # fmt: skip
CALIBRATION_MODELS = (
    ModelSpec(name="gpt-4x256", family="gpt", num_layers=4, hidden_size=256, num_heads=4,
              vocab_size=VOCAB, seq_len=256),
    ModelSpec(name="gpt-4x512", family="gpt", num_layers=4, hidden_size=512, num_heads=8,
              vocab_size=VOCAB, seq_len=128),
)  # fmt: skip
GLOBAL_BATCH = 4
TARGET_PLANS: dict[str, dict[str, Any]] = {
    "DP": {"dp": 2, "micro_batch_size": 2},
    "FSDP": {"dp": 2, "zero": 3, "micro_batch_size": 2},
    "TP": {"tp": 2, "micro_batch_size": 4},
    "TP+SP": {"tp": 2, "sequence_parallel": True, "micro_batch_size": 4},
    "PP 1F1B x4": {"pp": 2, "micro_batch_size": 1, "num_microbatches": 4},
    "DP PowerSGD": {"dp": 2, "micro_batch_size": 2,
                    "compression": {"kind": "powersgd", "rank": 4}},
    "DP recompute": {"dp": 2, "micro_batch_size": 2, "recompute": "full"},
}  # fmt: skip
CALIBRATION_PLANS = ("DP", "TP", "PP 1F1B x4", "FSDP")


def _handle(spec: ModelSpec) -> ModelHandle:
    return ModelHandle(spec.name, "spec", build(spec), lambda b, s: (), spec)


def _plan_file(spec: ModelSpec, name: str, workdir: Path) -> Path:
    cluster = Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2)
    training = Training(global_batch_size=GLOBAL_BATCH, dtype="fp32", optimizer="adamw")
    plan = assemble_plan(_handle(spec), cluster, training, Strategy(**TARGET_PLANS[name]))
    path = workdir / f"plan-{spec.name}-{name.replace(' ', '_').replace('+', '')}.json"
    path.write_text(plan.to_json())
    return path


def _plan(*args: str, torchrun: bool = False, attempts: int = 1) -> str:
    """Run ``plan ARGS`` (under torchrun with 2 ranks); its stdout. Exits on failure."""
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2"] if torchrun else []
    command = [sys.executable, *launcher, "-m", "planner", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(1, attempts + 1):
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode == 0:
            return result.stdout
        tail = "\n".join(line for line in result.stderr.splitlines()[-15:] if "USDT" not in line)
        print(f"attempt {attempt} of {attempts} failed: {' '.join(command)}\n{tail}")
    sys.exit(f"giving up on: {' '.join(command)}")


def _measure(plan: Path, steps: int, warmup: int, suffix: str = "") -> MeasuredProfile:
    out = plan.with_name(plan.name.replace("plan-", "measured-").replace(".json", f"{suffix}.json"))
    _plan("measure", str(plan), "-o", str(out), "--steps", str(steps), "--warmup", str(warmup),
          torchrun=True, attempts=3)  # fmt: skip
    return load_document(MeasuredProfile, out)


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for position, index in enumerate(order):
        ranks[index] = position + 1
    return ranks


def _table(names: list[str], predicted: list[Prediction], measured: list[MeasuredProfile]) -> bool:
    pred_t = [p.step_time_s for p in predicted]
    meas_t = [m.step_time_median_s for m in measured]
    rank_p, rank_m = _ranks(pred_t), _ranks(meas_t)
    print(f"\n{'plan':<13} {'predicted':>10} {'measured':>16} {'error':>7} {'rank pred':>9} "
          f"{'rank meas':>9} {'mem pred':>9} {'mem meas':>9} {'mem err':>7}")  # fmt: skip
    time_ok = mem_ok = True
    for i, name in enumerate(names):
        m = measured[i]
        error = pred_t[i] / meas_t[i] - 1
        mem_error = predicted[i].peak_memory_gib / m.peak_memory_max_gib - 1
        time_ok &= abs(error) <= 0.15
        mem_ok &= abs(mem_error) <= 0.10
        spread = f"±{(m.step_time_p90_s - m.step_time_p10_s) / 2 * 1e3:.0f}"
        print(
            f"{name:<13} {pred_t[i] * 1e3:8.0f}ms {meas_t[i] * 1e3:8.0f}ms {spread:>5}  "
            f"{error:+6.1%} {rank_p[i]:9d} {rank_m[i]:9d} {predicted[i].peak_memory_gib:8.3f}G "
            f"{m.peak_memory_max_gib:8.3f}G {mem_error:+6.1%}"
        )
    best = rank_p.index(1)
    top_gap = meas_t[best] / min(meas_t) - 1
    top_ok = top_gap <= 0.05
    print(f"\nstep time within 15% for every plan: {'yes' if time_ok else 'NO'}")
    print(f"peak memory within 10% for every plan: {'yes' if mem_ok else 'NO'}")
    print(f"top-ranked plan ({names[best]}) measured {top_gap:.1%} slower than the fastest "
          f"({names[meas_t.index(min(meas_t))]}): {'yes' if top_ok else 'NO'}")  # fmt: skip
    return time_ok and mem_ok and top_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, help="keep plans, profiles and measurements here")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per plan")
    parser.add_argument("--passes", type=int, default=2,
                        help="measure every target this many times, keep the lowest median")  # fmt: skip
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_cpu_loop."))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    micro = workdir / "my-cpu.json"
    print(_plan("calibrate", "-o", str(micro), torchrun=True))
    runs = []
    for spec in CALIBRATION_MODELS:
        for name in CALIBRATION_PLANS:
            measured = _measure(_plan_file(spec, name, workdir), args.steps, args.warmup)
            runs.append(measured)
            print(f"calibration run {spec.name} {name}: {measured.step_time_median_s * 1e3:.0f} ms",
                  flush=True)  # fmt: skip
    fitted = workdir / "my-cpu-fit.json"
    run_files = sorted(str(p) for p in workdir.glob("measured-gpt-4x*.json"))
    print(_plan("calibrate", "--profile", str(micro), "--from", *run_files, "-o", str(fitted)))
    profile = load_profile(str(fitted))
    options = measured_run_options(profile)
    names = list(TARGET_PLANS)
    plans = {name: _plan_file(TARGET, name, workdir) for name in names}
    predicted = [predict_plan(load_document(Plan, plans[name]), profile, options) for name in names]
    passes: dict[str, list[MeasuredProfile]] = {name: [] for name in names}
    for index in range(args.passes):  # interleaved passes: a busy spell hits one pass of a plan
        for name in names:
            passes[name].append(_measure(plans[name], args.steps, args.warmup, f"-pass{index}"))
            median = passes[name][-1].step_time_median_s
            print(f"target {name} pass {index}: {median * 1e3:.0f} ms", flush=True)
    measured_runs = [min(passes[name], key=lambda m: m.step_time_median_s) for name in names]
    ok = _table(names, predicted, measured_runs)
    print(f"\nworkdir {workdir}; benchmark took {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
