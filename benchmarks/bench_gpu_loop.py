"""Predicted against measured training steps on one GPU: calibrate, plan, measure, compare.

    python benchmarks/bench_gpu_loop.py --workdir DIR                  # on a GPU machine
    python benchmarks/bench_gpu_loop.py --workdir benchmarks/data/h200 --reuse   # anywhere
    python benchmarks/bench_gpu_loop.py --small --workdir DIR          # tiny models, on a CPU

On a GPU (one process, NCCL) the benchmark

1. runs ``plan calibrate --base BASE`` (GEMM, memory-bound and attention sweeps);
2. times the GEMMs ``plan calibrate`` sweeps on GPUs (``GPU_MATMUL_SHAPES``: the shapes
   transformer layers run), in bf16 and, where the GPU has them, fp8
   (``torch._scaled_mm``, per-tensor scales), into ``gemm.csv``;
3. makes a plan per entry of ``GPU_PLANS`` (Llama-3.2 1B, GPT-3 1.3B, OLMoE 1B-7B, one
   GPU, bf16 with fp32 master weights, AdamW) and measures each with
   ``strategies.measure.measure_plan`` (what ``plan measure`` runs);
4. prints, per plan, the measured step time and peak memory against the cost model's
   prediction on the datasheet profile (``BASE``, priced with the options of the run
   that measured it: ``plan compare --profile``), on the calibrated one, and on the
   calibrated one with its GEMM fit redone on ``gemm.csv`` ("GEMMs refit": a run
   calibrated before the sweep took these shapes); then the GEMM table: each shape's
   measured time against the cost model's on the three profiles.

``--reuse`` skips steps 1-3 and compares what ``--workdir`` holds, so the figures of a
GPU run stored in the repository (``benchmarks/data/h200``) reprint on any machine with
the cost model of the day.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_cpu_loop import loop_parser, loop_workdir

from planner.assemble import assemble_plan
from planner.calibrate import measured_run_options, predict_plan
from planner.calibrate.fit import fit_matmul
from planner.cli.calibrate import GPU_MATMUL_SHAPES
from planner.cost import RunConfig, estimate_run
from planner.cost.compute import ComputeModel
from planner.hardware import HardwareProfile, load_profile
from planner.io import write_text_atomic
from planner.measured import MeasuredProfile
from planner.models import ModelHandle, build
from planner.presets import get_preset
from planner.spec import (
    Cluster,
    DType,
    Plan,
    Prediction,
    Strategy,
    Training,
    load_document,
)

# name -> (preset, seq, global batch, strategy): one GPU each
GPU_PLANS: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "llama-1b mbs1 x8": ("llama3.2-1b", 4096, 8, {"micro_batch_size": 1}),
    "llama-1b mbs2 x4": ("llama3.2-1b", 4096, 8, {"micro_batch_size": 2}),
    "llama-1b mbs4 x2": ("llama3.2-1b", 4096, 8, {"micro_batch_size": 4}),
    "llama-1b mbs8": ("llama3.2-1b", 4096, 8, {"micro_batch_size": 8}),
    "llama-1b mbs4 sel": ("llama3.2-1b", 4096, 8, {"micro_batch_size": 4, "recompute": "selective"}),
    "llama-1b mbs8 full": ("llama3.2-1b", 4096, 8, {"micro_batch_size": 8, "recompute": "full"}),
    "gpt-1.3b mbs8 x2": ("gpt3-1.3b", 2048, 16, {"micro_batch_size": 8}),
    "olmoe mbs1 x4 full": ("olmoe-1b-7b", 4096, 4, {"micro_batch_size": 1, "recompute": "full"}),
}  # fmt: skip
# The same loop on tiny models, to check the benchmark itself on a CPU (--small).
SMALL_PLANS: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "tiny-llama mbs1 x4": ("tiny-llama", 32, 4, {"micro_batch_size": 1}),
    "tiny-llama mbs4 full": ("tiny-llama", 32, 4, {"micro_batch_size": 4, "recompute": "full"}),
    "tiny-moe mbs2 x2": ("tiny-moe", 32, 4, {"micro_batch_size": 2}),
}  # fmt: skip
SMALL_GEMM_SHAPES = ((64, 64, 64), (256, 256, 256), (512, 512, 2048))


def _plan_file(name: str, entry: tuple[str, int, int, dict[str, Any]], base: str,
               workdir: Path) -> Path:  # fmt: skip
    preset, seq, global_batch, strategy = entry
    spec = get_preset(preset).model_copy(update={"seq_len": seq})
    handle = ModelHandle(spec.name, "preset", build(spec), lambda b, s: (), spec)
    dtype = DType.BF16 if load_profile(base).device_kind == "gpu" else DType.FP32
    training = Training(global_batch_size=global_batch, dtype=dtype, optimizer="adamw")
    micro_batches = global_batch // strategy["micro_batch_size"]
    plan = assemble_plan(handle, Cluster(gpu=base, num_gpus=1, gpus_per_node=1), training,
                         Strategy(**strategy, num_microbatches=micro_batches))  # fmt: skip
    path = workdir / f"plan-{_slug(name)}.json"
    write_text_atomic(path, plan.to_json())
    return path


def _slug(name: str) -> str:
    return name.replace(" ", "_").replace(".", "")


def _measured_path(plan: Path) -> Path:
    return plan.with_name(plan.name.replace("plan-", "measured-", 1))


def _out_of_memory_path(plan: Path) -> Path:
    """Where the worker says that ``plan`` ran out of device memory (the error's line)."""
    return _measured_path(plan).with_suffix(".oom")


def _run(command: list[str], *, ranks: int, one_thread: bool) -> str:
    """``python -m torch.distributed.run --nproc-per-node RANKS COMMAND``'s stdout (with
    ``one_thread``, one thread per rank: a CPU's calibration and the runs it prices);
    exits on failure."""
    full = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), *command]
    threads = {"OMP_NUM_THREADS": "1"} if one_thread else {}
    result = subprocess.run(full, capture_output=True, text=True, env={**os.environ, **threads})
    if result.returncode != 0:
        own = [line for line in result.stderr.splitlines() if "torch/distributed" not in line]
        sys.exit(f"failed: {' '.join(full)}\n" + "\n".join(own[-40:]))
    return result.stdout.rstrip()


