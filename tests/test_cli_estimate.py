"""``plan estimate``: the JSON contract, the table, and clear errors for bad input."""

import json

import pytest

from planner.cli import main
from planner.cost.pipeline import balanced_chunks
from planner.errors import PlannerError

RUN = {
    "model": {"preset": "gpt3-175b"},
    "cluster": {"gpu": "a100-sxm-80gb", "num_gpus": 1024, "gpus_per_node": 8,
                "intra_node_GBps": 300, "inter_node_GBps": 25},
    "training": {"global_batch_size": 1536, "micro_batch_size": 1, "dtype": "bf16"},
    "strategy": {"dp": 8, "tp": 8, "pp": 16, "cp": 1, "zero": 0, "sequence_parallel": False,
                 "recompute": "full", "schedule": "1f1b", "virtual_stages": 1},
}  # fmt: skip
KEYS = {"step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu", "hfu",
        "peak_memory_gib", "fits", "breakdown"}  # fmt: skip


def _run(tmp_path, capsys, config, *flags):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    code = main(["estimate", "--config", str(path), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def _with(section, **fields):
    config = json.loads(json.dumps(RUN))
    config[section].update(fields)
    return config


def test_json_contract_for_one_run(tmp_path, capsys):
    code, out, _ = _run(tmp_path, capsys, RUN, "--json")
    result = json.loads(out)
    assert code == 0 and set(result) >= KEYS
    assert result["fits"] is True
    assert sum(result["breakdown"].values()) == pytest.approx(result["step_time_s"])
    assert 0 < result["mfu"] < result["hfu"] < 1


def test_a_list_gives_a_list_and_inline_models_work(tmp_path, capsys):
    inline = _with("model")
    inline["model"] = {"family": "gpt", "num_layers": 96, "hidden_size": 12288, "num_heads": 96,
                       "num_kv_heads": 96, "ffn_hidden_size": 49152, "vocab_size": 51200,
                       "seq_len": 2048}  # fmt: skip
    code, out, _ = _run(tmp_path, capsys, [RUN, inline], "--json")
    first, second = json.loads(out)
    assert code == 0
    assert first["step_time_s"] == pytest.approx(second["step_time_s"])


def test_table_output(tmp_path, capsys):
    code, out, _ = _run(tmp_path, capsys, RUN)
    assert code == 0
    assert "step time" in out and "MFU / HFU" in out and "comm_tp" in out


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_with("cluster", gpu="a100-sxm-81gb"), "Known: a100-sxm-40gb, a100-sxm-80gb"),
        (_with("strategy", tp=4), "dp(8) * tp(4) * pp(16) * cp(1) = 512 != num_gpus(1024)"),
        (_with("training", global_batch_size=1001), "not divisible by dp(8) * micro_batch_size(1)"),
        (_with("strategy", dp=1, tp=64), "num_heads (96) is not divisible by tp (64)"),
        (_with("strategy", schedule="pipedream"), 'schedule = "pipedream": Input should be'),
        (_with("model", preset="gpt5"), "unknown model preset 'gpt5'"),
        (_with("strategy", dp="eight"), 'dp = "eight"'),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, config, message):
    code, out, err = _run(tmp_path, capsys, config, "--json")
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err


def test_sequence_not_divisible_by_cp(tmp_path, capsys):
    config = _with("strategy", dp=2, cp=4)
    config["training"]["seq_len"] = 2050
    code, _, err = _run(tmp_path, capsys, config, "--json")
    assert code == 2 and "seq_len 2050 is not divisible by 2 * cp(4) = 8" in err


def test_not_fitting_says_how_much_and_why(tmp_path, capsys):
    config = _with("strategy", dp=128, pp=1, recompute="none")
    config["training"].update(global_batch_size=1024, micro_batch_size=8)
    code, out, _ = _run(tmp_path, capsys, config, "--json")
    result = json.loads(out)
    assert code == 0 and result["fits"] is False
    assert "GiB over" in result["reason"] and "largest term: optimizer" in result["reason"]


