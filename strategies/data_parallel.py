"""Plain data parallel (ZeRO-0): DDP over the ``dp_replicate`` axis (joined with ``cp``).

Context-parallel ranks hold replicas too, so their gradients are averaged over
dp_replicate x cp (:func:`strategies.mesh.replicate_mesh`).

With ``tp > 1`` DDP runs over the tensor-parallel shards: torch's
``_pre_dp_module_transform`` hands DDP the DTensor parameters' local shards (the way
torch composes TP with DDP), so DDP communication hooks (compression) apply too. It
loses tied weights, and DDP's reducer fails when a pipeline schedule runs several
backwards per step (torch 2.13, gloo): plans there use ZeRO >= 1 (the search offers no
ZeRO-0 and validation refuses it, :meth:`planner.parallel_dims.ParallelDims.ddp_blocker`).

Expert-parallel experts are no replicas over dp x cp: DDP ignores them, and their
gradients are averaged over their own replicas instead
(:func:`strategies.expert_parallel.reduce_replica_gradients`), under any ZeRO stage
where FSDP2 does not reduce them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
from torch.nn.parallel import DistributedDataParallel

from planner.parallel_dims import ParallelDims
from planner.spec import Plan
from strategies import expert_parallel
from strategies.mesh import replicate_mesh

__all__ = ["apply", "as_shard_of", "ddp"]

log = logging.getLogger(__name__)


def apply(
    model: nn.Module,
    mesh: DeviceMesh | None,
    plan: Plan,
    experts_mesh: expert_parallel.ExpertMesh | None = None,
) -> nn.Module:
    """Wrap ``model`` in DDP over dp_replicate x cp (returns the wrapper) when the plan says
    DP; average expert gradients over their replicas (``experts_mesh``, ``ep > 1``)."""
    experts = expert_parallel.expert_parameter_names(model) if experts_mesh is not None else []
    wrapped = _ddp(model, mesh, plan, experts)
    group = expert_parallel.replica_group(experts_mesh, plan)
    if group is not None:
        params = dict(model.named_parameters())  # DDP over TP shards: its local parameters
        hooked = expert_parallel.reduce_replica_gradients(
            model, [params[n] for n in experts], group
        )
        log.info("expert gradients: %d parameters averaged over %d replicas", hooked,
                 ParallelDims.of(plan.strategy).expert_replicas)  # fmt: skip
    return wrapped


def _ddp(model: nn.Module, mesh: DeviceMesh | None, plan: Plan, ignored: list[str]) -> nn.Module:
    if not ParallelDims.of(plan.strategy).uses_ddp or mesh is None:
        return model
    dp_mesh = replicate_mesh(mesh)
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    if plan.strategy.tp > 1:
        _over_tensor_parallel_shards(model)
    wrapped = ddp(model, dp_mesh)
    log.info("ddp: over %s, %d ranks%s", dp_mesh.mesh_dim_names, dp_mesh.size(),
             f", {len(ignored)} expert parameters left out" if ignored else "")  # fmt: skip
    return wrapped


def ddp(model: nn.Module, mesh: DeviceMesh | None = None) -> DistributedDataParallel:
    """``model`` under DDP over ``mesh`` (default: the process group), its gradients
    views into DDP's buckets: one copy of them, not two."""
    return DistributedDataParallel(model, device_mesh=mesh, gradient_as_bucket_view=True)


def as_shard_of(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``tensor`` (shaped like ``param``'s local shard) as the DTensor it is a shard of,
    when ``param`` is a tensor-parallel shard handed to DDP (it carries its layout as
    ``_st_info``); else ``tensor``. The DTensor shares ``tensor``'s storage."""
    spec = getattr(param, "_st_info", None)
    if spec is None:
        return tensor
    return DTensor.from_local(
        tensor.detach(),
        spec.mesh,
        spec.placements,
        run_check=False,
        shape=spec.shape,
        stride=spec.stride,
    )


def _over_tensor_parallel_shards(model: nn.Module) -> None:
    """Hand DDP the local shards of ``model``'s DTensor parameters (torch's
    ``_pre_dp_module_transform``), keeping ``state_dict`` whole.

    The transform turns the parameters into DTensor attributes during forward, so the
    module stops listing them; a state-dict hook puts each shard back as the DTensor
    it is (the optimizer holds the shards themselves).
    """
    _pre_dp_module_transform(model)
    shards = {name: p for name, p in model.named_parameters() if hasattr(p, "_st_info")}

    def add_shards(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        for name, shard in shards.items():
            state.setdefault(prefix + name, as_shard_of(shard, shard))

    model.register_state_dict_post_hook(add_shards)
