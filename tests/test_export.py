"""``plan export``: plans as torchtitan TOML (0.2) or overrides (0.3), Megatron-LM
arguments and DeepSpeed JSON.

Every export is parsed and checked against the option names each framework release
defines (held here, no framework installed; ``tests/test_export_parsers.py`` feeds them
to the frameworks' own parsers) and for values that agree with the plan; what a target
cannot express must be refused naming the plan field.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import re
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import planner.export
from planner.assemble import assemble_plan
from planner.cli import main
from planner.errors import ExportError, SpecError
from planner.export import export_plan, to_deepspeed, to_megatron, to_torchtitan
from planner.models import ModelHandle, get_preset, resolve_model
from planner.planning import make_plan
from planner.solve.search import Pins
from planner.spec import (
    Cluster,
    Compression,
    CompressionKind,
    DType,
    ModelSpec,
    ModuleTP,
    Optimizer,
    Plan,
    RecomputeMode,
    Schedule,
    Strategy,
    TPStyle,
    Training,
)

GPU = "h100-sxm-80gb"

# torchtitan 0.2.2 torchtitan/config/job_config.py: the options of each table.
TORCHTITAN_OPTIONS = {
    "parallelism": {
        "data_parallel_replicate_degree", "enable_compiled_autograd",
        "data_parallel_shard_degree", "fsdp_reshard_after_forward", "tensor_parallel_degree",
        "disable_loss_parallel", "enable_async_tensor_parallel", "pipeline_parallel_degree",
        "pipeline_parallel_split_points", "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
        "context_parallel_degree", "context_parallel_rotate_method", "expert_parallel_degree",
        "expert_tensor_parallel_degree",
    },
    "training": {
        "dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len",
        "max_norm", "steps", "enable_cpu_offload", "mixed_precision_param",
        "mixed_precision_reduce", "compile", "gc_freq", "gc_debug", "seed", "deterministic",
    },
    "activation_checkpoint": {
        "mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
    },
    "optimizer": {
        "name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation",
        "early_step_in_backward",
    },
    "model": {"name", "flavor", "tokenizer_path", "converters", "print_after_conversion"},
}  # fmt: skip
TORCHTITAN_CHOICES = {
    ("parallelism", "fsdp_reshard_after_forward"): {"default", "always", "never"},
    # torch.distributed.pipelining schedule names torchtitan resolves
    ("parallelism", "pipeline_parallel_schedule"): {
        "1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
        "LoopedBFS", "DualPipeV",
    },
    ("training", "mixed_precision_param"): {"bfloat16", "float32"},
    ("training", "mixed_precision_reduce"): {"float32"},
    ("activation_checkpoint", "mode"): {"selective", "full", "none"},
    ("optimizer", "name"): {"Adam", "AdamW"},
}  # fmt: skip
# torchtitan 0.3.0 Trainer.Config (torchtitan/trainer.py, torchtitan/config/configs.py):
# the overrides the export writes, and the activation-checkpoint subcommands.
TORCHTITAN_03_OPTIONS = {
    "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.fsdp_reshard_after_forward", "parallelism.tensor_parallel_degree",
    "parallelism.enable_sequence_parallel", "parallelism.no_enable_sequence_parallel",
    "parallelism.context_parallel_degree", "parallelism.pipeline_parallel_degree",
    "parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size",
    "parallelism.module_fqns_per_model_part", "compile.no_enable_async_tensor_parallel",
    "training.local_batch_size", "training.global_batch_size", "training.seq_len",
    "training.max_norm", "training.mixed_precision_param", "training.mixed_precision_reduce",
    "training.disable_cuda_graphs", "optimizer.param_groups.0.optimizer_name",
    "parallelism.expert_parallel_degree",
}  # fmt: skip
TORCHTITAN_03_SUBCOMMANDS = {
    "activation-checkpoint:" + mode for mode in ("none", "selective", "full")
}

# megatron/training/arguments.py (Megatron-LM core_v0.14.0 to core_v0.16.1): option ->
# number of values and, where the parser restricts them, the choices.
MEGATRON_OPTIONS: dict[str, tuple[int, set[str] | None]] = {
    "--tensor-model-parallel-size": (1, None),
    "--pipeline-model-parallel-size": (1, None),
    "--context-parallel-size": (1, None),
    "--sequence-parallel": (0, None),
    "--num-layers-per-virtual-pipeline-stage": (1, None),
    "--decoder-first-pipeline-num-layers": (1, None),
    "--decoder-last-pipeline-num-layers": (1, None),
    "--pipeline-model-parallel-layout": (1, None),
    "--micro-batch-size": (1, None),
    "--global-batch-size": (1, None),
    "--seq-length": (1, None),
    "--num-layers": (1, None),
    "--hidden-size": (1, None),
    "--ffn-hidden-size": (1, None),
    "--num-attention-heads": (1, None),
    "--group-query-attention": (0, None),
    "--num-query-groups": (1, None),
    "--max-position-embeddings": (1, None),
    "--vocab-size": (1, None),
    "--make-vocab-size-divisible-by": (1, None),
    "--norm-epsilon": (1, None),
    "--attention-dropout": (1, None),
    "--hidden-dropout": (1, None),
    "--normalization": (1, {"LayerNorm", "RMSNorm"}),
    "--position-embedding-type": (1, {"learned_absolute", "rope", "mrope", "relative", "none"}),
    "--rotary-base": (1, None),
    "--disable-bias-linear": (0, None),
    "--swiglu": (0, None),
    "--untie-embeddings-and-output-weights": (0, None),
    "--recompute-granularity": (1, {"full", "selective"}),
    "--recompute-method": (1, {"uniform", "block"}),
    "--recompute-num-layers": (1, None),
    "--use-distributed-optimizer": (0, None),
    "--overlap-grad-reduce": (0, None),
    "--overlap-param-gather": (0, None),
    "--num-distributed-optimizer-instances": (1, None),
    "--use-megatron-fsdp": (0, None),
    "--data-parallel-sharding-strategy": (
        1, {"no_shard", "optim", "optim_grads", "optim_grads_params"}
    ),
    "--ckpt-format": (1, {"torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"}),
    "--bf16": (0, None),
    "--fp16": (0, None),
    "--fp8-format": (1, {"e4m3", "hybrid"}),
    "--grad-reduce-in-bf16": (0, None),
    "--accumulate-allreduce-grads-in-fp32": (0, None),
    "--optimizer": (1, {"adam", "sgd", "muon", "dist_muon"}),
    "--clip-grad": (1, None),
    # mixture of experts and multi-head latent attention (checked with core_v0.14.0,
    # core_v0.15.3 and core_v0.16.1's parse_args, validate_args and TransformerConfig)
    "--expert-model-parallel-size": (1, None),
    "--expert-tensor-parallel-size": (1, None),
    "--num-experts": (1, None),
    "--moe-router-topk": (1, None),
    "--moe-ffn-hidden-size": (1, None),
    "--moe-shared-expert-intermediate-size": (1, None),
    "--moe-layer-freq": (1, None),
    "--moe-router-score-function": (1, {"softmax", "sigmoid"}),
    "--moe-router-load-balancing-type": (
        1, {"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"}
    ),
    "--moe-grouped-gemm": (0, None),
    "--moe-token-dispatcher-type": (1, {"allgather", "alltoall", "flex"}),
    "--multi-latent-attention": (0, None),
    "--q-lora-rank": (1, None),
    "--kv-lora-rank": (1, None),
    "--qk-head-dim": (1, None),
    "--qk-pos-emb-head-dim": (1, None),
    "--v-head-dim": (1, None),
    "--rope-type": (1, {"rope", "yarn", "mrope"}),
}  # fmt: skip

# deepspeed/runtime/config.py and zero/config.py (DeepSpeed 0.18.9, 0.19.6, 0.19.8)
DEEPSPEED_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "zero_optimization", "bf16", "fp16", "communication_data_type",
    "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown", "prescale_gradients",
}  # fmt: skip
DEEPSPEED_ZERO_KEYS = {
    "stage", "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
    "reduce_bucket_size", "contiguous_gradients", "offload_param", "offload_optimizer",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "sub_group_size", "mics_shard_size",
    "mics_hierarchical_params_gather", "zero_hpz_partition_size",
}  # fmt: skip


@functools.cache
def _handle(name: str) -> ModelHandle:
    return resolve_model(name)


def plan_for(
    model: str = "tiny-llama",
    *,
    training: dict[str, Any] | None = None,
    stages: list[list[str]] | None = None,
    tp_layout: dict[str, ModuleTP] | None = None,
    **strategy_fields: Any,
) -> Plan:
    """A plan assembled for ``strategy_fields``, its global batch made to agree."""
    strategy = Strategy(**strategy_fields)
    batch = strategy.dp * strategy.micro_batch_size * strategy.num_microbatches
    cluster = Cluster(gpu=GPU, num_gpus=strategy.world_size)
    settings = Training(global_batch_size=batch, **(training or {}))
    return assemble_plan(
        _handle(model), cluster, settings, strategy, stages=stages, tp_layout=tp_layout
    )


@functools.cache
def searched_llama_plan() -> Plan:
    """llama3-8b on 64 H100s, the search pinned to every dimension at once."""
    pins = Pins(
        tp=4, pp=4, cp=2, zero=3, sequence_parallel=True, recompute=RecomputeMode.FULL,
        schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2, micro_batch_size=1,
    )  # fmt: skip
    cluster = Cluster(gpu=GPU, num_gpus=64)
    return make_plan(_handle("llama3-8b"), cluster, Training(global_batch_size=64), pins=pins)


def torchtitan_tables(plan: Plan) -> dict[str, Any]:
    """The 0.2 TOML export parsed, every option checked against torchtitan 0.2's names."""
    tables = tomllib.loads(export_plan(plan, "torchtitan==0.2"))
    for table, options in tables.items():
        assert set(options) <= TORCHTITAN_OPTIONS[table], table
        for option, value in options.items():
            choices = TORCHTITAN_CHOICES.get((table, option))
            assert choices is None or value in choices, (table, option, value)
    return tables


