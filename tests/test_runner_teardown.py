"""``process_group_from_env`` frees a run's process-group handles before the group goes."""

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from _plan_run import TORCHRUN

SCRIPT = textwrap.dedent(
    """
    import gc
    import torch
    from planner.models import resolve_model
    from planner.planning import make_plan
    from planner.solve.search import Pins
    from planner.spec import Cluster, Training
    from strategies.apply import parallelize
    from strategies.parallel_model import local_slice
    from strategies.runner import Trainer, process_group_from_env, synthetic_batch

    def train_one_step(rank):
        training = Training(global_batch_size=4, seq_len=32, dtype="fp32")
        handle = resolve_model("tiny-llama", device="meta", seed=0)
        pins = Pins(dp=2, tp=1, pp=1, zero=3)
        plan = make_plan(handle, Cluster(gpu="h100-sxm-80gb", num_gpus=2), training, pins=pins)
        parallel = parallelize(resolve_model("tiny-llama", device="cpu", seed=0).module, plan)
        Trainer(parallel, lr=0.01).step(*local_slice(plan, rank, *synthetic_batch(256, 4, 32, seed=0, step=0)))

    with process_group_from_env() as rank:
        train_one_step(rank)
    alive = sorted({type(o).__name__ for o in gc.get_objects() if type(o).__name__.startswith("FSDP")})
    print(f"alive after the group: {alive}", flush=True)  # one write: the ranks share stdout
    """
)


@pytest.mark.distributed
def test_a_runs_fsdp_modules_are_freed_before_the_group_is_destroyed(tmp_path: Path) -> None:
    """FSDP2's modules hold the group's backend in reference cycles; left to interpreter
    exit, gloo's threads die mid-finalisation (pytorch/pytorch#179291)."""
    script = tmp_path / "teardown.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [*TORCHRUN, "2", str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("alive after the group: []") == 2, done.stdout
