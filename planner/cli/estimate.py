"""``plan estimate``: predict step time, MFU/HFU and peak memory for given runs.

``--config run.json`` holds one run object or a list of them (see
:mod:`planner.cost.run`); ``--plan plan.json`` prices a saved plan (model spec,
cluster, training, strategy and its pipeline stages; a traced model on its trace and
layout, :mod:`planner.priced_plan`) as the search did, so it prints the plan's own
prediction; ``--from FILE`` prices the run a torchtitan, Megatron-LM or
DeepSpeed config describes (:mod:`planner.importers`; ``--model``, ``--cluster`` and
``--gpus`` give what it leaves open, and what was read is printed on stderr).
``--json`` prints one JSON object per run (a list for a list; a saved plan's also has
``matches_plan``, whether its stored prediction is reproduced), otherwise a readable
table per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.cli.common import MAX_SEQ, add_cluster_args, count, read_framework_config
from planner.errors import SpecError
from planner.frameworks import Framework
from planner.io import read_json
from planner.spec import MAX_GPUS, Plan, Prediction, load_document

if TYPE_CHECKING:
    from planner.cost.run import RunConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="estimate step time and memory of given configurations",
        description="Predict step time, tokens/s per GPU, MFU/HFU and peak memory per GPU "
        "for fully specified runs (model, cluster, training, strategy) without searching.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="run JSON (object or list)")
    source.add_argument(
        "--plan", type=Path, metavar="plan.json",
        help="a plan written by 'plan -o': price its strategy, stages and layout (a Hugging "
        "Face config or module:function is built again from plan.model_source and traced)",
    )  # fmt: skip
    source.add_argument(
        "--from", dest="from_config", type=Path, metavar="FILE",
        help="a torchtitan TOML job config, Megatron-LM arguments or a DeepSpeed JSON config: "
        "price the run it describes",
    )  # fmt: skip
    imported = parser.add_argument_group("with --from")
    imported.add_argument(
        "--format", choices=[f.value for f in Framework if f is not Framework.PLANNER],
        help="the config's format (default: detected from its content)",
    )  # fmt: skip
    imported.add_argument(
        "--model", metavar="NAME|spec.json",
        help="the model, for a config that does not describe it: a preset (see 'plan models') "
        "or a ModelSpec JSON file",
    )  # fmt: skip
    imported.add_argument(
        "--seq", type=count(MAX_SEQ), metavar="N",
        help="the sequence length, for a config that does not state it (DeepSpeed's; "
        "default: the model's)",
    )  # fmt: skip
    cluster = add_cluster_args(parser)
    cluster.add_argument(
        "--gpus", type=count(MAX_GPUS),
        help="number of GPUs (with a GPU profile), when the config's degrees do not give it",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _read_runs(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The run objects in ``path`` (read through :mod:`planner.io`: UTF-8, strict JSON)
    and whether the file held a list."""
    data = read_json(path, what="--config")
    if isinstance(data, list):
        return data, True
    return [data], False


def _table(
    name: str, run: RunConfig | Plan, prediction: Prediction, stored: Prediction | None = None
) -> str:
    from planner.cost.error_band import describe_band
    from planner.cost.flops import bf16_peak_mfu

    p = prediction
    bf16 = bf16_peak_mfu(p, dtype=run.training.dtype, gpu=run.cluster.gpu)
    peak = f" (of the {run.training.dtype.value} peak)" if bf16 is not None else ""
    lines = [
        f"{name} on {run.cluster.num_gpus} x {run.cluster.gpu}: {run.strategy.describe()}",
        f"  step time        {p.step_time_s:10.3f} s",
        f"  tokens/s/GPU     {p.tokens_per_s_per_gpu:10.1f}",
        f"  model TFLOP/s    {p.model_tflops_per_gpu:10.1f} per GPU",
        f"  MFU / HFU        {p.mfu:10.1%} / {p.hfu:.1%}{peak}",
    ]
    if bf16 is not None:
        lines.append(f"  MFU (bf16 peak)  {bf16:10.1%}")
    lines.append(
        f"  peak memory      {p.peak_memory_gib:10.1f} GiB of {p.memory_limit_gib:.1f}"
        f" ({'fits' if p.fits else 'does NOT fit'})"
    )
    if stored is not None:
        same = "the same" if stored == p else f"{stored.step_time_s:.3f} s: differs"
        lines.append(f"  plan's own       {same}")
    if p.reason:
        label = "reason" if not p.fits else "note"
        lines.append(f"  {label:<17}{p.reason}")
    if p.error_band is not None:
        lines.append(f"  expected error   {describe_band(p.error_band, run.cluster.gpu)}")
    lines.append("  time breakdown (exposed):")
    lines += [f"    {k:<14}{v:10.3f} s" for k, v in p.breakdown_s.items() if v > 0]
    lines.append("  memory breakdown:")
    lines += [f"    {k:<17}{v:7.1f} GiB" for k, v in p.memory_gib.items()]
    return "\n".join(lines)