def torchtitan_overrides(plan: Plan) -> tuple[dict[str, list[str]], str]:
    """The 0.3 override export parsed: ``--key values`` checked against torchtitan 0.3's
    names, and the activation-checkpoint subcommand that ends it."""
    lines = [line for line in to_torchtitan(plan).splitlines() if not line.startswith("#")]
    *overrides, subcommand = lines
    assert subcommand in TORCHTITAN_03_SUBCOMMANDS
    options: dict[str, list[str]] = {}
    for line in overrides:
        option, *values = line.split(" ")
        assert option.removeprefix("--") in TORCHTITAN_03_OPTIONS and option not in options, line
        options[option] = values
    return options, subcommand


def megatron_args(plan: Plan) -> dict[str, list[str]]:
    """The argument export parsed, every option checked against Megatron's documented ones."""
    tokens = shlex.split(to_megatron(plan), comments=True)
    args: dict[str, list[str]] = {}
    while tokens:
        option = tokens.pop(0)
        assert option in MEGATRON_OPTIONS, option
        assert option not in args, f"{option} given twice"
        arity, choices = MEGATRON_OPTIONS[option]
        values, tokens = tokens[:arity], tokens[arity:]
        assert len(values) == arity and not any(v.startswith("--") for v in values), option
        assert choices is None or values[0] in choices, (option, values)
        args[option] = values
    return args


