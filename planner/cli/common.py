"""Command-line arguments shared by the subcommands: the model, cluster and training
options, the argparse types of numbers (in range, finite) and the check of output paths."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from planner.errors import SpecError
from planner.io import check_output_path, read_json
from planner.spec import (
    MAX_BATCH,
    MAX_GPUS_PER_NODE,
    MAX_SEQ,
    DType,
    Limit,
    Optimizer,
    Training,
    load_document,
)

if TYPE_CHECKING:
    from planner.cost.run import RunConfig
    from planner.importers import ImportedRun
    from planner.models import ModelHandle
    from planner.solve.search import Headroom

__all__ = [
    "MAX_STEPS",
    "MAX_SEED",
    "MAX_TOP_K",
    "positive_int",
    "count",
    "seed",
    "add_run_args",
    "host_seed",
    "positive_float",
    "output",
    "plot_output",
    "add_model_args",
    "add_preference_args",
    "argparse_type",
    "resolve_model_args",
    "add_cluster_args",
    "add_training_args",
    "resolve_training_args",
    "read_framework_config",
]

T = TypeVar("T")

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


def add_run_args(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--seed`` and ``--build-on`` of a command that builds the plan's model and
    trains it (``what``: what the seed also draws besides the weights)."""
    parser.add_argument("--seed", type=seed, default=0,
                        help=f"weights and {what} seed (default: 0)")  # fmt: skip
    parser.add_argument(
        "--build-on", choices=("meta", "cpu"), default="meta",
        help="meta (default): build the model on the meta device and initialise each rank's "
        "shards with its modules' reset_parameters() or the model's _init_weights; cpu: build "
        "it with the values its __init__ gives, seeded alike on every rank, for modules that "
        "set their parameters there (each rank holds the whole model until the plan cuts it)",
    )  # fmt: skip


def host_seed(args: argparse.Namespace) -> int | None:
    """The seed to build the model with on the CPU (``--build-on cpu``), else ``None``."""
    return args.seed if args.build_on == "cpu" else None


def output(text: str | None, option: str) -> Path | None:
    """The output path ``option`` gave (``None`` when not given), checked before the work
    that produces it starts (:func:`planner.io.check_output_path`)."""
    return None if text is None else check_output_path(text, option=option)


def plot_output(text: str | None) -> Path | None:
    """The ``--plot`` path (``None`` when not given), checked as an output and as a PNG
    (:func:`planner.plots.check_plot_path`) before the work that draws it starts."""
    from planner.plots import check_plot_path

    plot = output(text, "--plot")
    if plot is not None:
        check_plot_path(plot)
    return plot


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


