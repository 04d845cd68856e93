"""The README's plans stay the same through refactors: each case's plan JSON is compared
with the one stored in ``tests/golden/`` (timings aside).

Regenerate after an intended change of the search or the cost model with
``PLANNER_REGOLD=1 python -m pytest tests/test_golden_plans.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from planner.cli import main
from tests.devices import write_tp_pays

GOLDEN = Path(__file__).parent / "golden"
_TIMINGS = {"search_time_s", "ilp_time_s"}  # wall-clock figures differ run to run

CASES = {
    "llama3-70b-512": "--model llama3-70b --cluster h100-sxm-80gb --gpus 512 "
    "--global-batch 1024 --seq 8192",
    "gpt3-175b-1024-tp8": "--model gpt3-175b --cluster a100-sxm-80gb --gpus 1024 "
    "--global-batch 1536 --tp 8 --recompute full",
    "llama3-8b-64": "--model llama3-8b --cluster h100-sxm-80gb --gpus 64 --global-batch 64",
    "llama3-8b-64-seq8192": "--model llama3-8b --cluster h100-sxm-80gb --gpus 64 "
    "--global-batch 256 --seq 8192",
    "llama3-8b-64-lossy": "--model llama3-8b --gpus 64 --global-batch 64 --cluster "
    "h100-sxm-80gb --allow-lossy-compression bf16,powersgd:8",
    "llama3-8b-64-cp": "--model llama3-8b --gpus 64 --global-batch 16 --seq 32768 --cp 4",
    "tiny-llama-2": "--model tiny-llama --gpus 2 --global-batch 8 --seq 32 --dtype fp32",
    "nanogpt-4-tp": "--model tests.user_models:gpt --cluster {tp_pays} "
    "--global-batch 8 --dtype fp32 --tp 2",
}


def _comparable(value: object, tmp: str) -> object:
    """``value`` without timings, with the test's temporary directory named ``<tmp>``."""
    if isinstance(value, dict):
        return {k: _comparable(v, tmp) for k, v in value.items() if k not in _TIMINGS}
    if isinstance(value, list):
        return [_comparable(v, tmp) for v in value]
    if isinstance(value, str):
        return value.replace(tmp, "<tmp>")
    return value


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_is_unchanged(name, tmp_path, capsys):
    out = tmp_path / "plan.json"
    cluster = tmp_path / "tp-pays-cluster.json"
    cluster.write_text(json.dumps({"gpu": str(write_tp_pays(tmp_path)), "num_gpus": 4}))
    args = CASES[name].format(tp_pays=cluster).split()
    assert main([*args, "-o", str(out)]) == 0
    capsys.readouterr()
    plan = _comparable(json.loads(out.read_text()), str(tmp_path))
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("PLANNER_REGOLD"):
        golden.write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")
    assert plan == json.loads(golden.read_text())