def deepspeed_json(text: str) -> dict[str, Any]:
    """The JSON of a DeepSpeed export, its ``//`` header lines (hjson comments) dropped."""
    return json.loads("".join(line for line in text.splitlines() if not line.startswith("//")))


def deepspeed_config(plan: Plan) -> dict[str, Any]:
    """The JSON export parsed, its keys checked against DeepSpeed's documented ones."""
    config = deepspeed_json(to_deepspeed(plan))
    assert set(config) <= DEEPSPEED_KEYS
    assert set(config["zero_optimization"]) <= DEEPSPEED_ZERO_KEYS
    assert set(config["bf16"]) == set(config["fp16"]) == {"enabled"}
    return config


def test_torchtitan_carries_every_dimension_of_a_searched_plan() -> None:
    plan = searched_llama_plan()
    strategy = plan.strategy
    tables = torchtitan_tables(plan)
    parallelism = tables["parallelism"]
    degrees = [
        parallelism[f"{name}_degree"]
        for name in (
            "data_parallel_replicate", "data_parallel_shard", "tensor_parallel",
            "pipeline_parallel", "context_parallel",
        )
    ]  # fmt: skip
    assert degrees == [1, 2, 4, 4, 2]
    assert math.prod(degrees) == plan.cluster.num_gpus == 64
    assert parallelism["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert parallelism["module_fqns_per_model_part"] == [list(chunk) for chunk in plan.stages]
    assert len(parallelism["module_fqns_per_model_part"]) == strategy.pp * 2
    assert parallelism["fsdp_reshard_after_forward"] == "always"
    training = tables["training"]
    micro = parallelism["pipeline_parallel_microbatch_size"]
    assert training["local_batch_size"] // micro == strategy.num_microbatches
    assert training["local_batch_size"] * strategy.dp == training["global_batch_size"] == 64
    assert training["seq_len"] == 8192
    assert training["mixed_precision_param"] == "bfloat16"
    assert tables["activation_checkpoint"] == {"mode": "full"}
    assert tables["optimizer"] == {"name": "AdamW"}


def test_megatron_carries_every_dimension_of_a_searched_plan() -> None:
    plan = searched_llama_plan()
    args = megatron_args(plan)
    tp, pp, cp = (
        int(args[f"--{name}-parallel-size"][0])
        for name in ("tensor-model", "pipeline-model", "context")
    )
    dp = plan.cluster.num_gpus // (tp * pp * cp)
    assert (dp, tp, pp, cp) == (2, 4, 4, 2)
    micro, batch = int(args["--micro-batch-size"][0]), int(args["--global-batch-size"][0])
    assert batch == micro * dp * plan.strategy.num_microbatches == 64
    per_chunk = int(args["--num-layers-per-virtual-pipeline-stage"][0])
    assert per_chunk * pp * plan.strategy.virtual_stages == int(args["--num-layers"][0]) == 32
    assert "--sequence-parallel" in args
    assert args["--num-query-groups"] == ["8"] and args["--ffn-hidden-size"] == ["14336"]
    assert args["--rotary-base"] == ["500000"] and args["--normalization"] == ["RMSNorm"]
    assert args["--recompute-granularity"] == ["full"]
    assert args["--recompute-method"] == ["uniform"] and args["--recompute-num-layers"] == ["1"]
    assert args["--data-parallel-sharding-strategy"] == ["optim_grads_params"]
    assert "--bf16" in args and "--grad-reduce-in-bf16" not in args


def test_deepspeed_batch_sizes_multiply_to_the_global_batch() -> None:
    plan = plan_for(dp=8, zero=2, micro_batch_size=2, num_microbatches=4)
    config = deepspeed_config(plan)
    assert config["train_batch_size"] == 64
    assert (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 8
        == config["train_batch_size"]
    )
    # the reduction overlaps backward as priced (DeepSpeed's default: stage 3 only)
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["communication_data_type"] == "fp32"
    assert config["gradient_clipping"] == 1.0


def test_deepspeed_maps_compression_dtype_and_hybrid_zero3() -> None:
    compression = Compression(kind=CompressionKind.FP16)
    plan = plan_for(
        dp=16, zero=3, dp_shard=8, compression=compression, training={"dtype": DType.FP16}
    )
    text = export_plan(plan, "deepspeed==0.19.6")
    config = deepspeed_json(text)
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True, "mics_shard_size": 8}
    # MiCS_Optimizer asserts a model built under MiCS_Init; the header says so (a tester)
    assert "deepspeed.zero.MiCS_Init(config_dict_or_path=FILE)" in text.splitlines()[1]
    assert "pass the plan's adamw to deepspeed.initialize(optimizer=...)" in text
    with pytest.raises(
        ExportError, match=re.escape("MiCS, which sharded in groups, was removed in 0.19.7")
    ):
        export_plan(plan, "deepspeed==0.19.8")
    assert config["fp16"] == {"enabled": True} and config["bf16"] == {"enabled": False}
    assert config["communication_data_type"] == "fp16"


