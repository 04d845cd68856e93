"""A saved plan of a traced model (a Hugging Face config, a module of your own) is priced
again as the search priced it: ``plan estimate --plan``, ``plan compare --profile`` and
``plan calibrate --from`` take it like a zoo plan, and what runs it keeps the parameter
dtype it was priced with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import planner
from planner import Cluster, Training
from planner.calibrate.options import measured_run_options
from planner.calibrate.refit import predict_op_classes, predict_plan, refit_profile
from planner.cli import main
from planner.errors import SpecError
from planner.hardware import load_profile
from planner.hf import resolve_hf_config
from planner.models import resolve_model
from planner.priced_plan import PricedPlan, searched_options
from planner.solve.search import Pins
from planner.spec import Plan
from tests.devices import write_tp_pays
from tests.test_measure import fake_measured
from tests.user_models import GPT, CausalSelfAttention

_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 256, "max_position_embeddings": 64, "torch_dtype": "bfloat16",
}  # fmt: skip
TRAINING = Training(global_batch_size=8, seq_len=16, dtype="fp32")


def _config(tmp_path: Path, **fields: object) -> str:
    path = tmp_path / "llama"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**_LLAMA, **fields}))
    return str(path)


def _hf_plan(tmp_path: Path, pins: Pins) -> Plan:
    cluster = Cluster(gpu=str(write_tp_pays(tmp_path)), num_gpus=pins.tp * pins.pp)
    return planner.make_plan(resolve_hf_config(_config(tmp_path)), cluster, TRAINING, pins=pins)


@pytest.mark.parametrize(
    "pins",
    [Pins(tp=2, pp=2, sequence_parallel=True), Pins(tp=2, pp=1, sequence_parallel=False)],
    ids=["tp2-sp-pp2", "tp2"],
)
def test_a_hugging_face_plan_is_priced_again_to_the_float(tmp_path, pins):
    """Its trace at the plan's shape, its own ILP layout and stages: the search's price."""
    plan = _hf_plan(tmp_path, pins)
    assert plan.model is None and plan.strategy.tp == 2 and plan.tp_layout
    assert PricedPlan(plan, searched_options(plan)).estimate() == plan.prediction


def test_plan_estimate_prices_a_hugging_face_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # plan.model_source is the path as given
    config = _config(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["--hf-config", config, "--gpus", "2", "--global-batch", "8", "--seq", "16",
                 "--pp", "2", "-o", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["estimate", "--plan", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "plan's own       the same" in printed and "dp1 pp2" in printed
    assert main(["estimate", "--plan", str(out), "--json"]) == 0
    stored = Plan.model_validate_json(out.read_text()).prediction
    assert stored is not None
    printed_json = json.loads(capsys.readouterr().out)
    assert printed_json["step_time_s"] == stored.step_time_s and printed_json["matches_plan"]


def test_plan_estimate_prices_a_module_of_your_own(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--model", "tests.user_models:gpt", "--gpus", "1", "--global-batch", "2",
                 "--dtype", "fp32", "-o", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["estimate", "--plan", str(out)]) == 0
    assert "plan's own       the same" in capsys.readouterr().out


def test_a_plan_made_in_python_is_priced_with_its_module(tmp_path):
    """``plan.model_source`` is 'module': the error says to pass the module, which prices it."""
    torch.manual_seed(0)
    module = GPT()
    handle = planner.models.handle_for_module(module)
    cluster = Cluster(gpu=str(write_tp_pays(tmp_path)), num_gpus=2)
    plan = planner.make_plan(handle, cluster, TRAINING, pins=Pins(tp=2))
    with pytest.raises(SpecError, match=r"made for a module given in Python.*module=your_module"):
        PricedPlan(plan, searched_options(plan))
    assert PricedPlan(plan, searched_options(plan), module=module).estimate() == plan.prediction


def test_a_config_changed_since_planning_is_refused(tmp_path):
    plan = _hf_plan(tmp_path, Pins(tp=1, pp=2))
    _config(tmp_path, intermediate_size=192)
    with pytest.raises(SpecError, match=r"now builds a model with fingerprint .* make the plan"):
        PricedPlan(plan, searched_options(plan))


def test_a_config_edit_that_keeps_the_parameter_shapes_is_refused(tmp_path):
    """The fingerprint sees parameter names and shapes only; the plan's digest of its
    priced graph sees the activation (and experts per token, head width) too."""
    from strategies.runner import model_to_run

    plan = _hf_plan(tmp_path, Pins(tp=1, pp=2))
    assert plan.model_digest
    _config(tmp_path, hidden_act="gelu")
    for reprice in (lambda: PricedPlan(plan, searched_options(plan)),
                    lambda: model_to_run(plan, "plan run")):  # fmt: skip
        with pytest.raises(SpecError, match=r"now traces to another model than the plan priced"):
            reprice()


def test_a_code_edit_that_rewires_the_same_operators_is_refused():
    """Queries and keys swapped: the same operators and parameters, read in another order."""

    class Swapped(CausalSelfAttention):
        def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v = super().heads(x)
            return k, q, v

    one = Cluster(gpu="h100-sxm-80gb", num_gpus=1)
    plan = planner.make_plan(resolve_model("tests.user_models:gpt"), one, TRAINING)
    PricedPlan(plan, searched_options(plan), module=GPT())  # the model it was made for
    edited = GPT()
    for block in edited.transformer.h:
        block.attn.__class__ = Swapped
    with pytest.raises(SpecError, match=r"now traces to another model than the plan priced"):
        PricedPlan(plan, searched_options(plan), module=edited)


def test_compare_and_calibrate_reprice_a_hugging_face_plan(tmp_path):
    """Under another profile with ``plan measure``'s options, and refitted to a run."""
    plan = _hf_plan(tmp_path, Pins(tp=2, pp=2, sequence_parallel=True))
    profile = load_profile("h100-sxm-80gb")
    options = measured_run_options(profile)
    predicted = predict_plan(plan, profile, options)
    assert predicted.step_time_s != plan.prediction.step_time_s  # another device
    classes = predict_op_classes(plan, profile, options)
    assert classes["matmul"] > 0 and classes["attention"] > 0
    run = fake_measured(plan, seconds=1.5 * predicted.step_time_s)
    _, report = refit_profile(profile, [run], options=options, stamp="test")
    assert abs(report.after[0].error) < abs(report.before[0].error)


