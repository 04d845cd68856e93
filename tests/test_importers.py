"""``plan estimate --from`` and :func:`planner.import_config`: what users already have
(a torchtitan job config, Megatron-LM arguments, a DeepSpeed config) read as the run
the planner prices.

The round trip exports plans (searched for each framework, and strategies built by
hand) with :func:`planner.export.export_plan` and reads the text back: the strategy
and the training must come back, except where a target loses a field (:func:`expected`
says which, and the importer takes it from defaults or options).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest

import planner
from planner.cli import main
from planner.cost.options import ExpertChoice
from planner.cost.run import RunConfig, estimate_run
from planner.errors import ExportError, PlannerError, SpecError, UnknownNameError
from planner.export import TARGETS, export_plan
from planner.frameworks import RELEASES, Framework
from planner.importers import ImportedRun, describe_changes, detect_format, import_config
from planner.models import resolve_model
from planner.planning import make_plan
from planner.presets import get_preset
from planner.solve.search import Pins
from planner.spec import (
    Cluster,
    Compression,
    CompressionKind,
    DType,
    ModelSpec,
    Optimizer,
    Plan,
    RecomputeMode,
    Schedule,
    Strategy,
    Training,
)
from tests.test_export import GPU, TINY_MIXTRAL, TINY_MLA, _handle, moe_plan, plan_for


@functools.cache
def searched(model: str, gpus: int, batch: int, target: str) -> Plan:
    """A zoo preset planned with small settings for ``target`` (so it exports)."""
    cluster = Cluster(gpu=GPU, num_gpus=gpus)
    return make_plan(_handle(model), cluster, Training(global_batch_size=batch), target=target)


def facts(strategy: Strategy, training: Training, seq_len: int) -> dict[str, Any]:
    """The fields the round trip must keep."""
    return {
        "dp": strategy.dp, "dp_shard": strategy.shard_degree, "tp": strategy.tp,
        "pp": strategy.pp, "cp": strategy.cp, "ep": strategy.ep, "zero": strategy.zero,
        "sp": strategy.sequence_parallel, "recompute": strategy.recompute,
        "recompute_blocks": strategy.recompute_blocks,
        "micro_batch": strategy.micro_batch_size, "micro_batches": strategy.num_microbatches,
        "schedule": strategy.schedule if strategy.pp > 1 else None,
        "virtual_stages": strategy.virtual_stages, "compression": strategy.compression.kind,
        "batch": training.global_batch_size, "seq": seq_len, "dtype": training.dtype,
        "optimizer": training.optimizer, "grad_clip": training.grad_clip,
    }  # fmt: skip


def expected(plan: Plan, framework: str) -> dict[str, Any]:
    """The plan's facts with what the target loses read back as the importer reads it:

    - DeepSpeed: the config holds no optimizer (the script builds it: the importer prices
      the planner's default, AdamW) and no sequence length (the ``--model``'s);
    - Megatron-LM and torchtitan: nothing.
    """
    assert plan.model is not None
    wanted = facts(plan.strategy, plan.training, plan.training.seq_len or plan.model.seq_len)
    if framework == "deepspeed":
        wanted |= {"optimizer": Optimizer.ADAMW, "seq": plan.model.seq_len}
    return wanted


def round_trip(plan: Plan, target: str) -> ImportedRun:
    """Export ``plan`` to ``target`` and import the text back (the model from the plan
    where the target does not describe it, on the plan's cluster)."""
    text = export_plan(plan, target)
    framework = target.partition("==")[0]
    model = None if framework == "megatron" else plan.model
    return import_config(text, model=model, cluster=plan.cluster)


def check_round_trip(plan: Plan, target: str) -> None:
    imported = round_trip(plan, target)
    framework = target.partition("==")[0]
    assert imported.format == framework
    run = imported.run
    got = facts(run.strategy, run.training, run.training.seq_len or run.model.seq_len)
    assert got == expected(plan, framework), (
        f"{target}: {describe_changes(plan.strategy, run.strategy)}"
    )
    if plan.strategy.pp > 1:
        assert run.stages == plan.stages
    if framework == "megatron":  # the arguments describe the model priced (vocabulary unpadded)
        import_config(export_plan(plan, target), model=plan.model, cluster=plan.cluster)
    if plan.strategy.zero >= 1:  # the reduction overlaps backward, as the plan was priced
        assert run.options.overlap_grad_reduce, f"{target}: the export runs it exposed"


SEARCHED = [("tiny-llama", 8, 16), ("tiny-gpt", 8, 16), ("gpt2", 16, 32)]
RELEASED = [
    f"{framework.value}=={'.'.join(map(str, version))}"
    for framework, versions in RELEASES.items()
    if framework in TARGETS
    for version in versions
]


@pytest.mark.parametrize(
    ("model", "gpus", "batch", "target"),
    [  # torchtitan builds Llama-style decoders only (planner.frameworks.model_refusal)
        (*searched_model, target)
        for target in RELEASED
        for searched_model in SEARCHED
        if not (target.startswith("torchtitan") and "gpt" in searched_model[0])
    ],
)
def test_searched_plans_come_back_from_every_release(model, gpus, batch, target) -> None:
    check_round_trip(searched(model, gpus, batch, target), target)


@pytest.mark.parametrize("target", ["torchtitan", "megatron"])
def test_a_searched_llama_with_every_dimension_comes_back(target) -> None:
    """llama3-8b on 64 GPUs, the search pinned to tp, cp, an interleaved pipeline, ZeRO-3
    and full recompute."""
    pins = Pins(
        tp=4, pp=4, cp=2, zero=3, sequence_parallel=True, recompute=RecomputeMode.FULL,
        schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2, micro_batch_size=1,
    )  # fmt: skip
    cluster = Cluster(gpu=GPU, num_gpus=64)
    training = Training(global_batch_size=64)
    plan = make_plan(_handle("llama3-8b"), cluster, training, pins=pins, target=target)
    check_round_trip(plan, target)
    assert estimate_run(round_trip(plan, target).run) == plan.prediction


@pytest.mark.parametrize("target", ["torchtitan==0.2", "torchtitan==0.3", "megatron"])
def test_selective_recompute_is_priced_as_the_target_runs_it(target) -> None:
    """A plan searched for torchtitan prices its per-op selective recompute (what the export's
    ``selective_ac_option = "op"`` runs), Megatron's its own: the export re-priced is the
    plan's prediction, memory included."""
    pins = Pins(recompute=RecomputeMode.SELECTIVE, zero=3)
    plan = make_plan(
        _handle("llama3-8b"), Cluster(gpu=GPU, num_gpus=64), Training(global_batch_size=256),
        pins=pins, target=target,
    )  # fmt: skip
    assert estimate_run(round_trip(plan, target).run) == plan.prediction


STAGES_UNEVEN = [
    ["tok_embeddings", "layers.0"],
    ["layers.1", "layers.2", "layers.3", "norm", "output"],
]
STAGES_EMBEDDING_ALONE = [  # Megatron-LM: only its layout can say so
    ["tok_embeddings"],
    ["layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"],
]
STAGES_VIRTUAL = [
    ["tok_embeddings", "layers.0", "layers.1"],
    ["layers.2"],
    ["layers.3"],
    ["norm", "output"],
]
HAND_BUILT = [
    ("torchtitan", {"dp": 4, "zero": 2, "dp_shard": 2, "pp": 2, "schedule": Schedule.ZERO_BUBBLE,
                    "num_microbatches": 4, "micro_batch_size": 2,
                    "recompute": RecomputeMode.FULL}, {"grad_clip": False}, None),
    ("torchtitan==0.2", {"dp": 8, "zero": 3, "micro_batch_size": 2, "num_microbatches": 3},
     {"dtype": DType.FP8}, None),
    ("torchtitan", {"dp": 2, "zero": 2, "tp": 2, "sequence_parallel": True, "cp": 2, "pp": 2,
                    "schedule": Schedule.INTERLEAVED_1F1B, "virtual_stages": 2,
                    "num_microbatches": 4, "recompute": RecomputeMode.FULL},
     {"optimizer": Optimizer.ADAM}, STAGES_VIRTUAL),
    ("torchtitan", {"dp": 4}, {"dtype": DType.FP32, "grad_clip": False}, None),
    ("megatron", {"dp": 8, "zero": 1, "dp_shard": 4, "recompute": RecomputeMode.FULL,
                  "recompute_blocks": 2}, {}, None),
    ("megatron", {"dp": 8, "zero": 2, "compression": Compression(kind=CompressionKind.BF16)},
     {}, None),
    ("megatron", {"dp": 8}, {"dtype": DType.FP16}, None),
    ("megatron", {"dp": 4, "compression": Compression(kind=CompressionKind.FP16)},
     {"dtype": DType.FP16}, None),
    ("megatron", {"pp": 2, "num_microbatches": 4}, {}, STAGES_UNEVEN),
    ("megatron", {"pp": 2, "num_microbatches": 4}, {}, STAGES_EMBEDDING_ALONE),
    ("megatron", {"pp": 2, "virtual_stages": 2, "schedule": Schedule.INTERLEAVED_1F1B,
                  "num_microbatches": 4}, {}, STAGES_VIRTUAL),
    ("megatron", {"dp": 2, "zero": 3, "tp": 2, "sequence_parallel": True, "cp": 2,
                  "recompute": RecomputeMode.SELECTIVE},
     {"dtype": DType.FP8, "optimizer": Optimizer.SGD, "grad_clip": False}, None),
    ("deepspeed", {"dp": 8, "zero": 2, "micro_batch_size": 2, "num_microbatches": 4}, {}, None),
    ("deepspeed==0.19.6", {"dp": 16, "zero": 3, "dp_shard": 8,
                           "compression": Compression(kind=CompressionKind.FP16)},
     {"dtype": DType.FP16}, None),
    ("deepspeed", {"dp": 4}, {"dtype": DType.FP32, "grad_clip": False}, None),
    ("deepspeed", {"dp": 8, "zero": 1, "compression": Compression(kind=CompressionKind.BF16)},
     {}, None),
]  # fmt: skip


@pytest.mark.parametrize(("target", "strategy", "training", "stages"), HAND_BUILT)
def test_hand_built_strategies_come_back(target, strategy, training, stages) -> None:
    check_round_trip(plan_for(training=training, stages=stages, **strategy), target)


def test_gpt_strategy_comes_back_from_megatron_with_its_model() -> None:
    plan = plan_for("tiny-gpt", dp=2, tp=2, sequence_parallel=True)
    check_round_trip(plan, "megatron")
    assert round_trip(plan, "megatron").run.model == get_preset("tiny-gpt")


def test_pricing_an_export_reproduces_the_plan() -> None:
    """Every target carries every fact this plan's price depends on (FSDP overlaps its
    communication, as the search assumes; Megatron-LM is told to overlap)."""
    plan = searched("tiny-llama", 8, 16, "torchtitan")
    assert plan.prediction is not None
    assert estimate_run(round_trip(plan, "torchtitan").run) == plan.prediction
    plan = searched("llama3-8b", 64, 64, "megatron")  # dp64 ZeRO-3 (Megatron-FSDP)
    assert estimate_run(round_trip(plan, "megatron").run) == plan.prediction
    plan = searched("gpt2", 16, 32, "deepspeed")
    assert estimate_run(round_trip(plan, "deepspeed").run) == plan.prediction


def test_deepspeed_without_zero_is_planned_with_its_reduction_after_backward() -> None:
    """DeepSpeed's engine all-reduces after backward when ZeRO is off: the search prices
    that (its config cannot ask otherwise), so the export prices as the plan did."""
    cluster, training, pins = (
        Cluster(gpu=GPU, num_gpus=16),
        Training(global_batch_size=32),
        Pins(zero=0),
    )
    kept = make_plan(_handle("gpt2"), cluster, training, pins=pins, target="deepspeed")
    free = make_plan(_handle("gpt2"), cluster, training, pins=pins)
    assert kept.prediction.breakdown_s["comm_dp"] > 3 * free.prediction.breakdown_s["comm_dp"]
    assert estimate_run(round_trip(kept, "deepspeed").run) == kept.prediction


# ----- formats --------------------------------------------------------------------------

TOML = """
[model]
name = "llama3"
flavor = "8B"

[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 2

[training]
local_batch_size = 2
seq_len = 4096

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"

[metrics]
log_freq = 10
"""


def test_detects_each_format_and_says_how() -> None:
    assert detect_format(TOML, "x") == ("torchtitan", "detected: TOML")
    assert detect_format(TOML, "x.toml", ".toml")[1] == "detected: a .toml file"
    assert detect_format('{"zero_optimization": {"stage": 1}}', "x")[0] == "deepspeed"
    commented = '// written by plan export\n# and hjson comments\n{"train_batch_size": 8}'
    assert detect_format(commented, "x")[0] == "deepspeed"
    assert detect_format('{"parallelism": {}, "training": {}}', "x")[0] == "torchtitan"
    assert detect_format("# args\n--micro-batch-size 1\n", "x") == (
        "megatron",
        "detected: --options",
    )
    shell = "torchrun --nproc_per_node 8 pretrain_gpt.py --bf16"
    assert detect_format(shell, "x")[0] == "megatron"
    with pytest.raises(SpecError, match="give --format"):
        detect_format('{"lr": 1}', "x")
    with pytest.raises(SpecError, match="cannot tell the format of x"):
        detect_format("hello world", "x")


def test_reads_a_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(TOML)
    imported = import_config(path, cluster=GPU, gpus=16)
    assert imported.source == str(path) and imported.detected == "detected: a .toml file"
    assert import_config(str(path), cluster=GPU, gpus=16).run == imported.run
    with pytest.raises(SpecError, match="does not exist"):
        import_config(str(tmp_path / "missing.toml"), cluster=GPU, gpus=16)


def test_torchtitan_flavor_maps_to_a_preset_and_notes_what_it_used() -> None:
    imported = import_config(TOML, cluster=GPU, gpus=16)
    run = imported.run
    assert run.model == get_preset("llama3-8b").with_seq_len(4096)
    assert run.strategy.describe() == "dp8(zero3) tp2 sp mb2x1 recompute=selective"
    assert run.options.selective.value == "op"  # torchtitan's per-op policy is priced
    assert "parallelism.tensor_parallel_degree" in imported.used
    assert imported.not_read == ("metrics.log_freq",)
    lines = imported.describe()
    assert lines[0] == "read the config text as torchtitan (detected: TOML)"
    assert lines[1].startswith(
        "used: model.name, model.flavor, parallelism.data_parallel_shard_degree"
    )


def test_torchtitan_unknown_flavor_lists_the_known_ones() -> None:
    with pytest.raises(
        SpecError, match=r"model.flavor = 'debugmodel'.*known llama3 flavors: 8B, 70B, 405B"
    ):
        import_config(TOML.replace('"8B"', '"debugmodel"'), cluster=GPU, gpus=16)
    assert import_config(TOML.replace('"8B"', '"405B"'), cluster=GPU, gpus=16).run.model.name == (
        "llama3.1-405b"
    )


def test_torchtitan_auto_shard_degree_needs_the_gpu_count() -> None:
    with pytest.raises(SpecError, match=r"data_parallel_shard_degree = -1 takes the GPUs.*--gpus"):
        import_config(TOML, cluster=GPU)
    fixed = TOML.replace("= -1", "= 4")
    assert import_config(fixed, cluster=GPU).run.cluster.num_gpus == 8
    with pytest.raises(
        SpecError, match="the product of the parallelism degrees = 8 GPUs, but --gpus is 16"
    ):
        import_config(fixed, cluster=GPU, gpus=16)


def test_torchtitan_defaults_every_second_layer_and_its_own_stage_split() -> None:
    """Without those keys torchtitan checkpoints every 2nd layer (``selective_ac_option =
    "2"``) and splits the pipeline itself, weighting the embeddings and the head as a layer."""
    text = '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\npipeline_parallel_degree = 2\n'
    run = import_config(text, cluster=GPU, gpus=16).run
    assert (run.strategy.recompute, run.strategy.recompute_blocks) == (RecomputeMode.FULL, 8)
    assert [sum(f.startswith("layers.") for f in chunk) for chunk in run.stages] == [16, 16]
    assert run.stages[0][0] == "tok_embeddings" and run.stages[-1][-2:] == ("norm", "output")
    looped = text + 'pipeline_parallel_schedule = "Interleaved1F1B"\n'
    with pytest.raises(SpecError, match=r"one layer in 2 of chunks of \[8, 9, 8, 7\] layers"):
        import_config(looped, cluster=GPU, gpus=16)
    run = import_config(
        looped + '[activation_checkpoint]\nmode = "full"\n', cluster=GPU, gpus=16
    ).run
    assert run.strategy.virtual_stages == 2
    assert [sum(f.startswith("layers.") for f in chunk) for chunk in run.stages] == [8, 9, 8, 7]


def test_torchtitan_runs_each_gradient_accumulation_step_as_a_schedule() -> None:
    """Under a pipeline torchtitan calls the schedule once per gradient-accumulation step:
    4 steps of local_batch_size 8 in micro-batches of 2 are 4 schedules of 4, each with
    its fill and drain; one step of 32 is one schedule of 16."""
    base = '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\npipeline_parallel_degree = 2\n'
    base += "pipeline_parallel_microbatch_size = 2\n"
    runs = {}
    for local in (8, 32):
        text = base + f"[training]\nlocal_batch_size = {local}\nglobal_batch_size = 256\n"
        runs[local] = import_config(text, cluster=GPU, gpus=16)
    rounds, one = runs[8], runs[32]
    assert rounds.run.strategy == one.run.strategy  # 16 micro-batches of 2 per rank
    assert rounds.run.options.pipeline_round_microbatches == 4
    assert one.run.options.pipeline_round_microbatches is None
    assert any(
        "4 gradient-accumulation steps, each its own pipeline schedule" in n for n in rounds.notes
    )
    bubbles = [estimate_run(i.run).breakdown_s["bubble"] for i in (rounds, one)]
    assert bubbles[0] == pytest.approx(4 * bubbles[1])


@pytest.mark.parametrize("release", ["torchtitan==0.2", "torchtitan==0.3"])
def test_a_torchtitan_config_names_the_release_that_reads_it(release) -> None:
    """0.2 reads a TOML job config, 0.3 command-line overrides: ``plan --from`` then plans
    for the release the config was written for (and ``plan export`` writes its form)."""
    plan = searched("tiny-llama", 8, 16, release)
    assert round_trip(plan, release).release == release


def test_a_torchtitan_02_toml_with_a_compile_section_is_read_as_02() -> None:
    """0.2.2 has a [compile] section too (its example configs carry one): it reads as
    0.2, whose selective recompute defaults to every second block (from a tester)."""
    text = TOML + "[compile]\nenable = false\n"
    imported = import_config(text, cluster=GPU, gpus=16)
    assert not any("0.3" in note for note in imported.notes)
    assert imported.release == "torchtitan==0.2"


def test_torchtitan_03_keys_and_json_dump() -> None:
    text = TOML + "[compile]\nenable = true\n[parallelism.x]\n"
    text = text.replace(
        "tensor_parallel_degree = 2", "tensor_parallel_degree = 2\nenable_sequence_parallel = false"
    )
    imported = import_config(text, cluster=GPU, gpus=16)
    assert not imported.run.strategy.sequence_parallel
    assert imported.run.options.fused_pointwise
    assert "read with torchtitan 0.3's key names and defaults" in imported.notes
    dump = {
        "model_spec": {"name": "llama3", "flavor": "70B", "model": {"dim": 8192}},
        "parallelism": {"data_parallel_shard_degree": 8, "tensor_parallel_degree": 8},
        "training": {"local_batch_size": 1, "seq_len": 8192, "dtype": "float32"},
        "activation_checkpoint": {"preserve_rng_state": True, "debug": False},
        "optimizer": {"param_groups": [{"pattern": ".*", "optimizer_name": "AdamW"}]},
    }
    run = import_config(json.dumps(dump), cluster=GPU).run
    assert run.model.name == "llama3-70b"
    assert run.strategy.describe() == "dp8(zero3) tp8 sp mb1x1 recompute=full"
    dump["activation_checkpoint"] = None
    assert import_config(json.dumps(dump), cluster=GPU).run.strategy.recompute is RecomputeMode.NONE
    dump["activation_checkpoint"] = {"memory_budget": 0.5}
    with pytest.raises(SpecError, match=r"activation_checkpoint\.mode = 'memory-budget'"):
        import_config(json.dumps(dump), cluster=GPU)


def test_torchtitan_03_command_line_with_its_config_function() -> None:
    """A 0.3 launch: the --config function's values (llama3_70b: tp 8, local batch 8,
    full recompute) where the overrides do not say otherwise, the world from torchrun."""
    command = (
        "torchrun --nproc_per_node 8 --nnodes 2 -m torchtitan.train --module llama3 "
        "--config llama3_70b --parallelism.data_parallel_shard_degree=-1 "
        "--training.global_batch_size 64 --parallelism.no_enable_sequence_parallel "
        "--compile.enable activation-checkpoint:selective --metrics.log_freq 5"
    )
    assert detect_format(command, "x")[1] == "detected: --section.key overrides (torchtitan 0.3)"
    imported = import_config(command, cluster=GPU)
    run = imported.run
    assert (run.model.name, run.cluster.num_gpus, run.training.seq_len) == ("llama3-70b", 16, 8192)
    assert run.strategy.describe() == "dp2(zero3) tp8 mb8x4 recompute=selective"
    assert run.options.fused_pointwise and run.options.selective.value == "op"
    assert imported.notes[1].startswith("--config llama3_70b: training.local_batch_size = 8")
    assert imported.not_read == ("metrics.log_freq",)
    with pytest.raises(SpecError, match="torchrun --nproc_per_node x --nnodes = 16 GPUs, but"):
        import_config(command.replace("=-1", "=4"), cluster=GPU)
    with pytest.raises(SpecError, match=r"--config = 'llama3_debugmodel'.*llama3_8b, llama3_70b"):
        import_config(command.replace("llama3_70b", "llama3_debugmodel"), cluster=GPU)


def test_torchtitan_bf16_without_fsdp_under_tp_trains_in_fp32() -> None:
    text = TOML.replace("= -1", "= 1")
    imported = import_config(text, cluster=GPU)
    assert imported.run.training.dtype is DType.FP32
    assert any("torchtitan trains in float32" in note for note in imported.notes)


MEGATRON_SHELL = """torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py \\
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --sequence-parallel \\
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention \\
    --num-query-groups 8 --ffn-hidden-size 14336 --seq-length 8192 --max-position-embeddings 8192 \\
    --vocab-size 128256 --make-vocab-size-divisible-by 64 --normalization RMSNorm \\
    --position-embedding-type rope --rotary-base 500000 --swiglu --disable-bias-linear \\
    --untie-embeddings-and-output-weights --micro-batch-size 1 --global-batch-size 32 \\
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16 \\
    --recompute-activations --lr 3e-4 --data-path 0.5 a 0.5 b --save /ckpt
"""


def test_megatron_shell_command_gives_world_model_and_strategy() -> None:
    imported = import_config(MEGATRON_SHELL, cluster=GPU)
    run = imported.run
    assert run.cluster.num_gpus == 16
    assert run.model.name == "llama3-8b"  # the network-size arguments match the preset
    assert run.strategy.describe() == "dp2(zero1) tp4 sp pp2 1f1b mb1x16 recompute=selective"
    assert run.options.overlap_grad_reduce and run.options.dropout  # Megatron-LM's 0.1
    assert set(imported.not_read) == {"--max-position-embeddings", "--lr", "--data-path", "--save"}
    with pytest.raises(
        SpecError, match="torchrun --nproc_per_node x --nnodes = 16 GPUs, but --gpus is 8"
    ):
        import_config(MEGATRON_SHELL, cluster=GPU, gpus=8)


def test_megatron_prices_its_kernels_and_its_recompute_modules() -> None:
    run = import_config(MEGATRON_SHELL, cluster=GPU).run
    assert run.options.fused_norm_swiglu and run.options.gqa_native
    assert run.options.grad_accumulation.value == "fused"  # in the weight-gradient GEMM
    unfused = MEGATRON_SHELL.replace("--bf16", "--bf16 --no-gradient-accumulation-fusion")
    assert import_config(unfused, cluster=GPU).run.options.grad_accumulation.value == "autograd"
    assert run.options.selective.value == "attention"  # --recompute-modules: core_attn
    modules = MEGATRON_SHELL.replace(
        "--recompute-activations", "--recompute-granularity selective --recompute-modules "
        "layernorm moe_act",
    )  # fmt: skip
    run = import_config(modules, cluster=GPU).run
    assert run.options.selective.value == "modules"
    assert [m.value for m in run.options.recompute_modules] == ["layernorm", "moe_act"]
    mlp = import_config(modules.replace("layernorm moe_act", "moe_act mlp"), cluster=GPU).run
    assert [m.value for m in mlp.options.recompute_modules] == ["moe_act", "mlp"]
    with pytest.raises(SpecError, match=r"--recompute-modules = 'moe_act moe'.*not moe"):
        import_config(modules.replace("layernorm moe_act", "moe_act moe"), cluster=GPU)


def _accounting(layers: int, *extra: str) -> str:
    """MEGATRON_SHELL with ``layers`` layers and ``extra`` pipeline arguments."""
    return MEGATRON_SHELL.replace("--num-layers 32", f"--num-layers {layers} " + " ".join(extra))


EMBEDDING, LOSS = (
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
)


@pytest.mark.parametrize(
    ("layers", "extra", "counts"),
    [
        # (30 + 2) / pp 2 = 16 a rank, 4 a chunk: the end chunks build one layer fewer
        (30, (EMBEDDING, LOSS, "--num-layers-per-virtual-pipeline-stage 4"),
         [3, 4, 4, 4, 4, 4, 4, 3]),
        (31, (EMBEDDING,), [15, 16]),
        (31, (LOSS,), [16, 15]),
        # (6 + 2) / 8 chunks: the first holds the embedding alone, the last the loss alone
        (6, (EMBEDDING, LOSS, "--num-virtual-stages-per-pipeline-rank 4"),
         [0, 1, 1, 1, 1, 1, 1, 0]),
    ],
)  # fmt: skip
def test_megatron_split_accounting_for_the_embedding_and_loss_is_read(layers, extra, counts):
    """Qwen3-235B's Megatron-MoE-ModelZoo config accounts for both in its split."""
    run = import_config(_accounting(layers, *extra), cluster=GPU).run
    blocks = [sum(m.startswith("layers.") for m in chunk) for chunk in run.stages]
    assert blocks == counts
    assert run.stages[0][0] == "tok_embeddings" and run.stages[-1][-1] == "output"
    assert estimate_run(run).step_time_s > 0  # chunks without a layer are priced too


@pytest.mark.parametrize(
    "extra",
    [
        (EMBEDDING, "--decoder-first-pipeline-num-layers 10"),
        (LOSS, "--pipeline-model-parallel-layout 'E(t)*16|(t)*16L'"),
    ],
)
def test_megatron_refuses_the_accounting_beside_another_split(extra):
    with pytest.raises(SpecError, match="beside --account-for-embedding/loss-in-pipeline-split"):
        import_config(_accounting(32, *extra), cluster=GPU)


def test_megatron_accounting_that_does_not_divide_is_refused():
    with pytest.raises(SpecError, match=r"33 layers \(with the embedding and loss"):
        import_config(_accounting(32, EMBEDDING), cluster=GPU)


def test_megatron_needs_the_world_and_pads_the_vocabulary() -> None:
    args = MEGATRON_SHELL.split("pretrain_gpt.py")[1].replace(
        "--make-vocab-size-divisible-by 64", ""
    )
    with pytest.raises(SpecError, match=r"data-parallel size is what is left of the world"):
        import_config(args, cluster=GPU)
    imported = import_config(args, cluster=GPU, gpus=32)
    assert imported.run.model.vocab_size == 128512  # 128256 to a multiple of 128 x tp 4
    assert imported.run.model.name == "custom"
    assert any("padded to 128512" in note for note in imported.notes)
    with pytest.raises(SpecError, match="differ in vocab"):
        import_config(args, cluster=GPU, gpus=32, model="llama3-8b")


def test_megatron_without_network_size_arguments_takes_the_model_option() -> None:
    args = "--tensor-model-parallel-size 2 --micro-batch-size 2 --dropout-free 1"
    with pytest.raises(SpecError, match=r"does not describe the model.*--model"):
        import_config(args, cluster=GPU, gpus=8)
    run = import_config(args, cluster=GPU, gpus=8, model="gpt2").run
    assert run.model.name == "gpt2" and run.strategy.dp == 4
    assert run.options.dropout  # Megatron-LM's default 0.1


REFUSALS = [
    ("deepspeed", '{"train_batch_size": 64, "zero_optimization": {"stage": 3, '
     '"offload_optimizer": {"device": "cpu"}}}',
     "zero_optimization.offload_optimizer.device = 'cpu': the planner does not model CPU or NVMe "
     "offload; remove zero_optimization.offload_optimizer to price the run without it"),
    ("deepspeed", '{"train_batch_size": "auto"}', "train_batch_size = 'auto'"),
    ("deepspeed", '{"train_batch_size": 64, "optimizer": {"type": "Lamb"}}',
     "optimizer.type = 'Lamb'"),
    ("deepspeed", '{"train_batch_size": 64, "bf16": {"enabled": true}, "fp16": {"enabled": true}}',
     "fp16.enabled = true: bf16 is enabled too"),
    ("megatron", "--moe-expert-capacity-factor 1.25",
     "--moe-expert-capacity-factor = '1.25': the planner's experts are dropless"),
    ("megatron", "--moe-router-score-function sigmoid",
     "--moe-router-score-function = 'sigmoid': the planner's router is a softmax"),
    ("deepspeed", '{"train_batch_size": 64, "expert_parallel": {"enabled": true, '
     '"autoep_size": 8}}', "expert_parallel.enabled = true: AutoEP"),
    ("torchtitan", "[parallelism]\nexpert_tensor_parallel_degree = 2",
     "parallelism.expert_tensor_parallel_degree = 2: the planner does not price torchtitan's"),
    ("megatron", "--recompute-granularity full --recompute-method uniform --recompute-num-layers 4",
     "--recompute-method = 'uniform'"),
    ("megatron", "--recompute-granularity full", "--recompute-method = None: Megatron-LM refuses "
     "--recompute-granularity full without --recompute-method"),
    ("megatron", "--recompute-granularity full --recompute-method block",
     "--recompute-num-layers = None: Megatron-LM refuses"),
    ("megatron", "--use-megatron-fsdp --data-parallel-sharding-strategy optim",
     "--data-parallel-sharding-strategy = 'optim'"),
    ("megatron", "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 256 "
     "--seq-length 32 --normalization RMSNorm", "--position-embedding-type = 'learned_absolute'"),
    ("megatron", "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 256 "
     "--seq-length 32 --normalization RMSNorm --position-embedding-type rope",
     "--disable-bias-linear = false"),
    ("megatron", "--fp8-format hybrid", "--bf16/--fp16/--fp8-format = '--fp8-format hybrid'"),
    ("megatron", "--fp16 --grad-reduce-in-bf16", "--grad-reduce-in-bf16 = true"),
    ("torchtitan", "[training]\nenable_cpu_offload = true", "training.enable_cpu_offload = true"),
    ("torchtitan", '[parallelism]\nexpert_parallel_comm_backend = "nccl"',
     "expert_parallel_comm_backend = 'nccl': torchtitan's backends are standard, deepep, hybridep"),
    ("torchtitan", '[parallelism]\nexpert_parallel_comm_backend = "deepep"',
     "expert_parallel_comm_backend = 'deepep': torchtitan runs DeepEP and HybridEP only with"),
    ("torchtitan", '[training]\ndtype = "float16"', "training.dtype = 'float16': torchtitan takes"),
    ("torchtitan", '[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = '
     '"ZBVZeroBubble"', "pipeline_parallel_schedule = 'ZBVZeroBubble'"),
    ("torchtitan", '[model]\nconverters = ["mx"]', "model.converters = ['mx']"),
    ("torchtitan", "[parallelism]\ntensor_parallel_degree = 2\ndisable_loss_parallel = true",
     "parallelism.disable_loss_parallel = true"),
]  # fmt: skip


@pytest.mark.parametrize(("format", "text", "message"), REFUSALS)
def test_refuses_what_changes_the_math_naming_key_value_and_fix(format, text, message) -> None:
    with pytest.raises(PlannerError) as info:
        import_config(text, format=format, model="tiny-llama", cluster=GPU, gpus=8)
    assert str(info.value).startswith("cannot read the config text: ")
    assert message in str(info.value)


def test_deepspeed_derives_the_gpu_count_or_completes_the_batch_sizes() -> None:
    three = '{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}'
    assert import_config(three, model="gpt2", cluster=GPU).run.cluster.num_gpus == 8
    two = '{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}'
    with pytest.raises(SpecError, match="leaves the GPU count open"):
        import_config(two, model="gpt2", cluster=GPU)
    imported = import_config(two, model="gpt2", cluster=GPU, gpus=16)
    assert imported.run.strategy.describe() == "dp16(zero3) mb2x2 recompute=none"
    assert imported.run.training.dtype is DType.FP32 and not imported.run.training.grad_clip
    assert imported.run.options.overlap_grad_reduce  # overlap_comm defaults on under ZeRO-3


def test_the_api_takes_cluster_objects_and_refuses_what_is_missing() -> None:
    cluster = Cluster(gpu=GPU, num_gpus=16)
    assert import_config(TOML, cluster=cluster).run.cluster == cluster
    with pytest.raises(SpecError, match="no cluster given"):
        import_config(TOML, gpus=16)
    with pytest.raises(UnknownNameError, match="unknown config format 'colossal'"):
        import_config(TOML, format="colossal", cluster=GPU, gpus=16)
    with pytest.raises(SpecError, match="a module:function is traced instead"):
        import_config(TOML, model="pkg.mod:build", cluster=GPU, gpus=16)
    assert planner.import_config is import_config and planner.ImportedRun is ImportedRun


def test_describe_changes_names_each_difference() -> None:
    before = Strategy(dp=8, zero=1, tp=8, sequence_parallel=True, recompute=RecomputeMode.FULL)
    after = Strategy(dp=16, zero=3, tp=4, sequence_parallel=True, recompute=RecomputeMode.SELECTIVE)
    assert describe_changes(before, after) == (
        "dp 8 -> 16, dp_shard 8 -> 16, tp 8 -> 4, zero 1 -> 3, recompute full -> selective"
    )
    assert describe_changes(before, before) == "no change"


def test_imported_run_is_a_run_config_estimate_prices() -> None:
    run = import_config(TOML, cluster=GPU, gpus=16).run
    assert isinstance(run, RunConfig)
    assert estimate_run(run).step_time_s > 0


# ----- CLI ------------------------------------------------------------------------------


def test_cli_estimate_from_prints_what_it_read_and_the_table(tmp_path, capsys) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(export_plan(plan_for(dp=8, zero=2, num_microbatches=2), "deepspeed"))
    assert main(["estimate", "--from", str(path), "--model", "tiny-llama", "--gpus", "8"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith(
        f"read {path} as deepspeed (detected: JSON with zero_optimization)\nused: "
    )
    assert out.startswith("tiny-llama on 8 x h100-sxm-80gb: dp8(zero2) mb1x2 recompute=none\n")
    assert main(["estimate", "--from", str(path), "--model", "tiny-llama", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_cli_estimate_from_takes_the_sequence_a_config_does_not_state(tmp_path, capsys) -> None:
    """A DeepSpeed config has no sequence length: --seq gives it; a TOML that states one
    refuses a different --seq."""
    path = tmp_path / "ds_config.json"
    path.write_text(export_plan(plan_for(dp=8, zero=2), "deepspeed"))
    seconds = {}
    for seq in (32, 64):
        argv = ["estimate", "--from", str(path), "--model", "tiny-llama", "--seq", str(seq)]
        assert main([*argv, "--json"]) == 0
        seconds[seq] = json.loads(capsys.readouterr().out)["step_time_s"]
    assert seconds[64] > seconds[32]
    toml = tmp_path / "job.toml"
    toml.write_text(export_plan(plan_for(dp=8, zero=2), "torchtitan"))
    stated = import_config(toml, model="tiny-llama", cluster=GPU).run.training.seq_len
    argv = ["estimate", "--from", str(toml), "--model", "tiny-llama", "--seq", str(stated + 8)]
    assert main(argv) == 2
    assert f"states seq_len = {stated}: drop --seq" in capsys.readouterr().err


def test_a_plan_or_a_broken_toml_given_as_a_config_says_what_it_is(tmp_path) -> None:
    """From a tester: a plan JSON was read as torchtitan 0.3's dump (its training table)
    and a TOML with a syntax error as 'no TOML'."""
    plan = tmp_path / "plan.json"
    plan.write_text(plan_for(dp=8, zero=2).to_json())
    with pytest.raises(SpecError, match=r"is a plan this planner wrote.*plan estimate --plan"):
        import_config(plan, model="tiny-llama", cluster=GPU)
    broken = tmp_path / "job.toml"
    broken.write_text('[model\nname = "llama3"\n')
    with pytest.raises(SpecError, match=r"not TOML \(.*line 1"):
        import_config(broken, cluster=GPU)


def test_cli_refusals_and_misplaced_options_exit_2(tmp_path, capsys) -> None:
    path = tmp_path / "megatron.args"
    path.write_text("--moe-expert-capacity-factor 1.0\n")
    assert main(["estimate", "--from", str(path), "--model", "gpt2", "--gpus", "8"]) == 2
    assert "error: cannot read" in capsys.readouterr().err
    plan = tmp_path / "plan.json"
    plan.write_text(plan_for(dp=2).to_json())
    assert main(["estimate", "--plan", str(plan), "--model", "gpt2"]) == 2
    assert "--model only apply with --from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["estimate", "--plan", str(plan), "--from", str(path)])


def test_every_export_target_has_an_importer() -> None:
    from planner.importers import FORMATS

    assert {framework.value for framework in TARGETS} == set(FORMATS)
    assert Framework.PLANNER not in TARGETS


def model_facts(spec: ModelSpec) -> dict[str, Any]:
    """What makes two specs the same network, experts and latent attention included."""
    return {
        "layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads,
        "kv_heads": None if spec.latent_attention else spec.kv_heads, "ffn": spec.ffn_size,
        "vocab": spec.vocab_size, "experts": spec.num_experts, "top_k": spec.top_k,
        "expert_ffn": spec.expert_ffn_size if spec.moe else None,
        "shared": spec.num_shared_experts, "dense": spec.dense_layers,
        "latent": (spec.kv_lora_rank, spec.q_lora_rank, spec.qk_nope_head_dim,
                   spec.qk_rope_head_dim, spec.v_head_dim),
        "params": spec.num_params(),
    }  # fmt: skip


MOE_PLANS = {
    "mixtral-like cp2 ep8": (TINY_MIXTRAL, {"dp": 4, "cp": 2, "ep": 8, "zero": 1}),
    "deepseek-like pp3 ep4": (TINY_MLA, {"dp": 8, "pp": 3, "ep": 4, "zero": 3,
                                         "num_microbatches": 3}),
    "tiny-moe hsdp ep2": ("tiny-moe", {"dp": 8, "dp_shard": 4, "ep": 2, "zero": 1}),
}  # fmt: skip


@pytest.mark.parametrize("target", ["megatron", "torchtitan==0.2", "torchtitan==0.3"])
@pytest.mark.parametrize("label", MOE_PLANS)
def test_moe_plans_come_back_with_their_experts_and_ep(label, target) -> None:
    model, strategy = MOE_PLANS[label]
    if target.startswith("torchtitan") and strategy["zero"] == 1:  # torchtitan runs ZeRO-2
        strategy = strategy | {"zero": 2}
    plan = moe_plan(model, **strategy)
    assert plan.model is not None
    try:
        text = export_plan(plan, target)
    except ExportError as error:  # torchtitan has no GQA model with shared experts
        assert target.startswith("torchtitan") and "num_shared_experts" in str(error)
        return
    check_round_trip(plan, target)
    framework = target.partition("==")[0]
    read = import_config(text, model=None if framework == "megatron" else plan.model,
                         cluster=plan.cluster).run  # fmt: skip
    assert read.strategy.ep == plan.strategy.ep > 1
    assert model_facts(read.model) == model_facts(plan.model)


def _megatron_moe_args(**changes: str | None) -> str:
    """The export of an ep8 Mixtral-like plan, options replaced (None: removed) or added."""
    plan = moe_plan(TINY_MIXTRAL, dp=8, ep=8, zero=1)
    lines = []
    for line in export_plan(plan, "megatron").splitlines():
        option = line.split(" ")[0]
        if option in changes:
            value = changes.pop(option)
            line = option if value == "" else f"{option} {value}" if value else ""
        lines.append(line)
    return "\n".join(lines + [f"{k} {v}".strip() for k, v in changes.items() if v is not None])


MEGATRON_MOE_REFUSALS = [
    ({"--expert-tensor-parallel-size": None, "--tensor-model-parallel-size": "2",
      "--sequence-parallel": "", "--expert-model-parallel-size": "1"},
     "--expert-tensor-parallel-size = 2: without expert parallelism the planner prices"),
    ({"--expert-tensor-parallel-size": "2", "--expert-model-parallel-size": "1"},
     "--expert-tensor-parallel-size = '2'"),
    ({"--moe-token-dispatcher-type": "allgather"},
     "--moe-token-dispatcher-type = 'allgather': the planner prices expert parallelism as "
     "all-to-all"),
    ({"--moe-token-dispatcher-type": "flex"},
     "--moe-flex-dispatcher-backend = None: the planner prices the flex dispatcher with "
     "deepep or hybridep"),
    ({"--moe-token-dispatcher-type": "flex", "--moe-flex-dispatcher-backend": "nccl"},
     "--moe-flex-dispatcher-backend = 'nccl'"),
    ({"--moe-token-dispatcher-type": "flex", "--moe-enable-deepep": "",
      "--expert-tensor-parallel-size": "2", "--tensor-model-parallel-size": "2",
      "--sequence-parallel": ""},
     "--expert-tensor-parallel-size = 2: the flex dispatcher folds expert tensor parallelism"),
    ({"--moe-router-pre-softmax": ""}, "--moe-router-pre-softmax = true"),
    ({"--moe-layer-freq": "'([1]*1+[0]*1)'"}, "--moe-layer-freq = '([1]*1+[0]*1)'"),
    ({"--moe-shared-expert-intermediate-size": "100"},
     "--moe-shared-expert-intermediate-size = '100'"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "message"), MEGATRON_MOE_REFUSALS)
def test_megatron_experts_other_than_ours_are_refused(changes, message) -> None:
    with pytest.raises(SpecError, match=re.escape(message) + r".*; \S"):
        import_config(_megatron_moe_args(**changes), cluster=GPU, gpus=8)


@pytest.mark.parametrize(
    "dispatcher",
    [
        {"--moe-enable-deepep": ""},
        {"--moe-flex-dispatcher-backend": "deepep"},
        {"--moe-flex-dispatcher-backend": "hybridep", "--moe-router-force-load-balancing": ""},
    ],
)
def test_megatron_flex_dispatcher_prices_deduplicated_tokens(dispatcher) -> None:
    """DeepEP and HybridEP send a token once per rank and node: ep_dedup, which moves
    fewer bytes than the all-to-all dispatcher's pairs where a rank holds several of the
    experts (ep 2: four of the eight)."""
    ep2 = {"--expert-model-parallel-size": "2"}
    flex = _megatron_moe_args(**ep2, **{"--moe-token-dispatcher-type": "flex", **dispatcher})
    run = import_config(flex, cluster=GPU, gpus=8).run
    plain = import_config(_megatron_moe_args(**ep2), cluster=GPU, gpus=8).run
    assert run.options.ep_dedup and not plain.options.ep_dedup
    assert run.strategy == plain.strategy
    deduplicated, pairs = estimate_run(run), estimate_run(plain)
    assert 0 < deduplicated.breakdown_s["comm_ep"] < pairs.breakdown_s["comm_ep"]


def test_torchtitan_deepep_and_round_robin_routing_are_priced() -> None:
    """``expert_parallel_comm_backend = deepep``: ep_dedup; ``debug.moe_force_load_balance``:
    torchtitan's round-robin experts (contiguous), which a deduplicating dispatch sends
    to fewer ranks than random ones."""
    plan = moe_plan(TINY_MIXTRAL, dp=8, ep=2, zero=2)
    text = export_plan(plan, "torchtitan==0.3")
    backend = "--parallelism.expert_parallel_comm_backend deepep"
    runs = {
        name: import_config(text + extra, model=plan.model, cluster=plan.cluster).run
        for name, extra in [
            ("standard", ""), ("deepep", f"\n{backend}\n"),
            ("round robin", f"\n{backend}\n--debug.moe_force_load_balance\n"),
        ]
    }  # fmt: skip
    options = {
        name: (run.options.ep_dedup, run.options.expert_choice) for name, run in runs.items()
    }
    assert options == {
        "standard": (False, ExpertChoice.RANDOM), "deepep": (True, ExpertChoice.RANDOM),
        "round robin": (True, ExpertChoice.CONTIGUOUS),
    }  # fmt: skip
    comm = [estimate_run(run).breakdown_s["comm_ep"] for run in runs.values()]
    assert comm[0] > comm[1] > comm[2] > 0


def test_megatron_moe_defaults_are_megatrons() -> None:
    """No --moe-ffn-hidden-size: the dense width; no --moe-router-topk: 2; no
    --moe-layer-freq: experts in every block; --moe-layer-freq 1 alike."""
    text = _megatron_moe_args(**{"--moe-ffn-hidden-size": None, "--moe-router-topk": None,
                                 "--moe-layer-freq": "1"})  # fmt: skip
    model = import_config(text, cluster=GPU, gpus=8).run.model
    assert (model.top_k, model.expert_ffn_size, model.dense_layers) == (2, model.ffn_size, 0)


def test_qwen3_heads_round_trip_through_megatron(tmp_path):
    """Heads wider than hidden / heads and per-head q/k norms export as --kv-channels and
    --qk-layernorm and import back as the same preset."""
    from planner.export.megatron import to_megatron

    plan = moe_plan("qwen3-30b-a3b", dp=8, ep=8, zero=1)
    text = to_megatron(plan)
    assert "--kv-channels 128" in text and "--qk-layernorm" in text
    path = tmp_path / "qwen3.args"
    path.write_text(text)
    run = import_config(path, cluster=GPU, gpus=8).run
    assert run.model.name == "qwen3-30b-a3b"
    assert (run.model.head_dim, run.model.qk_norm, run.strategy.ep) == (128, True, 8)


def test_megatron_fp8_is_transformer_engines_with_its_weights_gathered_in_fp8() -> None:
    fp8 = MEGATRON_SHELL.replace("--bf16", "--bf16 --fp8-format hybrid")
    run = import_config(fp8, cluster=GPU).run
    assert run.training.dtype is DType.FP8 and run.options.fp8_linear.value == "te"
    assert not run.options.fp8_param_gather
    gathered = import_config(fp8 + " --fp8-param-gather", cluster=GPU).run
    assert gathered.options.fp8_param_gather
    assert estimate_run(gathered).peak_memory_gib < estimate_run(run).peak_memory_gib
    assert run.options.fp8_scaling.value == "delayed"  # Megatron's default recipe
    current = import_config(fp8 + " --fp8-recipe tensorwise", cluster=GPU).run
    assert current.options.fp8_scaling.value == "dynamic"  # an amax pass before each cast
    assert estimate_run(current).step_time_s > estimate_run(run).step_time_s
    with pytest.raises(SpecError, match="--fp8-recipe = 'mxfp8': the planner prices per-tensor"):
        import_config(fp8 + " --fp8-recipe mxfp8", cluster=GPU)


def test_torchtitan_prices_its_optimizers_implementation() -> None:
    """torchtitan's default AdamW is fused; a config may ask for another."""
    assert import_config(TOML, cluster=GPU, gpus=16).run.options.optimizer_impl.value == "fused"
    text = TOML + '\n[optimizer]\nimplementation = "foreach"\n'
    run = import_config(text, cluster=GPU, gpus=16).run
    assert run.options.optimizer_impl.value == "foreach"
    with pytest.raises(SpecError, match=r"optimizer.implementation = 'apex'.*use one of for-loop"):
        import_config(text.replace('"foreach"', '"apex"'), cluster=GPU, gpus=16)


def test_a_hugging_face_deepspeed_config_names_every_auto_value_it_needs_at_once() -> None:
    """The Trainer's "auto" values: those priced are listed together (a tester fixed them
    one run at a time); the optimizer's hyperparameters and the schedule's price nothing."""
    config = {
        "bf16": {"enabled": "auto"}, "train_batch_size": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        "zero_optimization": {"stage": 3},
    }  # fmt: skip
    with pytest.raises(SpecError) as info:
        import_config(json.dumps(config), model="tiny-llama", cluster=GPU, gpus=8)
    message = str(info.value)
    assert "bf16.enabled = 'auto'" in message and "write the values the run uses" in message
    assert "train_batch_size, gradient_clipping" in message
    assert "optimizer.params" not in message and "scheduler" not in message
    fixed = {**config, "bf16": {"enabled": True}, "train_batch_size": 64, "gradient_clipping": 1.0}
    assert import_config(json.dumps(fixed), model="tiny-llama", cluster=GPU, gpus=8).run


# --- from a tester who brought the configs these frameworks' users write ----------------


MEGATRON_RULES = [  # what Megatron-LM itself refuses: its config describes no run
    ({"--expert-model-parallel-size": "3"}, "ep(3) does not divide num_experts (8)"),
    ({"--tensor-model-parallel-size": "2", "--expert-tensor-parallel-size": "1"},
     "megatron would not run this: strategy.sequence_parallel = False: Megatron-LM's MoE "
     "layer refuses"),
    ({"--bf16": None, "--fp16": ""},
     "megatron would not run this: training.dtype = 'fp16': Megatron-LM refuses expert "
     "parallelism (ep 8) with fp16"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "message"), MEGATRON_RULES)
def test_a_megatron_config_megatron_refuses_is_refused(changes, message) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        import_config(_megatron_moe_args(**changes), cluster=GPU, gpus=8)


@pytest.mark.parametrize(("batch", "refused"), [(3, True), (1, True), (8, False)])
def test_megatron_interleaving_needs_micro_batches_in_groups_of_pp(batch, refused) -> None:
    """Megatron-Core's interleaved schedule takes micro-batches in groups of pp and raises
    on fewer or a remainder (forward_backward_pipelining_with_interleaving)."""
    text = (
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 1 --micro-batch-size 1 "
        f"--global-batch-size {batch} --bf16"
    )
    if refused:
        with pytest.raises(
            SpecError,
            match=r"strategy.num_microbatches = \d+: Megatron-LM's "
            r"interleaved schedule runs micro-batches in groups",
        ):
            import_config(text, model="tiny-llama", cluster=GPU, gpus=2)
    else:
        run = import_config(text, model="tiny-llama", cluster=GPU, gpus=2).run
        assert run.strategy.schedule is Schedule.INTERLEAVED_1F1B


def test_torchtitan_02_runs_no_context_parallelism_for_deepseek_v3() -> None:
    """torchtitan 0.2's deepseek_v3 flavors run FlexAttention, which its context
    parallelism refuses: the search keeps cp at 1 for it, a pinned cp says why, and its
    job config (671B, read as the deepseek-v3 preset) is refused."""
    toml = (
        '[model]\nname = "deepseek_v3"\nflavor = "671B"\n[parallelism]\n'
        "data_parallel_shard_degree = 128\ncontext_parallel_degree = 2\nexpert_parallel_degree = 8"
    )
    with pytest.raises(SpecError, match=r"torchtitan==0.2 would not run this: strategy.cp = 2:"
                                        r".*FlexAttention"):  # fmt: skip
        import_config(toml, cluster=GPU)
    run = import_config(toml.replace("context_parallel_degree = 2", ""), cluster=GPU, gpus=128).run
    assert run.model.name == "deepseek-v3" and run.strategy.ep == 8
    cluster, training = Cluster(gpu=GPU, num_gpus=16), Training(global_batch_size=16)
    handle = resolve_model(TINY_MLA)
    with pytest.raises(PlannerError, match=r"cp\(2\): torchtitan==0.2 builds this model as"):
        make_plan(handle, cluster, training, pins=Pins(cp=2), target="torchtitan==0.2")
    assert make_plan(handle, cluster, training, pins=Pins(cp=2), target="torchtitan==0.3")


def test_a_file_with_nothing_to_read_is_refused(tmp_path) -> None:
    """An empty file, or another framework's read with --format, priced nothing but
    defaults before."""
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing\n")
    with pytest.raises(SpecError, match=r"empty\.toml is empty"):
        import_config(empty, model="tiny-llama", cluster=GPU, gpus=8)
    megatron = "--tensor-model-parallel-size 2\n--micro-batch-size 1\n"
    with pytest.raises(
        SpecError,
        match=r"read as torchtitan gave none of its keys "
        r"\(tensor_model_parallel_size, micro_batch_size\)",
    ):
        import_config(megatron, format="torchtitan", model="tiny-llama", cluster=GPU, gpus=8)


@pytest.mark.parametrize(
    ("format", "text", "key", "meant"),
    [
        ("torchtitan", "[parallelism]\ntensor_paralel_degree = 8",
         "parallelism.tensor_paralel_degree", "parallelism.tensor_parallel_degree"),
        ("torchtitan", "--parallelism.tensor_parallel_degree 2\n--parallelism.tensor_paralel_degree 4",
         "parallelism.tensor_paralel_degree", "parallelism.tensor_parallel_degree"),
        ("megatron", "--tensor-model-paralel-size 2 --micro-batch-size 1",
         "--tensor-model-paralel-size", "--tensor-model-parallel-size"),
    ],
)  # fmt: skip
def test_a_misspelt_key_is_refused_with_the_key_meant(format, text, key, meant) -> None:
    """A typo left a degree at its default, priced without a word but "not read"."""
    with pytest.raises(SpecError, match=rf"{re.escape(key)} = .*: {format} has no such key; "
                                        rf"did you mean {re.escape(meant)}\?"):  # fmt: skip
        import_config(text, format=format, model="tiny-llama", cluster=GPU, gpus=8)


def test_unread_keys_are_listed_whole_and_not_taken_for_misspellings() -> None:
    """Keys the planner does not read, close to ones it does but not near-misses
    (pipeline_parallel_schedule beside pipeline_parallel_schedule_csv), stay unread."""
    keys = [f"metrics.key_{n}" for n in range(20)]
    text = (
        '[parallelism]\ndata_parallel_shard_degree = 8\npipeline_parallel_schedule = "1F1B"\n[metrics]\n'
        + "\n".join(f"{key.split('.')[1]} = 1" for key in keys)
    )
    imported = import_config(text, model="tiny-llama", cluster=GPU, gpus=8)
    (listed,) = [line for line in imported.describe() if line.startswith("not read: ")]
    assert listed == "not read: " + ", ".join(["parallelism.pipeline_parallel_schedule", *keys])


@pytest.mark.parametrize(("kind", "priced"), [("p2p", "ring"), ("allgather", "all-gather"),
                                              ("a2a", None), ("a2a+p2p", None)])  # fmt: skip
def test_megatron_context_parallel_communication_is_priced_or_refused(kind, priced) -> None:
    text = f"--context-parallel-size 2 --cp-comm-type {kind} --micro-batch-size 1 --bf16"
    if priced is None:
        with pytest.raises(SpecError, match=rf"--cp-comm-type = '{re.escape(kind)}': the planner "
                                            "prices one context-parallel kind"):  # fmt: skip
            import_config(text, model="tiny-llama", cluster=GPU, gpus=8)
    else:
        run = import_config(text, model="tiny-llama", cluster=GPU, gpus=8).run
        assert run.options.cp_attention.value == priced


def test_torchtitan_flavors_that_are_no_preset_take_the_model_option() -> None:
    toml = '[model]\nname = "deepseek_v3"\nflavor = "16B"\n'
    with pytest.raises(
        SpecError,
        match=r"deepseek_v3 16B is no zoo preset \(known deepseek_v3 "
        r"flavors: 671B\); use one, or give --model",
    ):
        import_config(toml, cluster=GPU, gpus=8)
    assert import_config(toml, model=TINY_MLA, cluster=GPU, gpus=8).run.model.name == "tiny-mla"
    with pytest.raises(SpecError, match=r"models with known flavors: deepseek_v3, llama3, qwen3"):
        import_config('[model]\nname = "llama4"\nflavor = "17bx16e"\n', cluster=GPU, gpus=8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[model]\nconverters = ["float8"]', "'float8' is torchtitan 0.1's name"),
        ("[float8]\nenable_fsdp_float8_all_gather = true", "[float8] is torchtitan 0.1's table"),
        ("[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true",
         "quantize.linear.float8.enable_fsdp_float8_all_gather = true: fp8 weight gathers are "
         "not priced"),
    ],
)  # fmt: skip
def test_torchtitan_fp8_is_read_with_02s_names(text, message) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        import_config(text, model="tiny-llama", cluster=GPU, gpus=8)


def test_what_the_config_leaves_open_is_said_and_kept_in_json(tmp_path, capsys) -> None:
    """A DeepSpeed config states no sequence length: the note says which was priced, and
    --json carries what was read and the run config priced."""
    path = tmp_path / "ds_config.json"
    path.write_text(export_plan(plan_for(dp=8, zero=2), "deepspeed"))
    argv = ["estimate", "--from", str(path), "--model", "tiny-llama"]
    assert main(argv) == 0
    seq = get_preset("tiny-llama").seq_len
    assert f"note: sequence length {seq}, the model's: the config states none" in (
        capsys.readouterr().err
    )
    assert main([*argv, "--seq", "64", "--json"]) == 0
    read = json.loads(capsys.readouterr().out)["read"]
    assert read["format"] == "deepspeed" and "zero_optimization.stage" in read["used"]
    assert read["notes"][-1] == "sequence length 64 (--seq)"
    assert RunConfig.from_dict(read["run"]).strategy.zero == 2


def test_partial_recompute_is_labelled_and_replanning_names_ep_changes() -> None:
    strategy = Strategy(dp=8, zero=1, recompute="full", recompute_blocks=2)
    assert strategy.describe().endswith("recompute=full(first 2 blocks/chunk)")
    staged = Strategy(pp=2, recompute_per_stage=("full", "none"), num_microbatches=2)
    assert "recompute=full,none" in staged.describe()
    before = Strategy(dp=8, zero=1, ep=8, etp=2, tp=2, sequence_parallel=True)
    after = before.model_copy(update={"etp": 1})
    assert describe_changes(before, after) == "etp 2 -> 1"


def test_a_launch_scripts_shell_variable_is_refused() -> None:
    text = (
        "torchrun --nproc_per_node $GPUS_PER_NODE --nnodes 2 pretrain_gpt.py --micro-batch-size 1"
    )
    with pytest.raises(SpecError, match=r"--nproc_per_node = '\$GPUS_PER_NODE': a shell variable"):
        import_config(text, model="tiny-llama", cluster=GPU)