def test_torchtitan_hybrid_sharding_zero_bubble_and_full_recompute() -> None:
    """Zero-bubble with full recompute, as torchtitan's own zero-bubble tests run it
    (selective recompute allows one backward pass; zero-bubble runs two)."""
    plan = plan_for(
        dp=4, zero=2, dp_shard=2, pp=2, schedule=Schedule.ZERO_BUBBLE, num_microbatches=4,
        micro_batch_size=2, recompute=RecomputeMode.FULL, training={"grad_clip": False},
    )  # fmt: skip
    tables = torchtitan_tables(plan)
    parallelism = tables["parallelism"]
    assert parallelism["data_parallel_replicate_degree"] == 2
    assert parallelism["data_parallel_shard_degree"] == 2
    assert parallelism["fsdp_reshard_after_forward"] == "never"
    assert parallelism["pipeline_parallel_schedule"] == "InterleavedZeroBubble"
    assert tables["training"]["local_batch_size"] == 8
    assert tables["training"]["max_norm"] == math.inf
    assert tables["activation_checkpoint"] == {"mode": "full"}


def test_torchtitan_without_pipelining_accumulates_micro_batches() -> None:
    plan = plan_for(dp=8, zero=3, micro_batch_size=2, num_microbatches=3, training={"dtype": "fp8"})
    tables = torchtitan_tables(plan)
    training = tables["training"]
    steps = training["global_batch_size"] // (training["local_batch_size"] * 8)
    assert (training["local_batch_size"], steps) == (2, 3)
    assert "pipeline_parallel_schedule" not in tables["parallelism"]
    assert tables["model"] == {"converters": ["quantize.linear.float8"]}
    with pytest.raises(
        ExportError, match=re.escape("training.dtype = 'fp8': torchtitan 0.3 converts")
    ):
        export_plan(plan, "torchtitan==0.3")


def test_torchtitan_03_writes_overrides_with_its_own_names() -> None:
    plan = searched_llama_plan()
    options, subcommand = torchtitan_overrides(plan)
    assert subcommand == "activation-checkpoint:full"
    degrees = [
        int(options[f"--parallelism.{name}_degree"][0])
        for name in ("data_parallel_shard", "tensor_parallel", "pipeline_parallel", "context_parallel")
    ]  # fmt: skip
    assert degrees == [2, 4, 4, 2]
    chunks = [chunk.split(",") for chunk in options["--parallelism.module_fqns_per_model_part"]]
    assert chunks[-1][-2:] == ["norm", "lm_head"]  # 0.3's head; the plan (and 0.2) say output
    renamed = [["lm_head" if fqn == "output" else fqn for fqn in chunk] for chunk in plan.stages]
    assert chunks == renamed
    assert "--training.disable_cuda_graphs" in options  # CUDA graphs refuse pipelining
    assert "--parallelism.enable_sequence_parallel" in options
    assert options["--optimizer.param_groups.0.optimizer_name"] == ["AdamW"]
    header = to_torchtitan(plan).splitlines()[1]
    assert header.startswith("# target: torchtitan==0.3: command-line overrides")


def test_torchtitan_03_runs_tensor_parallelism_without_sequence_parallelism() -> None:
    plan = plan_for(dp=2, zero=3, tp=2)
    options, _ = torchtitan_overrides(plan)
    assert "--parallelism.no_enable_sequence_parallel" in options
    assert "--training.disable_cuda_graphs" not in options
    with pytest.raises(ExportError, match=re.escape("strategy.sequence_parallel = False")):
        export_plan(plan, "torchtitan==0.2")


def test_megatron_hybrid_fsdp_and_launch_environment() -> None:
    hybrid = plan_for(dp=8, zero=3, dp_shard=4, tp=2, sequence_parallel=True)
    text = export_plan(hybrid, "megatron==0.14")
    args = megatron_args(hybrid)
    assert args["--data-parallel-sharding-strategy"] == ["optim_grads_params"]
    assert args["--num-distributed-optimizer-instances"] == ["2"]
    assert "# target: megatron==0.14: pretrain_gpt.py arguments" in text
    assert "# env: CUDA_DEVICE_MAX_CONNECTIONS unset or above 1" in text  # Megatron-FSDP
    tp = to_megatron(plan_for(dp=2, zero=1, tp=2, sequence_parallel=True))
    assert "# env: CUDA_DEVICE_MAX_CONNECTIONS=1 (validate_args requires it" in tp
    assert "# env: none" in to_megatron(plan_for(dp=2, zero=1))


def test_megatron_uneven_split_uses_first_and_last_stage_layers() -> None:
    stages = [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2", "layers.3", "norm", "output"],
    ]
    args = megatron_args(plan_for(pp=2, num_microbatches=4, stages=stages))
    assert args["--decoder-first-pipeline-num-layers"] == ["1"]
    assert args["--decoder-last-pipeline-num-layers"] == ["3"]
    assert "--num-layers-per-virtual-pipeline-stage" not in args


def test_megatron_uneven_virtual_split_uses_the_layout_string() -> None:
    stages = [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2"],
        ["layers.3"],
        ["norm", "output"],
    ]
    plan = plan_for(
        pp=2, virtual_stages=2, schedule=Schedule.INTERLEAVED_1F1B, num_microbatches=4,
        stages=stages,
    )  # fmt: skip
    assert megatron_args(plan)["--pipeline-model-parallel-layout"] == ["Ett|t|t|L"]
    swapped = (stages[0], stages[2], stages[1], stages[3])
    with pytest.raises(ExportError, match=r"plan.stages\[1\] = .*'layers.3' breaks"):
        to_megatron(plan.model_copy(update={"stages": tuple(tuple(c) for c in swapped)}))