def _worker(args: argparse.Namespace) -> int:
    """Under torchrun: time the GEMM shapes, then measure every plan (a plan that runs out
    of memory is reported and skipped)."""
    import torch

    import strategies.measure as measure  # torch.distributed only in the worker
    from strategies.runner import process_group_from_env

    with process_group_from_env():
        _gemm_sweep(args.workdir / "gemm.csv", small=args.small)
        for path in args.plans:
            plan = load_document(Plan, path)
            try:
                measured = measure.measure_plan(plan, steps=args.steps, warmup=args.warmup,
                                                command=f"bench_gpu_loop {path.stem}")  # fmt: skip
            except torch.OutOfMemoryError as error:
                message = str(error).splitlines()[0]
                write_text_atomic(_out_of_memory_path(path), message + "\n")
                print(f"{path.stem}: out of memory ({message})", flush=True)
                torch.cuda.empty_cache()
                continue
            write_text_atomic(_measured_path(path), measured.model_dump_json(indent=2) + "\n")
            print(f"{path.stem}: {measured.step_time_median_s * 1e3:.1f} ms, "
                  f"{measured.peak_memory_max_gib:.2f} GiB", flush=True)  # fmt: skip
    return 0


def _gemm_sweep(out: Path, *, small: bool) -> None:
    """Median seconds of each GEMM shape in bf16 (fp32 on a CPU) and fp8 where it runs."""
    import torch

    from planner.calibrate.microbench import matmul_sweep

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    shapes = SMALL_GEMM_SHAPES if small else GPU_MATMUL_SHAPES
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [("bf16" if device.type == "cuda" else "fp32", *shape, s.seconds)
            for shape, s in zip(shapes, matmul_sweep(device, dtype, shapes), strict=True)]  # fmt: skip
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        try:
            rows += [("fp8", *shape, _fp8_seconds(shape, device)) for shape in shapes]
        except RuntimeError as error:  # a torch without this GPU's fp8 GEMM: bf16 alone
            print(f"fp8 GEMMs not timed: {str(error).splitlines()[0]}", flush=True)
    lines = ["dtype,m,k,n,seconds"] + [",".join(map(str, row)) for row in rows]
    write_text_atomic(out, "\n".join(lines) + "\n")
    print(f"timed {len(rows)} GEMMs into {out}", flush=True)


def _fp8_seconds(shape: tuple[int, int, int], device: Any) -> float:
    """Median seconds of one e4m3 ``(m, k) @ (k, n)`` GEMM with per-tensor scales, bf16 out."""
    import torch

    from planner.calibrate.microbench import time_call

    m, k, n = shape
    one = torch.ones((), device=device)
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major
    return time_call(
        lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device
    )


