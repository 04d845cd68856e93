"""``plan compare``: predicted against measured, component by component, and a PNG.

::

    plan compare plan.json measured.json            # a 'plan measure' profile
    plan compare plan.json trace.json --profile P   # a torch.profiler Chrome/Kineto trace
    plan compare plan.json measured.json --plot out.png

The prediction is the plan's own (``plan search`` stores it); ``--profile`` re-prices
the plan with another hardware profile instead (needed for traces, whose operator
classes are priced from the profile).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.cli.common import output
from planner.compare import (
    TraceSummary,
    compare_measured,
    compare_trace,
    format_comparison,
    load_measured_side,
)
from planner.errors import SpecError
from planner.hardware import load_profile
from planner.io import check_output_path, read_json
from planner.measured import MeasuredProfile, check_same_plan
from planner.plots import check_plot_path, plot_comparison
from planner.spec import Plan, Prediction, load_document

MAX_TRACE_BYTES = 2**30  # a torch.profiler trace of a few steps of a large model: ~100s of MiB


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="predicted against measured (a measured profile or a torch.profiler trace)",
        description="Print the plan's predicted step time, phases and peak memory next to a "
        "measured profile or a torch.profiler trace, with the error of each, and plot them.",
    )
    parser.add_argument("plan", type=Path, help="plan JSON file")
    parser.add_argument("measured", type=Path, help="measured profile JSON or trace JSON")
    parser.add_argument(
        "--profile", metavar="PROFILE",
        help="re-price the plan with this hardware profile (default: the plan's prediction, "
        "or for traces the plan's cluster profile)",
    )  # fmt: skip
    parser.add_argument(
        "--plot", "--png", dest="plot", metavar="out.png",
        help="bar chart (default: next to the measured file, *-compare.png)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.calibrate.options import measured_run_options
    from planner.calibrate.refit import predict_op_classes, predict_plan  # torch

    png = output(args.plot, "--plot")  # before any reading or pricing
    plan = load_document(Plan, args.plan)
    measured = _measured_side(args.measured)
    if png is None:
        default = args.measured.with_name(f"{args.measured.stem}-compare.png")
        png = check_output_path(default, option="--plot (default: next to the measured file)")
    check_plot_path(png)
    if isinstance(measured, TraceSummary):
        profile = load_profile(args.profile or plan.cluster.gpu)
        options = measured_run_options(profile)
        prediction = predict_plan(plan, profile, options)
        classes = predict_op_classes(plan, profile, options)
        comparison = compare_trace(plan, measured, prediction, classes)
    else:
        check_same_plan(plan, measured, source=str(args.measured))  # before any pricing
        comparison = compare_measured(plan, measured, _prediction(plan, args.profile))
    plot_comparison(comparison, png)
    print(format_comparison(comparison))
    print(f"wrote {png}")
    return 0


def _measured_side(path: Path) -> MeasuredProfile | TraceSummary:
    """A measured profile or a trace, read through :mod:`planner.io` (UTF-8, bounded size
    and depth, finite numbers) before :func:`planner.compare.load_measured_side` tells
    them apart (a trace is read again there)."""
    if path.suffix == ".gz":
        return load_measured_side(path)  # its message: decompress first
    data = read_json(path, what="measured file", max_bytes=MAX_TRACE_BYTES)
    if isinstance(data, dict) and "plan_fingerprint" in data and "traceEvents" not in data:
        return load_document(MeasuredProfile, data, str(path))
    try:
        return load_measured_side(path)
    except (KeyError, TypeError, ValueError) as exc:  # an event without a numeric ts or dur
        raise SpecError(
            f"trace {path} has an event it cannot read ({type(exc).__name__}: {exc}): not a "
            "torch.profiler trace, or edited; export it again with export_chrome_trace"
        ) from None


def _prediction(plan: Plan, profile_name: str | None) -> Prediction:
    from planner.calibrate.options import measured_run_options
    from planner.calibrate.refit import predict_plan  # torch

    if profile_name is not None:
        profile = load_profile(profile_name)
        return predict_plan(plan, profile, measured_run_options(profile))
    if plan.prediction is None:
        raise SpecError(
            "the plan carries no prediction: pass --profile PROFILE to price it "
            "(e.g. the profile 'plan calibrate' wrote)"
        )
    return plan.prediction
