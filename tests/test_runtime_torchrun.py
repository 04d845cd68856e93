"""``plan run`` end to end under torchrun: same losses as one process on the same batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.assemble import assemble_plan
from planner.models import resolve_model
from planner.spec import Cluster, Strategy, Training


def _write_plan(path: Path, strategy: Strategy) -> Path:
    training = Training(
        global_batch_size=8, micro_batch_size=strategy.micro_batch_size, seq_len=16, dtype="fp32"
    )
    cluster = Cluster(gpu="cpu", num_gpus=strategy.world_size, gpus_per_node=strategy.world_size)
    plan = assemble_plan(resolve_model("tiny-gpt"), cluster, training, strategy)
    path.write_text(plan.to_json())
    return path


def _losses(command: list[str]) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [step["loss"] for step in json.loads(done.stdout)["steps"]]


@pytest.mark.distributed
@pytest.mark.slow
def test_plan_run_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    parallel = _write_plan(tmp_path / "fsdp.json", Strategy(dp=2, zero=3, micro_batch_size=4))
    single = _write_plan(tmp_path / "single.json", Strategy(micro_batch_size=8))
    args = ["run", "--steps", "3", "--json", "--lr", "0.01"]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    distributed = _losses([*torchrun, "-m", "planner", *args, str(parallel)])
    reference = _losses([sys.executable, "-m", "planner", *args, str(single)])
    assert distributed == pytest.approx(reference, abs=1e-5)
    assert distributed[-1] < distributed[0]