def test_a_bf16_model_is_refused_by_an_fp32_parameter_plan(tmp_path):
    """transformers builds a config's torch_dtype: trained as is, parameters and optimizer
    states would be bf16 where the plan priced (and the runtime keeps) fp32."""
    model = resolve_hf_config(_config(tmp_path), device="cpu").module
    assert next(model.parameters()).dtype == torch.bfloat16
    plan = planner.make_plan(
        planner.models.handle_for_module(model), Cluster(gpu="h100-sxm-80gb", num_gpus=1),
        TRAINING,
    )  # fmt: skip
    with pytest.raises(SpecError, match=r"'model.embed_tokens.weight' \(and \d+ more\) is bf16.*"
                       r"param_dtype = 'fp32'.*model.to\(torch.float32\)"):  # fmt: skip
        planner.parallelize(model, plan)
    parallel = planner.parallelize(model.to(torch.float32), plan)
    assert {p.dtype for p in parallel.parameters()} == {torch.float32}


def test_plan_run_builds_a_hugging_face_model_in_the_plans_parameter_dtype(tmp_path):
    from strategies.runner import model_to_run

    plan = _hf_plan(tmp_path, Pins(tp=1, pp=2))
    built = model_to_run(plan, "plan run").module
    assert {p.dtype for p in built.parameters()} == {torch.float32}


def test_plan_run_refuses_a_built_in_model_without_tokens(tmp_path):
    from strategies.runner import model_to_run

    plan = planner.make_plan(resolve_model("mlp"), Cluster(gpu="h100-sxm-80gb", num_gpus=1),
                             Training(global_batch_size=8))  # fmt: skip
    with pytest.raises(SpecError, match=r"built-in non-token model \('mlp'\).*parallelize"):
        model_to_run(plan, "plan run")


def test_paths_kept_as_given_name_the_plans_field_from_elsewhere(tmp_path, capsys, monkeypatch):
    """A relative --hf-config or cluster profile path resolves from where the plan was made."""
    monkeypatch.chdir(tmp_path)
    _config(tmp_path)
    (tmp_path / "tp.json").write_text(write_tp_pays(tmp_path).read_text())
    (tmp_path / "cluster.json").write_text(json.dumps({"gpu": "tp.json", "num_gpus": 2}))
    assert main(["--hf-config", "llama", "--cluster", "cluster.json", "--global-batch", "8",
                 "--seq", "16", "-o", "plan.json"]) == 0  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["estimate", "--plan", "../plan.json"]) == 2
    assert "plan.cluster.gpu = 'tp.json' (the path given to the cluster) does not exist" in (
        capsys.readouterr().err
    )
    (elsewhere / "tp.json").write_text((tmp_path / "tp.json").read_text())
    assert main(["estimate", "--plan", "../plan.json"]) == 2
    err = capsys.readouterr().err
    assert "plan.model_source = 'llama' (the path given to plan --hf-config) does not exist" in err
