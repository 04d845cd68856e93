"""``plan search`` (also plain ``plan``): find the fastest strategy that fits, write the plan."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from planner.cli.common import MAX_TOP_K, add_model_args, count, output, resolve_model_args
from planner.cli.render import render_plan
from planner.clusters import resolve_cluster
from planner.io import write_text_atomic
from planner.plots import check_plot_path, plot_plan
from planner.spec import (
    MAX_BATCH,
    MAX_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_VIRTUAL_STAGES,
    Cluster,
    DType,
    Optimizer,
    RecomputeMode,
    Schedule,
    Training,
    load_document,
)

if TYPE_CHECKING:
    from planner.solve.lossy import LossyCompression
    from planner.solve.search import Pins


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "search",
        help="search the fastest plan that fits (the default command)",
        description="Search data/tensor/pipeline/context parallelism, ZeRO, recompute, "
        "micro-batching and schedule for a model on a cluster; print and write the plan.",
    )
    add_model_args(parser)
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--cluster", default="h100-sxm-80gb", metavar="PROFILE|CLUSTER|cluster.json",
        help="a GPU profile with --gpus, a cluster profile with its own GPUs and links (both: "
        "see 'plan profiles'), or a Cluster JSON file (default: h100-sxm-80gb)",
    )  # fmt: skip
    cluster.add_argument("--gpus", type=count(MAX_GPUS),
                         help="number of GPUs (with a GPU profile)")  # fmt: skip
    cluster.add_argument("--gpus-per-node", type=count(MAX_GPUS_PER_NODE), default=8, metavar="N",
                         help="GPUs per node (default: 8)")  # fmt: skip
    training = parser.add_argument_group("training")
    training.add_argument("--global-batch", type=count(MAX_BATCH), required=True, metavar="SEQS",
                          help="sequences per optimizer step")  # fmt: skip
    training.add_argument("--micro-batch", type=count(MAX_BATCH), metavar="SEQS",
                          help="fix the micro-batch size (default: searched)")  # fmt: skip
    training.add_argument("--dtype", choices=[d.value for d in DType], default="bf16",
                          help="training precision")  # fmt: skip
    training.add_argument("--optimizer", choices=[o.value for o in Optimizer], default="adamw",
                          help="optimizer (its states count in memory)")  # fmt: skip
    pins = parser.add_argument_group("pins (fix a dimension, search the rest)")
    degrees = {"dp": "data", "tp": "tensor", "pp": "pipeline", "cp": "context"}
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
        dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, zero=args.zero, dp_shard=args.dp_shard,
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
    """A progress bar on stderr that appears only once a search has run for a second."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.started = time.perf_counter()
        self.bar: Progress | None = None
        self.task = TaskID(0)

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if time.perf_counter() - self.started < 1.0:
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


def run(args: argparse.Namespace) -> int:
    from planner.planning import search_plan  # torch: the model is traced

    destination = output(args.output, "--output")  # before the search
    plot = output(args.plot, "--plot")
    if plot is not None:
        check_plot_path(plot)
    handle = resolve_model_args(args)
    cluster = _cluster(args)
    training = load_document(
        Training,
        {"global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch,
         "seq_len": args.seq, "dtype": args.dtype, "optimizer": args.optimizer},
        "command line",
    )  # fmt: skip
    progress = _LazyProgress(Console(stderr=True))
    try:
        found = search_plan(handle, cluster, training, pins=_pins(args), top_k=args.top_k,
                            progress=progress, pareto=plot is not None,
                            lossy=_lossy(args))  # fmt: skip
    finally:
        progress.close()
    plan = found.plan
    if plot is not None:
        plot_plan(found, plot)
    if destination is not None:
        write_text_atomic(destination, plan.to_json() + "\n", option="--output")
    console = Console()
    if args.json:
        print(plan.to_json())
    else:
        render_plan(plan, console)
        for path in (destination, plot):
            if path is not None:
                console.print(f"wrote {path}")
    return 0
