"""``plan export plan.json --to torchtitan|megatron|deepspeed [-o PATH]``: a saved plan
as another framework's settings (stdout without ``-o``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from planner.cli.common import output
from planner.export import TARGETS, export_plan
from planner.io import write_text_atomic
from planner.spec import Plan, load_document


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a saved plan as torchtitan, Megatron-LM or DeepSpeed settings",
        description="Write a saved plan as a torchtitan job-config fragment (TOML), "
        "Megatron-LM arguments (one per line) or a DeepSpeed config (JSON). A plan the "
        "target cannot express is refused with the field to change.",
    )
    parser.add_argument("plan", type=Path, help="a plan JSON written by 'plan -o'")
    parser.add_argument(
        "--to", required=True, metavar="FRAMEWORK[==VERSION]",
        help=f"target framework ({', '.join(TARGETS)}), optionally a release, e.g. "
        "torchtitan==0.2 (default: the release the plan was searched for with --for, else "
        "the newest)",
    )  # fmt: skip
    parser.add_argument("-o", "--output", metavar="PATH", help="write here, not stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    destination = output(args.output, "--output")  # before the export
    text = export_plan(load_document(Plan, args.plan), args.to)
    if destination is None:
        sys.stdout.write(text)
    else:
        write_text_atomic(destination, text, option="--output")
        print(f"wrote {args.to} settings to {destination}", file=sys.stderr)
    return 0