def add_cluster_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the ``cluster`` group with ``--cluster`` and ``--gpus-per-node`` to ``parser``;
    the caller adds its own ``--gpus`` (one count, or several sizes) to the group returned."""
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--cluster", default="h100-sxm-80gb", metavar="PROFILE|CLUSTER|cluster.json",
        help="a GPU profile with --gpus, a cluster profile with its own GPUs and links (both: "
        "see 'plan profiles'), or a Cluster JSON file (default: h100-sxm-80gb)",
    )  # fmt: skip
    group.add_argument("--gpus-per-node", type=count(MAX_GPUS_PER_NODE), default=8, metavar="N",
                       help="GPUs per node (default: 8)")  # fmt: skip
    return group


def add_training_args(parser: argparse.ArgumentParser, *, batch_required: bool = True) -> None:
    """Add the ``training`` group: ``--global-batch`` (required unless told otherwise),
    ``--micro-batch``, ``--dtype``, ``--param-dtype`` and ``--optimizer``."""
    group = parser.add_argument_group("training")
    group.add_argument("--global-batch", type=count(MAX_BATCH), required=batch_required,
                       metavar="SEQS", help="sequences per optimizer step")  # fmt: skip
    group.add_argument("--micro-batch", type=count(MAX_BATCH), metavar="SEQS",
                       help="fix the micro-batch size (default: searched)")  # fmt: skip
    defaults = {name: field.default for name, field in Training.model_fields.items()}
    group.add_argument("--dtype", choices=[d.value for d in DType],
                       help=f"training precision (default: {defaults['dtype']})")  # fmt: skip
    group.add_argument("--param-dtype", choices=[DType.FP32.value, DType.BF16.value],
                       help="precision parameters, gradients and optimizer states are kept "
                       "in: fp32 (mixed precision) or bf16 (pure bf16, no fp32 copy; "
                       f"default: {defaults['param_dtype']})")  # fmt: skip
    group.add_argument("--optimizer", choices=[o.value for o in Optimizer],
                       help="optimizer, its states count in memory (default: "
                       f"{defaults['optimizer']})")  # fmt: skip


def add_preference_args(
    parser: argparse.ArgumentParser, target_default: str
) -> argparse._ArgumentGroup:
    """Add the ``what to plan for`` group: ``--for`` (default named by
    ``target_default``), ``--memory-headroom`` and ``--tolerance``; returns the group."""
    group = parser.add_argument_group("what to plan for")
    group.add_argument(
        "--for", dest="target", metavar="FRAMEWORK[==VERSION]",
        help="keep to what a framework release runs, so the plan exports to it: planner "
        "(this project's runtime), torchtitan, megatron or deepspeed, optionally with a "
        "release (torchtitan==0.2); 'plan explain' shows what it cost (default: "
        f"{target_default})",
    )  # fmt: skip
    group.add_argument(
        "--memory-headroom", type=argparse_type(_headroom), metavar="GIB|PCT",
        help="memory each GPU keeps free for fragmentation and buffers: GiB (8) or a share "
        "of its memory (10%%) (default: 0)",
    )  # fmt: skip
    group.add_argument(
        "--tolerance", type=_percent, default=1.0, metavar="PCT",
        help="plans this much slower than the fastest (percent) count as ties, and the "
        "tie with the fewest parallel dimensions, then the most free memory, wins "
        "(default: 1)",
    )  # fmt: skip
    return group


def _headroom(text: str) -> Headroom:
    from planner.solve.search import Headroom  # the search's modules load when used

    return Headroom.parse(text)


def argparse_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a parser that raises :class:`SpecError`."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except SpecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _percent(text: str) -> float:
    """A percentage in [0, 100) (a trailing % allowed), for argparse."""
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of percent") from None
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"{text!r}: give a percentage in [0, 100)")
    return value


TRAINING_OPTIONS = {  # option -> argparse attribute, as add_training_args and --seq set them
    "--global-batch": "global_batch",
    "--micro-batch": "micro_batch",
    "--seq": "seq",
    "--dtype": "dtype",
    "--param-dtype": "param_dtype",
    "--optimizer": "optimizer",
}


def resolve_training_args(args: argparse.Namespace) -> Training:
    """The :class:`Training` the ``training`` group and ``--seq`` describe (what is not
    given keeps :class:`Training`'s default)."""
    fields = {"global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch,
              "seq_len": args.seq, "dtype": args.dtype, "param_dtype": args.param_dtype,
              "optimizer": args.optimizer}  # fmt: skip
    return load_document(
        Training, {key: value for key, value in fields.items() if value is not None},
        "command line",
    )  # fmt: skip


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


def read_framework_config(args: argparse.Namespace) -> tuple[ImportedRun, RunConfig]:
    """The framework config ``--from`` names, read with ``--format``, ``--model``,
    ``--cluster``, ``--gpus`` and ``--gpus-per-node``, and its run at ``--seq``; what was
    read and assumed goes to stderr."""
    from planner.importers import import_config

    imported = import_config(
        args.from_config, format=args.format, model=args.model, cluster=args.cluster,
        gpus=args.gpus, gpus_per_node=args.gpus_per_node,
    )  # fmt: skip
    run = imported.run_at(args.seq)
    print("\n".join(imported.describe(args.seq)), file=sys.stderr)
    return imported, run
