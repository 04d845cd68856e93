"""Pure plan checks: world size, batch, compression, stages, layouts, fingerprint."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from planner.assemble import assemble_plan
from planner.errors import PlanMismatchError, PlannerError, SpecError
from planner.fqn import match_fqns
from planner.layouts import check_plan_layout
from planner.models import ModelHandle, build, fingerprint, get_preset, resolve_model
from planner.modules import check_model_against_plan, expand_layout, find_blocks
from planner.spec import Cluster, ModuleTP, Plan, Strategy, Training
from planner.validate import check_plan, validate_plan_for_world


def _plan(
    model: str = "tiny-llama",
    batch: int = 8,
    stages: list[list[str]] | None = None,
    **strategy: Any,
) -> Plan:
    handle = resolve_model(model)
    parsed = Strategy.model_validate(strategy)
    cluster = Cluster(gpu="h100", num_gpus=parsed.world_size)
    training = Training(global_batch_size=batch)
    return assemble_plan(handle, cluster, training, parsed, stages=stages)


def test_world_size_message_names_every_factor() -> None:
    plan = _plan(batch=4, dp=2, tp=2, pp=2, num_microbatches=2)
    with pytest.raises(PlanMismatchError) as error:
        validate_plan_for_world(plan, 4)
    assert "dp(2) * tp(2) * pp(2) * cp(1) = 8 != world_size(4)" in str(error.value)


def test_matching_plan_passes() -> None:
    validate_plan_for_world(_plan(batch=8, dp=2, micro_batch_size=4), 2)


def test_plain_data_parallelism_under_a_pipeline_is_refused_only_where_ddp_cannot_run() -> None:
    """This runtime's DDP cannot run a pipeline schedule's backwards; Megatron-LM's DDP
    runs under its pipeline (what a search for it may choose)."""
    plan = _plan(batch=8, dp=2, pp=2, num_microbatches=4)
    with pytest.raises(SpecError, match=r"strategy.zero = 0 .*DDP cannot run under a pipeline"):
        validate_plan_for_world(plan, 4)
    validate_plan_for_world(plan.model_copy(update={"target": "megatron==0.16"}), 4)


def test_global_batch_must_match_dp_times_microbatches() -> None:
    with pytest.raises(
        SpecError, match=r"global_batch_size = 8 != dp\(2\) \* micro_batch_size\(1\)"
    ):
        validate_plan_for_world(_plan(batch=8, dp=2), 2)


def test_context_parallel_on_the_zoo_transformer_is_accepted() -> None:
    plan = _plan(batch=2, dp=2, cp=2, tp=2, zero=3)
    validate_plan_for_world(plan, 8)
    check_model_against_plan(plan, resolve_model("tiny-llama").module)


def test_context_parallel_needs_seq_len_divisible_by_cp() -> None:
    plan = _plan(batch=1, cp=4)
    odd = plan.model_copy(update={"training": plan.training.model_copy(update={"seq_len": 30})})
    with pytest.raises(SpecError, match=r"seq_len 30 is not divisible by 2 \* cp\(4\)"):
        validate_plan_for_world(odd, 4)


def test_context_parallel_needs_a_forward_taking_position_ids() -> None:
    plan = _plan("mlp-mixer", batch=1, cp=2)
    with pytest.raises(SpecError, match=r"cp = 2 but MLPMixer .* takes no position_ids"):
        check_model_against_plan(plan, resolve_model("mlp-mixer").module)


def test_powersgd_needs_ddp() -> None:
    plan = _plan(batch=2, dp=2, zero=3, compression={"kind": "powersgd", "rank": 2})
    with pytest.raises(SpecError, match="powersgd"):
        validate_plan_for_world(plan, 2)


def test_compression_needs_data_parallel() -> None:
    with pytest.raises(SpecError, match=r"needs dp\(1\) \* cp\(1\) > 1"):
        validate_plan_for_world(_plan(batch=1, compression={"kind": "fp16"}), 1)


def test_recompute_blocks_without_mode() -> None:
    with pytest.raises(SpecError, match="recompute_blocks = 2"):
        validate_plan_for_world(_plan(batch=1, recompute_blocks=2), 1)


def test_too_few_microbatches_for_1f1b() -> None:
    with pytest.raises(SpecError, match=r"num_microbatches = 1 < pp\(2\): the 1f1b schedule"):
        validate_plan_for_world(_plan(batch=1, pp=2), 2)
    validate_plan_for_world(_plan(batch=1, pp=2, schedule="gpipe"), 2)


def test_fingerprint_mismatch_names_both() -> None:
    plan = _plan(batch=1)
    other = resolve_model("tiny-gpt").module
    with pytest.raises(PlanMismatchError, match="made for another model"):
        check_model_against_plan(plan, other)


COLWISE = ModuleTP(style="colwise", params={"weight": "Shard(0)"})


def test_layout_naming_a_missing_module() -> None:
    plan = _plan(batch=1, tp=2).model_copy(update={"tp_layout": {"layers.*.attn.wq": COLWISE}})
    with pytest.raises(SpecError, match=r"tp_layout\['layers.\*.attn.wq'\].*names no module"):
        check_model_against_plan(plan, resolve_model("tiny-llama").module)


def test_layout_must_place_parameters_the_module_has() -> None:
    model = resolve_model("tiny-llama").module
    biased = ModuleTP(style="colwise", params={"weight": "Shard(0)", "bias": "Shard(0)"})
    with pytest.raises(
        SpecError, match=r"places 'bias', but 'output' \(Linear\) holds \['weight'\]"
    ):
        expand_layout(model, {"output": biased})


def test_heads_must_divide_by_tp() -> None:
    plan = _plan(batch=1, tp=4)  # tiny-llama has 2 kv heads
    with pytest.raises(SpecError, match=r"kv_heads = 2 is not divisible by tp\(4\)"):
        check_model_against_plan(plan, resolve_model("tiny-llama").module)


def test_sharded_dimension_must_divide_by_tp() -> None:
    model = nn.Sequential(nn.Linear(6, 9), nn.Linear(9, 6))
    plan = _plan(batch=1, tp=2).model_copy(
        update={
            "tp_layout": {
                "0": ModuleTP(style="colwise", params={"weight": "Shard(0)", "bias": "Shard(0)"}),
                "1": ModuleTP(style="rowwise", params={"weight": "Shard(1)"}),
            },
            "model": None,
            "model_fingerprint": fingerprint(model),
        }
    )
    with pytest.raises(
        SpecError, match=r"shards weight on dim 0 of size 9, not divisible by tp\(2\)"
    ):
        check_model_against_plan(plan, model)


def test_too_few_blocks_for_stages() -> None:
    names = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]
    stages = [[name] for name in names] + [["output"]]
    plan = _plan(
        batch=8,
        stages=stages,
        pp=4,
        num_microbatches=8,
        schedule="interleaved-1f1b",
        virtual_stages=2,
    )
    bare = r"plan.stages\[0\] = \['tok_embeddings'\] holds none of Transformer's 4 blocks"
    with pytest.raises(SpecError, match=bare):
        check_model_against_plan(plan, resolve_model("tiny-llama").module)


def test_stage_naming_a_missing_module() -> None:
    plan = _plan(batch=2, pp=2, num_microbatches=2)
    stages = (("tok_embeddings", "layers.0", "layers.9"), plan.stages[1])
    with pytest.raises(SpecError, match=r"plan.stages\[0\] names 'layers.9'"):
        check_model_against_plan(
            plan.model_copy(update={"stages": stages}), resolve_model("tiny-llama").module
        )


def test_match_fqns_star_is_one_component() -> None:
    names = ["layers.0.attention.wq", "layers.10.attention.wq", "layers.0.attention.wk", "wq"]
    assert match_fqns("layers.*.attention.wq", names) == names[:2]


def test_find_blocks_on_zoo_and_hugging_face_naming() -> None:
    blocks = find_blocks(resolve_model("tiny-gpt").module)
    assert [name for name, _ in blocks] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    nested = nn.Module()
    nested.model = nn.Module()
    nested.model.layers = nn.ModuleList(nn.Sequential(nn.Linear(2, 2)) for _ in range(3))
    assert [name for name, _ in find_blocks(nested)] == [
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
    ]


def _tied_plan(**strategy: Any) -> tuple[Plan, nn.Module]:
    spec = get_preset("tiny-gpt").model_copy(update={"tied_embeddings": True})
    handle = ModelHandle("tied", "tied", build(spec), lambda b, s: (), spec)
    parsed = Strategy.model_validate(strategy)
    cluster = Cluster(gpu="h100", num_gpus=parsed.world_size)
    training = Training(global_batch_size=parsed.dp * parsed.num_microbatches)
    plan = assemble_plan(handle, cluster, training, parsed)
    return plan, handle.module


def test_tied_embeddings_sharded_alike_under_tensor_parallel() -> None:
    plan, module = _tied_plan(tp=2)
    expanded = check_model_against_plan(plan, module)
    assert expanded["tok_embeddings"].params == {"weight": "Shard(0)"}  # on the vocabulary
    assert expanded["output"].params == {"weight": "Shard(0)"}


def test_tied_embeddings_sharded_differently_are_refused() -> None:
    plan, module = _tied_plan(tp=2)
    layout = dict(plan.tp_layout)
    layout["tok_embeddings"] = layout["tok_embeddings"].model_copy(
        update={"params": {"weight": "Shard(1)"}}
    )
    with pytest.raises(
        SpecError,
        match=r"tied weights.*'tok_embeddings' Shard\(1\), 'output' Shard\(0\)",
    ):
        check_model_against_plan(plan.model_copy(update={"tp_layout": layout}), module)


def test_tied_embeddings_cannot_span_pipeline_chunks() -> None:
    plan, module = _tied_plan(pp=2, num_microbatches=2)
    with pytest.raises(SpecError, match=r"sit in pipeline chunks \[0, 1\]"):
        check_model_against_plan(plan, module)


def test_sequence_parallel_without_sharded_norms_is_refused_by_the_layout_rules() -> None:
    plan = _plan(batch=1, tp=2, sequence_parallel=True)
    norms = ("layers.*.attention_norm", "layers.*.ffn_norm", "norm")
    layout = {k: v for k, v in plan.tp_layout.items() if k not in norms}
    edited = plan.model_copy(update={"tp_layout": layout})
    with pytest.raises(SpecError, match=r"plan\.tp_layout"):
        check_plan_layout(edited, resolve_model("tiny-llama", device="cpu").module)


def _edited(plan: Plan, **changes: Any) -> Plan:
    """``plan`` as a user might hand-edit its JSON (no validation of the combination)."""
    document = plan.model_dump(mode="json")
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = document
        for key in parents:
            target = target[key]
        target[leaf] = value
    return Plan.model_validate(document)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cluster__num_gpus": 4}, r"cluster.num_gpus = 4 but dp\(1\) \* tp\(1\) \* pp\(2\)"),
        ({"training__global_batch_size": 63}, r"global_batch_size = 63 != dp\(1\)"),
        ({"stages": []}, r"strategy.pp = 2 but plan.stages is empty"),
        ({"stages": [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "norm", "output"]]},
         r"plan.stages leaves out layers.3"),
        ({"stages": [["tok_embeddings", "layers.0", "layers.9"], ["layers.1", "layers.2",
          "layers.3", "norm", "output"]]}, r"plan.stages names unknown modules layers.9"),
        ({"strategy__tp": 4, "mesh": [{"name": "pp", "size": 2}, {"name": "tp", "size": 4}],
          "cluster__num_gpus": 8}, r"model kv_heads = 2 is not divisible by tp\(4\)"),
    ],
    ids=["gpus", "batch", "no stages", "missing", "unknown", "heads"],
)  # fmt: skip
def test_a_hand_edited_plan_that_disagrees_with_itself_is_refused(changes, message) -> None:
    plan = _plan(batch=8, pp=2, micro_batch_size=4, num_microbatches=2)
    check_plan(plan)
    with pytest.raises(PlannerError, match=message):
        check_plan(_edited(plan, **changes))


def test_tied_embedding_and_head_in_different_chunks_are_refused() -> None:
    spec = get_preset("tiny-gpt").model_copy(update={"tied_embeddings": True})
    handle = ModelHandle("tied", "tied", build(spec), lambda b, s: (), spec)
    strategy = Strategy(pp=2, num_microbatches=2, micro_batch_size=4, zero=1)
    plan = assemble_plan(handle, Cluster(gpu="h100", num_gpus=2), Training(global_batch_size=8),
                         strategy)  # fmt: skip
    with pytest.raises(SpecError, match=r"ties its embedding and output head.*chunks \[0, 1\]"):
        check_plan(plan)


def test_export_of_a_hand_edited_plan_exits_2_with_the_reason(tmp_path, capsys) -> None:
    from planner.cli import main

    path = tmp_path / "plan.json"
    edited = _edited(_plan(batch=8, pp=2, micro_batch_size=4, num_microbatches=2), stages=[])
    path.write_text(edited.to_json())
    assert main(["export", str(path), "--to", "megatron"]) == 2
    assert "plan.stages is empty" in capsys.readouterr().err
