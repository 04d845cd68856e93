"""The typed documents: validation messages, defaults, JSON round trips."""

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.errors import SpecError
from planner.io import write_text_atomic
from planner.spec import (
    Axis,
    Cluster,
    Compression,
    CompressionKind,
    ModelSpec,
    Plan,
    RecomputeMode,
    Schedule,
    Strategy,
    Training,
    load_document,
)


def _llama() -> ModelSpec:
    return ModelSpec(
        family="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=128,
        seq_len=16,
    )


def test_documents_are_frozen_and_reject_unknown_fields():
    spec = _llama()
    with pytest.raises(Exception, match="frozen"):
        spec.num_layers = 3  # type: ignore[misc]
    with pytest.raises(SpecError, match="num_layerz"):
        load_document(ModelSpec, {**spec.model_dump(), "num_layerz": 3})


def test_model_defaults_follow_the_family():
    llama, gpt = (
        _llama(),
        ModelSpec(family="gpt", num_layers=1, hidden_size=64, num_heads=4, vocab_size=8, seq_len=8),
    )
    assert llama.act.value == "swiglu" and gpt.act.value == "gelu"
    assert gpt.ffn_size == 256
    assert llama.ffn_size == 256  # 2/3 * 4 * 64 = 170, rounded up to a multiple of 256
    assert llama.kv_heads == 2 and gpt.kv_heads == 4
    assert (
        llama.causal
        and not ModelSpec.model_validate({**gpt.model_dump(), "family": "encoder"}).causal
    )


def test_invalid_fields_give_one_line_each_with_value():
    bad = {"family": "llama", "num_layers": 0, "hidden_size": 64, "num_heads": 4,
           "vocab_size": 8, "seq_len": -1}  # fmt: skip
    with pytest.raises(SpecError) as info:
        load_document(ModelSpec, bad, source="model.json")
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid ModelSpec in model.json:"
    assert any(line.startswith("  num_layers = 0:") for line in lines)
    assert any(line.startswith("  seq_len = -1:") for line in lines)


@pytest.mark.parametrize(
    ("cls", "data", "said"),
    [
        (Plan, {"plan_fingerprint": "x", "step_times_s": [1.0], "plan": {}},
         "m.json is a measured profile ('plan measure' output), not a Plan file"),
        (Cluster, {"strategy": {}, "prediction": {}, "model": {}},
         "m.json is a plan ('plan -o' output), not a Cluster file"),
        (Plan, {"peak_tflops": {}, "matmul_efficiency": 0.5, "name": "cpu"},
         "m.json is a hardware profile (--cluster, 'plan calibrate' output), not a Plan file"),
        (ModelSpec, {"model_type": "llama"}, "m.json is a Hugging Face config (--hf-config)"),
    ],
)  # fmt: skip
def test_a_document_of_another_kind_is_named_not_listed_field_by_field(cls, data, said):
    """One line naming what the file is, not twenty fields it lacks."""
    with pytest.raises(SpecError) as info:
        load_document(cls, data, source="m.json")
    assert str(info.value).startswith(said) and "\n" not in str(info.value)


def test_head_divisibility_is_checked():
    with pytest.raises(SpecError, match=r"hidden_size \(65\) must be divisible by num_heads \(4\)"):
        load_document(ModelSpec, {**_llama().model_dump(), "hidden_size": 65})
    with pytest.raises(SpecError, match=r"multiple of num_kv_heads \(3\)"):
        load_document(ModelSpec, {**_llama().model_dump(), "num_kv_heads": 3})


