"""One run described as data (``plan estimate``'s contract) and its estimate.

A run config is one JSON object::

    {"model": {"preset": "gpt3-175b"} or inline ModelSpec fields,
     "cluster": {...Cluster}, "training": {...Training},
     "strategy": {...Strategy, num_microbatches may be omitted},
     "options": {...CostOptions, optional},
     "stages": [["tok_embeddings", "layers.0", ...], ...]}   (optional)

``training.micro_batch_size`` is the strategy's micro-batch size when the strategy
does not give one; ``options.causal`` follows the model family; ``num_microbatches`` defaults to ``global_batch_size / (dp * mbs)``.
``stages`` lists the module FQNs of each pipeline model chunk, as a plan's ``stages``
do (default: the even split). A saved plan of a zoo or spec model is a run config too
(:meth:`RunConfig.from_plan`): its estimate is the plan's prediction, to the float,
because the search and this module build the cost model with
:func:`~planner.cost.build.build_cost_model`.
Every inconsistency raises a :class:`~planner.errors.SpecError` naming the fields.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from planner.cost.build import build_cost_model, spec_graph, stage_indices
from planner.cost.flops import bf16_peak_mfu
from planner.cost.options import CostOptions, RecomputeModule, device_options
from planner.errors import SpecError
from planner.frameworks import KERNELS, parse_target
from planner.hardware import HardwareProfile, load_profile
from planner.parallel_dims import ParallelDims
from planner.presets import get_preset
from planner.spec import (
    Cluster,
    ModelSpec,
    Plan,
    Prediction,
    Strategy,
    Training,
    load_document,
)

__all__ = ["RunConfig", "estimate_run", "prediction_to_dict"]

_SECTIONS = ("model", "cluster", "training", "strategy", "options", "stages")


class RunConfig(BaseModel):
    """A validated run: model, cluster, training, strategy and implementation options."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec
    cluster: Cluster
    training: Training
    strategy: Strategy
    options: CostOptions = CostOptions()  # from_dict: over the device's own options
    stages: tuple[tuple[str, ...], ...] = ()  # module FQNs per model chunk; () = even split

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "run config") -> RunConfig:
        """Resolve presets, fill derived strategy fields and check consistency."""
        if not isinstance(data, dict):
            raise SpecError(f"{source}: expected a JSON object, got {type(data).__name__}")
        unknown = set(data) - set(_SECTIONS)
        if unknown:
            raise SpecError(
                f"{source}: unknown section(s) {', '.join(sorted(unknown))}; "
                f"allowed: {', '.join(_SECTIONS)}"
            )
        for section in ("model", "cluster", "training", "strategy"):
            if not isinstance(data.get(section), dict):
                raise SpecError(f"{source}: section {section!r} is missing or not an object")
        if not isinstance(data.get("options", {}), dict):
            raise SpecError(f"{source}: section 'options' is not an object; give a JSON object")
        training = load_document(Training, data["training"], f"{source} training")
        model = _resolve_model(data["model"], training, source)
        cluster = load_document(Cluster, data["cluster"], f"{source} cluster")
        profile = load_profile(cluster.gpu)  # unknown GPU: the error lists the profiles
        strategy = _resolve_strategy(data["strategy"], training, source)
        given = data.get("options", {})  # over what the profile's device runs
        defaults = device_options(profile.device_kind).model_dump(mode="json")
        options = load_document(CostOptions, {**defaults, **given}, f"{source} options")
        if "causal" in data.get("options", {}) and options.causal != model.causal:
            raise SpecError(
                f"{source}: options.causal = {options.causal} contradicts the {model.family.value} "
                f"model (causal = {model.causal}); leave it out, it follows the model"
            )
        if RecomputeModule.MLA_UP_PROJ in options.recompute_modules and not model.latent_attention:
            raise SpecError(
                f"{source}: options.recompute_modules has 'mla_up_proj' but {model.name} has no "
                "multi-head latent attention (Megatron-LM refuses it too); drop it"
            )
        stages = _resolve_stages(data.get("stages", []), strategy, source)
        check_run(model, cluster, training, strategy, split=bool(stages))
        return cls(
            model=model, cluster=cluster, training=training, strategy=strategy, options=options,
            stages=stages,
        )  # fmt: skip

    @classmethod
    def from_plan(cls, plan: Plan, source: str = "plan") -> RunConfig:
        """The run a saved plan describes: its model spec, cluster, training, strategy and
        pipeline stages, priced with the options ``plan`` searches with (what the
        cluster's device runs, :func:`~planner.cost.options.device_options`, with the
        kernels of the plan's target, :data:`~planner.frameworks.KERNELS`)."""
        if plan.model is None:
            where = plan.model_source or "a traced module"
            raise SpecError(
                f"{source}: the plan's model {plan.model_name!r} ({where}) carries no "
                "ModelSpec; plan estimate prices zoo and spec models, whose plans carry "
                "their spec (a traced model is priced by planner.make_plan)"
            )
        data = {
            "model": plan.model.model_dump(mode="json"),
            "cluster": plan.cluster.model_dump(mode="json"),
            "training": plan.training.model_dump(mode="json"),
            "strategy": plan.strategy.model_dump(mode="json"),
            "stages": [list(chunk) for chunk in plan.stages],
            "options": KERNELS.get(parse_target(plan.target, field="plan.target").framework, {}),
        }
        return cls.from_dict(data, source)


