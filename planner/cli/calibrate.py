"""``plan calibrate``: measure this machine into a hardware profile, or refit one to runs.

Microbenchmarks (launch under torchrun so the collectives run over the process group)::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m planner calibrate -o my-cpu.json
    torchrun --nproc-per-node 8 -m planner calibrate --base h100-sxm-80gb -o my-h100.json

On CPUs over 2 or more ranks the microbenchmarks end with the probe plans
(:mod:`planner.calibrate.probes`): the probe model trained under DDP, FSDP, TP, TP+SP
and a pipeline, to which the framework and collective overheads are refitted.

Refit to measured runs (no torchrun)::

    plan calibrate --profile my-cpu.json --from m1.json m2.json -o my-cpu-fit.json

Fit the links to nccl-tests output (no torchrun; one node's tables fit the scale-up
link, tables across nodes the network)::

    plan calibrate --base h100-sxm-80gb --nccl-tests all_reduce.txt all_gather.txt -o my-h100.json

The profile is written atomically; a failed fit writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from rich.console import Console

from planner.cli.common import output, positive_float
from planner.dtypes import RUNTIME_DTYPES
from planner.errors import SpecError
from planner.hardware import PEAK_LIMIT, HardwareProfile, load_profile, save_profile
from planner.measured import MeasuredProfile
from planner.spec import DType, load_document

if TYPE_CHECKING:  # the measuring and fitting machinery loads torch: imported on use
    import torch

    from planner.calibrate.fit import Sample
    from planner.calibrate.nccl_tests import LinkCalibration
    from planner.calibrate.profile import CalibrationReport, Measurements
    from planner.calibrate.refit import RefitReport, RunError
    from planner.cost.communication import Collective

# (m, k, n) GEMMs that transformer layers run: 1-32K tokens through hidden sizes 2048-8192
# and their attention, MLP and vocabulary projections. Fitted on square products instead
# (which run faster), an H200's profile priced its dense training steps 6-16% too fast,
# against within 7% fitted on these (benchmarks/data/h200, bench_gpu_loop.py).
GPU_MATMUL_SHAPES: tuple[tuple[int, int, int], ...] = tuple(
    (m, k, n)
    for m in (1024, 4096, 16384, 32768)
    for k, n in ((2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (2048, 128256),
                 (4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672))
)  # fmt: skip
_GPU_MEMORY = (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 27)
_GPU_ATTENTION = ((16, 1024, 128), (32, 2048, 128), (32, 4096, 128))
_GPU_COLLECTIVE_BYTES = (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 27)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="microbenchmark this machine into a hardware profile, refit one to runs, or fit "
        "its links to nccl-tests output",
        description="Without --from or --nccl-tests: GEMM, memory-bound, attention and "
        "collective sweeps (under torchrun), fitted into a hardware profile. With --from: "
        "refit --profile's efficiencies, overheads and bandwidths to measured profiles. With "
        "--nccl-tests: fit --base's links (NCCL's protocol curve) to your cluster's "
        "nccl-tests output.",
    )
    parser.add_argument("-o", "--output", required=True, metavar="profile.json",
                        help="hardware profile to write (JSON)")  # fmt: skip
    parser.add_argument("--name", help="profile name (default: the output file's stem)")
    parser.add_argument(
        "--base", metavar="PROFILE",
        help="datasheet profile for peak FLOP/s, memory bandwidth and the inter-node link "
        "(GPUs: e.g. h100-sxm-80gb); CPUs need none",
    )  # fmt: skip
    parser.add_argument("--peak-tflops", type=positive_float(PEAK_LIMIT),
                        help="override the peak per rank (TFLOP/s)")  # fmt: skip
    parser.add_argument("--dtype", choices=RUNTIME_DTYPES,
                        help="GEMM dtype (default: fp32 on CPU, bf16 on GPU)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument(
        "--no-probe-runs", dest="probe_runs", action="store_false",
        help="on CPUs over 2+ ranks, do not train the probe model's DDP, FSDP, TP, TP+SP and "
        "pipeline plans and refit the framework and collective overheads to them (the "
        "profile then prices only what a DDP step shows)",
    )  # fmt: skip
    refit = parser.add_argument_group("refit to measured runs")
    refit.add_argument("--from", dest="runs", nargs="+", type=Path, metavar="measured.json",
                       help="measured profiles written by 'plan measure'")  # fmt: skip
    refit.add_argument("--profile", metavar="PROFILE", help="the profile to refit (with --from)")
    links = parser.add_argument_group("fit the links to nccl-tests output")
    links.add_argument(
        "--nccl-tests", nargs="+", type=Path, metavar="OUTPUT",
        help="output files of nccl-tests (all_reduce_perf, all_gather_perf, reduce_scatter_perf, "
        "alltoall_perf, sendrecv_perf, broadcast_perf) run on your cluster; --base is the "
        "profile whose links they refit",
    )  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    args.output = output(args.output, "--output")  # before any measuring or fitting
    if args.nccl_tests:
        return _fit_links(args)
    if args.runs:
        return _refit(args)
    if args.profile:
        raise SpecError("--profile is the profile to refit: use it together with --from")
    return _microbenchmark(args)


def _stamp() -> str:
    import torch

    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    return f"measured {today} on {platform.node()} (torch {torch.__version__})"


def _refit(args: argparse.Namespace) -> int:
    from planner.calibrate.options import measured_run_options
    from planner.calibrate.refit import refit_profile

    if not args.profile:
        raise SpecError("--from needs --profile PROFILE: the profile whose parameters to refit")
    profile = load_profile(args.profile)
    runs = [load_document(MeasuredProfile, path) for path in args.runs]
    fitted, report = refit_profile(
        profile, runs, options=measured_run_options(profile), stamp=_stamp()
    )
    fitted = fitted.model_copy(update={"name": args.name or args.output.stem})
    save_profile(fitted, args.output)
    print(format_refit(report))
    print(f"wrote {args.output}")
    return 0


def _fit_links(args: argparse.Namespace) -> int:
    from planner.calibrate.nccl_tests import calibrate_links, read_nccl_tests

    if args.runs or args.profile:
        raise SpecError(
            "--nccl-tests fits the links of --base; --from/--profile refit a profile to "
            "measured runs: run them one after the other"
        )
    if not args.base:
        raise SpecError(
            "--nccl-tests needs --base PROFILE: the profile whose links the tables refit "
            "(a shipped one such as h100-sxm-80gb, or one 'plan calibrate' wrote)"
        )
    base = load_profile(args.base)
    tables = [table for path in args.nccl_tests for table in read_nccl_tests(path)]
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    fitted, report = calibrate_links(base, tables, today)
    fitted = fitted.model_copy(update={"name": args.name or args.output.stem})
    save_profile(fitted, args.output)
    print(format_link_fit(report, base.name))
    print(f"wrote {args.output}")
    return 0


def format_link_fit(report: LinkCalibration, base: str) -> str:
    """The GPUs the tables ran on, each table's error before and after on ``base`` and on
    the fitted profile, then each fitted field's old and new value (marked where the fit
    left it on the edge of its range)."""
    labels = [fit.table.label for fit in report.tables]
    width = max(len(label) for label in labels)
    devices = ", ".join(sorted({fit.table.device for fit in report.tables}))
    lines = [f"{base}'s links fitted to nccl-tests run on {devices}"]
    lines.append(f"{'table':<{width}} {'sizes':>5} {'before':>8} {'after':>8}")
    for label, table in zip(labels, report.tables, strict=True):
        lines.append(
            f"{label:<{width}} {len(table.table.rows):>5} {table.before:>8.1%} {table.after:>8.1%}"
        )
    edges = {f"links.{tier}.{name}" for tier, fit in report.fits.items() for name in fit.at_bounds}
    for tier, fit in report.fits.items():
        lines.append(f"{tier}: {fit.describe_error()} ({fit.samples} sizes)")
    for path, (old, new) in report.fields.items():
        edge = "  (at the edge of its range)" if path in edges else ""
        lines.append(f"  {path:<48} {old:10.4g} -> {new:10.4g}{edge}")
    return "\n".join(lines)


def format_refit(report: RefitReport) -> str:
    """Per-run error before and after, then each parameter's start and fitted value."""
    width = max(len(e.label) for e in report.before)
    lines = [f"{'run':<{width}}  {'measured':>9}  {'before':>16}  {'after':>16}"]
    for old, new in zip(report.before, report.after, strict=True):
        lines.append(
            f"{old.label:<{width}}  {old.measured_s * 1e3:7.1f}ms  "
            f"{old.predicted_s * 1e3:7.1f}ms {old.error:+6.1%}  "
            f"{new.predicted_s * 1e3:7.1f}ms {new.error:+6.1%}"
        )
    lines.append(
        f"mean |error|: {_mean_abs(report.before):.1%} before, {_mean_abs(report.after):.1%} after"
    )
    for name, start in report.start.items():
        lines.append(f"  {name:<34} {start:10.4g} -> {report.fitted[name]:10.4g}")
    return "\n".join(lines)


