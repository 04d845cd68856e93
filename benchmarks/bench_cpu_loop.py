"""Proof of the calibrate -> plan -> measure -> compare loop on this CPU machine.

    python benchmarks/bench_cpu_loop.py [--workdir DIR] [--steps 6] [--warmup 3] [--passes 2]
    python benchmarks/bench_cpu_loop.py --workdir DIR --reuse   # refit and compare again

CPU, gloo, 2 ranks with one thread each (``OMP_NUM_THREADS=1``). The benchmark

1. runs ``plan calibrate`` (microbenchmarks) under torchrun;
2. measures plans of two *other* GPT sizes (the calibration runs) and ten plans of a
   GPT with 6 layers, hidden 384, sequence 256 (DP, FSDP, TP, TP+SP, PP 1F1B with 4
   micro-batches, DP with PowerSGD, full recompute, context parallel, DP and FSDP over
   2 micro-batches), all in one
   torchrun job with ``strategies.measure.measure_plan`` (what ``plan measure`` runs),
   in ``--passes`` interleaved passes: each plan keeps its pass with the lowest median
   step, since other processes on a shared machine slow whole runs down, never speed
   them up;
3. refits the profile to the calibration runs alone with ``plan calibrate --from``
   (the target model is never seen), predicts the ten target plans with the
   refitted profile and prints the table: plan, predicted, measured, error, rank by
   prediction, rank by measurement, the peak-memory error and the error of the profile
   ``plan calibrate`` wrote ("micro only": its sweeps, eager step and probe plans on the
   zoo's tiny-llama, :mod:`planner.calibrate.probes`, without the refit); then each
   plan's components (predicted against measured) and whether the targets are met
   (step time within 15% for every plan, memory within 10%, the top-ranked plan
   measured fastest or within 5% of it).

The load average is printed at the start and the end: the figures mean something only
on an otherwise idle machine.
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
from planner.compare import compare_measured
from planner.hardware import HardwareProfile, load_profile
from planner.io import write_text_atomic
from planner.measured import MeasuredProfile
from planner.models import ModelHandle, build
from planner.spec import Cluster, ModelSpec, Plan, Prediction, Strategy, Training, load_document

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
    "CP": {"cp": 2, "micro_batch_size": 4},
    "DP x2": {"dp": 2, "micro_batch_size": 1, "num_microbatches": 2},
    "FSDP x2": {"dp": 2, "zero": 3, "micro_batch_size": 1, "num_microbatches": 2},
}  # fmt: skip
CALIBRATION_PLANS = ("DP", "TP", "PP 1F1B x4", "FSDP")


def _handle(spec: ModelSpec) -> ModelHandle:
    return ModelHandle(spec.name, "spec", build(spec), lambda b, s: (), spec)


def _plan_file(spec: ModelSpec, name: str, workdir: Path) -> Path:
    cluster = Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2)
    training = Training(global_batch_size=GLOBAL_BATCH, dtype="fp32", optimizer="adamw")
    plan = assemble_plan(_handle(spec), cluster, training, Strategy(**TARGET_PLANS[name]))
    path = workdir / f"plan-{spec.name}-{name.replace(' ', '_').replace('+', '')}.json"
    write_text_atomic(path, plan.to_json())
    return path


def _measured_path(plan: Path, index: int) -> Path:
    return plan.with_name(
        plan.name.replace("plan-", "measured-").replace(".json", f"-pass{index}.json")
    )


def _run(command: list[str], *, torchrun: bool = False) -> str:
    """Run ``python [-m torch.distributed.run (2 ranks)] COMMAND``; its stdout and the
    warnings it logged. Exits on failure."""
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2"] if torchrun else []
    full = [sys.executable, *launcher, *command]
    result = subprocess.run(full, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    if result.returncode != 0:
        tail = "\n".join(result.stderr.splitlines()[-20:])
        sys.exit(f"failed: {' '.join(full)}\n{tail}")
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING planner")]
    return "\n".join([result.stdout.rstrip(), *warnings])


def _worker(args: argparse.Namespace) -> int:
    """Under torchrun: measure every plan in ``args.plans`` once per pass, interleaved."""
    import strategies.measure as measure  # torch.distributed only in the worker
    from strategies.runner import process_group_from_env

    plans = [(path, load_document(Plan, path)) for path in args.plans]
    with process_group_from_env() as rank:
        for index in range(args.passes):
            for path, plan in plans:
                measured = measure.measure_plan(
                    plan, steps=args.steps, warmup=args.warmup,
                    command=f"bench_cpu_loop pass {index}",
                )  # fmt: skip
                if rank == 0:
                    out = _measured_path(path, index)
                    write_text_atomic(out, measured.model_dump_json(indent=2) + "\n")
                    print(f"pass {index} {path.stem}: {measured.step_time_median_s * 1e3:.0f} ms",
                          flush=True)  # fmt: skip
    return 0


def _best(plan: Path, passes: int) -> tuple[MeasuredProfile, Path]:
    """The pass with the lowest median step of ``plan``, and its file."""
    runs = [(load_document(MeasuredProfile, p), p) for i in range(passes)
            if (p := _measured_path(plan, i)).is_file()]  # fmt: skip
    return min(runs, key=lambda run: run[0].step_time_median_s)


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for position, index in enumerate(order):
        ranks[index] = position + 1
    return ranks


def _table(
    names: list[str],
    predicted: list[Prediction],
    measured: list[MeasuredProfile],
    micro: list[Prediction],
) -> bool:
    pred_t = [p.step_time_s for p in predicted]
    meas_t = [m.step_time_median_s for m in measured]
    rank_p, rank_m = _ranks(pred_t), _ranks(meas_t)
    print(f"\n{'plan':<13} {'predicted':>10} {'measured':>16} {'error':>7} {'rank pred':>9} "
          f"{'rank meas':>9} {'mem pred':>9} {'mem meas':>9} {'mem err':>7} {'micro only':>10}")  # fmt: skip
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
            f"{m.peak_memory_max_gib:8.3f}G {mem_error:+6.1%} "
            f"{micro[i].step_time_s / meas_t[i] - 1:+9.1%}"
        )
    best = rank_p.index(1)
    top_gap = meas_t[best] / min(meas_t) - 1
    top_ok = top_gap <= 0.05
    errors = [abs(p / m - 1) for p, m in zip(pred_t, meas_t, strict=True)]
    print(f"\nmean |step time error| over the target plans: {sum(errors) / len(errors):.1%}")
    alone = [abs(p.step_time_s / m - 1) for p, m in zip(micro, meas_t, strict=True)]
    print(f"plan calibrate alone (no refit; the 'micro only' column): mean |error| "
          f"{sum(alone) / len(alone):.1%}, max {max(alone):.1%}")  # fmt: skip
    print(f"step time within 15% for every plan: {'yes' if time_ok else 'NO'}")
    print(f"peak memory within 10% for every plan: {'yes' if mem_ok else 'NO'}")
    print(f"top-ranked plan ({names[best]}) measured {top_gap:.1%} slower than the fastest "
          f"({names[meas_t.index(min(meas_t))]}): {'yes' if top_ok else 'NO'}")  # fmt: skip
    return time_ok and mem_ok and top_ok


def _components(
    names: list[str],
    plans: list[Plan],
    predicted: list[Prediction],
    measured: list[MeasuredProfile],
) -> None:
    """Per plan, predicted/measured milliseconds of each component of the step."""
    print("\ncomponents, predicted/measured ms (communication includes the pipeline bubble):")
    for name, plan, prediction, run in zip(names, plans, predicted, measured, strict=True):
        rows = compare_measured(plan, run, prediction).rows[1:-1]
        cells = "  ".join(f"{r.name} {r.predicted * 1e3:.0f}/{r.measured * 1e3:.0f}" for r in rows)
        print(f"  {name:<13} {cells}")


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def loop_parser(description: str, *, steps: int, reuse: str) -> argparse.ArgumentParser:
    """The arguments of a calibrate-measure-compare loop: ``--workdir``, ``--steps``,
    ``--warmup``, ``--reuse`` (helped by ``reuse``), and its torchrun worker's."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workdir", type=Path, help="keep plans, profiles and measurements here")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per plan")
    parser.add_argument("--reuse", action="store_true", help=reuse)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("plans", nargs="*", type=Path, help=argparse.SUPPRESS)
    return parser


