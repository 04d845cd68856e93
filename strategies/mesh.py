"""The device mesh: named axes (pp, dp_replicate, dp_shard, cp, tp) from the plan."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.spec import Axis, Plan

__all__ = [
    "build_mesh",
    "device_type",
    "local_device",
    "axis_size",
    "axis_rank",
    "coordinates",
    "dp_rank_of",
    "shard_mesh",
    "replicate_mesh",
]

log = logging.getLogger(__name__)


def device_type() -> str:
    """``cuda`` on an NCCL process group or in one process with a GPU, else ``cpu`` (gloo)."""
    if dist.is_initialized():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def local_device() -> torch.device:
    """This rank's device, made current: under NCCL its GPU on the node (``LOCAL_RANK``, as
    torchrun sets it; else the current one), else the CPU. Untested on GPUs so far."""
    if device_type() != "cuda":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def build_mesh(plan: Plan) -> DeviceMesh | None:
    """The plan's mesh over all ranks, or ``None`` when every degree is 1."""
    if not plan.mesh:
        return None
    names = tuple(axis.name.value for axis in plan.mesh)
    sizes = tuple(axis.size for axis in plan.mesh)
    mesh = init_device_mesh(device_type(), sizes, mesh_dim_names=names)
    log.info("mesh: %s", " x ".join(f"{n}({s})" for n, s in zip(names, sizes, strict=True)))
    return mesh


def _names(mesh: DeviceMesh | None) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()


def axis_size(mesh: DeviceMesh | None, axis: Axis) -> int:
    """Size of ``axis`` in ``mesh`` (1 when absent)."""
    if mesh is None or axis.value not in _names(mesh):
        return 1
    return mesh[axis.value].size()


def axis_rank(mesh: DeviceMesh | None, axis: Axis) -> int:
    """This rank's coordinate on ``axis`` (0 when absent)."""
    if mesh is None or axis.value not in _names(mesh):
        return 0
    return mesh.get_local_rank(axis.value)


def coordinates(plan: Plan, rank: int) -> dict[Axis, int]:
    """``rank``'s coordinate on every axis of the plan's mesh (row-major, as ``init_device_mesh``)."""
    coords: dict[Axis, int] = {}
    for axis in reversed(plan.mesh):
        rank, coords[axis.name] = divmod(rank, axis.size)
    return coords


def dp_rank_of(plan: Plan, rank: int) -> int:
    """Index of ``rank``'s data-parallel replica among ``plan.strategy.dp``."""
    coords = coordinates(plan, rank)
    shard = plan.strategy.shard_degree
    return coords.get(Axis.DP_REPLICATE, 0) * shard + coords.get(Axis.DP_SHARD, 0)


def _joined(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The sub-mesh over ``names`` as one axis (flattened when there are several)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP's mesh: ``dp_shard`` and ``cp`` joined into one shard axis, ``dp_replicate`` outside.

    Context-parallel ranks hold the same parameters, so ZeRO shards over dp_shard x cp
    (as torchtitan's ``dp_shard_cp``; :attr:`planner.parallel_dims.ParallelDims.zero_shard_ranks`)
    and gradients are averaged over cp too. 1-D, or 2-D (replicate, shard) for hybrid
    sharding.
    """
    names = _names(mesh)
    shard = tuple(n for n in (Axis.DP_SHARD.value, Axis.CP.value) if n in names)
    if Axis.DP_REPLICATE.value not in names:
        return _joined(mesh, shard)
    if not shard:
        return mesh[Axis.DP_REPLICATE.value]
    return DeviceMesh._concatenate([mesh[Axis.DP_REPLICATE.value], _joined(mesh, shard)])


def replicate_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Plain data parallel's 1-D mesh: ``dp_replicate`` and ``cp`` joined (cp ranks hold
    replicas: :attr:`planner.parallel_dims.ParallelDims.replicas`)."""
    names = _names(mesh)
    return _joined(mesh, tuple(n for n in (Axis.DP_REPLICATE.value, Axis.CP.value) if n in names))