def _mean_abs(errors: list[RunError]) -> float:
    return sum(abs(e.error) for e in errors) / len(errors)


def _microbenchmark(args: argparse.Namespace) -> int:
    import torch

    from planner.calibrate.probes import refit_to_probe_runs
    from planner.calibrate.profile import build_profile
    from strategies import microbench as collectives
    from strategies import runner  # the runtime: torch.distributed only there

    gpu = torch.cuda.is_available()
    dtype = DType(args.dtype or ("bf16" if gpu else "fp32"))
    base = load_profile(args.base) if args.base else None
    _check_peak(args, base, gpu, dtype)
    with runner.process_group_from_env() as rank:
        device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        with _sweep_status(show=rank == 0) as announce:
            measured, runs = _measure(args, device, dtype, collectives, announce)
    if rank != 0:  # rank 0 fits after the group is gone: a failed fit strands no rank
        return 0
    peak, peak_source = _peak(args, base, measured.matmul)
    stamp = _stamp()
    profile, report = build_profile(
        measured, name=args.name or args.output.stem, stamp=stamp,
        device_kind="gpu" if gpu else "cpu", base=base, peak_tflops=peak,
        peak_source=peak_source, memory_capacity_gib=_capacity(gpu, measured.ranks_per_node),
    )  # fmt: skip
    if runs:
        profile, report.fits["runtime"] = refit_to_probe_runs(profile, runs, stamp)
    save_profile(profile, args.output)
    print(format_profile(profile, report))
    print(f"wrote {args.output}")
    return 0