def test_megatron_data_parallel_precision_and_block_recompute() -> None:
    hybrid = plan_for(dp=8, zero=1, dp_shard=4, recompute=RecomputeMode.FULL, recompute_blocks=2)
    args = megatron_args(hybrid)
    assert "--use-distributed-optimizer" in args
    assert args["--num-distributed-optimizer-instances"] == ["2"]
    assert args["--recompute-method"] == ["block"] and args["--recompute-num-layers"] == ["2"]
    compressed = plan_for(dp=8, zero=2, compression=Compression(kind=CompressionKind.BF16))
    args = megatron_args(compressed)
    assert args["--data-parallel-sharding-strategy"] == ["optim_grads"]
    assert "--grad-reduce-in-bf16" in args
    fp16 = megatron_args(plan_for(dp=8, training={"dtype": DType.FP16}))
    assert "--fp16" in fp16 and "--accumulate-allreduce-grads-in-fp32" in fp16
    gpt = megatron_args(plan_for("tiny-gpt", dp=2, tp=2, sequence_parallel=True))
    assert gpt["--normalization"] == ["LayerNorm"] and "--swiglu" not in gpt
    assert "--disable-bias-linear" not in gpt


REFUSALS = [
    ("deepspeed", {"tp": 2}, {}, "strategy.tp = 2"),
    ("deepspeed", {"pp": 2, "num_microbatches": 2}, {}, "strategy.pp = 2"),
    ("deepspeed", {"dp": 2, "cp": 2, "zero": 3}, {}, "strategy.cp = 2"),
    ("deepspeed", {"dp": 2, "recompute": RecomputeMode.FULL}, {}, "strategy.recompute = 'full'"),
    ("deepspeed", {"dp": 8, "zero": 2, "dp_shard": 4}, {}, "strategy.dp_shard = 4"),
    ("deepspeed", {"dp": 2}, {"dtype": DType.FP8}, "training.dtype = 'fp8'"),
    ("torchtitan", {"dp": 2}, {"dtype": DType.FP16}, "training.dtype = 'fp16'"),
    ("torchtitan", {"dp": 2, "zero": 3, "compression": Compression(kind=CompressionKind.BF16)},
     {}, "strategy.compression.kind = 'bf16'"),
    ("torchtitan==0.2", {"dp": 2, "zero": 3, "tp": 2}, {}, "strategy.sequence_parallel = False"),
    ("torchtitan", {"dp": 2, "tp": 2, "sequence_parallel": True}, {}, "strategy.zero = 0"),
    ("torchtitan", {"cp": 2}, {}, "strategy.zero = 0"),
    ("torchtitan", {"dp": 2, "zero": 1}, {}, "strategy.zero = 1"),  # it runs ZeRO-2
    ("torchtitan", {"tp": 2, "sequence_parallel": True, "zero": 1}, {}, "training.dtype = 'bf16'"),
    ("torchtitan", {"dp": 2}, {"optimizer": Optimizer.SGD}, "training.optimizer = 'sgd'"),
    ("torchtitan", {"dp": 2, "recompute": RecomputeMode.FULL, "recompute_blocks": 1}, {},
     "strategy.recompute_blocks = 1"),
    ("torchtitan", {"dp": 2, "zero": 3, "pp": 2, "num_microbatches": 2,
                    "recompute_per_stage": (RecomputeMode.FULL, RecomputeMode.NONE)}, {},
     "strategy.recompute_per_stage = ('full', 'none')"),
    ("megatron", {"pp": 2, "num_microbatches": 2, "schedule": Schedule.GPIPE}, {},
     "strategy.schedule = 'gpipe'"),
    ("megatron", {"pp": 2, "num_microbatches": 2, "schedule": Schedule.ZERO_BUBBLE}, {},
     "strategy.schedule = 'zero-bubble'"),
    ("megatron", {"dp": 2}, {"optimizer": Optimizer.ADAM}, "training.optimizer = 'adam'"),
    ("megatron", {"dp": 2, "zero": 3, "compression": Compression(kind=CompressionKind.FP16)},
     {}, "strategy.compression.kind = 'fp16'"),
    ("megatron", {"dp": 2, "recompute": RecomputeMode.SELECTIVE, "recompute_blocks": 1}, {},
     "strategy.recompute_blocks = 1"),
]  # fmt: skip


@pytest.mark.parametrize(("target", "strategy", "training", "field"), REFUSALS)
def test_refuses_what_the_target_cannot_express(
    target: str, strategy: dict[str, Any], training: dict[str, Any], field: str
) -> None:
    plan = plan_for(training=training, **strategy)
    framework = target.partition("==")[0]
    with pytest.raises(ExportError, match=f"cannot export to {framework}: ") as info:
        export_plan(plan, target)
    assert field in str(info.value)


@pytest.mark.parametrize("target", ["torchtitan", "megatron", "deepspeed"])
def test_every_target_refuses_hook_only_compression(target: str) -> None:
    for compression, zero in (
        (Compression(kind=CompressionKind.POWERSGD, rank=4), 0),
        (Compression(kind=CompressionKind.LOCAL_SGD, period=4, local_group=2), 0),
        (Compression(kind=CompressionKind.INT8), 3),
    ):
        plan = plan_for(dp=4, zero=zero, compression=compression)
        with pytest.raises(ExportError, match=f"strategy.compression.kind = '{compression.kind}'"):
            export_plan(plan, target)


