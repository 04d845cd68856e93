"""From the search to a run: what ``plan`` writes, ``torchrun ... plan run`` trains exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _plan_run import TORCHRUN, plan_run_losses

import planner
from planner.assemble import assemble_plan
from planner.cli import main
from planner.models import resolve_model
from planner.spec import Cluster, Plan, Strategy, Training, load_document


def _two_ranks_and_one_process(plan: Path, tmp_path: Path) -> tuple[list[float], list[float]]:
    """Losses of 3 ``plan run`` steps of ``plan`` (tiny-llama, batch 8, seq 16) on 2 ranks,
    and of the same training in one process."""
    training = Training(global_batch_size=8, seq_len=16, dtype="fp32")
    single = assemble_plan(
        resolve_model("tiny-llama", seq_len=16), Cluster(gpu="a100-sxm-80gb", num_gpus=1),
        training, Strategy(micro_batch_size=8),
    )  # fmt: skip
    (tmp_path / "single.json").write_text(single.to_json())
    run = ["run", "--steps", "3", "--json", "--lr", "0.01"]
    distributed = plan_run_losses([*TORCHRUN, "2", "-m", "planner", *run, str(plan)])
    reference = plan_run_losses(
        [sys.executable, "-m", "planner", *run, str(tmp_path / "single.json")]
    )
    return distributed, reference


@pytest.mark.distributed
@pytest.mark.slow
def test_searched_plan_runs_under_torchrun_like_one_process(tmp_path: Path) -> None:
    searched = tmp_path / "searched.json"
    args = ["--model", "tiny-llama", "--cluster", "a100-sxm-80gb", "--gpus", "2",
            "--global-batch", "8", "--seq", "16", "--dtype", "fp32", "--tp", "2",
            "-o", str(searched)]  # fmt: skip
    assert main(args) == 0
    plan = load_document(Plan, searched)
    assert plan.strategy.tp == 2 and plan.tp_layout
    distributed, reference = _two_ranks_and_one_process(searched, tmp_path)
    assert distributed == pytest.approx(reference, abs=1e-5)
    assert distributed[-1] < distributed[0]


def test_one_shot_parallelize_plans_then_applies() -> None:
    model = resolve_model("tiny-gpt", device="cpu", seed=0).module
    training = Training(global_batch_size=4, seq_len=16, dtype="fp32")
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=1)
    parallel = planner.parallelize(model, cluster=cluster, training=training)
    logits = parallel(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)


def test_parallelize_needs_a_plan_or_a_cluster() -> None:
    model = resolve_model("tiny-gpt", device="cpu", seed=0).module
    with pytest.raises(planner.PlannerError, match="cluster= and training="):
        planner.parallelize(model)


@pytest.mark.distributed
@pytest.mark.slow
def test_lossy_plan_for_a_slow_link_runs_under_torchrun(tmp_path: Path) -> None:
    """On a 1 MB/s link the search picks PowerSGD; the plan runs, and during its warm-up
    (uncompressed steps) it trains exactly like one process."""
    cluster = tmp_path / "slow.json"
    cluster.write_text(
        '{"gpu": "a100-sxm-80gb", "num_gpus": 2, "gpus_per_node": 1, "inter_node_GBps": 0.001}'
    )
    searched = tmp_path / "lossy.json"
    args = ["--model", "tiny-llama", "--cluster", str(cluster), "--global-batch", "8",
            "--seq", "16", "--dtype", "fp32", "--dp", "2",
            "--allow-lossy-compression", "powersgd:2", "-o", str(searched)]  # fmt: skip
    assert main(args) == 0
    plan = load_document(Plan, searched)
    assert plan.strategy.compression.describe() == "powersgd(r2)" and plan.tradeoffs
    distributed, reference = _two_ranks_and_one_process(searched, tmp_path)
    assert distributed == pytest.approx(reference, abs=1e-5)
