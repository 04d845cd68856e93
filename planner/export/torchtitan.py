"""torchtitan settings for a plan: a TOML job config (0.2) or command-line overrides (0.3).

torchtitan 0.2.x (0.2.0-0.2.2) reads a TOML job config (``--job.config_file``) into the
dataclasses of ``torchtitan/config/job_config.py`` (``Parallelism``, ``Training``,
``ActivationCheckpoint``, ``Optimizer``, ``Model``); fp8 is the model converter
``quantize.linear.float8`` (``torchtitan/components/quantization/float8.py``, registered
under that name since 0.2.0). The export is such a file: merge it into yours.

torchtitan 0.3.x has no TOML job config: ``torchtitan/config/manager.py`` builds the
config from a Python function (``--module llama3 --config llama3_8b``, the
``config_registry`` of a model) and applies tyro command-line overrides
(``--section.key value``) to ``Trainer.Config`` (``torchtitan/trainer.py``,
``torchtitan/config/configs.py``: ``ParallelismConfig``, ``TrainingConfig``,
``CompileConfig``). The export is those overrides, one per line, and ends with the
activation-checkpoint subcommand (``activation-checkpoint:none|selective|full``, the
classes of ``torchtitan/distributed/activation_checkpoint.py``). What moved from 0.2:
async TP is ``compile.enable_async_tensor_parallel``, sequence parallelism is
``parallelism.enable_sequence_parallel`` (so TP without SP runs), the optimizer is
``optimizer.param_groups.0.optimizer_name``, the head is ``lm_head`` (``output`` in 0.2),
``disable_loss_parallel`` and ``selective_ac_option`` are gone, pipelining and expert
parallelism (its default token dispatcher syncs the CPU) need
``training.disable_cuda_graphs`` (``Trainer.Config._validate_cuda_graphs``), and model
converters (fp8) are part of the ``--config`` function's ``model_spec``, which the command
line cannot set (:mod:`planner.frameworks` refuses fp8 for 0.3).

Both were checked with torchtitan's own parser, mesh and ``parallelize_llama`` on the
meta device (``benchmarks/bench_exports.py``; torchtitan 0.2.2 and 0.3.0 from PyPI).

Mapping: ``dp_replicate``/``dp_shard``/``tp``/``pp``/``cp`` degrees one to one (the
same mesh order, FSDP over ``dp_shard x cp`` as our runtime); ZeRO-3 is FSDP with
``fsdp_reshard_after_forward = "always"``, ZeRO-2 without resharding (``"never"``,
as :mod:`strategies.fsdp` runs it; torchtitan has no ZeRO-1, which
:mod:`planner.frameworks` refuses); ``plan.stages`` is
``module_fqns_per_model_part``; our zero-bubble schedule runs
``ScheduleInterleavedZeroBubble`` over the plan's chunks in loop order, torchtitan's
``InterleavedZeroBubble`` (``ZBVZeroBubble`` places chunks in a V). What torchtitan
cannot run is refused by :mod:`planner.frameworks`; here, a tensor-parallel layout other
than torchtitan's llama plan and first-k-blocks recompute.
"""

from __future__ import annotations

import math

from planner.export.common import (
    check_megatron_layout,
    check_recompute_blocks,
    check_target,
    described_model,
    header,
    selective_recompute_note,
    seq_len,
)
from planner.frameworks import (
    TORCHTITAN_OVERRIDES,
    TORCHTITAN_PARAM_DTYPES,
    Framework,
    Target,
    parse_target,
    torchtitan_model,
    torchtitan_shards,
)
from planner.io import dumps_json
from planner.spec import DType, Optimizer, Plan, RecomputeMode, Schedule

__all__ = ["OPTIMIZERS", "SCHEDULES", "to_torchtitan"]

TARGET = "torchtitan"
SCHEDULES = {
    Schedule.GPIPE: "GPipe",
    Schedule.ONE_F_ONE_B: "1F1B",
    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B",
    Schedule.ZERO_BUBBLE: "InterleavedZeroBubble",
}
OPTIMIZERS = {Optimizer.ADAMW: "AdamW", Optimizer.ADAM: "Adam"}
FLOAT8_CONVERTER = "quantize.linear.float8"  # the 0.2 registry name (was "float8")
HEADS_03 = {"output": "lm_head"}  # torchtitan/models/common/decoder.py names its head lm_head