def _read_plan(path: Path) -> Plan:
    """The plan in ``path`` (read through :mod:`planner.io`, validated as a :class:`Plan`)."""
    return load_document(Plan, read_json(path, what="--plan"), str(path))


def _imported_run(args: argparse.Namespace) -> tuple[RunConfig, dict[str, object]]:
    """The run ``--from`` describes and what was read (for ``--json``); what was read and
    assumed goes to stderr."""
    imported, run = read_framework_config(args)
    read: dict[str, object] = {
        "source": imported.source, "format": imported.format, "release": imported.release,
        "used": list(imported.used), "not_read": list(imported.not_read),
        "notes": imported.notes_at(args.seq),
        "run": run.model_dump(mode="json"),
    }  # fmt: skip
    return run, read


def run(args: argparse.Namespace) -> int:
    from planner.cost.run import RunConfig, estimate_run

    stored: Prediction | None = None
    read: dict[str, object] | None = None
    if args.from_config is not None:
        imported, read = _imported_run(args)
        configs, is_list = [imported], False
    elif given := [f"--{n}" for n in ("format", "model", "gpus", "seq") if getattr(args, n)]:
        raise SpecError(f"{', '.join(given)} only apply with --from")
    elif args.plan is not None:
        plan = _read_plan(args.plan)
        if plan.model is None:  # a traced model: priced on its trace and its own layout
            return _print_traced(plan, str(args.plan), as_json=args.json)
        configs, is_list = [RunConfig.from_plan(plan, str(args.plan))], False
        stored = plan.prediction
    else:
        objects, is_list = _read_runs(args.config)
        configs = [
            RunConfig.from_dict(data, f"{args.config}[{index}]" if is_list else str(args.config))
            for index, data in enumerate(objects)
        ]
    results = [(config, estimate_run(config)) for config in configs]
    if args.json:
        dicts = [_as_json(prediction, config, stored) for config, prediction in results]
        if read is not None:  # what --from read, and the run config it priced
            dicts[0]["read"] = read
        print(json.dumps(dicts if is_list else dicts[0], indent=2))
    else:
        print(
            "\n\n".join(
                _table(config.model.name, config, prediction, stored)
                for config, prediction in results
            )
        )
    return 0


def _as_json(
    prediction: Prediction, run: RunConfig | Plan, stored: Prediction | None
) -> dict[str, object]:
    """The ``--json`` object; a saved plan's also says whether its stored prediction is
    reproduced (``matches_plan``, what the table prints as "plan's own")."""
    from planner.cost.run import prediction_to_dict

    data = prediction_to_dict(prediction, run)
    if stored is not None:
        data["matches_plan"] = stored == prediction
    return data


def _print_traced(plan: Plan, source: str, *, as_json: bool) -> int:
    """Print the estimate of a plan for a traced model (Hugging Face config, module of
    your own), built again from ``plan.model_source``."""
    from planner.priced_plan import PricedPlan, searched_options  # torch

    prediction = PricedPlan(plan, searched_options(plan, source), source=source).estimate()
    if as_json:
        print(json.dumps(_as_json(prediction, plan, plan.prediction), indent=2))
    else:
        print(_table(plan.model_name, plan, prediction, plan.prediction))
    return 0
