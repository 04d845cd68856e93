"""A torchtitan job config read as the run the planner prices.

torchtitan 0.2: a TOML job config (``torchtitan/config/job_config.py``, pytorch/torchtitan
6404b93: ``[parallelism]``, ``[training]``, ``[activation_checkpoint]``, ``[optimizer]``,
``[model]``, ``[quantize.linear.float8]``), what ``plan export --to torchtitan==0.2`` writes, with
torchtitan's defaults for what is absent. torchtitan 0.3 configures a run with a config
function (``--module llama3 --config llama3_8b``: ``models/llama3/config_registry.py``)
and command-line overrides (``--parallelism.tensor_parallel_degree 8``,
``--section.no_flag``, ``activation-checkpoint:full``), what ``plan export --to
torchtitan==0.3`` writes, and dumps the job config as JSON
(``--debug.save_config_file``); both are read, with 0.3's key names
(``parallelism.enable_sequence_parallel``, ``[compile]``, ``training.dtype``,
``optimizer.param_groups``, ``model_spec`` name and flavor, the checkpointing policy:
``null`` none, ``memory_budget`` refused, ``force_recompute_mm_shapes_by_fqns`` per-op
selective, otherwise full) and the config function's values where not overridden.

Mapping (torchtitan's behaviour): the degrees one to one, ``data_parallel_shard_degree
= -1`` taking the GPUs the other degrees leave (so the GPU count comes from the
options); FSDP runs when dp_shard or cp is above 1, ``fsdp_reshard_after_forward``
``always`` is ZeRO-3, ``never`` ZeRO-2 (FSDP2 reduce-scatters the gradients),
``default`` ZeRO-3 without a pipeline and ZeRO-2 with one; the micro-batch is
``local_batch_size`` (gradient accumulation over ``global / (local x dp)`` steps) or,
pipelined, ``pipeline_parallel_microbatch_size``; the stage split is
``module_fqns_per_model_part`` or torchtitan's own (1 chunk per rank for single-stage
schedules, 2 for looped ones, the embeddings and the head weighted as
``pipeline_parallel_first/last_stage_less_layers`` layers); per-op selective recompute
(``selective_ac_option = "op"``) is priced with the ``op`` policy, every n-th layer
(an integer) as full recompute of as many layers per chunk; bf16 parameters with tp or
pp but no FSDP train in fp32 (torchtitan applies mixed precision through FSDP there);
``training.dtype = "bfloat16"`` is pure bf16 training (``training.param_dtype``);
``[model] converters = ["quantize.linear.float8"]`` is fp8 (0.1's ``"float8"`` and
``[float8]`` table are refused: 0.2 stops at them);
``compile`` fuses pointwise operators; async tensor parallelism overlaps its collectives;
DeepEP and HybridEP (``expert_parallel_comm_backend``) deduplicate the expert dispatch.
"""

from __future__ import annotations

import math
import re
import tomllib
from typing import Any

from planner.cost.options import ExpertChoice, OptimizerImpl
from planner.errors import SpecError
from planner.export.torchtitan import FLOAT8_CONVERTER, OPTIMIZERS, SCHEDULES
from planner.frameworks import (
    KERNELS,
    TORCHTITAN_PARAM_DTYPES,
    Framework,
    torchtitan_model,
    torchtitan_shards,
)
from planner.importers.common import (
    ImportedRun,
    Options,
    Settings,
    build_run,
    choose_model,
    chunks_of,
    command_words,
    launched_world,
    layers_per_chunk,
    looks_like_command,
    option_values,
    resolve_world,
)
from planner.io import parse_json
from planner.presets import get_preset
from planner.spec import Cluster, DType, ModelSpec, Optimizer, RecomputeMode, Schedule, Strategy

__all__ = ["FORMAT", "is_overrides", "read_torchtitan"]