TomlValue = bool | int | float | str | list["TomlValue"]


def to_torchtitan(plan: Plan, target: Target | None = None) -> str:
    """The plan as torchtitan settings for ``target`` (newest release by default): 0.2 a
    TOML job config, 0.3 command-line overrides; raises
    :class:`~planner.errors.ExportError` for what torchtitan cannot express."""
    target = target or parse_target(TARGET)
    check_target(plan, target)
    notes = check_megatron_layout(plan, TARGET) if plan.strategy.tp > 1 else []
    mode = plan.strategy.recompute
    if mode is not RecomputeMode.NONE:
        check_recompute_blocks(plan, TARGET)
    notes += selective_recompute_note(
        plan, Framework.TORCHTITAN,
        "torchtitan's per-op policy keeps every other matmul's output and attention's",
    )  # fmt: skip
    if plan.stages:
        notes.append(
            "module_fqns_per_model_part names this model's modules (as torchtitan's llama)"
        )
    module = torchtitan_model(described_model(plan))
    if module != "llama3":
        router = (
            "; torchtitan takes the router's score function, normalisation and load "
            "balancing from the flavor"
            if described_model(plan).moe
            else ""
        )
        notes.append(
            f"model: torchtitan's {module} (0.2: [model] name; 0.3: --module {module}) with a "
            f"flavor of plan.model's sizes{router}"
        )
    if target.at_least(TORCHTITAN_OVERRIDES):
        return _overrides(plan, target, notes)
    return _toml_config(plan, target, notes)


