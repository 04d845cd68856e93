"""Assemble a runnable :class:`~planner.spec.Plan` from a model and a chosen strategy.

The search decides the strategy; this module fills in what the runtime needs besides:
the mesh, the model fingerprint and source, the pipeline stage split as FQN lists
(torchtitan's ``module_fqns_per_model_part`` form) and, for tensor parallelism on the
zoo transformer, Megatron-LM's layout (:func:`planner.layouts.megatron_constraints`,
written out module by module). Models outside the zoo need an explicit ``tp_layout``
(:func:`planner.make_plan` writes the one the sharding ILP finds).
"""

from __future__ import annotations

from torch import nn

from planner.cost.pipeline import even_split
from planner.errors import SpecError
from planner.layouts import FIXED_STYLE_PRICER, ModelLayouts
from planner.models import ModelHandle, fingerprint, handle_for_module
from planner.modules import find_blocks
from planner.spec import (
    Candidate,
    Cluster,
    ModuleTP,
    Plan,
    Prediction,
    SolverStats,
    Strategy,
    Training,
)
from planner.staging import modules_around
from planner.tracing import default_seq_len, trace_for_training, traced_inputs
from planner.validate import check_batch
from planner.version import __version__

__all__ = ["assemble_plan", "megatron_layout", "even_stages"]


def assemble_plan(
    handle: ModelHandle,
    cluster: Cluster,
    training: Training,
    strategy: Strategy,
    *,
    tp_layout: dict[str, ModuleTP] | None = None,
    stages: list[list[str]] | None = None,
    prediction: Prediction | None = None,
    runners_up: tuple[Candidate, ...] = (),
    solver: SolverStats | None = None,
    tradeoffs: tuple[str, ...] = (),
    target: str = "planner",
    without_target: Candidate | None = None,
    model_digest: str = "",
) -> Plan:
    """A :class:`Plan` for ``handle`` under ``strategy``, with defaults for layout and stages.

    ``stages`` defaults to :func:`even_stages` when ``strategy.pp > 1``; ``tp_layout``
    defaults to :func:`megatron_layout` when ``strategy.tp > 1`` (zoo models only).
    Raises :class:`SpecError` when the strategy does not make the global batch.
    """
    check_batch(training, strategy)
    if training.seq_len is None and handle.spec is None:
        traced_seq = default_seq_len(handle)  # 1: not a sequence model
        if traced_seq > 1:
            training = training.model_copy(update={"seq_len": traced_seq})
    if strategy.tp > 1 and tp_layout is None:
        tp_layout = megatron_layout(handle, training, strategy)
    if strategy.pp > 1 and stages is None:
        stages = even_stages(handle.module, strategy.num_stages)
    return Plan(
        planner_version=__version__,
        model_name=handle.name,
        model_fingerprint=fingerprint(handle.module),
        model_digest=model_digest,
        model=handle.spec,
        model_source=handle.source,
        inputs=traced_inputs(handle, training),
        cluster=cluster,
        training=training,
        strategy=strategy,
        mesh=strategy.mesh_axes(),
        stages=tuple(tuple(chunk) for chunk in stages or ()),
        tp_layout=dict(tp_layout or {}),
        target=target,
        prediction=prediction,
        without_target=without_target,
        tradeoffs=tradeoffs,
        runners_up=runners_up,
        solver=solver or SolverStats(),
    )


def megatron_layout(
    handle: ModelHandle, training: Training, strategy: Strategy
) -> dict[str, ModuleTP]:
    """Megatron-LM's tensor-parallel layout of a zoo transformer at ``strategy``'s tp and
    sequence parallelism, module by module (redistributions chosen and rehearsed)."""
    if handle.spec is None:
        raise SpecError(
            f"strategy.tp > 1 for model {handle.name!r}, which is not a zoo transformer: "
            "give its tp_layout (planner.make_plan writes the one the sharding ILP finds)"
        )
    tokens = handle_for_module(handle.module, name=handle.name)  # token ids, whatever handle takes
    layouts = ModelLayouts(
        tokens, None, FIXED_STYLE_PRICER, trace=lambda: trace_for_training(tokens, training)
    )
    layout = layouts.layout(strategy.tp, strategy.sequence_parallel)
    if layout is None:
        raise SpecError(
            f"strategy.sequence_parallel = true at tp {strategy.tp} does not run "
            f"{handle.name!r} on this runtime: {layouts.why_not(strategy.tp, True)}"
        )
    return layout.modules


def even_stages(module: nn.Module, num_chunks: int) -> list[list[str]]:
    """Split ``module`` into ``num_chunks`` FQN lists as the cost model prices them
    (:func:`planner.cost.pipeline.even_split`).

    Modules registered before the block container (embeddings) join the first chunk,
    modules after it (final norm, output head) the last; when the blocks do not divide
    evenly, the middle chunks take the extra ones.
    """
    blocks = [fqn for fqn, _ in find_blocks(module)]
    if len(blocks) < num_chunks:
        raise SpecError(
            f"{type(module).__name__} has {len(blocks)} repeated blocks, too few for "
            f"{num_chunks} pipeline chunks; lower pp or virtual_stages"
        )
    before, after = modules_around(module)
    return even_split(blocks, num_chunks, before, after)
