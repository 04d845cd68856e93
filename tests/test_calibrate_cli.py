"""'plan calibrate' microbenchmarks under torchrun produce a profile 'plan search' accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.hardware import load_profile


def _plan(*args: str, torchrun: bool = False) -> subprocess.CompletedProcess[str]:
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2"] if torchrun else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *launcher, "-m", "planner", *args],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip


@pytest.mark.distributed
def test_calibrate_writes_a_cpu_profile_that_plan_search_uses(tmp_path: Path) -> None:
    profile_path = tmp_path / "my-cpu.json"
    result = _plan("calibrate", "--quick", "-o", str(profile_path), torchrun=True)
    if result.returncode != 0 and "did not converge" in result.stderr:
        # --quick times few collectives; on a busy 2-core machine they can scatter past the
        # fit's bound (the command says so and writes nothing): measure once more
        result = _plan("calibrate", "--quick", "-o", str(profile_path), torchrun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "collectives" in result.stdout and "matmul" in result.stdout
    profile = load_profile(str(profile_path))
    assert profile.device_kind == "cpu" and profile.gpus_per_node == 2
    assert 0 < profile.matmul_efficiency <= 1
    assert profile.sources["links.intra_node.latency_us"].startswith("measured ")
    assert "copy of intra_node" in profile.sources["links.inter_node.bandwidth_GBps"]
    # the probe plans measured what DTensor, FSDP2, the loop and the pipeline cost
    assert "runtime      " in result.stdout
    for field in ("dtensor_op_overhead_us", "dtensor_param_overhead_us", "fsdp_call_overhead_us",
                  "step_overhead_us", "pipeline_step_overhead_us"):  # fmt: skip
        assert getattr(profile, field) is not None, field
        assert "probe plan" in profile.sources[field]
    assert profile.fsdp_call_overhead_us > 0 and profile.dtensor_op_overhead_us > 0
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"gpu": str(profile_path), "num_gpus": 2, "gpus_per_node": 2}))
    plan_path = tmp_path / "plan.json"
    search = _plan("--model", "tiny-gpt", "--cluster", str(cluster), "--global-batch", "4",
                   "--dtype", "fp32", "-o", str(plan_path))  # fmt: skip
    assert search.returncode == 0, search.stderr[-3000:]
    assert json.loads(plan_path.read_text())["prediction"]["step_time_s"] > 0


@pytest.mark.slow  # a subprocess that imports torch
def test_calibrate_without_collectives_or_base_says_what_to_do(tmp_path: Path) -> None:
    result = _plan("calibrate", "--quick", "-o", str(tmp_path / "p.json"))
    assert result.returncode == 2
    assert "run under torchrun with 2 or more ranks, or pass --base" in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_refit_needs_a_profile(tmp_path: Path) -> None:
    result = _plan("calibrate", "--from", "m.json", "-o", str(tmp_path / "p.json"))
    assert result.returncode == 2 and "--from needs --profile" in result.stderr


@pytest.mark.slow  # a subprocess that imports torch
def test_calibrate_without_a_peak_refuses_before_measuring(tmp_path: Path) -> None:
    result = _plan("calibrate", "--quick", "--dtype", "bf16", "-o", str(tmp_path / "p.json"))
    assert result.returncode == 2
    assert "the CPU peak estimate is for fp32, not bf16: pass --peak-tflops" in result.stderr
    assert "sweep" not in result.stderr  # nothing was measured first
