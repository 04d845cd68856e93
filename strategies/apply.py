"""Apply a plan to a model, one parallel dimension at a time, in one documented order.

1. validate the plan against the world size and the model, its tensor-parallel
   layout by the planner's rules and a rehearsal on fake tensors (on the first rank),
   and its pipeline stages; the ranks agree on the outcome (one all-gather), so all
   fail alike
2. build the device mesh
3. pipeline split (this rank's chunks; each runs as its stage once steps 4-10 wrapped it)
4. context parallel (attention gathers keys and values over cp; global positions)
5. tensor / sequence parallel
6. expert parallel (ep > 1: each EP rank keeps its experts, tokens go by all-to-all)
7. activation recompute
8. FSDP (ZeRO >= 1, sharding over dp_shard x cp; experts over their own shard ranks)
9. deferred initialisation of a meta-device model: this rank's shards only
10. DDP (ZeRO 0, over dp_replicate x cp; expert gradients averaged over their replicas)
11. gradient-compression hooks
12. weights from a checkpoint or Hugging Face safetensors: each rank reads its shards

The same order as torchtitan's ``parallelize_llama``: each later step wraps what the
earlier ones produced (FSDP shards DTensor-TP parameters into 2-D DTensors, DDP's hooks
see the final parameters).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.errors import PlanMismatchError, PlannerError, SpecError, TraceError
from planner.frameworks import PLANNER, strategy_refusal
from planner.layouts import check_plan_layout
from planner.modules import (
    check_model_against_plan,
    check_parameter_dtype,
    router_loss_pipeline_blocker,
)
from planner.spec import Axis, Plan
from planner.staging import logits_problem, output_logits
from planner.validate import validate_plan_for_world
from strategies import (
    checkpointing,
    compression,
    context_parallel,
    data_parallel,
    expert_parallel,
    fsdp,
    materialize,
    pipeline,
    state,
    tensor_parallel,
)
from strategies.mesh import axis_rank, build_mesh, local_device
from strategies.parallel_model import ParallelModel, loss_context
from strategies.pipeline import LossFn

__all__ = ["parallelize", "token_cross_entropy", "loss_context"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def token_cross_entropy(output: object, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all tokens; ``output`` holds the logits
    (:func:`planner.staging.output_logits`: a tensor, ``.logits``, or a tuple's first)."""
    logits = output_logits(output)
    problem = logits_problem(logits.shape, targets.shape)
    if problem is not None:
        raise SpecError(
            f"the loss cannot be computed: {problem}, or give "
            "planner.parallelize(model, plan, loss_fn=...) a loss for its output"
        )
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def parallelize(
    model: nn.Module,
    plan: Plan,
    *,
    loss_fn: LossFn = token_cross_entropy,
    seed: int = 0,
    init: materialize.Init | None = None,
    weights: str | Path | None = None,
) -> ParallelModel:
    """Apply ``plan`` to ``model`` on the current process group (or a single process).

    Returns a :class:`~strategies.parallel_model.ParallelModel`: the parallel model (or,
    for ``pp > 1``, this rank's pipeline chunks behind the schedule), which knows the
    plan; its ``step(inputs, targets)`` runs forward and backward with ``loss_fn``.

    A model built on the meta device is initialised after the plan cut and sharded it,
    each rank allocating only its shards (:mod:`strategies.materialize`): ``init(module)``
    sets a module's own tensors (default: ``reset_parameters`` then the root's
    ``_init_weights``), seeded per module from ``seed``, so the weights are the same
    under any plan.

    ``weights`` names a Hugging Face model directory (``*.safetensors``; the zoo Llama's
    tensors under Hugging Face's names) or a checkpoint from :meth:`ParallelModel.save`:
    each rank reads only its shards of each tensor, after the plan cut and sharded the
    model (a meta-device model then initialises only what the checkpoint lacks, such as
    non-persistent buffers).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    _agreed(lambda: _check(model, plan, loss_fn, trace=rank == 0))
    source = _agreed(lambda: state.weight_source(weights, model)) if weights is not None else None
    loaded = frozenset(source.names) if source is not None else frozenset()
    deferred = _Deferred(seed, init, loaded) if materialize.is_deferred(model) else None
    mesh = build_mesh(plan)
    materialize.check_same_weights(model, loaded)
    meshes = _Meshes(mesh, expert_parallel.build_expert_mesh(plan))
    parallel = _parallel_model(model, meshes, plan, loss_fn, deferred)
    if source is not None:
        state.load_weights(parallel.model_state, source)
    return parallel


def _check(model: nn.Module, plan: Plan, loss_fn: LossFn, *, trace: bool) -> None:
    """Raise unless ``plan`` can run on ``model`` (pure: no collective); ``trace``: also
    check ``plan.tp_layout`` on a trace of the model (:func:`check_plan_layout`)."""
    refusal = strategy_refusal(PLANNER, plan.strategy, plan.training)
    if refusal is not None:  # a plan made for another framework (plan.target)
        raise SpecError(f"plan.{refusal.describe()} (plan made for {plan.target}); {refusal.fix}")
    _check_auxiliary_loss(model, loss_fn, plan)
    validate_plan_for_world(plan, dist.get_world_size() if dist.is_initialized() else 1)
    check_model_against_plan(plan, model)
    check_parameter_dtype(plan, model)
    if trace:
        check_plan_layout(plan, model)
    pipeline.check_split(model, plan)
    materialize.check_deferrable(model)


_PASSED_ON = {cls.__name__: cls for cls in (SpecError, TraceError, PlanMismatchError)}


def _agreed(check: Callable[[], _T]) -> _T:
    """``check()`` on this rank; on every rank, the first failing rank's error named after
    it (``rank 3: ...``; unnamed when every rank failed alike), so no rank is left
    waiting in a collective a peer never reached.
    The ranks check alike except that each reads its own file system and only the first
    traces the model: every rank holds the plan's model (:func:`check_model_against_plan`),
    so one trace speaks for all, where a node's ranks tracing at once would each spend its
    CPU time and memory."""
    result: _T | None = None
    error: PlannerError | None = None
    try:
        result = check()
    except PlannerError as exc:
        error = exc
    except OSError as exc:
        error = SpecError(f"{type(exc).__name__}: {exc}")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return result  # type: ignore[return-value]
    local_device()  # all_gather_object's tensors go to the current GPU under NCCL
    errors: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else _named(error))
    if error is not None and all(named == _named(error) for named in errors):
        raise error  # every rank alike: no rank to name
    failed = [(rank, named) for rank, named in enumerate(errors) if named is not None]
    if failed:
        rank, (kind, message) = failed[0]
        raise _PASSED_ON.get(kind, SpecError)(f"rank {rank}: {message}") from error
    return result  # type: ignore[return-value]


def _named(error: PlannerError) -> tuple[str, str]:
    return type(error).__name__, str(error)


def _check_auxiliary_loss(model: nn.Module, loss_fn: LossFn, plan: Plan) -> None:
    """Refuse a model set to add an auxiliary load-balancing loss (a Hugging Face MoE
    config's ``output_router_logits``) with the default loss (token cross-entropy alone
    would train without it, silently) or in a pipeline (the last stage's output is its
    logits, without the routers' loss)."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return
    coefficient = getattr(config, "router_aux_loss_coef", None)
    staged = router_loss_pipeline_blocker(model)
    if plan.strategy.pp > 1 and staged is not None:
        raise SpecError(f"plan.strategy.pp = {plan.strategy.pp}: {staged}")
    if loss_fn is not token_cross_entropy:
        return
    raise SpecError(
        "model.config.output_router_logits = True: the model adds a load-balancing loss "
        f"(router_aux_loss_coef = {coefficient}), which the default loss (token "
        "cross-entropy of the logits) leaves out; set config.output_router_logits = False "
        "to train without it, or give planner.parallelize(model, plan, loss_fn=...) a loss "
        "that adds output.aux_loss times the coefficient (pp = 1: a pipeline's last stage "
        "sees only its own routers)"
    )


@dataclass(frozen=True)
class _Meshes:
    """The plan's mesh and, for ``ep > 1``, the experts mesh (built once for all chunks)."""

    dense: DeviceMesh | None
    experts: expert_parallel.ExpertMesh | None


def _parallel_model(
    model: nn.Module,
    meshes: _Meshes,
    plan: Plan,
    loss_fn: LossFn,
    deferred: _Deferred | None,
) -> ParallelModel:
    mesh = meshes.dense
    if mesh is not None and plan.strategy.pp > 1:
        pp_rank = axis_rank(mesh, Axis.PP)
        chunks = [
            (index, _apply_dimensions(chunk, meshes, plan, pp_rank, deferred))
            for index, chunk in pipeline.split(model, mesh, plan)
        ]
        pipeline.install_stages(chunks, plan)
        runner = pipeline.build_runner(chunks, mesh, plan, loss_fn, lambda: loss_context(plan))
        return ParallelModel(plan, runner, mesh=mesh, loss_fn=loss_fn)
    return ParallelModel(
        plan, _apply_dimensions(model, meshes, plan, 0, deferred), mesh=mesh, loss_fn=loss_fn
    )


@dataclass(frozen=True)
class _Deferred:
    """How a meta-device model is initialised once sharded."""

    seed: int
    init: materialize.Init | None
    loaded: Collection[str]  # FQNs a checkpoint gives: not initialised


def _apply_dimensions(
    model: nn.Module,
    meshes: _Meshes,
    plan: Plan,
    pp_rank: int,
    deferred: _Deferred | None,
) -> nn.Module:
    device = local_device()
    if deferred is None and device.type == "cuda":
        model.to(device)
    mesh = meshes.dense
    model = context_parallel.apply(model, mesh, plan)
    model = tensor_parallel.apply(model, mesh, plan)
    model = expert_parallel.apply(model, mesh, meshes.experts, plan)
    model = checkpointing.apply(model, mesh, plan, pp_rank=pp_rank)
    model = fsdp.apply(model, mesh, plan, meshes.experts)
    if deferred is not None:
        model = materialize.apply(
            model, device, seed=deferred.seed, init=deferred.init, loaded=deferred.loaded
        )
    model = data_parallel.apply(model, mesh, plan, meshes.experts)
    return compression.apply(model, mesh, plan)
