"""The README is executable: its quick start, first-hour walk-through, Python examples and
troubleshooting messages are run and compared with what they print, and docs/CLI.md is
the generator's current output with a help string on every option.

Commands run in a temporary directory with this interpreter's environment first on PATH
(so ``plan`` and ``torchrun`` are the ones installed next to it) and ``COLUMNS=80``, the
width the README's outputs were pasted at.
"""

from __future__ import annotations

import difflib
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from planner.cli import build_parser, main
from planner.cli.reference import REGENERATE, render_reference, subcommands, undocumented
from planner.cli.reference import main as reference_main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_REFERENCE = ROOT / "docs" / "CLI.md"
CI_SCRIPT = ROOT / ".ci" / "run"
PROMPT = "$ "


@dataclass(frozen=True)
class Command:
    """A ``$ command`` line of a console block and the output lines the README shows."""

    text: str
    shown: tuple[str, ...]


def _readme() -> str:
    return README.read_text()


def _section(markdown: str, title_start: str) -> str:
    """The text of the ``## `` section whose title starts with ``title_start``."""
    match = re.search(rf"^## {re.escape(title_start)}.*?(?=^## |\Z)", markdown, re.M | re.S)
    assert match, f"README has no section '## {title_start}...'"
    return match.group(0)


def _between(markdown: str, name: str) -> str:
    match = re.search(rf"<!-- {name}:begin -->(.*?)<!-- {name}:end -->", markdown, re.S)
    assert match, f"README has no <!-- {name}:begin/end --> markers"
    return match.group(1)


def _fences(markdown: str) -> list[tuple[str, str]]:
    """Every fenced block as (info string, body), in order."""
    return [
        (m.group(1), m.group(2))
        for m in re.finditer(r"^```(\w*)\n(.*?)^```$", markdown, re.M | re.S)
    ]


def _console_commands(markdown: str) -> list[Command]:
    commands: list[Command] = []
    for info, body in _fences(markdown):
        if info != "console":
            continue
        for chunk in re.split(rf"^(?={re.escape(PROMPT)})", body, flags=re.M):
            if chunk.startswith(PROMPT):
                first, *rest = chunk.rstrip("\n").split("\n")
                commands.append(Command(first[len(PROMPT) :], tuple(rest)))
    return commands


