"""``plan estimate``: predict step time, MFU/HFU and peak memory for given runs.

``--config run.json`` holds one run object or a list of them (see
:mod:`planner.cost.run`); ``--json`` prints one JSON object per run (a list for a
list), otherwise a readable table per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import SpecError
from planner.spec import Prediction

if TYPE_CHECKING:
    from planner.cost.run import RunConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="estimate step time and memory of given configurations",
        description="Predict step time, tokens/s per GPU, MFU/HFU and peak memory per GPU "
        "for fully specified runs (model, cluster, training, strategy) without searching.",
    )
    parser.add_argument("--config", required=True, type=Path, help="run JSON (object or list)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _read_runs(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The run objects in ``path`` and whether the file held a list."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise SpecError(f"cannot read --config {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"--config {path} is not valid JSON: {exc}") from None
    if isinstance(data, list):
        return data, True
    return [data], False


def _table(run: RunConfig, prediction: Prediction) -> str:
    p = prediction
    lines = [
        f"{run.model.name} on {run.cluster.num_gpus} x {run.cluster.gpu}: {run.strategy.describe()}",
        f"  step time        {p.step_time_s:10.3f} s",
        f"  tokens/s/GPU     {p.tokens_per_s_per_gpu:10.1f}",
        f"  model TFLOP/s    {p.model_tflops_per_gpu:10.1f} per GPU",
        f"  MFU / HFU        {p.mfu:10.1%} / {p.hfu:.1%}",
        f"  peak memory      {p.peak_memory_gib:10.1f} GiB of {p.memory_limit_gib:.1f}"
        f" ({'fits' if p.fits else 'does NOT fit'})",
    ]
    if p.reason:
        lines.append(f"  reason           {p.reason}")
    lines.append("  time breakdown (exposed):")
    lines += [f"    {k:<14}{v:10.3f} s" for k, v in p.breakdown_s.items() if v > 0]
    lines.append("  memory breakdown:")
    lines += [f"    {k:<17}{v:7.1f} GiB" for k, v in p.memory_gib.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from planner.cost.run import RunConfig, estimate_run, prediction_to_dict

    objects, is_list = _read_runs(args.config)
    results = []
    for index, data in enumerate(objects):
        source = f"{args.config}[{index}]" if is_list else str(args.config)
        config = RunConfig.from_dict(data, source)
        results.append((config, estimate_run(config)))
    if args.json:
        dicts = [prediction_to_dict(prediction) for _, prediction in results]
        print(json.dumps(dicts if is_list else dicts[0], indent=2))
    else:
        print("\n\n".join(_table(config, prediction) for config, prediction in results))
    return 0
