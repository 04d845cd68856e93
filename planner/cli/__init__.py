"""The ``plan`` command: a thin shell over the Python API, one module per subcommand.

Each subcommand module defines ``add_parser(subparsers)`` (which sets
``func=run`` on its parser) and ``run(args) -> int``. ``plan --model X ...`` without a
subcommand means ``plan search --model X ...``. User mistakes (:class:`PlannerError`,
and bad arguments, which the parser reports) print one line ``error: ...`` and exit
with status 2, never a traceback; Ctrl-C prints ``interrupted`` and exits with 130
(nothing is half-written: files are written atomically, :mod:`planner.io`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from planner.cli import (
    calibrate,
    compare,
    estimate,
    explain,
    export,
    measure,
    models,
    profiles,
    run,
    scale,
    schema,
    search,
    trace,
)
from planner.errors import PlannerError
from planner.version import __version__

__all__ = ["main", "build_parser"]

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C

# Subcommand modules in help order; each registers one subcommand named after it and
# imports what its work needs (torch, the runtime) when it runs, so the parser is light.
_MODULES = (search, scale, explain, export, estimate, trace, run, calibrate, measure, compare,
            models, profiles, schema)  # fmt: skip
SUBCOMMANDS = tuple(module.__name__.rpartition(".")[2] for module in _MODULES)


class _Parser(argparse.ArgumentParser):
    """argparse, with its complaint as the one ``error:`` line every user mistake prints
    (instead of the usage and ``plan search: error: ...``); subcommand parsers are of
    the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"error: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="plan",
        description="Plan data, tensor, pipeline and context parallelism for PyTorch training.",
        epilog="Without a subcommand, 'plan ARGS' runs 'plan search ARGS'.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    subparsers = parser.add_subparsers(title="subcommands", metavar="COMMAND")
    for module in _MODULES:
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
    """Run ``plan`` with ``argv``; the exit status (argparse exits with 2 on bad arguments
    and 0 after ``--help`` by raising :class:`SystemExit`)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `plan models | head` ends quietly
    try:
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
        return int(args.func(args) or 0)
    except PlannerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
