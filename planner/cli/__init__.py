"""The ``plan`` command: a thin shell over the Python API, one module per subcommand.

Each subcommand module defines ``add_parser(subparsers)`` (which sets
``func=run`` on its parser) and ``run(args) -> int``. ``plan --model X ...`` without a
subcommand means ``plan search --model X ...``. User mistakes (:class:`PlannerError`)
print one message and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from collections.abc import Sequence

from planner import __version__
from planner.errors import PlannerError

__all__ = ["main", "build_parser"]

# Subcommand modules in help order; each registers one subcommand.
SUBCOMMANDS = (
    "search",
    "explain",
    "export",
    "estimate",
    "trace",
    "run",
    "calibrate",
    "measure",
    "compare",
    "models",
    "profiles",
    "schema",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plan",
        description="Plan data, tensor, pipeline and context parallelism for PyTorch training.",
        epilog="Without a subcommand, 'plan ARGS' runs 'plan search ARGS'.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    subparsers = parser.add_subparsers(title="subcommands", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"planner.cli.{name}")
        module.add_parser(subparsers)
    return parser


def _with_default_command(argv: list[str]) -> list[str]:
    commands = set(SUBCOMMANDS)
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    asks_top_level = any(arg in ("-h", "--help", "--version") for arg in argv) and first is None
    if first in commands or asks_top_level or not argv:
        return argv
    return ["search", *argv]


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `plan models | head` ends quietly
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(_with_default_command(argv))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except PlannerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