def loop_workdir(parser: argparse.ArgumentParser, args: argparse.Namespace, prefix: str) -> Path:
    """``--workdir`` (required with ``--reuse``), or a new temporary one; created."""
    if args.reuse and args.workdir is None:
        parser.error("--reuse needs --workdir")
    workdir: Path = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def main() -> int:
    parser = loop_parser(__doc__.split("\n")[0], steps=6,
                         reuse="refit and compare the profile and runs already in --workdir")  # fmt: skip
    parser.add_argument("--passes", type=int, default=2,
                        help="measure every plan this many times, keep the lowest median")  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    workdir = loop_workdir(parser, args, "bench_cpu_loop.")
    started = time.perf_counter()
    print(f"load average at the start: {_load()}")
    micro = workdir / "my-cpu.json"
    calibration = [_plan_file(spec, name, workdir)
                   for spec in CALIBRATION_MODELS for name in CALIBRATION_PLANS]  # fmt: skip
    names = list(TARGET_PLANS)
    targets = [_plan_file(TARGET, name, workdir) for name in names]
    if args.reuse:
        print(f"reusing the microbenchmarks and measurements in {workdir}")
    else:
        print(_run(["-m", "planner", "calibrate", "-o", str(micro)], torchrun=True))
        print(_run([__file__, "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
                    "--passes", str(args.passes), *map(str, calibration + targets)],
                   torchrun=True))  # fmt: skip
    fitted = workdir / "my-cpu-fit.json"
    runs = [str(_best(path, args.passes)[1]) for path in calibration]
    print(_run(["-m", "planner", "calibrate", "--profile", str(micro), "--from", *runs,
                "-o", str(fitted)]))  # fmt: skip
    plans = [load_document(Plan, path) for path in targets]
    measured = [_best(path, args.passes)[0] for path in targets]
    predicted = _predict(plans, load_profile(str(fitted)))
    ok = _table(names, predicted, measured, _predict(plans, load_profile(str(micro))))
    _components(names, plans, predicted, measured)
    print(f"\nload average at the end: {_load()}")
    print(f"workdir {workdir}; benchmark took {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


def _predict(plans: list[Plan], profile: HardwareProfile) -> list[Prediction]:
    options = measured_run_options(profile)
    return [predict_plan(plan, profile, options) for plan in plans]


if __name__ == "__main__":
    sys.exit(main())