def _python_examples(markdown: str) -> list[tuple[str, str]]:
    """(code, output) for every ```python block followed directly by its ```text output."""
    fences = _fences(markdown)
    return [
        (code, output)
        for (info, code), (next_info, output) in itertools.pairwise(fences)
        if info == "python" and next_info == "text"
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "80"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _shell(command: str, cwd: Path, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip


def _mask_timings(line: str) -> str:
    """The search statistics' wall-clock seconds vary from run to run; nothing else does."""
    line = line.rstrip()
    if line.startswith(("searched ", "sharding ILP")):
        return re.sub(r"\d+(\.\d+)? s\b", "<t> s", line)
    return line


# --- docs/CLI.md and help strings ---------------------------------------------------------


def test_cli_reference_is_the_generators_current_output() -> None:
    assert CLI_REFERENCE.read_text() == render_reference(), f"docs/CLI.md is stale: {REGENERATE}"


def test_reference_check_mode_flags_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "CLI.md"
    stale.write_text(render_reference().replace("plan search", "plan serach", 1))
    assert reference_main(["--check", str(stale)]) == 1
    assert reference_main(["--check", str(CLI_REFERENCE)]) == 0


def test_every_subcommand_and_option_has_help() -> None:
    assert undocumented(build_parser()) == []


def test_readme_lists_every_subcommand_with_its_help_line() -> None:
    section = _section(_readme(), "CLI reference")
    assert "(docs/CLI.md)" in section
    parser = build_parser()
    for name in subcommands(parser):
        assert f"| `plan {name}` |" in section, f"README's CLI table lacks plan {name}"
    for line in render_reference(parser).splitlines():
        if line.startswith("| [`plan "):  # the generated index: | [`plan x`](#plan-x) | help |
            name, help_line = re.findall(r"`plan (\S+)`\]\(#[^)]*\) \| (.*) \|$", line)[0]
            assert f"| `plan {name}` | {help_line} |" in section


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_and_pictures_resolve() -> None:
    markdown = _readme()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", markdown, re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", markdown):
        if target.startswith("#"):
            assert target[1:] in anchors, f"README links to a missing heading: {target}"
        elif not target.startswith("http"):
            assert (ROOT / target).is_file(), f"README links to a missing file: {target}"
    picture = ROOT / "docs" / "plot-example.png"
    assert f"--plot {picture.relative_to(ROOT)}" in markdown  # made by a command shown
    assert picture.stat().st_size < 300_000


# --- quick start ----------------------------------------------------------------------------


def _quick_start() -> list[str]:
    blocks = [body for info, body in _fences(_section(_readme(), "Quick start")) if not info]
    return blocks[0].strip().splitlines()


def test_quick_start_is_two_commands_and_the_second_is_what_ci_runs() -> None:
    plan_line, test_line = _quick_start()  # exactly two commands
    ci_lines = [line.strip() for line in CI_SCRIPT.read_text().splitlines()]
    install, test = test_line.rsplit(" && ", 1)
    assert install in ci_lines, "the README's install command is not the one .ci/run runs"
    assert test in ci_lines, "the README's test command is not the one .ci/run runs"
    assert plan_line.startswith(install.replace('".[test]"', ".") + " && .venv/bin/plan ")


@pytest.mark.slow  # a subprocess that imports torch
def test_quick_start_plan_prints_the_readme_example(tmp_path: Path) -> None:
    command = _quick_start()[0].rsplit(" && ", 1)[1].replace(".venv/bin/plan", "plan", 1)
    result = _shell(command, tmp_path)
    assert result.returncode == 0, result.stderr
    shown = _section(_readme(), "Quick start").split("prints (at 80 columns")[1]
    example = next(body for info, body in _fences(shown) if not info)
    expected = [_mask_timings(line) for line in example.splitlines()]
    printed = [_mask_timings(line) for line in result.stdout.splitlines()]
    diff = "\n".join(difflib.unified_diff(expected, printed, "README", "printed", lineterm=""))
    assert printed == expected, f"paste the new output into the README:\n{diff}"


# --- the first-hour walk-through --------------------------------------------------------------

# Lines each walk-through step must print, checked in the README's pasted output and in
# the real output. Keyed by a pattern of the command; every command must match one key.
WALKTHROUGH_KEY_LINES: dict[str, tuple[str, ...]] = {
    r"-m planner calibrate -o my-cpu\.json$": (r"profile my-cpu \(cpu\)", r"wrote my-cpu\.json"),
    r"^echo .*> cpu-cluster\.json$": (),
    r"^plan --model tiny-llama --cluster cpu-cluster\.json .*-o plan\.json$": (
        r"Plan for tiny-llama on 2 x my-cpu\.json", r"│ step time +│ [\d.]+ s",
        r"│ peak memory per GPU +│ [\d.]+ of [\d.]+ GiB \(fits\)", r"searched [\d,]+ candidates",
        r"wrote plan\.json",
    ),
    r"^plan explain plan\.json$": (r"Plan for tiny-llama on 2 x my-cpu\.json", r"│ mesh +│"),
    r"-m planner run plan\.json --steps 5$": (r"step +0  loss 5\.6558\d\d  time [\d.]+ s", r"step +4  loss"),
    r"-m planner measure plan\.json .*-o measured\.json$": (
        r"tiny-llama: dp", r"step time: median [\d.]+ ms", r"wrote measured\.json",
    ),
    r"^plan compare plan\.json measured\.json$": (
        r"step +[\d.]+ ms +[\d.]+ ms +[-+][\d.]+%", r"peak memory +[\d.]+ GiB", r"wrote measured-compare\.png",
    ),
}  # fmt: skip


def _key_lines(command: str) -> tuple[str, ...]:
    keys = [key for key in WALKTHROUGH_KEY_LINES if re.search(key, command)]
    assert len(keys) == 1, f"walk-through command {command!r} matches {len(keys)} known steps"
    return WALKTHROUGH_KEY_LINES[keys[0]]


def _missing(patterns: tuple[str, ...], lines: list[str]) -> list[str]:
    return [p for p in patterns if not any(re.match(p, line) for line in lines)]


def test_walkthrough_covers_the_first_hour_and_shows_each_key_line() -> None:
    commands = _console_commands(_between(_readme(), "walkthrough"))
    steps = [re.search(r"\b(?:plan|planner) (\S+)", c.text) for c in commands]
    named = [step.group(1) for step in steps if step]
    assert named == ["calibrate", "--model", "explain", "run", "measure", "compare"]
    for command in commands:
        assert not _missing(_key_lines(command.text), list(command.shown)), command.text


# How 'plan calibrate' refuses a fit spoilt by timing noise (a loaded machine): documented
# behaviour, not what the walk-through tests, so that step gets a second try (with a warning).
CALIBRATION_NOISE = ("did not converge", "outside its physical range")


def _run_step(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    result = _shell(command, cwd)
    noisy = any(message in result.stderr for message in CALIBRATION_NOISE)
    if result.returncode != 0 and " calibrate " in command and noisy:
        refused = result.stderr[-300:]
        warnings.warn(f"calibration refused a noisy fit, retrying: {refused}", stacklevel=2)
        result = _shell(command, cwd)
    return result


@pytest.mark.slow
@pytest.mark.distributed
def test_walkthrough_runs_end_to_end(tmp_path: Path) -> None:
    for command in _console_commands(_between(_readme(), "walkthrough")):
        result = _run_step(command.text, tmp_path)
        assert result.returncode == 0, f"{command.text}\n{result.stdout}\n{result.stderr}"
        missing = _missing(_key_lines(command.text), result.stdout.splitlines())
        assert not missing, f"{command.text} did not print {missing}:\n{result.stdout}"


# --- Python examples ----------------------------------------------------------------------------


@pytest.mark.slow
def test_python_examples_print_what_the_readme_shows(tmp_path: Path) -> None:
    examples = _python_examples(_readme())
    assert len(examples) >= 3  # the Python API example and the troubleshooting snippets
    for code, output in examples:
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.rstrip() == output.rstrip(), code


# --- troubleshooting ----------------------------------------------------------------------------


def _run_in_process(command: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run ``plan ...`` through :func:`planner.cli.main`; return its status and stderr."""
    capsys.readouterr()
    status = main(shlex.split(command)[1:])
    return status, capsys.readouterr().err


@pytest.mark.slow
def test_troubleshooting_messages_are_what_the_commands_print(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # The --hf-config entry shows a machine without the [hf] extra: hide transformers.
    monkeypatch.setitem(sys.modules, "transformers", None)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    commands = _console_commands(_section(_readme(), "Troubleshooting"))
    assert len(commands) >= 10
    for command in commands:
        assert command.text.startswith("plan "), command.text
        errors = [line for line in command.shown if line.startswith("error: ")]
        status, stderr = _run_in_process(command.text, capsys)
        if errors:
            assert status == 2, command.text
            assert stderr.splitlines() == errors, command.text
        else:
            assert status == 0, f"{command.text}: {stderr}"


def test_the_estimate_example_prints_what_the_readme_says() -> None:
    """The ``plan estimate`` example (its config with the annotations taken out) and the
    figures the README says it prints."""
    from planner.cost import estimate_run

    section = _section(_readme(), "Cost model and `plan estimate`")
    config = _fences(section)[0][1]
    config = re.sub(r"\s+\((?:or inline|optional)[^)]*\)", "", config)
    prediction = estimate_run(json.loads(config))
    said = re.search(
        r"it prints a ([\d.]+) s step, ([\d.]+)\s+tokens/s/GPU, MFU ([\d.]+)%, HFU ([\d.]+)% "
        r"and ([\d.]+) GiB per GPU",
        section,
    )
    assert said, "README no longer says what the estimate example prints"
    printed = (
        f"{prediction.step_time_s:.2f}", f"{prediction.tokens_per_s_per_gpu:.1f}",
        f"{100 * prediction.mfu:.1f}", f"{100 * prediction.hfu:.1f}",
        f"{prediction.peak_memory_gib:.1f}",
    )  # fmt: skip
    assert said.groups() == printed