FORMAT = "torchtitan"
_SCHEDULES = {name: schedule for schedule, name in SCHEDULES.items()}
_SINGLE_STAGE = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)  # torch's PipelineScheduleSingle
_OPTIMIZERS = {name: optimizer for optimizer, name in OPTIMIZERS.items()}
_OLD_FLOAT8 = "float8"  # torchtitan 0.1's converter name and table, which 0.2 refuses
_HEAD_ALIASES = {"lm_head": "output"}  # torchtitan 0.3's llama names its head lm_head
_DOTTED = re.compile(r"^--\w[\w-]*\.")  # --section.key
_SUBCOMMAND = re.compile(r"^activation[-_]checkpoint:([\w-]+)$")  # tyro's policy subcommand
_EXPERT_MODULES = ("deepseek_v3", "qwen3")  # torchtitan's MoE models the exporter names
_MODULE_03 = "llama3"  # the torchtitan 0.3 module whose config functions follow
_EP_BACKENDS = ("standard", "deepep", "hybridep")  # parallelism.expert_parallel_comm_backend
# torchtitan 0.3's llama3 config functions that train a zoo preset, and what each sets
# beyond the dataclass defaults (models/llama3/config_registry.py).
_CONFIGS_03: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3_8b": ("llama3-8b", {
        "training.local_batch_size": 1, "training.seq_len": 8192,
        "activation_checkpoint.mode": "selective"}),
    "llama3_70b": ("llama3-70b", {
        "training.local_batch_size": 8, "training.seq_len": 8192,
        "parallelism.tensor_parallel_degree": 8, "activation_checkpoint.mode": "full"}),
    "llama3_405b": ("llama3.1-405b", {
        "training.local_batch_size": 2, "training.seq_len": 8192,
        "parallelism.tensor_parallel_degree": 8, "activation_checkpoint.mode": "full",
        "compile.enable": True, "compile.enable_async_tensor_parallel": True,
        "model.converters": [FLOAT8_CONVERTER]}),
}  # fmt: skip
# Keys only torchtitan 0.3 has (their presence switches its defaults on); 0.2 has a
# [compile] section too, so compile.* tells nothing
_RELEASE_03 = re.compile(
    r"^(parallelism\.enable_sequence_parallel|training\.dtype$|model_spec\.|"
    r"optimizer\.param_groups|debug\.|config$|module$)"
)
# Keys that change what a step computes or keeps, unpriced: key -> (harmless values, why).
_UNPRICED: dict[str, tuple[tuple[Any, ...], str]] = {
    "training.enable_cpu_offload": ((None, False), "the planner does not model CPU offload"),
    "training.mixed_precision_reduce": ((None, "float32"), "the planner prices torchtitan's "
                                        "float32 reduction"),
    "optimizer.early_step_in_backward": ((None, False), "stepping the optimizer in backward "
                                         "frees gradients early, which is not priced"),
    "parallelism.expert_tensor_parallel_degree": ((None, 1), "the planner does not price "
                                                  "torchtitan's expert tensor parallelism "
                                                  "(experts sharded with DTensor over tp)"),
    "parallelism.pipeline_parallel_schedule_csv": ((None, ""), "a schedule from a CSV file is "
                                                   "not priced"),
    "parallelism.pipeline_parallel_split_points": ((None, []), "split points are deprecated "
                                                   "and not read"),
    "quantize.linear.float8.enable_fsdp_float8_all_gather": ((None, False), "fp8 weight "
                                                             "gathers are not priced"),
    "fault_tolerance.enable": ((None, False), "torchft's replica groups are not priced"),
}  # fmt: skip


