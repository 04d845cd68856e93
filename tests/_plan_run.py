"""Run ``plan run --json`` in a subprocess (optionally under torchrun) and read its losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def plan_run_losses(command: list[str]) -> list[float]:
    """Losses per step printed by ``command`` (a ``plan run ... --json`` invocation)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [step["loss"] for step in json.loads(done.stdout)["steps"]]