def _toml_config(plan: Plan, target: Target, notes: list[str]) -> str:
    """torchtitan 0.2: ``[parallelism]``, ``[training]``, ``[activation_checkpoint]``,
    ``[optimizer]`` and, for fp8, ``[model]`` tables."""
    parallelism = _parallelism(plan) | {
        "disable_loss_parallel": False,
        "enable_async_tensor_parallel": False,
    }
    if described_model(plan).moe:  # 0.3 has no expert tensor parallelism
        parallelism["expert_tensor_parallel_degree"] = 1
    checkpoint: dict[str, TomlValue] = {"mode": plan.strategy.recompute.value}
    if plan.strategy.recompute is RecomputeMode.SELECTIVE:
        checkpoint["selective_ac_option"] = "op"
    tables: dict[str, dict[str, TomlValue]] = {
        "parallelism": parallelism,
        "training": _training(plan),
        "activation_checkpoint": checkpoint,
        "optimizer": {"name": OPTIMIZERS[plan.training.optimizer]},
    }
    module = torchtitan_model(described_model(plan))
    if module != "llama3":  # torchtitan's default model, which has no experts
        tables["model"] = {"name": module}
    if plan.training.dtype is DType.FP8:
        tables.setdefault("model", {})["converters"] = [FLOAT8_CONVERTER]
        if plan.strategy.tp > 1:  # models/llama3/infra/parallelize.py in 0.2.2
            notes.append(
                "torchtitan 0.2's parallelize_llama enables float8 tensor-parallel "
                "communication only for a converter named 'float8', so tp runs its "
                "collectives in bf16"
            )
    form = "a TOML job config; merge it into yours (torchtitan ... --job.config_file FILE)"
    lines = header(plan, target, form) + [f"# note: {note}" for note in notes]
    for name, table in tables.items():
        lines += ["", f"[{name}]"] + [f"{key} = {_toml(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def _overrides(plan: Plan, target: Target, notes: list[str]) -> str:
    """torchtitan 0.3: ``--section.key value`` lines, the activation-checkpoint subcommand
    last (tyro reads a subcommand's options after it)."""
    strategy = plan.strategy
    settings: dict[str, TomlValue] = {
        f"parallelism.{key}": value for key, value in _parallelism(plan).items()
    }
    if strategy.pp > 1:  # the zoo's (and torchtitan 0.2's) head "output" is 0.3's "lm_head"
        settings["parallelism.module_fqns_per_model_part"] = [
            [HEADS_03.get(fqn, fqn) for fqn in chunk] for chunk in plan.stages
        ]
    if strategy.tp > 1:
        settings["parallelism.enable_sequence_parallel"] = strategy.sequence_parallel
    settings["compile.enable_async_tensor_parallel"] = False
    settings |= {f"training.{key}": value for key, value in _training(plan).items()}
    if strategy.pp > 1 or strategy.ep > 1:  # CUDA graphs pipeline no stage, and take only
        settings["training.disable_cuda_graphs"] = True  # dispatchers that never sync the CPU
    settings["optimizer.param_groups.0.optimizer_name"] = OPTIMIZERS[plan.training.optimizer]
    notes.append(
        "model converters (fp8) come from the --config function's model_spec: pick one "
        "without Float8LinearConverter (llama3_405b has one)"
    )
    form = (
        "command-line overrides; torchrun ... -m torchtitan.train --module MODEL "
        "--config CONFIG $(grep -v '^#' FILE)"
    )
    lines = header(plan, target, form) + [f"# note: {note}" for note in notes]
    lines += [_flag(key, value) for key, value in settings.items()]
    lines.append(f"activation-checkpoint:{strategy.recompute.value}")
    return "\n".join(lines) + "\n"


def _flag(key: str, value: TomlValue) -> str:
    """One tyro override: booleans as ``--key``/``--no-key`` flags (the last part
    negated), lists of lists as space-separated comma-joined chunks."""
    if isinstance(value, bool):
        section, _, name = key.rpartition(".")
        return f"--{section}.{name}" if value else f"--{section}.no_{name}"
    if isinstance(value, list):
        return f"--{key} " + " ".join(",".join(map(str, chunk)) for chunk in value)  # type: ignore[arg-type]
    return f"--{key} {value}"


def _parallelism(plan: Plan) -> dict[str, TomlValue]:
    """The ``parallelism`` settings both releases share (module names as the plan's)."""
    strategy = plan.strategy
    table: dict[str, TomlValue] = {
        "data_parallel_replicate_degree": strategy.replicate_degree,
        "data_parallel_shard_degree": strategy.shard_degree,
    }
    if torchtitan_shards(strategy):
        table["fsdp_reshard_after_forward"] = "always" if strategy.zero == 3 else "never"
    table |= {
        "tensor_parallel_degree": strategy.tp,
        "context_parallel_degree": strategy.cp,
        "pipeline_parallel_degree": strategy.pp,
    }
    if described_model(plan).moe:
        table["expert_parallel_degree"] = strategy.ep
    if strategy.pp > 1:
        table |= {
            "pipeline_parallel_schedule": SCHEDULES[strategy.schedule],
            "pipeline_parallel_microbatch_size": strategy.micro_batch_size,
            "module_fqns_per_model_part": [list(chunk) for chunk in plan.stages],
        }
    return table


def _training(plan: Plan) -> dict[str, TomlValue]:
    """Batch sizes in sequences: torchtitan accumulates gradients over
    ``global / (local * dp)`` steps without pipelining and splits ``local_batch_size``
    into pipeline micro-batches with it."""
    strategy = plan.strategy
    per_rank = strategy.micro_batch_size * strategy.num_microbatches
    table: dict[str, TomlValue] = {
        "local_batch_size": per_rank if strategy.pp > 1 else strategy.micro_batch_size,
        "global_batch_size": plan.training.global_batch_size,
    }
    tokens = seq_len(plan)
    if tokens is not None:
        table["seq_len"] = tokens
    table |= {
        "max_norm": 1.0 if plan.training.grad_clip else math.inf,
        "mixed_precision_param": TORCHTITAN_PARAM_DTYPES[plan.training.dtype],
        "mixed_precision_reduce": "float32",
    }
    if plan.training.param_dtype is DType.BF16:  # pure bf16: no fp32 copy
        table["dtype"] = TORCHTITAN_PARAM_DTYPES[DType.BF16]
    return table


def _toml(value: TomlValue) -> str:
    """A TOML literal; lists of lists go one inner list per line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, (int, float, str)):
        return dumps_json(value, what="torchtitan TOML value", indent=None)
    if value and all(isinstance(item, list) for item in value):
        return "[\n" + "".join(f"  {_toml(item)},\n" for item in value) + "]"
    return "[" + ", ".join(_toml(item) for item in value) + "]"
