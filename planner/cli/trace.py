"""``plan trace``: trace a model and print its cost per segment type."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.cli.common import add_model_args, count, resolve_model_args
from planner.dtypes import RUNTIME_DTYPES
from planner.io import dumps_json
from planner.spec import MAX_BATCH


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="trace a model: parameters, FLOPs and activations per block type",
        description="Trace a model on the meta device into an operator graph and print, per "
        "segment type (embedding, block, head), its parameters, FLOPs and saved activations.",
    )
    add_model_args(parser)
    parser.add_argument(
        "--batch", type=count(MAX_BATCH), default=1, metavar="B",
        help="micro-batch size (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype",
        choices=sorted(RUNTIME_DTYPES),
        default="bf16",
        help="training dtype (default bf16)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def _count(value: float) -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}"
    return f"{value:.0f}"


def _bytes(value: float) -> str:
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {suffix}"
    return f"{value:.0f} B"


def _label(row: dict[str, Any]) -> str:
    return row["kind"] if row["first"] == row["kind"] else f"{row['kind']} ({row['first']})"


def _table(summary: dict[str, Any]) -> Table:
    shape = f"batch {summary['batch_size']}"
    if summary["seq_len"] > 1:
        shape += f" x seq {summary['seq_len']}"
    title = f"{summary['model']}: {shape}, {summary['dtype']}, traced with {summary['tracer']}"
    table = Table(title=title)
    for header in ("segment type", "count", "params", "fwd FLOPs", "activations", "share"):
        table.add_column(header, justify="left" if header == "segment type" else "right")
    for row in summary["types"]:
        table.add_row(
            _label(row), str(row["count"]), _count(row["params"]),
            _count(row["flops_fwd"]), _bytes(row["saved_bytes"]), f"{row['share_of_flops']:.1%}",
        )  # fmt: skip
    table.add_section()
    table.add_row(
        "total", str(summary["segments"]), _count(summary["params"]),
        _count(summary["flops_fwd"]), _bytes(summary["saved_bytes"]), "100.0%",
    )  # fmt: skip
    return table


def run(args: argparse.Namespace) -> int:
    from planner.tracing import summarize, trace  # torch: loaded when tracing

    handle = resolve_model_args(args)
    graph = trace(handle, batch_size=args.batch, seq_len=args.seq, dtype=args.dtype)
    summary = summarize(graph)
    if args.json:
        print(dumps_json(summary, what="the trace summary"))
        return 0
    console = Console()
    console.print(_table(summary))
    console.print(
        f"per micro-batch: forward {_count(summary['flops_fwd'])}FLOP, backward "
        f"{_count(summary['flops_bwd'])}FLOP; params and activations are per segment"
    )
    return 0