def _resolve_stages(data: Any, strategy: Strategy, source: str) -> tuple[tuple[str, ...], ...]:
    """``stages`` as module FQNs per model chunk, one chunk per pipeline stage."""
    if not isinstance(data, list) or not all(
        isinstance(chunk, list) and chunk and all(isinstance(f, str) for f in chunk)
        for chunk in data
    ):
        raise SpecError(
            f"{source}: stages must be a list of non-empty lists of module names (a plan's "
            'stages, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]])'
        )
    if data and len(data) != strategy.num_stages:
        raise SpecError(
            f"{source}: stages has {len(data)} chunks but pp({strategy.pp}) * "
            f"virtual_stages({strategy.virtual_stages}) = {strategy.num_stages}: give one "
            "list of modules per model chunk"
        )
    return tuple(tuple(chunk) for chunk in data)


def _resolve_model(data: dict[str, Any], training: Training, source: str) -> ModelSpec:
    fields = dict(data)
    preset = fields.pop("preset", None)
    if preset is not None:
        base = get_preset(str(preset)).model_dump()
        fields = {**base, **fields}
    spec = load_document(ModelSpec, fields, f"{source} model")
    if training.seq_len is not None and training.seq_len != spec.seq_len:
        spec = spec.with_seq_len(training.seq_len)
    return spec


def _resolve_strategy(data: dict[str, Any], training: Training, source: str) -> Strategy:
    fields = dict(data)
    given = fields.get("micro_batch_size")
    if training.micro_batch_size is not None:
        if given is not None and given != training.micro_batch_size:
            raise SpecError(
                f"{source}: strategy.micro_batch_size ({given}) != training.micro_batch_size "
                f"({training.micro_batch_size}): give it once or make them agree"
            )
        fields["micro_batch_size"] = training.micro_batch_size
    mbs, dp = fields.get("micro_batch_size", 1), fields.get("dp", 1)
    well_formed = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (mbs, dp))
    if "num_microbatches" not in fields and well_formed:  # else validation names the field
        if training.global_batch_size % (dp * mbs):
            raise SpecError(
                f"{source}: training.global_batch_size ({training.global_batch_size}) is not "
                f"divisible by dp({dp}) * micro_batch_size({mbs}) = {dp * mbs}: change the "
                "batch size or the micro-batch size"
            )
        fields["num_microbatches"] = training.global_batch_size // (dp * mbs)
    return load_document(Strategy, fields, f"{source} strategy")


def check_run(
    model: ModelSpec, cluster: Cluster, training: Training, strategy: Strategy,
    *, split: bool = False,
) -> None:  # fmt: skip
    """Raise :class:`SpecError` if the strategy cannot run this model on this cluster
    (``split``: with a given stage split, whose chunks may hold only the embedding or head)."""
    s = strategy
    if s.world_size != cluster.num_gpus:
        raise SpecError(
            f"dp({s.dp}) * tp({s.tp}) * pp({s.pp}) * cp({s.cp}) = {s.world_size} != "
            f"num_gpus({cluster.num_gpus}): change the degrees or cluster.num_gpus"
        )
    for name, heads in (("num_heads", model.num_heads), ("num_kv_heads", model.kv_heads)):
        if heads % s.tp:
            raise SpecError(
                f"model.{name} ({heads}) is not divisible by tp ({s.tp}): "
                "choose a tp that divides the head counts"
            )
    dims = ParallelDims.of(s)
    blocker = (
        dims.batch_blocker(training.global_batch_size, s.micro_batch_size, s.num_microbatches)
        or dims.sequence_blocker(model.seq_len)
        or (dims.expert_blocker(model.num_experts) if s.ep > 1 or s.etp > 1 else None)
    )
    if blocker is not None:
        raise SpecError(blocker)
    # a given stage split may hold the embedding and the head in chunks of their own
    chunks = model.num_layers + (2 if split else 0)
    if s.num_stages > chunks:
        raise SpecError(
            f"pp({s.pp}) * virtual_stages({s.virtual_stages}) = {s.num_stages} model chunks "
            f"but the model has {model.num_layers} layers"
            + (" (and the embedding and head chunks)" if split else "")
            + ": use fewer pipeline stages"
        )


def estimate_run(
    config: dict[str, Any] | RunConfig, *, profile: HardwareProfile | None = None
) -> Prediction:
    """Estimate one run given as a :class:`RunConfig` or its JSON-shaped dict, on
    ``profile`` (default: the cluster's GPU profile)."""
    run = config if isinstance(config, RunConfig) else RunConfig.from_dict(config)
    graph = spec_graph(run.model, run.training, run.options)
    model = build_cost_model(
        graph, run.cluster, run.training, causal=run.model.causal, options=run.options,
        profile=profile,
    )  # fmt: skip
    stages = stage_indices(graph, run.stages) if run.stages else None
    return model.estimate(run.strategy, stages=stages)


def prediction_to_dict(
    prediction: Prediction, run: RunConfig | Plan | None = None
) -> dict[str, Any]:
    """The ``plan estimate --json`` object for one run; with the ``run`` (or plan), also
    ``mfu_bf16_peak`` when the dtype's own peak is not bf16's (fp8)."""
    data = prediction.model_dump(mode="json")
    data["breakdown"] = data.pop("breakdown_s")
    bf16 = None
    if run is not None:
        bf16 = bf16_peak_mfu(prediction, dtype=run.training.dtype, gpu=run.cluster.gpu)
    if bf16 is not None:
        data["mfu_bf16_peak"] = bf16
    return data