def _check_peak(
    args: argparse.Namespace, base: HardwareProfile | None, gpu: bool, dtype: DType
) -> None:
    """Refuse, before anything is measured, a sweep that would end without a peak."""
    import torch

    from planner.calibrate.fit import CalibrationError

    if args.peak_tflops is not None or base is not None:
        return
    if gpu:
        raise CalibrationError(
            f"no peak for {torch.cuda.get_device_name()}: pass --base PROFILE (see 'plan "
            "profiles') or --peak-tflops"
        )
    if dtype is not DType.FP32:
        raise CalibrationError(
            f"the CPU peak estimate is for fp32, not {dtype.value}: pass --peak-tflops"
        )


def _peak(
    args: argparse.Namespace, base: HardwareProfile | None, gemms: Sequence[Sample]
) -> tuple[float | None, str]:
    """The peak per rank (TFLOP/s) and its source: given, the base's (None), or the CPU's
    estimated from the fp32 GEMM sweep (what :func:`_check_peak` leaves)."""
    import torch

    from planner.calibrate.profile import cpu_peak_tflops

    if args.peak_tflops is not None:
        return args.peak_tflops, "given on the command line (--peak-tflops)"
    if base is not None:
        return None, ""
    return cpu_peak_tflops(torch.get_num_threads(), gemms)


def _capacity(gpu: bool, ranks_per_node: int) -> float:
    import torch

    from planner.calibrate.profile import ram_gib

    if gpu:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    return ram_gib(ranks_per_node)


