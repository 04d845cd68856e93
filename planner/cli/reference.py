"""The CLI reference (``docs/CLI.md``), generated from the ``plan`` argument parser.

::

    python -m planner.cli.reference -o docs/CLI.md     # regenerate
    python -m planner.cli.reference --check docs/CLI.md  # exit 1 if it is stale

The Markdown is built from the parser's actions, not from argparse's help formatter,
so it is the same on every Python version and terminal width. :func:`undocumented`
lists the subcommands and options that lack a help string (a test keeps it empty).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from planner.cli import build_parser
from planner.errors import SpecError
from planner.io import read_text, write_text_atomic

__all__ = ["render_reference", "subcommands", "undocumented", "main"]

REGENERATE = "python -m planner.cli.reference -o docs/CLI.md"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers of ``parser`` by name, in help order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The one-line help of each subcommand (what ``plan --help`` lists)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def _documented_actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            yield action


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Subcommands without a help line or description, and arguments without help."""
    missing = [f"plan: {a.dest}" for a in _documented_actions(parser) if not a.help]
    summaries = _summaries(parser)
    for name, sub in subcommands(parser).items():
        if not summaries.get(name):
            missing.append(f"plan {name}: help line")
        if not sub.description:
            missing.append(f"plan {name}: description")
        missing += [f"plan {name}: {_names(a)}" for a in _documented_actions(sub) if not a.help]
    return missing


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        name = str(action.metavar)
    elif action.choices is not None:
        name = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        name = action.dest.upper() if action.option_strings else action.dest
    if action.nargs == "?":
        return f"[{name}]"
    if action.nargs in ("+", "*"):
        return f"{name} [{name} ...]"
    return name


def _names(action: argparse.Action) -> str:
    """``-o, --output PATH``; ``--[no-]flag`` for boolean pairs; the metavar for positionals."""
    metavar = _metavar(action)
    if not action.option_strings:
        return metavar
    options = list(action.option_strings)
    if isinstance(action, argparse.BooleanOptionalAction):
        options = [o for o in options if not o.startswith("--no-")]
        options = [o.replace("--", "--[no-]", 1) for o in options]
    return " ".join([", ".join(options), metavar]).strip()


def _details(action: argparse.Action) -> str:
    """The help text with what the user must know besides it: required, choices, default."""
    text = action.help or ""
    extras = []
    if action.required and action.option_strings:
        extras.append("required")
    if action.choices is not None and action.metavar is not None:
        extras.append("one of " + ", ".join(str(c) for c in action.choices))
    shows_default = action.default not in (None, False, argparse.SUPPRESS)
    if shows_default and "default" not in text:
        extras.append(f"default: {action.default}")
    return "; ".join([text, *extras]) if extras else text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _synopsis(name: str, parser: argparse.ArgumentParser) -> str:
    actions = list(_documented_actions(parser))
    options = ["[options]"] if any(a.option_strings for a in actions) else []
    positionals = [_metavar(a) for a in actions if not a.option_strings]
    return " ".join(["plan", name, *options, *positionals])


def _argument_tables(parser: argparse.ArgumentParser) -> list[str]:
    lines: list[str] = []
    documented = set(_documented_actions(parser))
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a in documented]
        if not actions:
            continue
        lines += ["", f"*{group.title}*", "", "| argument | meaning |", "|---|---|"]
        lines += [f"| `{_cell(_names(a))}` | {_cell(_details(a))} |" for a in actions]
    return lines


def _subcommand_section(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## plan {name}", "", f"{summary[0].upper()}{summary[1:]}.", ""]
    lines += ["```", _synopsis(name, parser), "```", "", parser.description or ""]
    lines += _argument_tables(parser)
    return [*lines, ""]


def render_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole reference as Markdown: an index, global options, one section per subcommand."""
    parser = parser or build_parser()
    summaries = _summaries(parser)
    lines = [
        "# `plan` command reference",
        "",
        f"Generated from the argument parser by `{REGENERATE}`; do not edit by hand "
        "(`tests/test_readme.py` fails when this file is stale). `plan SUBCOMMAND --help` "
        "prints the same information.",
        "",
        parser.description or "",
        f"{parser.epilog or ''}",
        "",
        "| subcommand | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`plan {n}`](#plan-{n}) | {_cell(s)} |" for n, s in summaries.items()]
    lines += ["", "Options of `plan` itself:"]
    lines += _argument_tables(parser)
    lines.append("")
    for name, sub in subcommands(parser).items():
        lines += _subcommand_section(name, summaries[name], sub)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write the reference (``-o``), check a file is current (``--check``), or print it."""
    cli = argparse.ArgumentParser(
        prog="python -m planner.cli.reference",
        description="Generate the plan command's Markdown reference from its parser.",
    )
    cli.add_argument("-o", "--output", type=Path, help="write the reference here")
    cli.add_argument("--check", type=Path, metavar="CLI.md", help="exit 1 if this file is stale")
    args = cli.parse_args(argv)
    text = render_reference()
    if args.check is not None:
        try:
            current = read_text(args.check, what="--check") == text
        except SpecError:  # missing or not text: stale
            current = False
        if not current:
            print(f"{args.check} is stale: run {REGENERATE}", file=sys.stderr)
        return 0 if current else 1
    if args.output is not None:
        write_text_atomic(args.output, text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
