"""Command-line arguments shared by the subcommands: the model options, the argparse
types of numbers (in range, finite) and the check of output paths."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from planner.errors import SpecError
from planner.io import check_output_path, read_json
from planner.spec import MAX_SEQ, Limit

if TYPE_CHECKING:
    from planner.models import ModelHandle

__all__ = [
    "MAX_STEPS",
    "MAX_SEED",
    "MAX_TOP_K",
    "positive_int",
    "count",
    "seed",
    "positive_float",
    "output",
    "add_model_args",
    "resolve_model_args",
]

MAX_STEPS = Limit(10_000_000, "a synthetic run of more than ten million steps never ends")
MAX_SEED = Limit(2**32 - 1, "seeds are 32-bit")
MAX_TOP_K = Limit(1000, "a thousand runners-up is more than anyone reads")


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def count(limit: Limit | None = None, *, least: int = 1) -> Callable[[str], int]:
    """argparse type for an integer in ``[least, limit.most]``; the message says which
    bound a value breaks and why."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {_shown(text)}") from None
        if value < least:
            wanted = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        if limit is not None and value > limit.most:
            raise argparse.ArgumentTypeError(f"{value} > {limit.most}: {limit.why}")
        return value

    return parse


positive_int = count()
seed = count(MAX_SEED, least=0)


def positive_float(limit: Limit | None = None) -> Callable[[str], float]:
    """argparse type for a finite number > 0 (at most ``limit.most``): refuses ``nan``,
    ``inf``, zero and negatives."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {_shown(text)}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(
                f"expected a positive finite number, got {_shown(text)}"
            )
        if limit is not None and value > limit.most:
            raise argparse.ArgumentTypeError(f"{text} > {limit.most:g}: {limit.why}")
        return value

    return parse


def output(text: str | None, option: str) -> Path | None:
    """The output path ``option`` gave (``None`` when not given), checked before the work
    that produces it starts (:func:`planner.io.check_output_path`)."""
    return None if text is None else check_output_path(text, option=option)


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
        "--seq", type=count(MAX_SEQ), metavar="N", help="sequence length (default: the model's)"
    )


def resolve_model_args(args: argparse.Namespace) -> ModelHandle:
    """The model ``--model`` or ``--hf-config`` names, on the meta device."""
    if args.model and args.hf_config:
        raise SpecError("give either --model or --hf-config, not both")
    from planner.models import resolve_model  # torch: loaded when a model is named

    if args.hf_config:
        from planner.hf import resolve_hf_config

        _check_hf_config(args.hf_config)
        return resolve_hf_config(args.hf_config)
    if not args.model:
        raise SpecError(
            "no model given: pass --model NAME (see 'plan models'), a ModelSpec JSON file "
            "or module:function, or --hf-config PATH"
        )
    return resolve_model(args.model, seq_len=args.seq)


def _check_hf_config(path: str) -> None:
    """Read a Hugging Face config through :mod:`planner.io` first (UTF-8, bounded size
    and depth), so a binary or deeply nested file is an ``error:`` line. Hugging Face
    writes ``Infinity`` in some configs, so non-finite numbers are left to transformers;
    a missing file is left to :func:`planner.hf.resolve_hf_config`'s message."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if file.is_file():
        read_json(file, what="--hf-config", finite=False)
