"""``plan measure``: run a plan for N steps after warm-up and write a measured profile.

Launch under torchrun for a multi-rank plan::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m planner measure plan.json \\
        --steps 10 --warmup 3 -o measured.json

Rank 0 writes the JSON (step time median and spread, per-phase breakdown, peak memory
per rank, provenance) and prints a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path

from rich.console import Console

from planner.cli.common import MAX_STEPS, add_run_args, count, host_seed, output
from planner.io import document_json, write_text_atomic
from planner.measured import MeasuredProfile
from planner.spec import Plan, load_document
from planner.validate import check_plan


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "measure",
        help="run a plan and write its measured profile (launch with torchrun)",
        description="Train a plan on synthetic tokens: warm-up steps, then timed steps, "
        "one profiled step (phases) and one memory-tracked step; write a measured profile.",
    )
    parser.add_argument("plan", type=Path, help="plan JSON file")
    parser.add_argument("-o", "--output", required=True, metavar="measured.json",
                        help="measured profile to write (JSON; rank 0 writes it)")  # fmt: skip
    parser.add_argument("--steps", type=count(MAX_STEPS), default=10,
                        help="timed steps (default 10)")  # fmt: skip
    parser.add_argument("--warmup", type=count(MAX_STEPS, least=0), default=3,
                        help="untimed steps first (default 3)")  # fmt: skip
    add_run_args(parser, "data")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    destination = output(args.output, "--output")  # before the measurement
    assert destination is not None  # a required option
    plan = load_document(Plan, args.plan)
    check_plan(plan)  # before any process group starts
    from strategies import measure, runner  # the runtime: torch.distributed only there

    command = "plan " + shlex.join(sys.argv[1:])
    steps = f"measuring {args.plan}: {args.warmup} warm-up and {args.steps} timed steps"
    with runner.process_group_from_env() as rank:
        status = Console(stderr=True).status(steps) if rank == 0 else contextlib.nullcontext()
        with status:
            measured = measure.measure_plan(
                plan,
                steps=args.steps,
                warmup=args.warmup,
                seed=args.seed,
                command=command,
                host_seed=host_seed(args),
            )
        if rank == 0:
            write_text_atomic(destination, document_json(measured) + "\n", option="--output")
            print(summary(measured))
            print(f"wrote {destination}")
    return 0


def summary(measured: MeasuredProfile) -> str:
    """A few lines: plan, step time with spread, phases and peak memory."""
    phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(measured.phases_s.items()))
    memory = ", ".join(f"{m:.3f}" for m in measured.peak_memory_gib)
    return (
        f"{measured.model_name}: {measured.plan.strategy.describe()}\n"
        f"step time: median {measured.step_time_median_s * 1e3:.1f} ms "
        f"(p10 {measured.step_time_p10_s * 1e3:.1f}, p90 {measured.step_time_p90_s * 1e3:.1f}) "
        f"over {len(measured.step_times_s)} steps\n"
        f"phases: {phases}\n"
        f"peak memory per rank (GiB): {memory}"
    )