def test_a_traced_model_exports_only_where_the_framework_takes_your_model() -> None:
    """torchtitan and Megatron-LM build their own transformer from a description a traced
    plan lacks (its experts, their count and parallel degree would be dropped): refused as
    ``plan --for`` refuses them; DeepSpeed runs your module."""
    handle = resolve_model("tests.user_models:gpt")
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    plan = make_plan(handle, cluster, Training(global_batch_size=4, seq_len=16), pins=Pins(dp=2))
    for target in ("torchtitan==0.2", "torchtitan==0.3", "megatron"):
        with pytest.raises(ExportError, match=r"model = 'a traced module'.*plan a zoo preset"):
            export_plan(plan, target)
    assert '"train_batch_size": 4' in export_plan(plan, "deepspeed")


def test_a_refusal_names_only_frameworks_that_run_the_plan_as_it_is() -> None:
    """DeepSpeed refuses tp: a zoo plan at tp 2 over nothing sharded runs on Megatron-LM
    (torchtitan's mixed precision comes with FSDP: it would train in fp32), a traced one
    on none of the frameworks that build their own transformer, only on this runtime."""
    with pytest.raises(ExportError) as zoo:
        export_plan(plan_for(tp=2), "deepspeed")
    assert str(zoo.value).endswith(
        "re-plan with --tp 1 --pp 1 --cp 1, or export it to megatron as it is"
    )
    handle = resolve_model("tests.user_models:gpt")
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    traced = make_plan(handle, cluster, Training(global_batch_size=4, seq_len=16), pins=Pins(tp=2))
    with pytest.raises(ExportError) as own:
        export_plan(traced, "deepspeed")
    assert str(own.value).endswith(
        "or run it as it is with this runtime (plan run, planner.parallelize)"
    )


def test_megatron_refuses_a_non_megatron_layout_and_encoders() -> None:
    plan = plan_for(tp=2, sequence_parallel=True)
    wo = plan.tp_layout["layers.*.attention.wo"].model_copy(update={"style": TPStyle.COLWISE})
    layout = plan.tp_layout | {"layers.*.attention.wo": wo}
    with pytest.raises(ExportError, match=r"plan.tp_layout\['layers.\*.attention.wo'\]"):
        to_megatron(plan.model_copy(update={"tp_layout": layout}))
    with pytest.raises(ExportError, match=r"plan\.model\.family = 'encoder'"):
        to_megatron(plan_for("bert-base", dp=2))


def test_per_head_query_and_key_norms_export_beside_tensor_parallelism() -> None:
    """Qwen3's q/k norms run on their heads' shard with replicated weights, as Megatron's
    --qk-layernorm and torchtitan's qwen3 run them; a module that differs is refused
    naming the style Megatron's layout gives it."""
    spec = get_preset("tiny-llama").model_copy(update={"name": "tiny-qk", "qk_norm": True})
    plan = make_plan(
        resolve_model(spec),
        Cluster(gpu="h100-sxm-80gb", num_gpus=2), Training(global_batch_size=8),
        pins=Pins(tp=2), target="megatron",
    )  # fmt: skip
    assert plan.tp_layout["layers.*.attention.q_norm"].style in (
        TPStyle.SEQUENCE_PARALLEL, TPStyle.REPLICATE,
    )  # fmt: skip
    assert "--qk-layernorm" in to_megatron(plan)
    norm = plan.tp_layout["layers.*.attention.k_norm"].model_copy(update={"style": "colwise"})
    edited = plan.model_copy(
        update={"tp_layout": plan.tp_layout | {"layers.*.attention.k_norm": norm}}
    )
    with pytest.raises(ExportError, match=r"\(layers\.\*\.attention\.k_norm replicate\)"):
        to_megatron(edited)


def test_colwise_embedding_is_exported_with_a_note() -> None:
    plan = plan_for(tp=2, sequence_parallel=True, zero=2, dp=2)
    embedding = ModuleTP(style="colwise", params={"weight": "Shard(1)"})
    layout = plan.tp_layout | {"tok_embeddings": embedding}
    text = to_torchtitan(plan.model_copy(update={"tp_layout": layout}))
    assert "# note: tok_embeddings: the plan shards it on the embedding dim" in text


def test_unknown_target_names_the_known_ones() -> None:
    with pytest.raises(SpecError, match="unknown framework 'colossal'; use one of planner, torch"):
        export_plan(plan_for(dp=2), "colossal")
    with pytest.raises(SpecError, match=r"outside the releases .* \(0\.2, 0\.3\)"):
        export_plan(plan_for(dp=2), "torchtitan==0.1")
    with pytest.raises(SpecError, match="runs plans as they are"):
        export_plan(plan_for(dp=2), "planner")


