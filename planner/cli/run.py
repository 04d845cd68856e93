"""``plan run``: train a plan's model on synthetic tokens and print loss and step time.

Launch under torchrun for a multi-rank plan::

    torchrun --nproc-per-node 8 -m planner run plan.json --steps 20

A plan whose degrees are all 1 also runs as a plain ``plan run plan.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from planner.cli.common import MAX_STEPS, count, positive_float, seed
from planner.io import dumps_json
from planner.spec import Plan, load_document
from planner.validate import check_plan


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="train a plan on synthetic data (launch with torchrun for several ranks)",
        description="Apply a plan with torch.distributed and train its model on synthetic "
        "tokens, printing the global mean loss and the time of each step. A plan whose "
        "degrees are all 1 runs without torchrun.",
    )
    parser.add_argument("plan", type=Path, help="plan JSON file")
    parser.add_argument("--steps", type=count(MAX_STEPS), default=10,
                        help="optimizer steps (default: 10)")  # fmt: skip
    parser.add_argument("--seed", type=seed, default=0, help="weights and data seed (default: 0)")
    parser.add_argument("--lr", type=positive_float(), default=1e-3,
                        help="learning rate, a positive number (default: 1e-3)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON document at the end")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = load_document(Plan, args.plan)
    check_plan(plan)  # before any process group starts
    from strategies import runner  # the runtime: torch.distributed only there

    with runner.process_group_from_env() as rank:
        records = runner.run_plan(plan, steps=args.steps, seed=args.seed, lr=args.lr)
        steps = [_report(record, show=rank == 0 and not args.json) for record in records]
        if rank == 0 and args.json:
            summary = {
                "plan": plan.strategy.describe(),
                "model": plan.model_name,
                "world_size": plan.strategy.world_size,
                "steps": steps,
            }
            print(dumps_json(summary, what="the run summary"))
    return 0


def _report(record: Any, *, show: bool) -> dict[str, Any]:
    """Print one step (when ``show``) and return it as a dict."""
    if show:
        print(f"step {record.step:4d}  loss {record.loss:.6f}  time {record.step_time_s:.3f} s")
    return dict(record.as_dict())