def read_torchtitan(text: str, source: str, detected: str, options: Options) -> ImportedRun:
    """The run ``text`` (a torchtitan TOML job config, or 0.3's overrides or JSON dump)
    describes, completed by ``options``."""
    settings, notes, toml = _settings(text, source)
    old_table = [key for key in settings.values if key.startswith(f"{_OLD_FLOAT8}.")]
    if old_table:
        raise settings.refuse(
            old_table[0], settings.values[old_table[0]],
            f"[{_OLD_FLOAT8}] is torchtitan 0.1's table; 0.2 and 0.3 read [quantize.linear.float8]",
            f"move it to quantize.linear.{old_table[0]}",
        )  # fmt: skip
    settings.check_unpriced(_UNPRICED)
    release_03 = any(_RELEASE_03.match(key) for key in settings.values)
    if release_03:
        notes.insert(0, "read with torchtitan 0.3's key names and defaults")
    described, keys = _model(settings, given=options.model is not None, toml=toml)
    model = choose_model(settings, described, keys, options.model)
    _check_module(settings, model)
    cluster, (replicas, shard, tp, pp, cp) = _mesh(settings, options)
    dp = replicas * shard
    zero = _zero(settings, dp, shard, cp, pp)
    micro, local, total = _batch(settings, dp, pp)
    rounds = _pipeline_rounds(pp, micro, local, total // (local * dp), notes)
    stages, virtual, schedule = _pipeline(settings, model, pp, notes)
    counts = layers_per_chunk(model, stages) if stages else [model.num_layers]
    recompute, policy = _recompute(settings, counts, release_03)
    strategy = {
        "dp": dp, "dp_shard": shard if zero else None, "tp": tp, "pp": pp, "cp": cp,
        "zero": zero, "sequence_parallel": tp > 1
        and settings.flag("parallelism.enable_sequence_parallel", True),
        "ep": settings.integer("parallelism.expert_parallel_degree", 1),
        "micro_batch_size": micro, "schedule": schedule.value, "virtual_stages": virtual,
        **recompute,
    }  # fmt: skip
    param_dtype = _param_dtype(settings)
    training = {
        "global_batch_size": total, "seq_len": settings.integer("training.seq_len", 2048),
        "dtype": _dtype(settings, strategy, notes, param_dtype).value,
        "param_dtype": param_dtype.value, "optimizer": _optimizer(settings).value,
        "grad_clip": _clipping(settings),
    }  # fmt: skip
    cost = _cost_options(settings, tp) | ({"selective": policy} if policy else {})
    cost |= _expert_dispatch(settings, strategy["ep"]) | rounds
    # 0.2 reads a TOML job config; 0.3 its command-line overrides (or writes the JSON dump)
    release = f"{FORMAT}=={'0.2' if toml and not release_03 else '0.3'}"
    return build_run(
        settings, format=FORMAT, detected=detected, model=model, cluster=cluster,
        training=training, strategy=strategy, options=cost, stages=stages, notes=notes,
        release=release,
    )  # fmt: skip


def _settings(text: str, source: str) -> tuple[Settings, list[str], bool]:
    """The job config's keys (TOML, torchtitan 0.3's JSON dump or its command-line
    overrides), notes on what they were completed with, and whether it was TOML."""
    if text.lstrip().startswith("{"):
        data = parse_json(text, source, what="torchtitan job config")
        if not isinstance(data, dict):
            raise SpecError(f"cannot read {source}: a torchtitan job config is a JSON object")
        return Settings.nested(data, source), [], False
    if looks_like_command(text):
        return *_overrides(text, source), False
    try:
        return Settings.nested(tomllib.loads(text), source), [], True
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"cannot read {source}: not TOML ({exc})") from None


def is_overrides(words: list[str]) -> bool:
    """Whether command words are torchtitan 0.3's (``--section.key``, or a policy
    subcommand); Megatron-LM's options have no dots."""
    return any(_DOTTED.match(word) or _SUBCOMMAND.match(word) for word in words)


def _overrides(text: str, source: str) -> tuple[Settings, list[str]]:
    """torchtitan 0.3's command line as dotted keys: ``--section.key value``
    (``--section.flag``, ``--section.no_flag`` for booleans), ``activation-checkpoint:POLICY``,
    ``--module``/``--config`` (a config function's values where not overridden) and a
    launcher's world size."""
    words, launcher = command_words(text, source)
    policies = [match[1] for word in words if (match := _SUBCOMMAND.match(word))]
    plain = [word for word in words if not _SUBCOMMAND.match(word)]
    values: dict[str, Any] = {}
    for name, value in option_values(plain, source, frozenset(), "torchtitan").items():
        key = name.removeprefix("--").replace("-", "_")
        section, _, field = key.rpartition(".")
        if value is True and field.startswith("no_"):
            key, value = f"{section}.{field[3:]}".lstrip("."), False
        values[key] = value
    if policies:
        values["activation_checkpoint.mode"] = policies[-1]
    notes = []
    config = values.get("config")
    if config in _CONFIGS_03:
        defaults = {k: v for k, v in _CONFIGS_03[config][1].items() if k not in values}
        values |= defaults
        taken = ", ".join(f"{k} = {v}" for k, v in defaults.items())
        notes.append(
            f"--config {config}: {taken} (torchtitan 0.3's config_registry, where not overridden)"
            if taken
            else f"--config {config}: every value it sets is overridden"
        )
    elif config is None:
        notes.append(
            "no --config: keys not given take the --config function's values at launch; "
            "priced with torchtitan's defaults"
        )
    return Settings(values | launcher, source), notes