def test_cli_prints_or_writes_the_export(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    path.write_text(plan_for(dp=8, zero=3, num_microbatches=2).to_json())
    assert main(["export", str(path), "--to", "deepspeed"]) == 0
    assert deepspeed_json(capsys.readouterr().out)["gradient_accumulation_steps"] == 2
    out = tmp_path / "megatron.args"
    assert main(["export", str(path), "--to", "megatron", "-o", str(out)]) == 0
    assert "--use-megatron-fsdp" in shlex.split(out.read_text(), comments=True)
    assert capsys.readouterr().out == ""


def test_cli_refusal_exits_2_naming_the_field(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    path.write_text(plan_for(tp=2).to_json())
    assert main(["export", str(path), "--to", "deepspeed"]) == 2
    assert "strategy.tp = 2" in capsys.readouterr().err
    assert main(["export", str(path), "--to", "colossal"]) == 2
    assert "--to = 'colossal': unknown framework" in capsys.readouterr().err


def test_exports_are_torch_free() -> None:
    """The export modules import the standard library and the planner's documents only."""
    allowed = (
        "planner.spec",
        "planner.errors",
        "planner.validate",
        "planner.frameworks",
        "planner.io",
        "planner.export",
        "planner.parallel_dims",
        "__future__",
    )
    for path in Path(planner.export.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert name.startswith(allowed) or name.split(".")[0] in sys.stdlib_module_names, (
                    f"{path.name} imports {name}"
                )


# ----- mixture of experts and latent attention ------------------------------------------

TINY_MLA = ModelSpec(
    name="tiny-mla", family="llama", num_layers=3, hidden_size=64, num_heads=4, vocab_size=256,
    seq_len=32, num_experts=8, top_k=2, moe_ffn_hidden_size=32, num_shared_experts=2,
    dense_layers=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16,
)  # fmt: skip
TINY_MIXTRAL = ModelSpec(
    name="tiny-mixtral", family="llama", num_layers=2, hidden_size=64, num_heads=4,
    num_kv_heads=2, vocab_size=256, seq_len=32, num_experts=8, top_k=2,
)  # fmt: skip


def megatron_moe_layout(spec: ModelSpec) -> dict[str, ModuleTP]:
    """Megatron-Core's tensor-parallel layout of a zoo MoE model: attention's query (or
    its up-projection), key/value (up-)projections and the dense or shared-expert w1/w3
    column-parallel, wo/w2 row-parallel; router and routed experts whole."""
    col = ModuleTP(style="colwise", params={"weight": "Shard(0)"})
    row = ModuleTP(style="rowwise", params={"weight": "Shard(1)"})
    layout = {"tok_embeddings": ModuleTP(style="vocab_parallel", params={"weight": "Shard(0)"})}
    layout["output"] = col
    for index in range(spec.num_layers):
        prefix = f"layers.{index}."
        attention = ("wq_b", "wkv_b") if spec.latent_attention else ("wq", "wk", "wv")
        layout |= {f"{prefix}attention.{name}": col for name in attention}
        layout[f"{prefix}attention.wo"] = row
        moe = spec.is_moe_layer(index)
        if moe and not spec.num_shared_experts:
            continue
        ffn = f"{prefix}feed_forward." + ("shared_experts." if moe else "")
        layout |= {f"{ffn}w1": col, f"{ffn}w3": col, f"{ffn}w2": row}
    return layout


def moe_plan(spec: ModelSpec | str, **strategy_fields: Any) -> Plan:
    """A plan for a MoE model under ``strategy_fields`` (Megatron's layout when tp > 1)."""
    handle = _handle(spec) if isinstance(spec, str) else resolve_model(spec)
    assert handle.spec is not None
    strategy = Strategy(**strategy_fields)
    batch = strategy.dp * strategy.micro_batch_size * strategy.num_microbatches
    layout = megatron_moe_layout(handle.spec) if strategy.tp > 1 else None
    cluster = Cluster(gpu=GPU, num_gpus=strategy.world_size)
    training = Training(global_batch_size=batch)
    return assemble_plan(handle, cluster, training, strategy, tp_layout=layout)


def moe_layers(freq: str) -> list[int]:
    """Megatron's ``--moe-layer-freq`` list expression evaluated as its parser does."""
    assert re.fullmatch(r"[\[\]()*+0-9]+", freq), freq
    return eval(freq, {"__builtins__": {}})  # digits, brackets, * and + only


def test_megatron_moe_arguments_describe_the_experts_and_expert_parallelism() -> None:
    plan = moe_plan("tiny-moe", dp=8, ep=8, zero=1)
    spec = plan.model
    assert spec is not None
    args = megatron_args(plan)
    assert args["--num-experts"] == ["8"] and args["--moe-router-topk"] == ["2"]
    assert args["--moe-ffn-hidden-size"] == [str(spec.expert_ffn_size)]
    assert args["--moe-shared-expert-intermediate-size"] == [str(spec.expert_ffn_size)]
    pattern = moe_layers(args["--moe-layer-freq"][0])
    assert pattern == [int(spec.is_moe_layer(i)) for i in range(spec.num_layers)] == [0, 1, 1, 1]
    assert args["--expert-model-parallel-size"] == ["8"]
    assert args["--expert-tensor-parallel-size"] == ["1"]  # Megatron's default would be tp
    assert args["--moe-token-dispatcher-type"] == ["alltoall"] and "--moe-grouped-gemm" in args
    assert args["--moe-router-score-function"] == ["softmax"]
    # load balancing is the training script's (a value here would override it when merged)
    assert "--moe-router-load-balancing-type" not in args
    assert "# note: the routers' load balancing is not set here" in to_megatron(plan)
    # dropless, softmax over the top-k logits (= renormalised top-k probabilities)
    assert not {"--moe-expert-capacity-factor", "--moe-router-pre-softmax"} & set(args)


def test_megatron_runs_expert_parallelism_beside_sequence_parallelism() -> None:
    """Megatron-Core routes each tp rank's sequence shard (expert tensor parallelism 1);
    this runtime cannot run the plan (its experts take tokens replicated over tp)."""
    plan = moe_plan(TINY_MIXTRAL, dp=2, tp=2, ep=4, zero=1, sequence_parallel=True)
    args = megatron_args(plan)
    assert "--sequence-parallel" in args and args["--tensor-model-parallel-size"] == ["2"]
    assert args["--expert-model-parallel-size"] == ["4"]
    assert args["--expert-tensor-parallel-size"] == ["1"]
    from strategies.apply import parallelize

    model = resolve_model(TINY_MIXTRAL).module
    with pytest.raises(SpecError, match=r"plan\.strategy\.sequence_parallel = True: beside "
                       r"ep\(4\) > 1: this runtime's experts .*target megatron"):  # fmt: skip
        parallelize(model, plan)


def test_megatron_writes_latent_attention_and_every_block_moe() -> None:
    args = megatron_args(moe_plan(TINY_MLA, dp=4, ep=4, zero=1))
    assert "--multi-latent-attention" in args and "--group-query-attention" not in args
    assert {key: args[key] for key in (
        "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
        "--v-head-dim", "--rope-type", "--moe-shared-expert-intermediate-size",
    )} == {
        "--q-lora-rank": ["24"], "--kv-lora-rank": ["16"], "--qk-head-dim": ["16"],
        "--qk-pos-emb-head-dim": ["8"], "--v-head-dim": ["16"], "--rope-type": ["rope"],
        "--moe-shared-expert-intermediate-size": ["64"],  # two shared experts of 32
    }  # fmt: skip
    direct = TINY_MLA.model_copy(update={"q_lora_rank": None, "num_shared_experts": 0,
                                         "dense_layers": 0})  # fmt: skip
    args = megatron_args(moe_plan(direct, dp=4, ep=2, zero=1))
    assert "--q-lora-rank" not in args and "--moe-layer-freq" not in args
    assert "--moe-shared-expert-intermediate-size" not in args


def test_dense_exports_carry_no_expert_settings() -> None:
    args = megatron_args(plan_for(dp=2, tp=2, zero=1, sequence_parallel=True))
    assert not {key for key in args if "expert" in key or key.startswith("--moe")}
    assert "expert_parallel_degree" not in torchtitan_tables(plan_for(dp=2, zero=2))["parallelism"]


def test_torchtitan_writes_expert_parallelism_and_names_its_moe_model() -> None:
    plan = moe_plan(TINY_MIXTRAL, dp=8, ep=8, zero=2)
    tables = torchtitan_tables(plan)
    assert tables["parallelism"]["expert_parallel_degree"] == 8
    assert tables["parallelism"]["expert_tensor_parallel_degree"] == 1
    assert tables["model"] == {"name": "qwen3"}  # torchtitan's default llama3 has no experts
    options, _ = torchtitan_overrides(plan)
    assert options["--parallelism.expert_parallel_degree"] == ["8"]
    # 0.3's CUDA graphs take only dispatchers that never sync the CPU; its default does
    assert "--training.disable_cuda_graphs" in options
    assert "model: torchtitan's qwen3" in to_torchtitan(plan)
    latent = torchtitan_tables(moe_plan(TINY_MLA, dp=8, ep=8, zero=3))
    assert latent["model"] == {"name": "deepseek_v3"}


MOE_REFUSALS = [
    ("torchtitan", "tiny-moe", {"dp": 8, "ep": 8, "zero": 1}, "plan.model.num_shared_experts = 1"),
    ("torchtitan", TINY_MIXTRAL, {"dp": 8, "ep": 8, "zero": 0}, "strategy.zero = 0"),
    ("deepspeed", TINY_MIXTRAL, {"dp": 8, "ep": 8, "zero": 1}, "strategy.ep = 8"),
    ("megatron", TINY_MIXTRAL.model_copy(update={"top_k": 1}), {"dp": 8, "ep": 8, "zero": 1},
     "plan.model.top_k = 1"),
    ("megatron", TINY_MIXTRAL, {"dp": 2, "tp": 2, "ep": 4, "zero": 1},
     "strategy.sequence_parallel = False"),
    ("torchtitan", TINY_MIXTRAL, {"dp": 2, "tp": 2, "ep": 4, "zero": 2, "sequence_parallel": True},
     "strategy.sequence_parallel = True"),
]  # fmt: skip


@pytest.mark.parametrize(("target", "model", "strategy", "field"), MOE_REFUSALS)
def test_refuses_experts_the_target_cannot_run(target, model, strategy, field) -> None:
    with pytest.raises(ExportError, match=re.escape(field) + r": .*; .*(re-plan|target|use)"):
        export_plan(moe_plan(model, **strategy), target)


def test_expert_parallelism_the_mesh_cannot_split_is_refused_before_any_export() -> None:
    """ep must divide dp_shard x cp x tp (torchtitan's efsdp = dp_shard * cp * tp / ep,
    Megatron's expert data-parallel groups per distributed-optimizer instance)."""
    plan = moe_plan(TINY_MIXTRAL, dp=8, ep=4, zero=2)
    hybrid = plan.model_copy(update={"strategy": plan.strategy.model_copy(update={"dp_shard": 2})})
    for target in ("torchtitan", "megatron"):
        assert export_plan(plan, target)
        with pytest.raises(SpecError, match=r"strategy\.ep\(4\) does not divide dp_shard"):
            export_plan(hybrid, target)


def test_a_selective_recompute_priced_for_another_framework_is_noted() -> None:
    """Selective recompute keeps what each framework's policy keeps: an export of a plan
    priced with another's says so (a Megatron-LM run recomputes core attention alone)."""
    plan = plan_for(dp=2, recompute="selective")
    assert plan.target == "planner"
    assert "# note: selective recompute: Megatron-LM's" in to_megatron(plan)
    assert "# note: selective recompute: torchtitan's per-op policy" in to_torchtitan(plan)
    assert "selective recompute" not in to_megatron(plan_for(dp=2, recompute="full"))
