"""``plan scale``: plan a model at several cluster sizes; how many GPUs, how long, what cost."""

from __future__ import annotations

import argparse
import math

from rich import box
from rich.console import Console
from rich.table import Table

from planner.cli.common import (
    add_cluster_args,
    add_model_args,
    add_preference_args,
    add_training_args,
    argparse_type,
    output,
    plot_output,
    positive_float,
    resolve_model_args,
    resolve_training_args,
)
from planner.clusters import resolve_cluster
from planner.hardware import list_profiles
from planner.io import write_text_atomic
from planner.plots import plot_scale
from planner.scale_math import (
    KNEE_THRESHOLD,
    MAX_KNEE_THRESHOLD,
    MAX_PRICE,
    MAX_TOKENS,
    GpuSizes,
    ScaleRow,
    ScaleTable,
    parse_duration_days,
    short_reason,
)
from planner.spec import Cluster

_SUFFIXES = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "scale",
        help="plan a model at several cluster sizes: how many GPUs, how long, what cost",
        description="Search the fastest plan at each cluster size and print one row per size: "
        "strategy, step time, MFU, cluster tokens/s, days to train --tokens, GPU-hours, cost, "
        "free memory and scaling efficiency, with the knee of the curve marked (the "
        "largest size before the throughput each added GPU brings, relative to each GPU's "
        "before, first falls below --knee-threshold). A cluster profile or JSON keeps its "
        "links at every size.",
    )  # fmt: skip
    add_model_args(parser)
    cluster = add_cluster_args(parser)
    cluster.add_argument(
        "--gpus", type=argparse_type(GpuSizes.parse), required=True, metavar="A..B|N,N,...",
        help="cluster sizes: A..B is A, 2A, 4A, ... up to B (B = A x a power of two), or a "
        "comma list; a size above one node must be whole nodes",
    )  # fmt: skip
    add_training_args(parser)
    add_preference_args(parser, "planner")
    budget = parser.add_argument_group("budget")
    budget.add_argument("--tokens", type=positive_float(MAX_TOKENS), required=True, metavar="N",
                        help="tokens to train on (e.g. 15e12)")  # fmt: skip
    budget.add_argument("--price-per-gpu-hour", type=positive_float(MAX_PRICE), metavar="PRICE",
                        help="add a cost column: GPU-hours x PRICE")  # fmt: skip
    budget.add_argument(
        "--deadline", type=argparse_type(parse_duration_days), metavar="30d|12h",
        help="name the smallest size that trains the tokens within this time (units: d, h)",
    )  # fmt: skip
    budget.add_argument(
        "--knee-threshold", type=positive_float(MAX_KNEE_THRESHOLD), default=KNEE_THRESHOLD,
        metavar="F", help=f"marginal efficiency that ends the knee (default: {KNEE_THRESHOLD})",
    )  # fmt: skip
    out = parser.add_argument_group("output")
    out.add_argument("-o", "--output", metavar="table.json", help="write the table as JSON")
    out.add_argument("--json", action="store_true", help="print the table JSON instead")
    out.add_argument("--plot", metavar="out.png",
                     help="draw tokens/s and days against GPUs, the knee marked")  # fmt: skip
    parser.set_defaults(func=run)


def _base_cluster(args: argparse.Namespace) -> Cluster:
    """The cluster each size resizes: one node of a GPU profile, or a cluster profile or
    JSON file with its links."""
    node = args.gpus_per_node if args.cluster in list_profiles() else None
    return resolve_cluster(args.cluster, num_gpus=node, gpus_per_node=args.gpus_per_node)


def run(args: argparse.Namespace) -> int:
    from planner.scaling import scale_plans  # torch: the model is traced

    destination = output(args.output, "--output")  # before the search
    plot = plot_output(args.plot)
    cluster = _base_cluster(args)
    args.gpus.clusters(cluster)  # every size whole nodes, before the model loads
    handle = resolve_model_args(args)
    training = resolve_training_args(args)
    with Console(stderr=True).status("planning") as status:
        table = scale_plans(
            handle, cluster, training, args.gpus, tokens=args.tokens,
            price_per_gpu_hour=args.price_per_gpu_hour, deadline_days=args.deadline,
            knee_threshold=args.knee_threshold, target=args.target or "planner",
            headroom=args.memory_headroom, tolerance=args.tolerance / 100,
            progress=lambda done, total: status.update(f"planned {done} of {total} sizes"),
        )  # fmt: skip
    if destination is not None:
        write_text_atomic(destination, table.to_json() + "\n", option="--output")
    console = Console()
    if args.json:
        print(table.to_json())
    else:
        console.print(_table(table, training.global_batch_size))
        for line in _notes(table):
            console.print(line, highlight=False)
    if plot is not None:  # last: a table where nothing fits has no curve to draw
        plot_scale(table, plot)
    if not args.json:
        for path in (destination, plot):
            if path is not None:
                # not rich's print: it would wrap a long path and read [...] as markup
                print(f"wrote {path}")
    return 0


