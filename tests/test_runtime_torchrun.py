"""Under torchrun: ``plan run`` end to end, and a training loop written the way the README
tells users to (``tests/_user_loop.py``) on models the project did not write; each gives
the same losses as one process on the same batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _plan_run import TORCHRUN, plan_run_losses

import planner
from planner.assemble import assemble_plan
from planner.hf import resolve_hf_config
from planner.models import resolve_model
from planner.spec import Cluster, Strategy, Training
from tests.devices import write_tp_pays

ROOT = Path(__file__).resolve().parents[1]
USER_LOOP = str(ROOT / "tests" / "_user_loop.py")
LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 256, "max_position_embeddings": 64,
}  # fmt: skip


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


def _user_plans(tmp_path: Path, model: str) -> tuple[str, Path, Path]:
    """The model's source and its plans at tp 2 with SP (2 ranks) and on one rank, made
    on a device where tensor parallelism pays even for tiny layers."""
    if model == "hf-llama":
        source = tmp_path / "llama"
        source.mkdir()
        (source / "config.json").write_text(json.dumps(LLAMA))
        handle, source_arg = resolve_hf_config(source), str(source)
    else:
        handle, source_arg = (
            resolve_model("tests.user_models:gpt_tied"),
            "tests.user_models:gpt_tied",
        )
    device = str(write_tp_pays(tmp_path))
    training = Training(global_batch_size=8, micro_batch_size=8, seq_len=16, dtype="fp32")
    paths = []
    for gpus, pins in ((2, planner.Pins(tp=2, sequence_parallel=True)), (1, planner.Pins())):
        plan = planner.make_plan(handle, Cluster(gpu=device, num_gpus=gpus), training, pins=pins)
        assert plan.strategy.tp == gpus
        paths.append(tmp_path / f"plan-{gpus}.json")
        paths[-1].write_text(plan.to_json())
    return source_arg, paths[0], paths[1]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf-llama", "nanogpt-tied"])
def test_a_users_loop_under_torchrun_matches_one_process(tmp_path, monkeypatch, model):
    """HF Llama built with AutoModelForCausalLM.from_config (loss parallel) and a tied
    nanoGPT-style module, at tp 2 with sequence parallelism, trained as the README says."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    source, tensor_parallel, single = _user_plans(tmp_path, model)
    distributed = plan_run_losses([*TORCHRUN, "2", USER_LOOP, source, str(tensor_parallel), "3"])
    reference = plan_run_losses([sys.executable, USER_LOOP, source, str(single), "3"])
    assert distributed == pytest.approx(reference, abs=1e-5)
