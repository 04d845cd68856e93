"""Plain data parallel (ZeRO-0): DDP over the ``dp_replicate`` axis.

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

from planner.spec import Axis, Plan
from strategies import fsdp

__all__ = ["apply"]

log = logging.getLogger(__name__)


def apply(model: nn.Module, mesh: DeviceMesh | None, plan: Plan) -> nn.Module:
    """Wrap ``model`` in DDP over ``dp_replicate`` (returns the wrapper) when the plan says DP."""
    if fsdp.uses_fsdp(plan) or plan.strategy.dp == 1 or mesh is None:
        return model
    dp_mesh = mesh[Axis.DP_REPLICATE.value]
    if plan.strategy.tp > 1 or plan.strategy.pp > 1:
        log.warning(
            "data parallel with tp=%d, pp=%d: DDP cannot reduce DTensor parameters nor run "
            "under a pipeline schedule, so replication over dp_replicate runs as FSDP2 "
            "fully_shard (same gradients, sharded storage)",
            plan.strategy.tp,
            plan.strategy.pp,
        )
        fsdp.shard(model, dp_mesh, plan, reason="zero=0 with tp/pp")
        return model
    wrapped = DistributedDataParallel(model, device_mesh=dp_mesh)
    log.info("ddp: dp_replicate=%d", dp_mesh.size())
    return wrapped
