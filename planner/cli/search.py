"""``plan search`` (also plain ``plan``): find the fastest strategy that fits, write the plan."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from planner.cli.common import (
    MAX_TOP_K,
    TRAINING_OPTIONS,
    add_cluster_args,
    add_model_args,
    add_preference_args,
    add_training_args,
    count,
    output,
    plot_output,
    read_framework_config,
    resolve_model_args,
    resolve_training_args,
)
from planner.cli.render import render_plan
from planner.clusters import resolve_cluster
from planner.errors import SpecError
from planner.frameworks import Framework
from planner.io import write_text_atomic
from planner.plots import plot_plan
from planner.spec import (
    MAX_GPUS,
    MAX_VIRTUAL_STAGES,
    Cluster,
    Plan,
    Prediction,
    RecomputeMode,
    Schedule,
    Training,
)

if TYPE_CHECKING:
    from planner.cost import CostOptions
    from planner.cost.run import RunConfig
    from planner.importers import ImportedRun
    from planner.models import ModelHandle
    from planner.solve.lossy import LossyCompression
    from planner.solve.search import Pins

IMPORT_FORMATS = [framework.value for framework in Framework if framework is not Framework.PLANNER]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "search",
        help="search the fastest plan that fits (the default command)",
        description="Search data/tensor/pipeline/context parallelism, ZeRO, recompute, "
        "micro-batching and schedule for a model on a cluster; print and write the plan.",
    )
    add_model_args(parser)
    cluster = add_cluster_args(parser)
    cluster.add_argument("--gpus", type=count(MAX_GPUS),
                         help="number of GPUs (with a GPU profile)")  # fmt: skip
    add_training_args(parser, batch_required=False)
    pins = parser.add_argument_group("pins (fix a dimension, search the rest)")
    degrees = {
        "dp": "data", "tp": "tensor", "pp": "pipeline", "cp": "context", "ep": "expert",
        "etp": "expert tensor",
    }  # fmt: skip
    for name, what in degrees.items():
        pins.add_argument(
            f"--{name}", type=count(MAX_GPUS), metavar="N", help=f"{what}-parallel degree"
        )
    pins.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (3 = FSDP)")
    pins.add_argument("--dp-shard", type=count(MAX_GPUS), metavar="N",
                      help="ranks ZeRO shards over (less than dp: hybrid sharding)")  # fmt: skip
    pins.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                      help="sequence parallel with tensor parallel")  # fmt: skip
    pins.add_argument("--recompute", choices=[r.value for r in RecomputeMode],
                      help="activation recompute")  # fmt: skip
    pins.add_argument("--schedule", choices=[s.value for s in Schedule], help="pipeline schedule")
    pins.add_argument("--virtual-stages", type=count(MAX_VIRTUAL_STAGES), metavar="V",
                      help="model chunks per pipeline rank (interleaved-1f1b)")  # fmt: skip
    choice = add_preference_args(parser, "planner, or the framework of the --from config")
    choice.add_argument(
        "--from", dest="from_config", type=Path, metavar="FILE",
        help="a torchtitan job config, Megatron-LM arguments or a DeepSpeed config you run "
        "now: plan the same job (its model, GPUs, batch and precision), price your config "
        "and say what differs",
    )  # fmt: skip
    choice.add_argument(
        "--format", choices=list(IMPORT_FORMATS),
        help="the --from config's format (default: detected from its content)",
    )  # fmt: skip
    lossy = parser.add_argument_group("gradient compression")
    lossy.add_argument(
        "--allow-lossy-compression", nargs="?", const="default", metavar="OPTIONS",
        help="let the search choose lossy gradient compression where it pays: a comma list "
        "of bf16 (or fp16), int8 (FSDP reduce-scatter), powersgd[:RANK] (default rank 4), "
        "local_sgd[:PERIOD] (default 8 steps); without a list, bf16, int8 and powersgd:4. "
        "Off by default",
    )  # fmt: skip
    out = parser.add_argument_group("output")
    out.add_argument("-o", "--output", metavar="plan.json", help="write the plan")
    out.add_argument("--top-k", type=count(MAX_TOP_K), default=5, help="runners-up to keep")
    out.add_argument("--json", action="store_true", help="print the plan JSON instead of tables")
    out.add_argument(
        "--plot", metavar="out.png",
        help="draw the step-time breakdown of the plan and its runners-up, and the Pareto "
        "front of throughput against memory (the search then prices the whole front)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def _cluster(args: argparse.Namespace) -> Cluster:
    return resolve_cluster(args.cluster, num_gpus=args.gpus, gpus_per_node=args.gpus_per_node)


def _pins(args: argparse.Namespace) -> Pins:
    from planner.solve.search import Pins

    return Pins(
        dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=args.etp, zero=args.zero,
        dp_shard=args.dp_shard,
        sequence_parallel=args.sequence_parallel,
        recompute=RecomputeMode(args.recompute) if args.recompute else None,
        schedule=Schedule(args.schedule) if args.schedule else None,
        virtual_stages=args.virtual_stages,
    )  # fmt: skip


def _lossy(args: argparse.Namespace) -> LossyCompression | None:
    from planner.solve.lossy import LossyCompression

    allowed = args.allow_lossy_compression
    return None if allowed is None else LossyCompression.parse(allowed)


class _LazyProgress:
    """A progress bar on stderr (a terminal) that appears once a search has run for a second."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.started = time.perf_counter()
        self.bar: Progress | None = None
        self.task = TaskID(0)

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if not self.console.is_terminal or time.perf_counter() - self.started < 1.0:
                return
            self.bar = Progress(
                TextColumn("searching"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
                TimeElapsedColumn(), console=self.console, transient=True,
            )  # fmt: skip
            self.bar.start()
            self.task = self.bar.add_task("search", total=total)
        self.bar.update(self.task, completed=done, total=total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class _Job(NamedTuple):
    """What to plan: the model, cluster, training, cost options and target, from the
    command line or from an existing framework config (``imported``)."""

    handle: ModelHandle
    cluster: Cluster
    training: Training
    options: CostOptions | None
    target: str
    imported: ImportedRun | None
    config_run: RunConfig | None  # the imported config's own run, at --seq


def _job(args: argparse.Namespace) -> _Job:
    from planner.models import resolve_model

    if args.from_config is None:
        if args.format is not None:
            raise SpecError("--format only applies with --from")
        if args.global_batch is None:
            raise SpecError(
                "--global-batch is required: give the sequences per optimizer step, or plan "
                "the job of a config you have with --from FILE"
            )
        handle, cluster = resolve_model_args(args), _cluster(args)
        return _Job(
            handle, cluster, resolve_training_args(args), None, args.target or "planner", None,
            None,
        )  # fmt: skip
    given = [
        option for option, name in TRAINING_OPTIONS.items()
        if getattr(args, name) is not None and option != "--seq"  # for a config without one
    ]  # fmt: skip
    if given or args.hf_config:
        raise SpecError(
            f"{', '.join(given) or '--hf-config'} with --from: the config sets the model and "
            "training; edit the config, or plan without --from"
        )
    imported, run = read_framework_config(args)
    target = args.target or imported.release or imported.format
    return _Job(
        resolve_model(run.model), run.cluster, run.training, run.options, target, imported, run
    )


def _compare_with_yours(
    imported: ImportedRun, yours: Prediction, plan: Plan, console: Console
) -> None:
    """Your config's price (``yours``) next to the plan's, and what differs."""
    from planner.importers import describe_changes

    ours = plan.prediction
    assert ours is not None  # a searched plan carries its prediction
    fits = "fits" if yours.fits else "does NOT fit"
    console.print(
        f"[bold]your config[/bold] ({imported.source}, {imported.format}): "
        f"{imported.run.strategy.describe()}: {yours.step_time_s:.3f} s/step, "
        f"{yours.peak_memory_gib:.1f} GiB of {yours.memory_limit_gib:.1f} ({fits})"
    )
    speedup = yours.step_time_s / ours.step_time_s
    console.print(
        f"[bold]planned[/bold] (for {plan.target}): {ours.step_time_s:.3f} s/step, "
        f"{ours.peak_memory_gib:.1f} GiB: {speedup:.2f}x "
        + ("faster" if speedup >= 1 else "slower (your config is faster: keep it)")
    )
    console.print(
        f"[bold]what differs[/bold]: {describe_changes(imported.run.strategy, plan.strategy)}"
    )


def run(args: argparse.Namespace) -> int:
    from planner.planning import search_plan  # torch: the model is traced

    destination = output(args.output, "--output")  # before the search
    plot = plot_output(args.plot)
    job = _job(args)
    yours = None  # the config's own run, priced as planned (at --seq where it states none)
    if job.config_run is not None:
        from planner.cost.run import estimate_run

        yours = estimate_run(job.config_run)
    progress = _LazyProgress(Console(stderr=True))
    try:
        found = search_plan(job.handle, job.cluster, job.training, pins=_pins(args),
                            top_k=args.top_k, options=job.options, progress=progress,
                            pareto=plot is not None, lossy=_lossy(args), target=job.target,
                            headroom=args.memory_headroom, tolerance=args.tolerance / 100)  # fmt: skip
    finally:
        progress.close()
    plan = found.plan
    if plot is not None:
        plot_plan(found, plot, yours=yours)
    if destination is not None:
        write_text_atomic(destination, plan.to_json() + "\n", option="--output")
    console = Console()
    if args.json:
        print(plan.to_json())
    else:
        render_plan(plan, console)
        if job.imported is not None and yours is not None:
            _compare_with_yours(job.imported, yours, plan, console)
        for path in (destination, plot):
            if path is not None:
                # not rich's print: it would wrap a long path and read [...] as markup
                print(f"wrote {path}")
    return 0
