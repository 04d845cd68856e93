"""A DeepSpeed config JSON for a plan.

Key names are those of the DeepSpeed configuration reference
(https://www.deepspeed.ai/docs/config-json/, DeepSpeed 0.16-0.17, and
``deepspeed/runtime/constants.py`` / ``deepspeed/runtime/zero/config.py``):
``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
data-parallel ranks``, ``zero_optimization.stage`` (``mics_shard_size`` for ZeRO-3
sharded in groups, MiCS), ``bf16``/``fp16`` ``enabled``, ``gradient_clipping`` and
``communication_data_type`` (the gradient-reduction dtype; ``fp32`` unless the plan
compresses to bf16/fp16). The optimizer is left to the training script.

Refused: tensor, pipeline and context parallelism (DeepSpeed sets them up in code:
``PipelineModule``, Ulysses, AutoTP, none of them from this config or with this plan's
layout), recompute (the ``activation_checkpointing`` section only configures
``deepspeed.checkpointing.checkpoint``, which model code must call), fp8, hybrid
sharding with ZeRO-1/2, PowerSGD and local SGD.
"""

from __future__ import annotations

from planner.export.common import check_hook_compression, refuse, uniform_recompute
from planner.io import dumps_json
from planner.parallel_dims import ParallelDims
from planner.spec import CompressionKind, DType, Plan, RecomputeMode

__all__ = ["to_deepspeed"]

TARGET = "deepspeed"
_COMMUNICATION_DTYPES = {
    CompressionKind.NONE: "fp32",
    CompressionKind.BF16: "bf16",
    CompressionKind.FP16: "fp16",
}


def to_deepspeed(plan: Plan) -> str:
    """The plan as a DeepSpeed config (JSON text); raises
    :class:`~planner.errors.ExportError` for what the config cannot express."""
    check_hook_compression(plan, TARGET)
    _check_model_parallel(plan)
    _check_recompute(plan)
    strategy, training = plan.strategy, plan.training
    if training.dtype is DType.FP8:
        raise refuse(
            TARGET,
            "training.dtype",
            training.dtype,
            "the DeepSpeed config has no fp8 training switch",
            "re-plan with --dtype bf16, or export to torchtitan or megatron",
        )
    config = {
        "train_batch_size": training.global_batch_size,
        "train_micro_batch_size_per_gpu": strategy.micro_batch_size,
        "gradient_accumulation_steps": strategy.num_microbatches,
        "gradient_clipping": 1.0 if training.grad_clip else 0.0,
        "zero_optimization": _zero(plan),
        "bf16": {"enabled": training.dtype is DType.BF16},
        "fp16": {"enabled": training.dtype is DType.FP16},
        "communication_data_type": _COMMUNICATION_DTYPES[strategy.compression.kind],
    }
    return dumps_json(config, what="DeepSpeed config") + "\n"


def _check_model_parallel(plan: Plan) -> None:
    strategy = plan.strategy
    ways = {
        "strategy.tp": (strategy.tp, "tensor parallelism (AutoTP is set up in code and shards "
                        "only linear layers)"),
        "strategy.pp": (strategy.pp, "pipeline parallelism (PipelineModule is built in code)"),
        "strategy.cp": (strategy.cp, "context parallelism (Ulysses is set up in code)"),
    }  # fmt: skip
    for field, (size, what) in ways.items():
        if size > 1:
            raise refuse(
                TARGET,
                field,
                size,
                f"a DeepSpeed config cannot express {what}",
                "re-plan with --tp 1 --pp 1 --cp 1, or export to torchtitan or megatron",
            )


def _check_recompute(plan: Plan) -> None:
    mode = uniform_recompute(plan, TARGET)
    if mode is not RecomputeMode.NONE:
        raise refuse(
            TARGET,
            "strategy.recompute",
            mode,
            "a DeepSpeed config cannot switch recompute on (activation_checkpointing only "
            "configures deepspeed.checkpointing.checkpoint, which the model code must call)",
            "re-plan with --recompute none, or export to torchtitan or megatron",
        )


def _zero(plan: Plan) -> dict[str, int]:
    strategy = plan.strategy
    section: dict[str, int] = {"stage": strategy.zero}
    if not ParallelDims.of(strategy).hybrid_sharding:
        return section
    if strategy.zero < 3:
        raise refuse(
            TARGET,
            "strategy.dp_shard",
            strategy.shard_degree,
            f"DeepSpeed ZeRO-{strategy.zero} partitions over all {strategy.dp} data-parallel "
            "ranks (MiCS groups, mics_shard_size, need ZeRO-3)",
            "re-plan with --dp-shard equal to --dp, or --zero 3",
        )
    return section | {"mics_shard_size": strategy.shard_degree}
