"""A DeepSpeed config for a plan: JSON under ``//`` header comments.

Key names and checks are those of ``deepspeed/runtime/config.py`` (``DeepSpeedConfig``)
and ``deepspeed/runtime/zero/config.py`` (``DeepSpeedZeroConfig``) in DeepSpeed 0.18.9,
0.19.6 and 0.19.8, and every export was run through ``DeepSpeedConfig``
(``benchmarks/bench_exports.py``): ``train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * data-parallel ranks``, ``zero_optimization.stage``,
``bf16``/``fp16`` ``enabled``, ``gradient_clipping`` and ``communication_data_type``
(the gradient-reduction dtype; ``fp32`` unless the plan compresses to bf16/fp16). ZeRO-3
sharded in groups (hybrid sharding) is MiCS, ``mics_shard_size``, up to 0.19.6;
DeepSpeed 0.19.7 removed MiCS (``_REMOVED_ZERO_CONFIG_KEYS`` in
``deepspeed/runtime/config.py`` refuses the key), and no other key shards in groups
(ZeRO++'s ``zero_hpz_partition_size`` keeps a second, node-local copy of the weights on
top of the full partition, with gradients and optimizer states still over every rank),
so :mod:`planner.frameworks` refuses hybrid sharding for 0.19.7 and later. The optimizer
is left to the training script.

The header is ``//`` comment lines: ``DeepSpeedConfig`` reads a config file with
``hjson``, which takes them as comments (``deepspeed.initialize(config=PATH)``,
``deepspeed --deepspeed_config PATH``); a reader that wants strict JSON (Hugging Face's
``--deepspeed``) needs them dropped: ``grep -v '^//' FILE``. What DeepSpeed cannot run is
refused by :mod:`planner.frameworks`.
"""

from __future__ import annotations

from planner.export.common import check_target, header
from planner.frameworks import Target, parse_target
from planner.io import dumps_json
from planner.parallel_dims import ParallelDims
from planner.spec import CompressionKind, DType, Plan

__all__ = ["COMMUNICATION_DTYPES", "to_deepspeed"]

TARGET = "deepspeed"
COMMUNICATION_DTYPES = {
    CompressionKind.NONE: "fp32",
    CompressionKind.BF16: "bf16",
    CompressionKind.FP16: "fp16",
}


def to_deepspeed(plan: Plan, target: Target | None = None) -> str:
    """The plan as a DeepSpeed config (JSON text); raises
    :class:`~planner.errors.ExportError` for what the config cannot express."""
    target = target or parse_target(TARGET)
    check_target(plan, target)
    strategy, training = plan.strategy, plan.training
    config = {
        "train_batch_size": training.global_batch_size,
        "train_micro_batch_size_per_gpu": strategy.micro_batch_size,
        "gradient_accumulation_steps": strategy.num_microbatches,
        "gradient_clipping": 1.0 if training.grad_clip else 0.0,
        "zero_optimization": _zero(plan),
        "bf16": {"enabled": training.dtype is DType.BF16},
        "fp16": {"enabled": training.dtype is DType.FP16},
        "communication_data_type": COMMUNICATION_DTYPES[strategy.compression.kind],
    }
    form = "a DeepSpeed config (JSON under hjson // comments); deepspeed.initialize(config=FILE)"
    if ParallelDims.of(strategy).hybrid_sharding:  # MiCS: MiCS_Optimizer asserts MiCS_Init
        form += ", the model built under deepspeed.zero.MiCS_Init(config_dict_or_path=FILE)"
    form += (
        f"; no optimizer section: pass the plan's {training.optimizer.value} to "
        "deepspeed.initialize(optimizer=...) or add one"
    )
    lines = header(plan, target, form, comment="//")
    return "\n".join(lines) + "\n" + dumps_json(config, what="DeepSpeed config") + "\n"


def _zero(plan: Plan) -> dict[str, int | bool]:
    """The ``zero_optimization`` section; ZeRO >= 1 overlaps the gradient reduction with
    backward, as the plan was priced (``overlap_comm``: DeepSpeed's default is on for
    stage 3 only)."""
    strategy = plan.strategy
    section: dict[str, int | bool] = {"stage": strategy.zero}
    if strategy.zero >= 1:
        section["overlap_comm"] = True
    if not ParallelDims.of(strategy).hybrid_sharding:
        return section
    return section | {"mics_shard_size": strategy.shard_degree}
