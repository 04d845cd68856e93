"""The runtime in one process: plan run, recompute, pipeline chunks, early errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import planner
from planner.assemble import assemble_plan
from planner.cli import main
from planner.errors import PlanMismatchError, SpecError
from planner.models import resolve_model
from planner.spec import Cluster, Plan, RecomputeMode, Strategy, Training
from strategies.checkpointing import recompute_block


def _single_plan(model: str = "tiny-llama", **strategy: object) -> Plan:
    parsed = Strategy.model_validate({"micro_batch_size": 4, **strategy})
    training = Training(
        global_batch_size=4 * parsed.dp, micro_batch_size=4, seq_len=16, dtype="fp32"
    )
    cluster = Cluster(gpu="cpu", num_gpus=parsed.world_size, gpus_per_node=parsed.world_size)
    return assemble_plan(resolve_model(model), cluster, training, parsed)


def test_plan_run_single_process_prints_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(_single_plan(recompute="full").to_json())
    assert main(["run", str(path), "--steps", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [step["step"] for step in report["steps"]] == [0, 1, 2]
    assert all(5.0 < step["loss"] < 6.5 and step["step_time_s"] > 0 for step in report["steps"])


def test_plan_run_saves_resumes_and_refuses_what_cannot_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, checkpoints = tmp_path / "plan.json", str(tmp_path / "ckpt")
    path.write_text(_single_plan().to_json())
    assert main(["run", str(path), "--steps", "2", "--checkpoint-dir", checkpoints]) == 0
    assert main(["run", str(path), "--steps", "2", "--checkpoint-dir", checkpoints,
                 "--resume"]) == 2  # fmt: skip
    assert "is at step 2: nothing is left to train" in capsys.readouterr().err
    assert main(["run", str(path), "--steps", "3", "--resume"]) == 2
    assert "--resume needs --checkpoint-dir DIR" in capsys.readouterr().err
    gpt = tmp_path / "gpt.json"
    gpt.write_text(_single_plan("tiny-gpt").to_json())
    assert main(["run", str(gpt), "--checkpoint-dir", checkpoints, "--export-hf",
                 str(tmp_path / "out")]) == 2  # fmt: skip
    assert "only zoo llama models load from or export to" in capsys.readouterr().err
    assert main(["run", str(path), "--steps", "4", "--checkpoint-dir", checkpoints,
                 "--resume", "--save-every", "1", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert [step["step"] for step in report["steps"]] == [2, 3]
    assert sorted(p.name for p in Path(checkpoints).glob("step-*")) == [
        "step-00000002", "step-00000003", "step-00000004",
    ]  # fmt: skip


def test_plan_run_rejects_multi_rank_plan_without_torchrun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(_single_plan(dp=2).to_json())
    assert main(["run", str(path), "--steps", "1"]) == 2
    assert "= 2 != world_size(1)" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [RecomputeMode.FULL, RecomputeMode.SELECTIVE])
def test_recompute_keeps_gradients(mode: RecomputeMode) -> None:
    reference = resolve_model("tiny-llama", device="cpu", seed=0).module
    recomputed = resolve_model("tiny-llama", device="cpu", seed=0).module
    for block in recomputed.layers.values():
        recompute_block(block, mode)
    tokens = torch.randint(0, 256, (2, 16))
    for model in (reference, recomputed):
        model(tokens).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(
        reference.named_parameters(), recomputed.named_parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_plan_for_another_model_fails_before_any_collective(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(_single_plan("tiny-llama").to_json())
    with pytest.raises(PlanMismatchError, match="made for another model"):
        planner.parallelize(resolve_model("tiny-gpt", device="cpu").module, path)
    assert not dist.is_initialized()


def test_wrong_world_size_fails_before_any_collective() -> None:
    with pytest.raises(
        PlanMismatchError, match=r"dp\(1\) \* tp\(2\) \* pp\(1\) \* cp\(1\) = 2 != world_size\(1\)"
    ):
        planner.parallelize(resolve_model("tiny-llama", device="cpu").module, _single_plan(tp=2))
    assert not dist.is_initialized()


def test_meta_model_is_initialised_in_place() -> None:
    parallel = planner.parallelize(resolve_model("tiny-llama").module, _single_plan(), seed=3)
    assert not any(p.is_meta or p.isnan().any() for p in parallel.parameters())


def test_single_process_plan_returns_the_model() -> None:
    model = resolve_model("tiny-llama", device="cpu").module
    assert planner.parallelize(model, _single_plan()).module is model


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (ops served from a recompute cache never get here)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: RecomputeMode) -> Counter[str]:
    """Aten ops run during backward of one tiny-llama step with ``mode`` on every block."""
    model = resolve_model("tiny-llama", device="cpu", seed=0).module
    if mode is not RecomputeMode.NONE:
        for block in model.layers.values():
            recompute_block(block, mode)
    loss = model(torch.randint(0, 256, (2, 32))).float().pow(2).mean()
    with _OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_recompute_reruns_what_the_mode_says() -> None:
    none, selective, full = (_backward_ops(mode) for mode in RecomputeMode.__members__.values())
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert none[attention] == 0
    assert selective[attention] == full[attention] == 4  # attention core rerun in every block
    assert none["mm"] == selective["mm"] < full["mm"]  # selective keeps the matmul outputs


@pytest.mark.slow  # trains, exports and measures two models
def test_plan_run_measure_and_export_a_hugging_face_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan made from a Hugging Face config trains (``plan run``), measures and exports
    its model, built again on the meta device from ``plan.model_source``; a plan for a
    module of your own trains when it takes token ids, and is refused with where it trains
    instead when it does not."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from planner.hf import resolve_hf_config
    from planner.planning import make_plan
    from strategies.measure import measure_plan
    from strategies.runner import model_to_run
    from tests.test_hf import CONFIGS, _write

    config = _write(tmp_path, "qwen2", **CONFIGS["qwen2"])
    training = Training(global_batch_size=4, micro_batch_size=4, seq_len=16, dtype="fp32")
    one = Cluster(gpu="h100-sxm-80gb", num_gpus=1)
    plan = make_plan(resolve_hf_config(config), one, training)
    path, out = tmp_path / "plan.json", tmp_path / "hf-out"
    path.write_text(plan.to_json())
    assert main(["run", str(path), "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                 "--export-hf", str(out)]) == 0  # fmt: skip
    assert "exported to" in capsys.readouterr().out
    exported, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(exported).__name__ == "Qwen2ForCausalLM" and not any(info.values())
    measured = measure_plan(plan, steps=1, warmup=0)
    assert measured.step_time_median_s > 0
    user = make_plan(resolve_model("tests.user_models:gpt"), one, training)
    built = model_to_run(user, "plan run")
    assert (built.vocab_size, built.seq_len, built.hf_config) == (256, 16, None)
    assert measure_plan(user, steps=1, warmup=0).step_time_median_s > 0  # plan measure too
    regressor = make_plan(resolve_model("tests.user_models:regressor"), one, training.model_copy(
        update={"seq_len": None}))  # fmt: skip
    with pytest.raises(SpecError, match=r"'tests.user_models:regressor', whose forward does not"):
        model_to_run(regressor, "plan run")
    viewed = make_plan(resolve_model("tests.user_models:gpt_viewed_ids"), one, training)
    assert model_to_run(viewed, "plan run").vocab_size == 256  # ids reshaped, then embedded
    segments = make_plan(resolve_model("tests.user_models:gpt_segments"), one, training)
    with pytest.raises(SpecError, match=r"it takes int64\[1, 16\], int64\[1, 16\]"):
        model_to_run(segments, "plan run")  # it would train without the segments it priced
