"""``plan explain plan.json``: print a saved plan's strategy, prediction and breakdown."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from planner.cli.render import render_plan
from planner.spec import Plan, load_document
from planner.validate import check_plan


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="print a saved plan and why it was chosen",
        description="Print a plan JSON written by 'plan -o' as 'plan' printed it: the mesh "
        "and settings, the prediction, where the time and memory go, the stages, the "
        "tensor-parallel layout and the runners-up.",
    )
    parser.add_argument("plan", type=Path, help="a plan JSON written by 'plan -o'")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = load_document(Plan, args.plan)
    check_plan(plan)  # a hand-edited plan that disagrees with itself is refused
    render_plan(plan, Console())
    return 0