def test_head_dim_sets_the_head_width_apart_from_hidden_over_heads():
    narrow = _llama()
    wide = ModelSpec.model_validate({**narrow.model_dump(), "head_dim": 32})
    assert (narrow.head_dim, narrow.head_size, wide.head_size) == (None, 16, 32)
    # q and o: 64 x (4 x 32) each, k and v: 64 x (2 x 32) each, against 64 x 64 and 64 x 32
    per_block = (2 * 64 * 128 + 2 * 64 * 64) - (2 * 64 * 64 + 2 * 64 * 32)
    assert wide.num_params() - narrow.num_params() == narrow.num_layers * per_block
    odd_hidden = ModelSpec.model_validate(
        {**narrow.model_dump(), "hidden_size": 50, "head_dim": 16}
    )
    assert odd_hidden.head_size == 16
    with pytest.raises(SpecError, match=r"divisible by num_heads \(4\), or set head_dim"):
        load_document(ModelSpec, {**narrow.model_dump(), "hidden_size": 50})
    with pytest.raises(SpecError, match=r"even head_dim, got 15"):
        load_document(ModelSpec, {**narrow.model_dump(), "head_dim": 15})
    latent = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
    with pytest.raises(SpecError, match=r"head_dim \(32\) with kv_lora_rank \(16\)"):
        load_document(ModelSpec, {**wide.model_dump(), **latent})


def test_qk_norm_adds_one_weight_per_head_feature_to_queries_and_keys():
    spec = _llama()
    normed = ModelSpec.model_validate({**spec.model_dump(), "qk_norm": True})
    assert normed.num_params() - spec.num_params() == spec.num_layers * 2 * 16
    assert normed.active_params() - spec.active_params() == spec.num_layers * 2 * 16
    with pytest.raises(SpecError, match=r"qk_norm with family 'gpt'"):
        load_document(ModelSpec, {**normed.model_dump(), "family": "gpt"})
    latent = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
    with pytest.raises(SpecError, match=r"qk_norm with family 'llama' and kv_lora_rank"):
        load_document(ModelSpec, {**normed.model_dump(), **latent})


def test_strategy_derived_degrees_and_mesh():
    strategy = Strategy(dp=8, dp_shard=4, zero=3, tp=4, pp=2, num_microbatches=8)
    assert (strategy.shard_degree, strategy.replicate_degree) == (4, 2)
    assert strategy.world_size == 64
    axes = [(axis.name, axis.size) for axis in strategy.mesh_axes()]
    assert axes == [(Axis.PP, 2), (Axis.DP_REPLICATE, 2), (Axis.DP_SHARD, 4), (Axis.TP, 4)]
    assert Strategy(dp=8, zero=1).shard_degree == 8
    assert Strategy(dp=8).shard_degree == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dp": 8, "dp_shard": 3, "zero": 3}, r"dp_shard \(3\) must divide dp \(8\)"),
        ({"dp": 4, "dp_shard": 2}, "needs zero >= 1"),
        ({"sequence_parallel": True}, "sequence_parallel needs tp > 1"),
        ({"virtual_stages": 2}, "needs schedule 'interleaved-1f1b'"),
        ({"pp": 2, "recompute_per_stage": ["full"]}, "has 1 entries, pp is 2"),
    ],
)
def test_strategy_rejects_inconsistent_degrees(fields, message):
    with pytest.raises(SpecError, match=message):
        load_document(Strategy, fields)


def test_compression_rank_rules():
    assert Compression(kind="powersgd", rank=4).rank == 4
    with pytest.raises(SpecError, match="needs a rank"):
        load_document(Compression, {"kind": "powersgd"})
    with pytest.raises(SpecError, match="only applies to powersgd"):
        load_document(Compression, {"kind": "fp16", "rank": 2})


def test_cluster_must_fill_whole_nodes():
    assert Cluster(gpu="h100-sxm-80gb", num_gpus=4).num_nodes == 1
    assert Cluster(gpu="h100-sxm-80gb", num_gpus=64).num_nodes == 8
    with pytest.raises(SpecError, match=r"num_gpus \(12\) must be a multiple of gpus_per_node"):
        load_document(Cluster, {"gpu": "h100-sxm-80gb", "num_gpus": 12})


