"""Under torchrun: ``plan run`` end to end, and a training loop written the way the README
tells users to (``tests/_user_loop.py``) on models the project did not write; each gives
the same losses as one process on the same batch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _plan_run import TORCHRUN, loss_falls, plan_run_losses, run_printing

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
    "torch_dtype": "bfloat16",  # as published configs say: the README loop builds fp32
}  # fmt: skip


def _write_plan(path: Path, strategy: Strategy, source: str = "tiny-gpt") -> Path:
    training = Training(
        global_batch_size=8, micro_batch_size=strategy.micro_batch_size, seq_len=16, dtype="fp32"
    )
    cluster = Cluster(gpu="cpu", num_gpus=strategy.world_size, gpus_per_node=strategy.world_size)
    path.write_text(assemble_plan(resolve_model(source), cluster, training, strategy).to_json())
    return path


@pytest.mark.distributed
@pytest.mark.slow
def test_plan_run_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    parallel = _write_plan(tmp_path / "fsdp.json", Strategy(dp=2, zero=3, micro_batch_size=4))
    single = _write_plan(tmp_path / "single.json", Strategy(micro_batch_size=8))
    args = ["run", "--steps", "8", "--json", "--lr", "0.01"]
    distributed = plan_run_losses([*TORCHRUN, "2", "-m", "planner", *args, str(parallel)])
    reference = plan_run_losses([sys.executable, "-m", "planner", *args, str(single)])
    assert distributed == pytest.approx(reference, abs=1e-5)
    assert loss_falls(distributed)


@pytest.mark.distributed
@pytest.mark.slow
def test_plan_run_resumes_under_another_plan_and_exports(tmp_path: Path) -> None:
    """4 steps of FSDP over 2 ranks saved, then resumed in one process to step 8: the
    losses of the uninterrupted run; the exported safetensors load in transformers."""
    transformers = pytest.importorskip("transformers")
    model = "tiny-llama"
    fsdp = _write_plan(tmp_path / "fsdp.json", Strategy(dp=2, zero=3, micro_batch_size=4), model)
    single = _write_plan(tmp_path / "single.json", Strategy(micro_batch_size=8), model)
    args = ["run", "--json", "--lr", "0.01"]
    checkpoints, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    before = plan_run_losses(
        [*TORCHRUN, "2", "-m", "planner", *args, "--steps", "4", "--checkpoint-dir", checkpoints,
         str(fsdp)]
    )  # fmt: skip
    after = plan_run_losses(
        [sys.executable, "-m", "planner", *args, "--steps", "8", "--checkpoint-dir", checkpoints,
         "--resume", "--export-hf", str(out), str(single)]
    )  # fmt: skip
    reference = plan_run_losses(
        [sys.executable, "-m", "planner", *args, "--steps", "8", str(single)]
    )
    assert before + after == pytest.approx(reference, abs=1e-6)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000008"
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    assert hf.config.num_hidden_layers == 4


def _user_plans(
    tmp_path: Path, model: str, pins: planner.Pins | None = None, micro_batch_size: int = 8
) -> tuple[str, Path, Path]:
    """The model's source and its plans with ``pins`` on 2 ranks (default tp 2 with SP)
    and on one rank, made on a device where tensor parallelism pays even for tiny layers."""
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
    training = Training(
        global_batch_size=8, micro_batch_size=micro_batch_size, seq_len=16, dtype="fp32"
    )
    paths = []
    pins = pins or planner.Pins(tp=2, sequence_parallel=True)
    for gpus, pinned in ((2, pins), (1, planner.Pins())):
        plan = planner.make_plan(handle, Cluster(gpu=device, num_gpus=gpus), training, pins=pinned)
        assert plan.strategy.world_size == gpus
        paths.append(tmp_path / f"plan-{gpus}.json")
        paths[-1].write_text(plan.to_json())
    return source_arg, paths[0], paths[1]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "loss_from"), [("hf-llama", "own"), ("hf-llama", "labels"), ("nanogpt-tied", "own")]
)
def test_a_users_loop_under_torchrun_matches_one_process(tmp_path, monkeypatch, model, loss_from):
    """HF Llama built with AutoModelForCausalLM.from_config (loss parallel; its own loss
    from labels too) and a tied nanoGPT-style module, at tp 2 with sequence parallelism,
    trained as the README says."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    source, tensor_parallel, single = _user_plans(tmp_path, model)
    loop = [USER_LOOP, source, str(tensor_parallel), "3", "parallel", loss_from]
    distributed = plan_run_losses([*TORCHRUN, "2", *loop])
    reference = plan_run_losses(
        [sys.executable, USER_LOOP, source, str(single), "3", "parallel", loss_from]
    )
    assert distributed == pytest.approx(reference, abs=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("model", ["hf-llama", "nanogpt-tied"])
def test_a_users_loop_accumulating_under_fsdp_matches_one_process(
    tmp_path, monkeypatch, model, zero
):
    """HF Llama and a tied nanoGPT-style module (fused c_attn, ModuleList blocks) under
    FSDP2 over 2 ranks, 2 micro-batches of 2 sequences each: every micro-batch's
    gradients reduce-scattered into the shards, trained as the README says."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pins = planner.Pins(dp=2, zero=zero)
    source, sharded, single = _user_plans(tmp_path, model, pins, micro_batch_size=2)
    assert json.loads(sharded.read_text())["strategy"]["num_microbatches"] == 2
    distributed = plan_run_losses([*TORCHRUN, "2", USER_LOOP, source, str(sharded), "3",
                                   "parallel", "own"])  # fmt: skip
    reference = plan_run_losses([sys.executable, USER_LOOP, source, str(single), "3",
                                 "parallel", "own"])  # fmt: skip
    assert distributed == pytest.approx(reference, abs=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "source",
    [
        "tests.user_models:gpt",
        "tests.user_models:llama_rope",  # rotary tables computed in __init__
        "tests.user_models:gpt_mask_buffer",  # a boolean mask handed to every block
    ],
)
def test_plan_run_trains_a_module_of_your_own_at_a_pinned_tp_as_one_process(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plan run`` of a ``module:function`` token model (built again with its parameters
    on meta, token ids up to its vocabulary; a Llama's rotary tables as its ``__init__``
    computes them), pinned at tp 2 on H100s where keeping it whole would be cheaper: the
    layout splits a block weight and trains as one process does."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    training = Training(global_batch_size=8, micro_batch_size=8, seq_len=16, dtype="fp32")
    paths = []
    for gpus, pins in ((2, planner.Pins(tp=2)), (1, planner.Pins())):
        cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=gpus, gpus_per_node=gpus)
        plan = planner.make_plan(resolve_model(source), cluster, training, pins=pins)
        assert plan.strategy.tp == gpus
        paths.append(tmp_path / f"plan-{gpus}.json")
        paths[-1].write_text(plan.to_json())
    assert any(m.shards_parameters for m in json_layout(paths[0]))
    args = ["run", "--steps", "4", "--json", "--lr", "0.01"]
    distributed = plan_run_losses([*TORCHRUN, "2", "-m", "planner", *args, str(paths[0])])
    reference = plan_run_losses([sys.executable, "-m", "planner", *args, str(paths[1])])
    assert distributed == pytest.approx(reference, abs=1e-5)
    assert loss_falls(distributed)


def json_layout(path: Path) -> list[planner.spec.ModuleTP]:
    return list(planner.spec.Plan.model_validate_json(path.read_text()).tp_layout.values())


@pytest.mark.distributed
@pytest.mark.slow
def test_stock_clipping_is_right_or_fails_loudly(tmp_path, monkeypatch):
    """Stock ``torch.nn.utils.clip_grad_norm_`` in a user's loop: under DDP it clips by the
    whole model's norm (same losses as one process); over tensor-parallel shards it would
    not, so it raises naming ``parallel.clip_grad_norm_`` before any step is taken."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    source = "tests.user_models:gpt"
    single = _write_plan(tmp_path / "single.json", Strategy(micro_batch_size=8), source)
    ddp = _write_plan(tmp_path / "ddp.json", Strategy(dp=2, micro_batch_size=4), source)
    distributed = plan_run_losses([*TORCHRUN, "2", USER_LOOP, source, str(ddp), "3", "stock"])
    reference = plan_run_losses([sys.executable, USER_LOOP, source, str(single), "3", "stock"])
    assert distributed == pytest.approx(reference, abs=1e-5)
    _, tensor_parallel, _ = _user_plans(tmp_path, "nanogpt-tied")
    loop = [USER_LOOP, "tests.user_models:gpt_tied", str(tensor_parallel), "1", "stock"]
    done = subprocess.run(
        [*TORCHRUN, "2", *loop], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode != 0
    assert "tensor-parallel shards (tp = 2)" in done.stderr
    assert "call parallel.clip_grad_norm_(max_norm)" in done.stderr


def _readme_training_loop(tmp_path: Path) -> Path:
    """The README's ``train.py`` block, written to a file."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(
        r"<!-- train-loop:begin -->\n```python\n(.*?)```\n<!-- train-loop:end -->", readme, re.S
    )
    assert found, "README has no train-loop block"
    script = tmp_path / "train.py"
    script.write_text(found.group(1))
    return script


def _printed_losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+ loss (\S+)", stdout, re.M)]


def _held_out_loss(stdout: str) -> float:
    found = re.search(r"^held-out loss (\S+)", stdout, re.M)
    assert found, f"the loop printed no held-out loss:\n{stdout}"
    return float(found.group(1))


def _llama_plans(tmp_path: Path, pins: dict[str, planner.Pins]) -> tuple[Path, dict[str, Path]]:
    """An HF Llama config directory and, for each name, the plan the search makes with
    those pins (4 GPUs; ``one process``: 1 GPU)."""
    config = tmp_path / "llama"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(LLAMA))
    handle = resolve_hf_config(config)
    training = Training(global_batch_size=8, seq_len=16, dtype="fp32")
    plans = {}
    for name, pinned in {**pins, "one process": planner.Pins()}.items():
        cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=1 if name == "one process" else 4)
        plan = planner.make_plan(handle, cluster, training, pins=pinned)
        plans[name] = tmp_path / f"plan-{name.replace(' ', '-')}.json"
        plans[name].write_text(plan.to_json())
    return config, plans


@pytest.mark.distributed
@pytest.mark.slow
def test_the_readme_training_loop_runs_a_pipeline_and_resumes_under_another_plan(
    tmp_path, monkeypatch
):
    """The README's loop, copied from the README, builds an HF Llama on meta from its
    config and trains it under torchrun on 4 ranks: 2 steps under a pp2 x dp2 plan the
    search made, saved, then resumed under a pp2 x cp2 plan for a third step, its
    learning-rate warm-up restored from the checkpoint. The losses, and the held-out loss
    it evaluates then, equal one process's uninterrupted run."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pins = {"pp2 x dp2": planner.Pins(pp=2, dp=2), "pp2 x cp2": planner.Pins(pp=2, cp=2)}
    config, plans = _llama_plans(tmp_path, pins)
    script, checkpoints = str(_readme_training_loop(tmp_path)), str(tmp_path / "ckpt")
    first = run_printing(
        [*TORCHRUN, "4", script, str(config), str(plans["pp2 x dp2"]), "2", checkpoints],
        "step 1",
    )
    resumed = run_printing(
        [*TORCHRUN, "4", script, str(config), str(plans["pp2 x cp2"]), "3", checkpoints],
        "step 2",
    )
    single = run_printing([sys.executable, script, str(config), str(plans["one process"]), "3"],
                          "step 2")  # fmt: skip
    distributed = _printed_losses(first) + _printed_losses(resumed)
    assert len(_printed_losses(single)) == 3 and len(distributed) == 3
    assert distributed == pytest.approx(_printed_losses(single), abs=1e-5)
    worst = max(abs(a - b) for a, b in zip(distributed, _printed_losses(single), strict=True))
    print(f"README loop pp2 x dp2, resumed under pp2 x cp2: max |loss - one process| = {worst:.2e}")
    held_out = [_held_out_loss(out) for out in (resumed, single)]
    assert held_out[0] == pytest.approx(held_out[1], abs=1e-5)
