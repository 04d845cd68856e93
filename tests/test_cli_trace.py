"""``plan trace`` in-process: the table, the JSON summary, and clean errors."""

from __future__ import annotations

import json

import pytest

from planner.cli import main


def test_table_lists_segment_types(capsys):
    assert main(["trace", "--model", "tiny-llama", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "traced with fx" in out
    for text in ("embedding", "block (layers.0)", "head", "total", "share"):
        assert text in out


def test_json_summary(capsys):
    assert main(["trace", "--model", "tiny-gpt", "--json", "--batch", "2", "--dtype", "fp32"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tracer"] == "fx"
    assert (summary["batch_size"], summary["seq_len"], summary["dtype"]) == (2, 32, "fp32")
    kinds = [(row["kind"], row["count"]) for row in summary["types"]]
    assert kinds == [("embedding", 1), ("block", 4), ("head", 1)]
    assert sum(row["share_of_flops"] for row in summary["types"]) == pytest.approx(1.0)
    assert summary["params"] == sum(row["params"] * row["count"] for row in summary["types"])


def test_hf_config(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["trace", "--hf-config", str(tmp_path), "--seq", "16", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tracer"] == "export"
    assert [row["count"] for row in summary["types"] if row["kind"] == "block"] == [2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama3-7b"], "unknown model 'llama3-7b'. Did you mean"),
        (["--model", "/nonexistent/spec.json"], "cannot read ModelSpec file"),
        (["--model", "nowhere_pkg:make"], "cannot import 'nowhere_pkg'"),
        ([], "no model given"),
        (["--model", "gpt2", "--hf-config", "x"], "either --model or --hf-config"),
        (["--hf-config", "/nonexistent/dir"], "no such file"),
    ],
)
def test_bad_input_exits_2_without_traceback(capsys, argv, message):
    assert main(["trace", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_bad_spec_file_lists_fields(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"family": "gpt", "num_layers": -1, "hidden_size": 64,
                                "num_heads": 4, "vocab_size": 8, "seq_len": 8, "colour": 1}))  # fmt: skip
    assert main(["trace", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "num_layers = -1" in err and "colour = 1" in err


def test_untraceable_user_model_exits_2(capsys, monkeypatch):
    import sys
    import types

    import torch
    from torch import nn

    module = types.ModuleType("cli_user_models")
    module.broken = lambda: (nn.Linear(8, 8), torch.randn(2, 5))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cli_user_models", module)
    assert main(["trace", "--model", "cli_user_models:broken"]) == 2
    err = capsys.readouterr().err
    assert "broken: its forward fails (RuntimeError: " in err  # inputs 5 wide, the layer 8
    assert "check the model's code or its config" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["--seq", "0"], ["--batch", "-2"], ["--dtype", "fp8"]])
def test_bad_numbers_are_argparse_errors(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(["trace", "--model", "gpt2", *argv])
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.slow  # a subprocess that imports torch
def test_untraceable_model_in_a_real_process_prints_no_traceback(tmp_path):
    """torch logs kernel failures with tracebacks from its own handlers: they must stay muted."""
    import os
    import subprocess
    import sys

    (tmp_path / "broken_models.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def broken():\n    return nn.Linear(8, 8), torch.randn(2, 5)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "planner", "trace", "--model", "broken_models:broken"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert "broken: its forward fails (RuntimeError: " in result.stderr
    assert "Traceback" not in result.stderr