def test_plan_round_trips_through_json(tmp_path: Path):
    strategy = Strategy(
        dp=2,
        tp=2,
        pp=2,
        zero=1,
        sequence_parallel=True,
        recompute=RecomputeMode.SELECTIVE,
        schedule=Schedule.INTERLEAVED_1F1B,
        virtual_stages=2,
        num_microbatches=4,
        compression=Compression(kind=CompressionKind.BF16),
    )
    plan = Plan(
        planner_version="0.1.0",
        model_name="tiny",
        model_fingerprint="abc",
        model=_llama(),
        cluster=Cluster(gpu="h100-sxm-80gb", num_gpus=8),
        training=Training(global_batch_size=16),
        strategy=strategy,
        mesh=strategy.mesh_axes(),
        stages=(("tok_embeddings", "layers.0"), ("layers.1", "norm", "output")),
        tp_layout={"layers.*.attention.wq": {"style": "colwise", "params": {"weight": "Shard(0)"}}},
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    again = load_document(Plan, path)
    assert again == plan
    assert json.loads(path.read_text())["schema_version"] == 1


def test_plan_mesh_must_match_strategy():
    with pytest.raises(SpecError, match="mesh sizes multiply to 2, strategy needs 4"):
        load_document(
            Plan,
            {
                "planner_version": "0",
                "model_name": "m",
                "model_fingerprint": "f",
                "cluster": {"gpu": "x", "num_gpus": 4},
                "training": {"global_batch_size": 4},
                "strategy": {"dp": 4},
                "mesh": [{"name": "dp_replicate", "size": 2}],
            },
        )


@given(
    dp=st.integers(1, 16),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.integers(1, 8),
    zero=st.sampled_from([0, 1, 2, 3]),
)
def test_strategy_json_round_trip_property(dp, tp, pp, zero):
    strategy = Strategy(dp=dp, tp=tp, pp=pp, zero=zero)
    assert Strategy.from_json(strategy.to_json()) == strategy
    assert strategy.world_size == dp * tp * pp
    sizes = [axis.size for axis in strategy.mesh_axes()]
    product = 1
    for size in sizes:
        product *= size
    assert product == strategy.world_size


def test_strategy_description_names_every_choice():
    text = Strategy(
        dp=4, zero=3, dp_shard=2, tp=8, sequence_parallel=True, pp=4,
        schedule="interleaved-1f1b", virtual_stages=2, micro_batch_size=1, num_microbatches=16,
        recompute="selective", compression={"kind": "powersgd", "rank": 4},
    ).describe()  # fmt: skip
    assert text == (
        "dp4(zero3,shard2) tp8 sp pp4 interleaved-1f1bv2 mb1x16 recompute=selective "
        "compress=powersgd(r4)"
    )


def test_atomic_writes_leave_ordinary_permissions(tmp_path: Path):
    path = tmp_path / "plan.json"
    write_text_atomic(path, "{}")
    mask = os.umask(0)
    os.umask(mask)
    assert path.read_text() == "{}"
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_a_document_loads_from_json_text_a_path_or_a_path_string(tmp_path):
    text = _llama().model_dump_json()
    (tmp_path / "model.json").write_text(text)
    for data in (text, tmp_path / "model.json", str(tmp_path / "model.json")):
        assert load_document(ModelSpec, data) == _llama()
    with pytest.raises(SpecError, match=r"cannot read ModelSpec file .*missing\.json"):
        load_document(ModelSpec, str(tmp_path / "missing.json"))


# ----- bounds on absurd values -----------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"num_layers": 100_000}, "  num_layers = 100000 > 1000: no published model has more "
         "than ~200 layers; this bound keeps planning in seconds"),
        ({"hidden_size": 2**21, "num_heads": 1}, "  hidden_size = 2097152 > 1048576: "),
        ({"num_heads": 2**17}, "  num_heads = 131072 > 65536: "),
        ({"vocab_size": 10**9}, "  vocab_size = 1000000000 > 16777216: "),
        ({"seq_len": 10**8}, "  seq_len = 100000000 > 10000000: "),
        ({"ffn_hidden_size": 10**8}, "  ffn_hidden_size = 100000000 > 4194304: "),
        ({"num_layers": 10**100}, "  num_layers = a 101-digit number > 1000: "),
    ],
)  # fmt: skip
def test_model_bounds_name_the_value_the_limit_and_why(fields, line):
    with pytest.raises(SpecError) as info:
        load_document(ModelSpec, {**_llama().model_dump(), **fields}, source="model.json")
    assert any(text.startswith(line) for text in str(info.value).splitlines()), str(info.value)