def _table(table: ScaleTable, global_batch: int) -> Table:
    title = f"{table.model} on {table.cluster}: {_count(table.tokens)} tokens, global batch {global_batch}"
    view = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 0))
    headers = ["GPUs", "strategy", "step\ns", "MFU", "tokens\n/s", "days", "GPU-\nhours"]
    headers += ["cost"] if table.price_per_gpu_hour is not None else []
    headers += ["free\nGiB", "scaling\neff."]
    for header in headers:
        if header == "strategy":
            view.add_column(header, min_width=14, ratio=1)
        else:
            view.add_column(header, justify="right", no_wrap=True)
    knee = table.knee
    for row in table.rows:
        mark = " *" if row is knee else ""
        if isinstance(row, ScaleRow):
            view.add_row(f"{row.gpus}{mark}", *_cells(row, table.price_per_gpu_hour is not None))
        else:
            blanks = ["-"] * (len(headers) - 2)
            view.add_row(str(row.gpus), f"no plan: {short_reason(row.reason)}", *blanks)
    return view


def _cells(row: ScaleRow, priced: bool) -> list[str]:
    cells = [row.strategy, f"{row.step_time_s:.3f}", f"{row.mfu:.1%}",
             _count(row.tokens_per_s), f"{row.days:,.1f}", _count(row.gpu_hours)]  # fmt: skip
    if priced:
        assert row.cost is not None
        cells.append(_count(row.cost))
    return [*cells, f"{row.free_gib:.1f}", f"{row.efficiency:.0%}"]


def _count(value: float) -> str:
    """``8.43M``, ``507k``, ``4.00M``, ``15.0T``: three significant figures and a suffix
    (B for billions)."""
    size, suffix = next(((s, x) for s, x in _SUFFIXES if value >= s), (1.0, ""))
    scaled = value / size
    decimals = max(0, 2 - math.floor(math.log10(scaled))) if scaled >= 1 else 2
    return f"{scaled:.{decimals}f}{suffix}"


def _notes(table: ScaleTable) -> list[str]:
    """The knee, the deadline's answer and the price, one line each."""
    lines = [_knee_note(table)]
    if table.deadline_days is not None:
        lines.append(_deadline_note(table, table.deadline_days))
    if table.price_per_gpu_hour is not None:
        lines.append(f"cost at {table.price_per_gpu_hour:g} per GPU-hour")
    return lines


def _knee_note(table: ScaleTable) -> str:
    knee = table.knee
    if knee is None:
        return "no size fits: no knee"
    threshold = f"{table.knee_threshold:.0%}"
    after = next((r for r in table.fitting if r.gpus > knee.gpus), None)
    if after is None:
        return (
            f"* knee: {_gpus(knee.gpus)}, the largest size (each step up kept a marginal "
            f"efficiency of at least {threshold})"
        )
    assert after.marginal_efficiency is not None
    return (
        f"* knee: {_gpus(knee.gpus)}; going to {after.gpus}, each added GPU brings "
        f"{after.marginal_efficiency:.1%} of a GPU's throughput at {knee.gpus} (< {threshold})"
    )


def _deadline_note(table: ScaleTable, deadline_days: float) -> str:
    met, fastest = table.meets_deadline, table.fastest
    deadline = f"deadline {deadline_days:g} days"
    if met is not None:
        return (
            f"{deadline}: {_gpus(met.gpus)} is the smallest size that meets it "
            f"({met.days:,.1f} days)"
        )
    if fastest is None:
        return f"{deadline}: no size fits"
    return (
        f"{deadline}: no size meets it; the fastest, {_gpus(fastest.gpus)}, needs "
        f"{fastest.days:,.1f} days"
    )


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"
