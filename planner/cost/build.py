"""The one way to set up a cost model: what the search prices is what ``plan estimate`` prices.

The search (:func:`planner.planning.search_plan`), ``plan estimate`` and
:func:`~planner.cost.run.estimate_run` all build their :class:`CostModel` here, so the
graph of a zoo-style spec, attention causality (it follows the model: an encoder's
attention is bidirectional) and every :class:`CostOptions` field come from one place.
A plan's prediction is therefore reproduced, to the float, by ``plan estimate --plan``.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.cost.model import CostModel
from planner.cost.options import CostOptions, Fp8Linear, device_options
from planner.cost.spec_graph import Kernels, graph_from_spec
from planner.cost.tp import AssignmentSource
from planner.errors import SpecError
from planner.graph import OpGraph
from planner.hardware import HardwareProfile, load_profile
from planner.spec import Cluster, ModelSpec, Training

__all__ = ["build_cost_model", "model_options", "spec_graph", "stage_indices"]


def model_options(
    options: CostOptions | None, *, causal: bool | None, profile: HardwareProfile,
    masked_share: float = 0.0,
) -> CostOptions:  # fmt: skip
    """``options`` (default: what ``profile``'s device runs,
    :func:`~planner.cost.options.device_options`) with attention causality set by the
    model: ``causal`` is the model's (``ModelSpec.causal``), or ``None`` when the model
    does not say (a traced module: the options' own value, a decoder by default);
    ``masked_share``: the share of its attention calls that pass a mask tensor
    (``CostOptions.masked_attention_share``)."""
    chosen = options or device_options(profile.device_kind)
    update: dict[str, bool | float] = (
        {"masked_attention_share": masked_share} if masked_share else {}
    )
    if causal is not None and chosen.causal != causal:
        update["causal"] = causal
    return chosen.model_copy(update=update) if update else chosen


def spec_graph(spec: ModelSpec, training: Training, options: CostOptions | None = None) -> OpGraph:
    """The formula graph priced for ``spec``: at the training's sequence length (the
    spec's when unset) and dtype, with the dropout nodes and the kernels the options
    describe."""
    options = options or CostOptions()
    kernels = Kernels(
        fused_norm_swiglu=options.fused_norm_swiglu, gqa_native=options.gqa_native,
        moe_probs_in_activation=options.moe_probs_in_activation,
        fp8_saved_inputs=options.fp8_linear is Fp8Linear.TRANSFORMER_ENGINE,
    )  # fmt: skip
    return graph_from_spec(
        spec, seq_len=training.seq_len or spec.seq_len, dtype=training.dtype,
        dropout=options.dropout, kernels=kernels,
    )  # fmt: skip


def build_cost_model(
    graph: OpGraph,
    cluster: Cluster,
    training: Training,
    *,
    causal: bool | None,
    options: CostOptions | None = None,
    tp_layouts: AssignmentSource | None = None,
    profile: HardwareProfile | None = None,
) -> CostModel:
    """The cost model of ``graph`` trained as ``training`` on ``cluster``.

    ``causal``: whether the model's attention is causal (``ModelSpec.causal``; ``None``
    for a traced model: what its own attention calls say, ``graph.attention_causal``,
    else the options' value). ``options``
    default to what the profile's device runs; ``profile`` to the cluster's. ``tp_layouts`` gives
    the tensor-parallel layouts to price (the sharding ILP's for a traced model; ``None``
    for a formula graph, which is priced with Megatron-LM's).
    """
    profile = profile or load_profile(cluster.gpu)
    return CostModel(
        graph, cluster, training, profile=profile,
        options=model_options(
            options, causal=graph.attention_causal if causal is None else causal,
            profile=profile, masked_share=graph.masked_attention_share,
        ),
        tp_layouts=tp_layouts,
    )  # fmt: skip


def stage_indices(graph: OpGraph, stages: Sequence[Sequence[str]]) -> list[list[int]]:
    """A plan's stages (module FQNs per model chunk, as ``Plan.stages``) as the segment
    indices per chunk that :meth:`CostModel.estimate` takes. Raises :class:`SpecError`
    naming a module that is no segment of the graph or a chunk that splits a segment."""
    owner: dict[str, int] = {}
    for index, segment in enumerate(graph.segments):
        for fqn in segment.modules:
            owner[fqn] = index
    chunks: list[list[int]] = []
    for number, chunk in enumerate(stages):
        indices: list[int] = []
        for fqn in chunk:
            if fqn not in owner:
                known = ", ".join(list(owner)[:4])
                raise SpecError(
                    f"stages[{number}] names {fqn!r}, which is not a pipeline unit of "
                    f"{graph.model_name} (units are modules such as {known}, ...)"
                )
            if not indices or indices[-1] != owner[fqn]:
                indices.append(owner[fqn])
        chunks.append(indices)
    for segment in graph.segments:
        holders = [n for n, chunk in enumerate(stages) if set(segment.modules) & set(chunk)]
        if len(holders) > 1:
            raise SpecError(
                f"stages {holders} split {segment.fqn!r} ({', '.join(segment.modules)}): "
                "its modules must stay in one stage"
            )
    return chunks