@pytest.mark.parametrize(
    ("document", "fields", "where"),
    [
        (Training, {"global_batch_size": 10**18}, "global_batch_size = 1000000000000000000 > "
         "100000000: the largest published runs take a few thousand sequences per step"),
        (Training, {"global_batch_size": 8, "micro_batch_size": 10**9}, "micro_batch_size = "),
        (Cluster, {"gpu": "x", "num_gpus": 2**21}, "num_gpus = 2097152 > 1048576: the largest "
         "clusters have ~100,000 GPUs"),
        (Cluster, {"gpu": "x", "num_gpus": 8, "gpus_per_node": 10**4}, "gpus_per_node = 10000 "
         "> 4096"),
        (Cluster, {"gpu": "x", "num_gpus": 8, "inter_node_GBps": 0}, "inter_node_GBps = 0 < "
         "1e-06: must be positive"),
        (Strategy, {"tp": 2**21}, "tp = 2097152 > 1048576"),
        (Strategy, {"num_microbatches": 10**9}, "num_microbatches = 1000000000 > 100000000"),
        (Strategy, {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 5000},
         "virtual_stages = 5000 > 1000: a pipeline rank cannot hold more model chunks"),
    ],
)  # fmt: skip
def test_training_cluster_and_strategy_bounds(document, fields, where):
    with pytest.raises(SpecError, match="invalid") as info:
        load_document(document, fields)
    assert where in str(info.value)


def test_bounds_accept_the_largest_allowed_values():
    spec = {**_llama().model_dump(), "num_layers": 1000, "seq_len": 10_000_000}
    assert load_document(ModelSpec, spec).num_layers == 1000
    assert Cluster(gpu="x", num_gpus=2**20, gpus_per_node=4096).num_gpus == 2**20
    assert Training(global_batch_size=100_000_000).global_batch_size == 100_000_000


def test_the_schema_shows_the_bounds():
    properties = ModelSpec.model_json_schema()["properties"]
    assert properties["num_layers"]["maximum"] == 1000
    assert properties["num_layers"]["minimum"] == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_documents_refuse_non_finite_numbers(value):
    with pytest.raises(SpecError, match="finite number"):
        load_document(ModelSpec, {**_llama().model_dump(), "norm_eps": value})
    with pytest.raises(SpecError, match="finite"):
        load_document(Cluster, {"gpu": "x", "num_gpus": 8, "inter_node_latency_us": value})


def test_documents_in_files_refuse_nan_and_bad_bytes(tmp_path: Path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**_llama().model_dump(), "norm_eps": float("nan")}))
    with pytest.raises(SpecError, match=r"ModelSpec file .*model\.json holds the number NaN"):
        load_document(ModelSpec, path)
    path.write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(SpecError, match="is not UTF-8 text"):
        load_document(ModelSpec, path)
    path.write_text("[" * 1000 + "]" * 1000)
    with pytest.raises(SpecError, match="more than 64 levels deep"):
        load_document(ModelSpec, path)
    with pytest.raises(SpecError, match="it is a directory"):
        load_document(ModelSpec, tmp_path)


def test_a_hugging_face_config_given_as_a_model_spec_names_the_option_that_takes_it(tmp_path):
    """Not every ModelSpec field it lacks: it is a Hugging Face config, which --hf-config
    takes (as --model of plan, plan estimate --from and planner.resolve_model)."""
    from planner.importers import import_config
    from planner.models import resolve_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    with pytest.raises(
        SpecError, match=r"is a Hugging Face config \(model_type 'qwen2'\).*--hf-config"
    ):
        resolve_model(str(path))
    toml = '[model]\nname = "llama3"\nflavor = "8B"\n'
    with pytest.raises(SpecError, match=r"model_type 'qwen2'"):
        import_config(toml, model=str(path), cluster="h100-sxm-80gb", gpus=8)
