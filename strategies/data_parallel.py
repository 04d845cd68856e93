"""Plain data parallel (ZeRO-0): DDP over the ``dp_replicate`` axis (joined with ``cp``).

Context-parallel ranks hold replicas too, so their gradients are averaged over
dp_replicate x cp (:func:`strategies.mesh.replicate_mesh`).

DDP reduces only plain-tensor parameters, and its reducer fails when a pipeline
schedule runs several backwards per step (torch 2.13, gloo). So with ``tp > 1`` or
``pp > 1`` replication over ``dp_replicate`` runs through FSDP2 instead (same averaged
gradients, with sharded storage), and a warning says so.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from planner.spec import Plan
from strategies import fsdp
from strategies.mesh import replicate_mesh

__all__ = ["apply"]

log = logging.getLogger(__name__)


def apply(model: nn.Module, mesh: DeviceMesh | None, plan: Plan) -> nn.Module:
    """Wrap ``model`` in DDP over dp_replicate x cp (returns the wrapper) when the plan says DP."""
    if fsdp.uses_fsdp(plan) or plan.strategy.dp * plan.strategy.cp == 1 or mesh is None:
        return model
    dp_mesh = replicate_mesh(mesh)
    if plan.strategy.tp > 1 or plan.strategy.pp > 1:
        log.warning(
            "data parallel with tp=%d, pp=%d: DDP cannot reduce DTensor parameters nor run "
            "under a pipeline schedule, so replication over %s runs as FSDP2 "
            "fully_shard (same gradients, sharded storage)",
            plan.strategy.tp,
            plan.strategy.pp,
            dp_mesh.mesh_dim_names,
        )
        fsdp.shard(model, dp_mesh, plan, reason="zero=0 with tp/pp")
        return model
    wrapped = DistributedDataParallel(model, device_mesh=dp_mesh)
    log.info("ddp: over %s, %d ranks", dp_mesh.mesh_dim_names, dp_mesh.size())
    return wrapped
