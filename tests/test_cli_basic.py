"""The CLI shell: help, schema, model listing, error handling."""

import json
import subprocess
import sys

import pytest

from planner.cli import main


def test_schema_prints_a_json_schema_for_each_document(capsys):
    for document in ("plan", "model", "cluster", "training", "strategy"):
        assert main(["schema", document]) == 0
        schema = json.loads(capsys.readouterr().out)
        assert schema["type"] == "object"
        assert schema["additionalProperties"] is False
        assert "schema_version" in schema["properties"]


def test_models_lists_presets_with_parameter_counts(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama3.1-405b" in out and "405.85B" in out
    assert "gpt3-175b" in out and "175.24B" in out


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("schema", "models"):
        assert name in out


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "planner", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("plan ")


def _status_and_stderr(argv, capsys):
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--model", "gpt2", "--global-batch", "0"],
         "error: argument --global-batch: expected a positive integer, got 0; "
         "see 'plan search --help'"),
        (["--model", "gpt2"],
         "error: --global-batch is required: give the sequences per optimizer step, or plan "
         "the job of a config you have with --from FILE"),
        (["run", "plan.json", "--lr", "-1"],
         "error: argument --lr: expected a positive finite number, got '-1'; see 'plan run --help'"),
        (["run", "plan.json", "--steps", "1e3"],
         "error: argument --steps: expected an integer, got '1e3'; see 'plan run --help'"),
        (["trace", "--model", "gpt2", "--batch", str(10**9)],
         "error: argument --batch: 1000000000 > 100000000: the largest published runs take a "
         "few thousand sequences per step; this bound keeps planning in seconds; "
         "see 'plan trace --help'"),
        (["schema", "planz"],
         "error: argument document: invalid choice: 'planz' (choose from 'cluster', 'model', "
         "'plan', 'strategy', 'training'); see 'plan schema --help'"),
    ],
)  # fmt: skip
def test_bad_arguments_print_one_error_line(argv, line, capsys):
    status, err = _status_and_stderr(argv, capsys)
    assert (status, err) == (2, line + "\n")


def test_a_model_function_that_raises_is_an_error_line(capsys):
    argv = ["trace", "--model", "tests.test_fuzz_cli:raising_model"]
    status, err = _status_and_stderr(argv, capsys)
    assert status == 2
    assert err == (
        "error: model function 'tests.test_fuzz_cli:raising_model' raised RuntimeError: the "
        "weights server is down (second line); fix the function (call "
        "tests.test_fuzz_cli.raising_model() in Python to see the traceback)\n"
    )


def test_a_module_that_fails_to_import_is_an_error_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_models_xyz.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status, err = _status_and_stderr(["trace", "--model", "broken_models_xyz:build"], capsys)
    assert status == 2
    assert err.startswith(
        "error: importing 'broken_models_xyz' from model path 'broken_models_xyz:build' raised "
        "ZeroDivisionError: division by zero; fix the module"
    )
    assert err.count("\n") == 1
