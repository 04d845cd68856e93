"""``plan estimate``: the JSON contract, the table, and clear errors for bad input."""

import json

import pytest

from planner.cli import main
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