# torchtitan's (model name, flavor) that are zoo presets (torchtitan/models/*/__init__.py)
FLAVORS: dict[tuple[str, str], str] = {
    ("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b",
    ("llama3", "405B"): "llama3.1-405b", ("qwen3", "30B-A3B"): "qwen3-30b-a3b",
    ("qwen3", "235B-A22B"): "qwen3-235b-a22b", ("deepseek_v3", "671B"): "deepseek-v3",
}  # fmt: skip


def _model(settings: Settings, *, given: bool, toml: bool) -> tuple[ModelSpec | None, str]:
    """The zoo preset ``[model]`` (or 0.3's ``model_spec``) name and flavor name, or
    0.3's ``--config`` function trains; ``given``: a ``--model`` stands in for a flavor
    that is no preset; ``toml``: a job config (else command-line overrides)."""
    module = settings.get("module", _MODULE_03)
    if module != _MODULE_03:
        raise settings.refuse(
            "--module", module, f"the torchtitan models that are zoo presets are {_MODULE_03}'s",
            f"use --module {_MODULE_03}, or drop --module and --config and give --model",
        )  # fmt: skip
    config = settings.get("config")
    if config is not None:
        if config not in _CONFIGS_03:
            raise settings.refuse(
                "--config", config, "the torchtitan config functions that train zoo presets "
                f"are {', '.join(_CONFIGS_03)}", "use one, or drop --config and give --model",
            )  # fmt: skip
        return get_preset(_CONFIGS_03[config][0]), "--config"
    for table in ("model", "model_spec"):
        if f"{table}.name" in settings and f"{table}.flavor" not in settings:
            name = settings.text(f"{table}.name", "llama3")
            if name in _EXPERT_MODULES:  # its flavor unnamed: the model from --model
                return None, f"{table}.flavor (a {name} flavor: give --model)"
        if f"{table}.name" in settings or f"{table}.flavor" in settings:
            name = settings.text(f"{table}.name", "llama3")
            flavor = settings.text(f"{table}.flavor", "debugmodel")
            preset = FLAVORS.get((name, flavor))
            if preset is not None:
                return get_preset(preset), f"{table}.name/flavor"
            if given:  # --model gives the sizes the flavor names
                return None, f"{table}.flavor ({name} {flavor}, no zoo preset)"
            known = [f for n, f in FLAVORS if n == name]
            listed = f"known {name} flavors: {', '.join(known)}" if known else (
                "models with known flavors: " + ", ".join(sorted({n for n, _ in FLAVORS}))
            )  # fmt: skip
            raise settings.refuse(
                f"{table}.flavor", flavor, f"{name} {flavor} is no zoo preset ({listed})",
                "use one, or give --model (a preset or a ModelSpec JSON file of this "
                "flavor's sizes)",
            )  # fmt: skip
    return None, "[model] name and flavor" if toml else "--module and --config"


def _check_module(settings: Settings, model: ModelSpec) -> None:
    """torchtitan 0.2's ``[model] name`` builds ``model`` (llama3 a dense one)."""
    if "model.name" not in settings:
        return
    name = settings.text("model.name", "llama3")
    wanted = torchtitan_model(model)
    if name in (*_EXPERT_MODULES, "llama3") and name != wanted:
        raise settings.refuse(
            "model.name", name,
            f"torchtitan's {name} is not the model being priced ({model.name}: {wanted})",
            f"use name = {wanted!r}, or give the --model this config trains",
        )  # fmt: skip


def _mesh(settings: Settings, options: Options) -> tuple[Cluster, tuple[int, ...]]:
    """The cluster and the degrees (dp_replicate, dp_shard, tp, pp, cp), dp_shard
    completed from the GPU count when it is -1."""
    names = ("data_parallel_replicate", "tensor_parallel", "pipeline_parallel", "context_parallel")
    replicas, tp, pp, cp = (settings.integer(f"parallelism.{name}_degree", 1) for name in names)
    others = replicas * tp * pp * cp
    shard = settings.integer("parallelism.data_parallel_shard_degree", -1, least=-1)
    if shard == 0:
        raise settings.refuse("parallelism.data_parallel_shard_degree", 0, "0 is no degree",
                              "give -1 (the GPUs left over) or a positive degree")  # fmt: skip
    if settings.flag("parallelism.disable_loss_parallel") and tp > 1:
        raise settings.refuse(
            "parallelism.disable_loss_parallel", True, "the planner prices vocabulary-parallel "
            "logits and loss under tensor parallelism", "remove it",
        )  # fmt: skip
    cluster = resolve_world(settings, options, *_world(settings, shard, others))
    shard = shard if shard > 0 else _left_over(settings, cluster.num_gpus, others)
    return cluster, (replicas, shard, tp, pp, cp)


def _world(settings: Settings, shard: int, others: int) -> tuple[int | None, str]:
    """The GPU count the degrees (or a ``torchrun`` launch) give, and from what; None
    with ``data_parallel_shard_degree = -1`` and no launch."""
    launched, launch = launched_world(settings)
    if shard > 0 and launched not in (None, shard * others):
        raise SpecError(
            f"cannot read {settings.source}: {launch} = {launched} GPUs, but the parallelism "
            f"degrees multiply to {shard * others}; make them agree"
        )
    if shard > 0:
        return shard * others, "the product of the parallelism degrees"
    if launched is not None:
        return launched, launch
    return None, (
        "parallelism.data_parallel_shard_degree = -1 takes the GPUs the other degrees "
        "leave, so the GPU count must come from the options"
    )


def _left_over(settings: Settings, world: int, others: int) -> int:
    if world % others:
        raise settings.refuse(
            "parallelism.data_parallel_shard_degree", -1,
            f"the other degrees multiply to {others}, which does not divide the {world} GPUs",
            "change the degrees or the GPU count",
        )  # fmt: skip
    return world // others


def _zero(settings: Settings, dp: int, shard: int, cp: int, pp: int) -> int:
    """The ZeRO stage torchtitan's FSDP runs: none without it (DDP), 3 when it reshards
    after forward, else 2 (FSDP2 reduce-scatters the gradients)."""
    if not torchtitan_shards(Strategy(dp=dp, dp_shard=shard, cp=cp, zero=1)):
        return 0
    policy = settings.text("parallelism.fsdp_reshard_after_forward", "default")
    reshard = {"always": True, "never": False, "default": pp == 1}  # torchtitan's policies
    if policy not in reshard:
        raise settings.refuse(
            "parallelism.fsdp_reshard_after_forward", policy, "torchtitan takes "
            + ", ".join(reshard), "use one of them",
        )  # fmt: skip
    return 3 if reshard[policy] else 2


def _batch(settings: Settings, dp: int, pp: int) -> tuple[int, int, int]:
    """(micro-batch, local batch, global batch) in sequences."""
    local = settings.integer("training.local_batch_size", 8)
    total = settings.integer("training.global_batch_size", -1, least=-1)
    total = local * dp if total < 0 else total
    if total % (local * dp):
        raise settings.refuse(
            "training.global_batch_size", total,
            f"not a multiple of local_batch_size x data-parallel degree = {local} x {dp}",
            "make the batch sizes agree",
        )  # fmt: skip
    if pp == 1:
        return local, local, total
    micro = settings.integer("parallelism.pipeline_parallel_microbatch_size", 1)
    if local % micro:
        raise settings.refuse(
            "parallelism.pipeline_parallel_microbatch_size", micro,
            f"does not divide training.local_batch_size = {local}", "use a divisor of it",
        )  # fmt: skip
    return micro, local, total


def _pipeline_rounds(
    pp: int, micro: int, local: int, steps: int, notes: list[str]
) -> dict[str, Any]:
    """Under a pipeline torchtitan runs each of the ``steps`` gradient-accumulation steps
    as a schedule of its own, of ``local_batch_size / pipeline_parallel_microbatch_size``
    micro-batches: a cost option then."""
    if pp == 1 or steps == 1:
        return {}
    notes.append(
        f"{steps} gradient-accumulation steps, each its own pipeline schedule of "
        f"{local // micro} micro-batches (pipeline_round_microbatches)"
    )
    return {"pipeline_round_microbatches": local // micro}


def _pipeline(
    settings: Settings, model: ModelSpec, pp: int, notes: list[str]
) -> tuple[tuple[tuple[str, ...], ...], int, Schedule]:
    """(stage split, model chunks per rank, schedule); no split without a pipeline."""
    if pp == 1:
        return (), 1, Schedule.ONE_F_ONE_B
    name = settings.text("parallelism.pipeline_parallel_schedule", "1F1B")
    if name not in _SCHEDULES:
        raise settings.refuse(
            "parallelism.pipeline_parallel_schedule", name,
            f"the planner prices {', '.join(_SCHEDULES)}", "use one of them",
        )  # fmt: skip
    schedule = _SCHEDULES[name]
    given = settings.get("parallelism.module_fqns_per_model_part")
    if given is not None:
        stages = _named_stages(settings, given, notes)
    else:
        stages = chunks_of(model, _default_split(settings, model.num_layers, pp, schedule))
    if len(stages) % pp:
        raise settings.refuse(
            "parallelism.module_fqns_per_model_part", given, f"{len(stages)} chunks do not "
            f"divide over pipeline_parallel_degree = {pp}", "give a multiple of it",
        )  # fmt: skip
    return stages, len(stages) // pp, schedule


def _named_stages(settings: Settings, given: Any, notes: list[str]) -> tuple[tuple[str, ...], ...]:
    key = "parallelism.module_fqns_per_model_part"
    if isinstance(given, str):
        given = [given]
    if isinstance(given, list) and all(isinstance(chunk, str) for chunk in given):
        given = [chunk.split(",") for chunk in given]  # a command line: A,B C,D
    if not isinstance(given, list) or not all(
        isinstance(chunk, list) and chunk and all(isinstance(f, str) for f in chunk)
        for chunk in given
    ):
        raise settings.refuse(key, given, "expected a list of lists of module names",
                              'write [["tok_embeddings", "layers.0"], ...]')  # fmt: skip
    renamed = [[_HEAD_ALIASES.get(fqn, fqn) for fqn in chunk] for chunk in given]
    if renamed != given:
        notes.append("module_fqns_per_model_part: lm_head read as the zoo model's output")
    return tuple(tuple(chunk) for chunk in renamed)


def _default_split(settings: Settings, layers: int, pp: int, schedule: Schedule) -> list[int]:
    """Blocks per chunk as torchtitan splits the model without module_fqns_per_model_part
    (``pipeline_parallel.py``: ``_get_pipeline_metadata``, ``_generate_llm_fqn_per_model_part``)."""
    first = settings.integer("parallelism.pipeline_parallel_first_stage_less_layers", 1, least=0)
    last = settings.integer("parallelism.pipeline_parallel_last_stage_less_layers", 1, least=0)
    per_stage = settings.get("parallelism.pipeline_parallel_layers_per_stage")
    single = schedule in _SINGLE_STAGE
    if per_stage is None:
        chunks = pp * (1 if single else 2)
    else:
        size = settings.integer("parallelism.pipeline_parallel_layers_per_stage", 1)
        chunks = math.ceil((layers + first + last) / size)
        if chunks % pp or (chunks // pp != 1 if single else chunks // pp < 2):
            raise settings.refuse(
                "parallelism.pipeline_parallel_layers_per_stage", size,
                f"gives {chunks} chunks for {pp} ranks; the {schedule.value} schedule needs "
                f"{'one chunk' if single else 'two or more chunks'} per rank",
                "change it, or give module_fqns_per_model_part",
            )  # fmt: skip
    effective = layers + first + last
    base, extra = divmod(effective, chunks)
    if base == 0 or first > base or last > base:
        raise SpecError(
            f"cannot read {settings.source}: torchtitan cannot split {layers} layers into "
            f"{chunks} chunks with first/last stage weights {first}/{last}; give "
            "module_fqns_per_model_part"
        )
    sizes = [base + (index < extra) for index in range(chunks)]
    sizes[0] -= first
    sizes[-1] -= last
    return sizes


def _recompute(
    settings: Settings, counts: list[int], release_03: bool
) -> tuple[dict[str, Any], str | None]:
    """Strategy recompute fields and the selective policy to price (``op`` for
    torchtitan's per-op selective recompute)."""
    mode = _checkpoint_mode(settings, release_03)
    if mode == "none":
        return {"recompute": RecomputeMode.NONE.value}, None
    if mode == "full":
        return {"recompute": RecomputeMode.FULL.value}, None
    if mode != "selective":
        raise settings.refuse(
            "activation_checkpoint.mode", mode, "the planner prices none, full and selective",
            "use one of them",
        )  # fmt: skip
    key = "activation_checkpoint.selective_ac_option"
    given = key in settings
    option = settings.get(key, "op" if release_03 else "2")  # torchtitan 0.2's default: "2"
    if option == "op":
        return {"recompute": RecomputeMode.SELECTIVE.value}, "op"
    every = settings.integer(key, int(option) if str(option).isdigit() else 0)
    if len(counts) > 1 and (len(set(counts)) > 1 or counts[0] % every):
        default = "" if given else " (torchtitan 0.2's default: the config sets none)"
        raise settings.refuse(
            key, option,
            f"checkpointing one layer in {every} of chunks of {counts} layers does not "
            f"recompute as many layers in every chunk{default}",
            f"set {key} = 'op', or mode 'full' or 'none'",
        )  # fmt: skip
    blocks = counts[0] // every
    if blocks == 0:
        return {"recompute": RecomputeMode.NONE.value}, None
    return {"recompute": RecomputeMode.FULL.value, "recompute_blocks": blocks}, None


def _checkpoint_mode(settings: Settings, release_03: bool) -> str:
    """``activation_checkpoint.mode``, or the policy a torchtitan 0.3 dump's fields name."""
    if "activation_checkpoint.mode" in settings or not release_03:
        return settings.text("activation_checkpoint.mode", "selective")
    fields = settings.under("activation_checkpoint")
    if fields == {"activation_checkpoint": None}:
        return "none"
    if "memory_budget" in fields:
        return "memory-budget"
    return "selective" if not fields or "force_recompute_mm_shapes_by_fqns" in fields else "full"


def _param_dtype(settings: Settings) -> DType:
    """``training.dtype``: float32 (mixed precision) or bfloat16 (parameters, gradients
    and optimizer states all in bf16)."""
    names = {TORCHTITAN_PARAM_DTYPES[d]: d for d in (DType.FP32, DType.BF16)}
    kept = settings.text("training.dtype", TORCHTITAN_PARAM_DTYPES[DType.FP32])
    if kept not in names:
        raise settings.refuse("training.dtype", kept, f"torchtitan takes {' or '.join(names)}",
                              "use one of them")  # fmt: skip
    param = settings.text("training.mixed_precision_param", "bfloat16")
    if names[kept] is DType.BF16 and param != kept:
        raise settings.refuse("training.mixed_precision_param", param,
                              f"with training.dtype = {kept!r} the parameters are bf16 and "
                              "are computed in bf16", "set mixed_precision_param to bfloat16")  # fmt: skip
    return names[kept]


def _dtype(
    settings: Settings, strategy: dict[str, Any], notes: list[str], param_dtype: DType
) -> DType:
    """The training dtype: the parameters' mixed-precision dtype (fp8 with the float8
    converter), fp32 where torchtitan's mixed precision does not reach."""
    param = settings.text("training.mixed_precision_param", "bfloat16")
    # fp8 keeps bfloat16 parameters: the float8 converter, not the dtype, says fp8
    dtypes: dict[str, DType] = {
        name: d for d, name in TORCHTITAN_PARAM_DTYPES.items() if d is not DType.FP8
    }
    if param not in dtypes:
        raise settings.refuse("training.mixed_precision_param", param,
                              f"torchtitan takes {' or '.join(dtypes)}", "use one of them")  # fmt: skip
    dtype = dtypes[param]
    converters = _names(settings.get("model.converters", []))
    if _OLD_FLOAT8 in converters:
        raise settings.refuse(
            "model.converters", converters, f"{_OLD_FLOAT8!r} is torchtitan 0.1's name, which "
            f"0.2 does not register (KeyError)", f"use {FLOAT8_CONVERTER!r}",
        )  # fmt: skip
    unknown = [c for c in converters if c != FLOAT8_CONVERTER]
    if unknown:
        raise settings.refuse("model.converters", converters, f"{unknown[0]} is not priced "
                              f"(fp8 is: {FLOAT8_CONVERTER})", "remove it")  # fmt: skip
    if converters:
        if dtype is not DType.BF16:
            raise settings.refuse("model.converters", converters, "fp8 training keeps bfloat16 "
                                  "parameters", "set mixed_precision_param to bfloat16")  # fmt: skip
        dtype = DType.FP8
    sharded = torchtitan_shards(Strategy(dp=strategy["dp"], dp_shard=strategy["dp_shard"],
                                         cp=strategy["cp"], zero=strategy["zero"]))  # fmt: skip
    pure = param_dtype is DType.BF16  # parameters kept in bf16 throughout
    if (
        dtype is not DType.FP32
        and not pure
        and not sharded
        and (strategy["tp"] > 1 or strategy["pp"] > 1)
    ):
        notes.append(
            f"mixed_precision_param = {param!r} with tp or pp and no FSDP: torchtitan trains in "
            "float32 (it applies mixed precision through FSDP there); priced in fp32"
        )
        return DType.FP32
    return dtype


def _optimizer(settings: Settings) -> Optimizer:
    """The optimizer: ``optimizer.name``, or 0.3's ``param_groups`` (one optimizer)."""
    names: set[str] = set()
    for key, value in settings.under("optimizer.param_groups").items():
        if key.endswith(
            "optimizer_name"
        ):  # a command line: --optimizer.param_groups.0.optimizer_name
            names.add(str(value))
        elif isinstance(value, list):  # a JSON dump: the groups
            names |= {str(g.get("optimizer_name")) for g in value if isinstance(g, dict)}
    if len(names) > 1:
        raise settings.refuse("optimizer.param_groups", sorted(map(str, names)),
                              "the planner prices one optimizer", "use one optimizer")  # fmt: skip
    name = str(names.pop()) if names else settings.text("optimizer.name", "AdamW")
    if name not in _OPTIMIZERS:
        raise settings.refuse("optimizer.name", name, f"the planner prices {', '.join(_OPTIMIZERS)}"
                              " in torchtitan", "use one of them")  # fmt: skip
    return _OPTIMIZERS[name]


def _clipping(settings: Settings) -> bool:
    """Whether gradients are clipped (``max_norm``; infinite: not clipped)."""
    norm = settings.number("training.max_norm", 1.0)
    if norm <= 0:
        raise settings.refuse("training.max_norm", norm, "clipping to a norm <= 0 zeroes the "
                              "gradients", "give a positive norm, or inf for no clipping")  # fmt: skip
    return math.isfinite(norm)


def _cost_options(settings: Settings, tp: int) -> dict[str, Any]:
    """Async tensor parallelism (collectives overlapped with matmuls), compilation
    (pointwise operators fused) and the optimizer's implementation (torchtitan's
    default where the config names none, :data:`~planner.frameworks.KERNELS`)."""
    overlap = settings.flag("parallelism.enable_async_tensor_parallel") or settings.flag(
        "compile.enable_async_tensor_parallel"
    )
    components = _names(settings.get("compile.components", ["model", "loss"]))
    compiled = settings.flag("training.compile") or (
        settings.flag("compile.enable") and "model" in components
    )
    implementation = settings.get(
        "optimizer.implementation", KERNELS[Framework.TORCHTITAN]["optimizer_impl"]
    )
    if implementation not in set(OptimizerImpl):
        raise settings.refuse(
            "optimizer.implementation", implementation, "not an implementation torchtitan has",
            "use one of " + ", ".join(impl.value for impl in OptimizerImpl),
        )  # fmt: skip
    return {
        "tp_comm_overlap": overlap and tp > 1, "fused_pointwise": compiled,
        "optimizer_impl": implementation,
    }  # fmt: skip


def _expert_dispatch(settings: Settings, ep: int) -> dict[str, Any]:
    """``expert_parallel_comm_backend``: DeepEP and HybridEP send a token once per rank
    and node (``ep_dedup``); ``debug.moe_force_load_balance`` gives token t the experts
    t*k .. t*k + k - 1 (torchtitan's round-robin routing: ``expert_choice`` contiguous)."""
    backend = settings.text("parallelism.expert_parallel_comm_backend", "standard")
    if backend not in _EP_BACKENDS:
        raise settings.refuse(
            "parallelism.expert_parallel_comm_backend", backend,
            f"torchtitan's backends are {', '.join(_EP_BACKENDS)}", "use one of them",
        )  # fmt: skip
    dedup = backend != "standard"
    if dedup and ep == 1:
        raise settings.refuse(
            "parallelism.expert_parallel_comm_backend", backend,
            "torchtitan runs DeepEP and HybridEP only with expert parallelism",
            "set parallelism.expert_parallel_degree > 1, or the standard backend",
        )  # fmt: skip
    options: dict[str, Any] = {"ep_dedup": True} if dedup else {}
    if settings.flag("debug.moe_force_load_balance"):
        options["expert_choice"] = ExpertChoice.CONTIGUOUS.value
    return options


def _names(value: Any) -> list[Any]:
    """A list option: a TOML/JSON list, or command-line words (comma-joined in one)."""
    if isinstance(value, str):
        return value.split(",") if "," in value else [value]
    return list(value) if isinstance(value, list) else [value]
