"""Pure bf16 training (``training.param_dtype = bf16``): parameters, gradients and
optimizer states kept in bf16 with no fp32 copy, as torchtitan's ``training.dtype =
"bfloat16"``. Priced, searched and exported for torchtitan; this runtime, Megatron-LM
and DeepSpeed refuse it naming the field."""

from __future__ import annotations

import pytest

from planner.errors import ExportError, SpecError
from planner.export import export_plan
from planner.importers import import_config
from planner.models import resolve_model
from planner.planning import make_plan
from planner.solve.search import Pins
from planner.spec import Cluster, DType, Training

CLUSTER = Cluster(gpu="h100-sxm-80gb", num_gpus=8)
PURE = Training(global_batch_size=16, seq_len=512, dtype=DType.BF16, param_dtype=DType.BF16)
PINS = Pins(tp=1, pp=1, cp=1, zero=3, recompute="none")


def _plan(training: Training, target: str):
    return make_plan(resolve_model("tiny-llama"), CLUSTER, training, pins=PINS, target=target)


def test_it_needs_half_precision_compute() -> None:
    with pytest.raises(ValueError, match=r"param_dtype 'bf16' \(pure bf16 training\) with dtype"):
        Training(global_batch_size=1, dtype=DType.FP32, param_dtype=DType.BF16)


def test_it_halves_the_states_the_plan_prices() -> None:
    mixed = _plan(PURE.model_copy(update={"param_dtype": DType.FP32}), "torchtitan")
    pure = _plan(PURE, "torchtitan")
    assert mixed.strategy == pure.strategy
    m, p = mixed.prediction.memory_gib, pure.prediction.memory_gib
    assert p["optimizer"] == pytest.approx(m["optimizer"] / 2)  # Adam's moments in bf16
    assert p["weights"] < m["weights"] and p["gradients"] <= m["gradients"]
    assert pure.prediction.peak_memory_gib < mixed.prediction.peak_memory_gib


@pytest.mark.parametrize("target", ["torchtitan==0.2", "torchtitan==0.3"])
def test_torchtitan_exports_and_imports_it(target) -> None:
    plan = _plan(PURE, target)
    text = export_plan(plan, target)
    assert ('dtype = "bfloat16"' in text) if target.endswith("0.2") else (
        "--training.dtype bfloat16" in text
    )  # fmt: skip
    read = import_config(text, model=plan.model, cluster=plan.cluster).run
    assert read.training.param_dtype is DType.BF16 and read.training.dtype is DType.BF16
    assert read.strategy == plan.strategy


@pytest.mark.parametrize(
    ("target", "why"),
    [("megatron", "Megatron-LM keeps fp32 main"), ("deepspeed", "DeepSpeed's bf16 mode")],
)
def test_other_frameworks_refuse_it_naming_the_field(target, why) -> None:
    plan = _plan(PURE, "torchtitan")
    with pytest.raises(ExportError, match=rf"training\.param_dtype = 'bf16': .*{why}"):
        export_plan(plan, target)
    with pytest.raises(SpecError, match=rf"--for {target}.*{why}.*--param-dtype fp32"):
        _plan(PURE, target)


def test_this_runtime_refuses_it_up_front_and_when_applied() -> None:
    from strategies.apply import parallelize

    with pytest.raises(SpecError, match=r"--for planner: training\.param_dtype = 'bf16'"):
        _plan(PURE, "planner")
    plan = _plan(PURE, "torchtitan")
    with pytest.raises(SpecError, match=r"training\.param_dtype = 'bf16'.*target torchtitan"):
        parallelize(resolve_model("tiny-llama").module, plan)


def test_torchtitan_configs_that_mix_the_two_are_refused() -> None:
    text = '[training]\ndtype = "bfloat16"\nmixed_precision_param = "float32"\n'
    with pytest.raises(
        SpecError, match=r"mixed_precision_param = 'float32'.*set mixed_precision_param to bfloat16"
    ):
        import_config(text, format="torchtitan", model="tiny-llama", cluster=CLUSTER, gpus=8)


def test_the_plan_says_its_states_are_bf16() -> None:
    from rich.console import Console

    from planner.cli.render import render_plan

    console = Console(record=True, width=120)
    render_plan(_plan(PURE, "torchtitan"), console)
    assert "batch 16, bf16, states in bf16)" in console.export_text()  # title wraps at the table
