"""Run a training command in a subprocess (optionally under torchrun) and read its losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
# A gloo rank now and then aborts ("terminate called without an active exception", a
# joinable std::thread destroyed) on a loaded machine, at exit or, rarely, mid-run; not
# understood (pytorch/pytorch#179291 describes one way at exit).
TEARDOWN_ABORT = "terminate called without an active exception"


def plan_run_losses(command: list[str]) -> list[float]:
    """Losses per step printed by ``command`` (a ``plan run ... --json`` invocation)."""
    return [step["loss"] for step in json.loads(run_printing(command, '"steps"'))["steps"]]


def run_printing(command: list[str], printed: str) -> str:
    """The stdout of ``command``, which must succeed (:func:`run_to_completion`)."""
    return run_to_completion(command, printed).stdout


def run_to_completion(command: list[str], printed: str) -> subprocess.CompletedProcess[str]:
    """``command``'s completed process, which must succeed.

    A run whose stdout holds ``printed`` (its results) and that then died of the teardown
    abort alone is run once more (with a warning): any other failure, or the abort
    twice, fails the test.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(2):
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        aborted_after_work = TEARDOWN_ABORT in done.stderr and printed in done.stdout
        if done.returncode == 0 or not aborted_after_work or attempt == 1:
            break
        warnings.warn(
            f"gloo teardown abort after the run finished; rerunning: {command}", stacklevel=2
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def loss_falls(losses: list[float]) -> bool:
    """Whether the mean of the last three losses is below that of the first three (each
    step trains on a new batch, so single steps are noisy)."""
    return sum(losses[-3:]) < sum(losses[:3])