@contextlib.contextmanager
def _sweep_status(*, show: bool) -> Iterator[Callable[[str], None]]:
    """Yield ``announce(sweep)``: a spinner on stderr naming the sweep in progress when
    ``show`` (rank 0) and stderr is a terminal; otherwise announcing does nothing."""
    if not show:
        yield lambda _sweep: None
        return
    with Console(stderr=True).status("calibrating") as status:
        yield lambda sweep: status.update(f"calibrating: {sweep}")


def _measure(
    args: argparse.Namespace,
    device: torch.device,
    dtype: DType,
    collectives: ModuleType,
    announce: Callable[[str], None],
) -> tuple[Measurements, list[MeasuredProfile]]:
    """What the sweeps measured, and the probe plans' runs (CPUs over 2+ ranks)."""
    from planner.calibrate import microbench
    from planner.calibrate.probes import probe_plans
    from planner.calibrate.profile import Measurements
    from planner.torch_dtypes import TORCH_DTYPES

    gpu = device.type == "cuda"
    repeats = 5 if args.quick else 15
    torch_dtype = TORCH_DTYPES[dtype]
    cpu_shapes = microbench.DEFAULT_MATMUL_SHAPES[:: 2 if args.quick else 1]
    announce(f"{dtype.value} matmul sweep")
    matmul = microbench.matmul_sweep(
        device, torch_dtype, GPU_MATMUL_SHAPES if gpu else cpu_shapes, repeats=repeats
    )
    announce("memory-bound kernel sweep")
    memory = microbench.memory_sweep(
        device, torch_dtype, _GPU_MEMORY if gpu else microbench.DEFAULT_MEMORY_ELEMENTS,
        repeats=repeats,
    )  # fmt: skip
    cpu_attention = microbench.DEFAULT_ATTENTION_SHAPES[: 3 if args.quick else None]
    announce("attention sweep")
    attention = microbench.attention_sweep(
        device, torch_dtype, _GPU_ATTENTION if gpu else cpu_attention, repeats=max(3, repeats // 2)
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    samples: list[tuple[Collective, int, float, float]] = []
    if world > 1:
        sizes = _GPU_COLLECTIVE_BYTES if gpu else collectives.DEFAULT_COLLECTIVE_BYTES
        announce(f"collective sweep over {world} ranks")
        for s in collectives.collective_sweep(device, sizes, repeats=repeats // 2 + 1):
            samples.append((s.kind, s.ranks, float(s.size_bytes), s.seconds))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    step = narrow = None
    if not gpu:  # GPU kernels queue ahead of the host: no eager framework time priced there
        announce(f"eager training step of {microbench.PROBE_MODEL}")
        step = microbench.training_step_sample(
            device, repeats=repeats, data_parallel=collectives.data_parallel if world > 1 else None,
            ranks=world,
        )  # fmt: skip
        # a GPU's narrow GEMM waits on memory and launch, not on its kernel's panel
        narrow = microbench.narrow_matmul_sample(device, torch_dtype, repeats=repeats)
    runs: list[MeasuredProfile] = []
    if not gpu and world > 1 and args.probe_runs:
        plans = probe_plans(world, local, args.name or args.output.stem)
        announce(f"{len(plans)} probe plans of {microbench.PROBE_MODEL} over {world} ranks")
        runs = collectives.probe_runs(plans, steps=3 if args.quick else 8, warmup=2)
    return Measurements(dtype, matmul, memory, attention, samples, local, step, narrow), runs


def format_profile(profile: HardwareProfile, report: CalibrationReport) -> str:
    """The fitted parameters with each fit's RMS log error (~relative) before and after."""
    fits = report.fits
    lines = [f"profile {profile.name} ({profile.device_kind})"]
    for name, fit in fits.items():
        values = ", ".join(f"{k} = {v:.4g}" for k, v in fit.values.items())
        lines.append(f"  {name:<12} {values}  ({fit.describe_error()}, {fit.samples} samples)")
    peaks = ", ".join(f"{d.value} {v:.3g}" for d, v in profile.peak_tflops.items())
    lines.append(f"  peak TFLOP/s: {peaks}; memory {profile.memory_capacity_gib:.1f} GiB per rank")
    return "\n".join(lines)
