"""``plan run`` end to end under torchrun: same losses as one process on the same batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _plan_run import TORCHRUN, plan_run_losses

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


@pytest.mark.distributed
@pytest.mark.slow
def test_plan_run_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    parallel = _write_plan(tmp_path / "fsdp.json", Strategy(dp=2, zero=3, micro_batch_size=4))
    single = _write_plan(tmp_path / "single.json", Strategy(micro_batch_size=8))
    args = ["run", "--steps", "3", "--json", "--lr", "0.01"]
    distributed = plan_run_losses([*TORCHRUN, "2", "-m", "planner", *args, str(parallel)])
    reference = plan_run_losses([sys.executable, "-m", "planner", *args, str(single)])
    assert distributed == pytest.approx(reference, abs=1e-5)
    assert distributed[-1] < distributed[0]
