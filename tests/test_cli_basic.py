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
