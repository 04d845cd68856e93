"""One run described as data (``plan estimate``'s contract) and its estimate.

A run config is one JSON object::

    {"model": {"preset": "gpt3-175b"} or inline ModelSpec fields,
     "cluster": {...Cluster}, "training": {...Training},
     "strategy": {...Strategy, num_microbatches may be omitted},
     "options": {...CostOptions, optional}}

``training.micro_batch_size`` is the strategy's micro-batch size when the strategy
does not give one; ``options.causal`` follows the model family; ``num_microbatches`` defaults to ``global_batch_size / (dp * mbs)``.
Every inconsistency raises a :class:`~planner.errors.SpecError` naming the fields.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from planner.cost.model import CostModel
from planner.cost.options import CostOptions
from planner.cost.spec_graph import graph_from_spec
from planner.errors import SpecError
from planner.hardware import load_profile
from planner.parallel_dims import ParallelDims
from planner.presets import get_preset
from planner.spec import Cluster, ModelSpec, Prediction, Strategy, Training, load_document

__all__ = ["RunConfig", "estimate_run", "prediction_to_dict"]


class RunConfig(BaseModel):
    """A validated run: model, cluster, training, strategy and implementation options."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec
    cluster: Cluster
    training: Training
    strategy: Strategy
    options: CostOptions = CostOptions()

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "run config") -> RunConfig:
        """Resolve presets, fill derived strategy fields and check consistency."""
        if not isinstance(data, dict):
            raise SpecError(f"{source}: expected a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"model", "cluster", "training", "strategy", "options"}
        if unknown:
            raise SpecError(
                f"{source}: unknown section(s) {', '.join(sorted(unknown))}; "
                "allowed: model, cluster, training, strategy, options"
            )
        for section in ("model", "cluster", "training", "strategy"):
            if not isinstance(data.get(section), dict):
                raise SpecError(f"{source}: section {section!r} is missing or not an object")
        training = load_document(Training, data["training"], f"{source} training")
        model = _resolve_model(data["model"], training, source)
        cluster = load_document(Cluster, data["cluster"], f"{source} cluster")
        load_profile(cluster.gpu)  # unknown GPU: the error lists the profiles
        strategy = _resolve_strategy(data["strategy"], training, source)
        options = load_document(CostOptions, data.get("options", {}), f"{source} options")
        if "causal" in data.get("options", {}) and options.causal != model.causal:
            raise SpecError(
                f"{source}: options.causal = {options.causal} contradicts the {model.family.value} "
                f"model (causal = {model.causal}); leave it out, it follows the model"
            )
        check_run(model, cluster, training, strategy)
        return cls(
            model=model, cluster=cluster, training=training, strategy=strategy, options=options
        )


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


def check_run(model: ModelSpec, cluster: Cluster, training: Training, strategy: Strategy) -> None:
    """Raise :class:`SpecError` if the strategy cannot run this model on this cluster."""
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
    blocker = dims.batch_blocker(
        training.global_batch_size, s.micro_batch_size, s.num_microbatches
    ) or dims.sequence_blocker(model.seq_len)
    if blocker is not None:
        raise SpecError(blocker)
    if s.num_stages > model.num_layers:
        raise SpecError(
            f"pp({s.pp}) * virtual_stages({s.virtual_stages}) = {s.num_stages} model chunks "
            f"but the model has {model.num_layers} layers: use fewer pipeline stages"
        )


def estimate_run(config: dict[str, Any] | RunConfig) -> Prediction:
    """Estimate one run given as a :class:`RunConfig` or its JSON-shaped dict."""
    run = config if isinstance(config, RunConfig) else RunConfig.from_dict(config)
    graph = graph_from_spec(run.model, dtype=run.training.dtype, dropout=run.options.dropout)
    training = run.training.model_copy(update={"seq_len": None})
    options = run.options.model_copy(update={"causal": run.model.causal})
    model = CostModel(graph, run.cluster, training, options=options)
    return model.estimate(run.strategy)


def prediction_to_dict(prediction: Prediction) -> dict[str, Any]:
    """The ``plan estimate --json`` object for one run."""
    data = prediction.model_dump(mode="json")
    data["breakdown"] = data.pop("breakdown_s")
    return data