def _step_table(names: list[str], plans: list[Plan], profiles: dict[str, HardwareProfile],
                workdir: Path) -> None:  # fmt: skip
    """Measured step time against each profile's prediction, and peak memory against the
    first's (memory does not depend on the profile)."""
    print(f"\n{'plan':<20} {'measured':>9} " + " ".join(f"{k:>15}" for k in profiles)
          + f" {'mem meas':>9} {'mem pred':>16}")  # fmt: skip
    errors: dict[str, list[float]] = {**{k: [] for k in profiles}, "memory": []}
    base = next(iter(profiles.values()))
    for name, plan in zip(names, plans, strict=True):
        path = _measured_path(workdir / f"plan-{_slug(name)}.json")
        if not path.is_file():
            print(f"{name:<20} {_not_measured(plan, base, path.with_suffix('.oom'))}")
            continue
        run = load_document(MeasuredProfile, path)
        measured_s, measured_gib = run.step_time_median_s, run.peak_memory_max_gib
        cells = []
        for key, profile in profiles.items():
            predicted_s = _predict(plan, profile).step_time_s
            errors[key].append(error := predicted_s / measured_s - 1)
            cells.append(f"{predicted_s * 1e3:6.0f}ms {error:+6.1%}")
        predicted_gib = _predict(plan, base).peak_memory_gib
        errors["memory"].append(mem_error := predicted_gib / measured_gib - 1)
        print(f"{name:<20} {measured_s * 1e3:7.0f}ms {' '.join(cells)} "
              f"{measured_gib:8.2f}G {predicted_gib:8.2f}G {mem_error:+6.1%}")  # fmt: skip
    for key, values in errors.items():
        if values:
            mean = sum(abs(v) for v in values) / len(values)
            worst = max(values, key=abs)
            what = "peak memory" if key == "memory" else f"step time, {key} profile"
            print(f"{what}: {len(values)} plans, mean |error| {mean:.1%}, worst {worst:+.1%}")


def _not_measured(plan: Plan, base: HardwareProfile, out_of_memory: Path) -> str:
    """Why ``plan`` has no measurement: out of memory, with what the cost model said, or
    not run."""
    if not out_of_memory.is_file():
        return "not measured (not run)"
    planned = estimate_run(RunConfig.from_plan(plan))  # the plan's own options: margins too
    return (
        f"out of memory on the device ({out_of_memory.read_text().split('.')[0]}): predicted "
        f"{_predict(plan, base).peak_memory_gib:.1f} GiB allocated, {planned.peak_memory_gib:.1f}"
        f" GiB as planned of {planned.memory_limit_gib:.1f} (fits: {planned.fits})"
    )


def _gemm_rows(path: Path) -> list[tuple[DType, int, int, int, float]]:
    """(dtype, m, k, n, seconds) of each GEMM the worker timed."""
    with path.open() as f:
        return [(DType(r["dtype"]), int(r["m"]), int(r["k"]), int(r["n"]), float(r["seconds"]))
                for r in csv.DictReader(f)]  # fmt: skip


def _gemm_fit(profile: HardwareProfile, rows: list[tuple[DType, int, int, int, float]],
              dtype: DType) -> dict[str, float]:  # fmt: skip
    """GEMM efficiency and overhead fitted on the ``dtype`` GEMMs of ``rows``, as ``plan
    calibrate`` fits its sweep (the same shapes on GPUs)."""
    timed = [(2.0 * m * k * n, seconds) for kind, m, k, n, seconds in rows if kind is dtype]
    return fit_matmul(
        [f for f, _ in timed], [t for _, t in timed], profile.peak_flops(dtype)
    ).values


def _gemm_refit(profile: HardwareProfile, rows: list[tuple[DType, int, int, int, float]],
                dtype: DType) -> HardwareProfile:  # fmt: skip
    """``profile`` with its GEMM fit redone on the ``dtype`` GEMMs of ``rows`` and, where
    fp8 GEMMs were timed, ``fp8_matmul_ratio`` as the fp8 fit's efficiency over it."""
    fitted = _gemm_fit(profile, rows, dtype)
    if any(kind is DType.FP8 for kind, *_ in rows):
        fp8 = _gemm_fit(profile, rows, DType.FP8)["matmul_efficiency"]
        fitted["fp8_matmul_ratio"] = fp8 / fitted["matmul_efficiency"]
    return profile.model_copy(update=fitted)


