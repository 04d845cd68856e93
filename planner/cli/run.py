"""``plan run``: train a plan's model on synthetic tokens and print loss and step time.

Launch under torchrun for a multi-rank plan::

    torchrun --nproc-per-node 8 -m planner run plan.json --steps 20

A plan whose degrees are all 1 also runs as a plain ``plan run plan.json``. It trains
zoo and spec-file transformers, Hugging Face configs (``plan --hf-config``) and
``module:function`` models that take token ids alone, built again from
``plan.model_source``; any other module trains in your own loop.

``--checkpoint-dir D`` saves the model and optimizer to ``D`` after the last step (and
every ``--save-every`` steps); ``--resume`` loads ``D``'s latest checkpoint first, saved
under any plan, and trains on from its step to ``--steps``. ``--export-hf OUT`` writes
the trained model as a Hugging Face safetensors directory (a zoo Llama or Mixtral under
Hugging Face's names; a Hugging Face model as it is).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from planner.cli.common import MAX_STEPS, add_run_args, count, host_seed, positive_float
from planner.errors import SpecError
from planner.io import dumps_json
from planner.spec import Plan, load_document
from planner.validate import check_plan


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="train a plan on synthetic data (launch with torchrun for several ranks)",
        description="Apply a plan with torch.distributed and train its model on synthetic "
        "tokens, printing the global mean loss and the time of each step. The model is a "
        "zoo or spec-file transformer, a Hugging Face config or a module:function token "
        "model, built again (on the meta device, or --build-on cpu). A plan whose degrees are all 1 runs "
        "without torchrun.",
    )
    parser.add_argument("plan", type=Path, help="plan JSON file")
    parser.add_argument("--steps", type=count(MAX_STEPS), default=10,
                        help="optimizer steps (default: 10)")  # fmt: skip
    add_run_args(parser, "data")
    parser.add_argument("--lr", type=positive_float(), default=1e-3,
                        help="learning rate, a positive number (default: 1e-3)")  # fmt: skip
    parser.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                        help="save model and optimizer here after the last step (DCP, any plan "
                        "can resume it)")  # fmt: skip
    parser.add_argument("--save-every", type=count(MAX_STEPS), metavar="N",
                        help="also save every N steps (needs --checkpoint-dir)")  # fmt: skip
    parser.add_argument("--resume", action="store_true",
                        help="load the latest checkpoint of --checkpoint-dir first and train on "
                        "from its step to --steps")  # fmt: skip
    parser.add_argument("--export-hf", type=Path, metavar="DIR",
                        help="after training, write the model as a Hugging Face safetensors "
                        "directory (zoo Llama/Mixtral and Hugging Face models; needs --checkpoint-dir)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON document at the end")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = load_document(Plan, args.plan)
    check_plan(plan)  # before any process group starts
    _check_checkpointing(args, plan)
    from strategies import runner  # the runtime: torch.distributed only there

    with runner.process_group_from_env() as rank:
        records = runner.run_plan(
            plan, steps=args.steps, seed=args.seed, lr=args.lr,
            checkpoint_dir=args.checkpoint_dir, resume=args.resume, save_every=args.save_every,
            host_seed=host_seed(args),
        )  # fmt: skip
        steps = [_report(record, show=rank == 0 and not args.json) for record in records]
        if rank == 0 and args.export_hf is not None:
            _export_hf(plan, args.checkpoint_dir, args.export_hf, show=not args.json)
        if rank == 0 and args.json:
            summary = {
                "plan": plan.strategy.describe(),
                "model": plan.model_name,
                "world_size": plan.strategy.world_size,
                "steps": steps,
            }
            if args.checkpoint_dir is not None:
                summary["checkpoint"] = str(args.checkpoint_dir)
            print(dumps_json(summary, what="the run summary"))
    return 0


def _check_checkpointing(args: argparse.Namespace, plan: Plan) -> None:
    """Raise on checkpoint options that cannot work, before any process group starts."""
    for flag, given in (("--resume", args.resume), ("--save-every", args.save_every),
                        ("--export-hf", args.export_hf)):  # fmt: skip
        if given and args.checkpoint_dir is None:
            raise SpecError(f"{flag} needs --checkpoint-dir DIR (where checkpoints are kept)")
    if args.export_hf is not None:
        from planner.models.hf_layout import check_hf_layout, hf_llama_config  # loads torch

        if plan.model is not None:
            check_hf_layout(plan.model)
            hf_llama_config(plan.model)  # a model transformers has no class for: say so now
        if args.export_hf.exists():
            raise SpecError(f"--export-hf {args.export_hf} exists: give a new directory")


def _export_hf(plan: Plan, checkpoint_dir: Path, out: Path, *, show: bool) -> None:
    """Write the latest checkpoint's model as a Hugging Face directory (this rank alone)."""
    from planner.models.hf_layout import hf_llama_config, hf_name
    from strategies.runner import model_to_run
    from strategies.state import export_hf

    if plan.model is None:  # a Hugging Face config's plan: saved under its own names
        model = model_to_run(plan, "plan run --export-hf")
        export_hf(checkpoint_dir, out, config=model.hf_config)
        kind = type(model.module).__name__
    else:
        export_hf(checkpoint_dir, out, rename=hf_name, config=hf_llama_config(plan.model))
        kind = "MixtralForCausalLM" if plan.model.moe else "LlamaForCausalLM"
    if show:
        print(f"exported to {out} (Hugging Face {kind} safetensors)")


def _report(record: Any, *, show: bool) -> dict[str, Any]:
    """Print one step (when ``show``) and return it as a dict."""
    if show:
        print(f"step {record.step:4d}  loss {record.loss:.6f}  time {record.step_time_s:.3f} s")
    return dict(record.as_dict())