def test_unreadable_config(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    assert main(["estimate", "--config", str(path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_estimate_run_accepts_a_dict_or_a_run_config():
    from planner.cost import RunConfig, estimate_run

    from_dict = estimate_run(RUN)
    from_config = estimate_run(RunConfig.from_dict(RUN))
    assert from_dict == from_config
    contradicting = {**RUN, "options": {"causal": False}}
    with pytest.raises(PlannerError, match="causal"):
        RunConfig.from_dict(contradicting)


# ----- the search and plan estimate price with one cost model (issue #16) ---------------

PLANS = {
    "encoder": "--model bert-large --gpus 8 --global-batch 8 --seq 32768",
    "rebalanced-stages": "--model llama3-8b --gpus 16 --global-batch 64 --pp 4 --schedule 1f1b",
    "fp8-zero3-pipeline": "--model llama3-8b --gpus 16 --global-batch 32 --pp 2 --dtype fp8 "
    "--zero 3 --for torchtitan==0.2",
    "interleaved": "--model gpt3-1.3b --cluster a100-sxm-80gb --gpus 16 --global-batch 64 --pp 4 "
    "--schedule interleaved-1f1b",
    "tiny-zero-bubble": "--model tiny-llama --gpus 2 --global-batch 8 --seq 32 --dtype fp32",
    "megatron-kernels": "--model llama3-8b --gpus 16 --global-batch 32 --for megatron",
}


def _plan(tmp_path, capsys, args):
    out = tmp_path / "plan.json"
    assert main([*args.split(), "-o", str(out)]) == 0
    capsys.readouterr()
    return out, json.loads(out.read_text())


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_estimate_reproduces_the_plans_prediction_to_the_float(tmp_path, capsys, name):
    """``plan estimate --plan`` prices the plan's strategy and (re-balanced) stages with
    the cost model the search built: every figure equal, not approximately."""
    out, plan = _plan(tmp_path, capsys, PLANS[name])
    assert main(["estimate", "--plan", str(out), "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    stored = dict(plan["prediction"])
    stored["breakdown"] = stored.pop("breakdown_s")
    estimated.pop("mfu_bf16_peak", None)
    assert estimated.pop("matches_plan") is True
    assert estimated == stored
    assert main(["estimate", "--plan", str(out)]) == 0
    assert "plan's own       the same" in capsys.readouterr().out


def test_a_plans_rebalanced_stages_are_priced_as_the_plan_says(tmp_path, capsys):
    """The stage DP re-splits llama3-8b's pipeline unevenly; a run document's ``stages``
    (the plan's module lists) prices that split, the even split prices another."""
    from planner.cost import RunConfig, estimate_run
    from planner.spec import Plan

    _, data = _plan(tmp_path, capsys, PLANS["rebalanced-stages"])
    plan = Plan.model_validate(data)
    blocks = [sum(fqn.startswith("layers.") for fqn in chunk) for chunk in plan.stages]
    assert blocks != balanced_chunks(32, 4)  # re-balanced: not the even split of 32 blocks
    run = RunConfig.from_plan(plan)
    assert estimate_run(run) == plan.prediction
    even = estimate_run(run.model_copy(update={"stages": ()}))
    assert even.step_time_s > plan.prediction.step_time_s
    document = {
        "model": {"preset": "llama3-8b"}, "cluster": data["cluster"],
        "training": data["training"], "strategy": data["strategy"], "stages": data["stages"],
    }  # fmt: skip
    assert estimate_run(document) == plan.prediction


def test_the_search_prices_encoder_attention_as_bidirectional():
    """bert-large at 32k tokens: the search once priced its attention causal (half the
    work): 0.70 s and 55% MFU where plan estimate said 1.23 s and 31%."""
    from planner.models import resolve_model
    from planner.planning import cost_graph, priced_model
    from planner.spec import Cluster, Training

    handle = resolve_model("bert-large", seq_len=32768)
    training = Training(global_batch_size=8, seq_len=32768)
    graph = cost_graph(handle, training)
    model, _ = priced_model(handle, graph, Cluster(gpu="h100-sxm-80gb", num_gpus=8), training)
    assert model.options.causal is False
    decoder, _ = priced_model(
        resolve_model("llama3-8b"), graph, Cluster(gpu="h100-sxm-80gb", num_gpus=8), training
    )
    assert decoder.options.causal is True


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]], "stages has 2 chunks"),
        ([["tok_embeddings"], ["layers.0"], ["layers.1"], ["layerz.2"]], "'layerz.2'"),
        ([["tok_embeddings"], "layers.0"], "must be a list of non-empty lists"),
    ],
)
def test_bad_stages_are_clear_errors(stages, message):
    from planner.cost import estimate_run

    config = _with("strategy")
    config["strategy"].update(dp=16, pp=4, tp=16)
    config["stages"] = stages
    with pytest.raises(PlannerError, match=message):
        estimate_run(config)


def test_fp8_mfu_is_against_the_fp8_peak_with_the_bf16_figure_beside_it(tmp_path, capsys):
    config = _with("training", dtype="fp8")
    config["cluster"]["gpu"] = "h100-sxm-80gb"
    code, out, _ = _run(tmp_path, capsys, config, "--json")
    result = json.loads(out)
    assert code == 0 and 0 < result["mfu"] <= 1
    assert result["mfu_bf16_peak"] == pytest.approx(result["mfu"] * 1979 / 989)
    code, out, _ = _run(tmp_path, capsys, config)
    assert "(of the fp8 peak)" in out and "MFU (bf16 peak)" in out
    assert "mfu_bf16_peak" not in json.loads(_run(tmp_path, capsys, RUN, "--json")[1])


def test_explain_prints_both_mfus_and_why_zero3_is_zero2_under_a_pipeline(tmp_path, capsys):
    out, _ = _plan(tmp_path, capsys, PLANS["fp8-zero3-pipeline"])
    assert main(["explain", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the table's text
    assert "of the fp8 peak" in printed and "MFU of the bf16 peak" in printed
    assert "note" in printed and "ZeRO-1, 2 and 3 hold the same memory" in printed