def _gemm_table(rows: list[tuple[DType, int, int, int, float]],
                profiles: dict[str, HardwareProfile]) -> None:  # fmt: skip
    """Each GEMM's measured time against each profile's (``ComputeModel.gemm_time``)."""
    print(f"\n{'dtype':<5} {'m x k x n':<22} {'measured':>10} {'TFLOP/s':>8} "
          + " ".join(f"{k:>11}" for k in profiles))  # fmt: skip
    errors: dict[tuple[str, str], list[float]] = {}
    for dtype, m, k, n, seconds in rows:
        flops, nbytes = 2.0 * m * k * n, dtype.activation_bytes * (m * k + k * n + m * n)
        cells = []
        for label, profile in profiles.items():
            model = ComputeModel(profile, dtype, measured_run_options(profile))
            error = model.gemm_time(flops, nbytes) / seconds - 1
            errors.setdefault((dtype.value, label), []).append(error)
            cells.append(f"{error:+11.1%}")
        print(f"{dtype.value:<5} {f'{m}x{k}x{n}':<22} {seconds * 1e6:8.1f}us "
              f"{flops / seconds / 1e12:8.1f} {' '.join(cells)}")  # fmt: skip
    for (dtype_name, label), values in errors.items():
        mean = sum(abs(v) for v in values) / len(values)
        print(f"GEMM {dtype_name}, {label} profile: {len(values)} shapes, mean |error| "
              f"{mean:.1%}, range {min(values):+.1%} to {max(values):+.1%}")  # fmt: skip


def _predict(plan: Plan, profile: HardwareProfile) -> Prediction:
    return predict_plan(plan, profile, measured_run_options(profile))


def main() -> int:
    parser = loop_parser(__doc__.split("\n")[0], steps=8,
                         reuse="compare the profile and runs already in --workdir")  # fmt: skip
    parser.add_argument("--base", default="h200-sxm-141gb",
                        help="datasheet profile of this GPU (default: h200-sxm-141gb)")  # fmt: skip
    parser.add_argument("--small", action="store_true",
                        help="tiny models, a CPU calibrated as their profile: check the benchmark")  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    entries = SMALL_PLANS if args.small else GPU_PLANS
    workdir = loop_workdir(parser, args, "bench_gpu_loop.")
    started = time.perf_counter()
    calibrated_path = workdir / "calibrated.json"
    # a CPU has no datasheet profile: it is calibrated over 2 ranks and is its own base
    base_name = str(calibrated_path) if args.small else args.base
    names = list(entries)
    if args.reuse:  # the plans that were measured, as they were made
        paths = [workdir / f"plan-{_slug(name)}.json" for name in names]
    else:
        calibrate = ["-m", "planner", "calibrate", "-o", str(calibrated_path)]
        print(_run(calibrate + ([] if args.small else ["--base", base_name]),
                   ranks=2 if args.small else 1, one_thread=args.small))  # fmt: skip
        paths = [_plan_file(name, entries[name], base_name, workdir) for name in names]
        worker = [__file__, "--worker", "--workdir", str(workdir), "--steps", str(args.steps),
                  "--warmup", str(args.warmup), *(["--small"] if args.small else [])]  # fmt: skip
        print(_run([*worker, *map(str, paths)], ranks=1, one_thread=args.small))
    calibrated = load_profile(str(calibrated_path))
    print(f"\n{calibrated.description}")
    plans = [load_document(Plan, path) for path in paths]
    gemms = _gemm_rows(workdir / "gemm.csv")
    profiles = {
        "datasheet": load_profile(base_name),
        "calibrated": calibrated,
        "GEMMs refit": _gemm_refit(calibrated, gemms, plans[0].training.dtype),
    }
    refit = profiles["GEMMs refit"]
    if refit.fp8_matmul_ratio is not None:
        print(f"fp8 GEMMs reach {refit.fp8_matmul_ratio:.3f} of bf16's efficiency (each fitted "
              f"on gemm.csv: {refit.matmul_efficiency_for(DType.FP8):.3f} of the fp8 peak, "
              f"{refit.matmul_efficiency:.3f} of the bf16 peak)")  # fmt: skip
    _step_table(names, plans, profiles, workdir)
    _gemm_table(gemms, profiles)
    print(f"\nworkdir {workdir}; benchmark took {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
