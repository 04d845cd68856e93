"""Command-line arguments shared by the subcommands that take a model."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from planner.errors import SpecError

if TYPE_CHECKING:
    from planner.models import ModelHandle

__all__ = ["positive_int", "add_model_args", "resolve_model_args"]


def positive_int(text: str) -> int:
    """argparse type for counts: rejects zero, negatives and non-integers."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--hf-config`` and ``--seq`` to ``parser``."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", metavar="NAME|spec.json|module:function",
        help="a preset (see 'plan models'), a ModelSpec JSON file, or an import path "
        "to a function returning an nn.Module (or (module, example_inputs))",
    )  # fmt: skip
    group.add_argument(
        "--hf-config", metavar="PATH",
        help="a Hugging Face config.json (or its directory); needs the [hf] extra",
    )  # fmt: skip
    group.add_argument(
        "--seq", type=positive_int, metavar="N", help="sequence length (default: the model's)"
    )


def resolve_model_args(args: argparse.Namespace) -> ModelHandle:
    """The model ``--model`` or ``--hf-config`` names, on the meta device."""
    if args.model and args.hf_config:
        raise SpecError("give either --model or --hf-config, not both")
    from planner.models import resolve_model  # torch: loaded when a model is named

    if args.hf_config:
        from planner.hf import resolve_hf_config

        return resolve_hf_config(args.hf_config)
    if not args.model:
        raise SpecError(
            "no model given: pass --model NAME (see 'plan models'), a ModelSpec JSON file "
            "or module:function, or --hf-config PATH"
        )
    return resolve_model(args.model, seq_len=args.seq)
