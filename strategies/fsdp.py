"""ZeRO / FSDP2: ``fully_shard`` per block and at the root over the data-parallel axes.

Context-parallel ranks hold the same parameters, so the shard axis is dp_shard x cp
(:func:`strategies.mesh.shard_mesh`): ZeRO shards over it and gradients are averaged
over it, as the cost model assumes.

``zero = 3`` reshards weights after forward (gathered again in backward); ``zero = 1``
and ``2`` keep them gathered between forward and backward (``reshard_after_forward=False``,
so memory lies between ZeRO-2 and ZeRO-3: FSDP2 has no separate ZeRO-1/2 modes). A 2-D
(dp_replicate, dp_shard) mesh gives hybrid sharding (HSDP). ``MixedPrecisionPolicy``
takes the parameter dtype from ``training.dtype`` and the gradient-reduction dtype from
the plan's compression (fp16/bf16), else fp32; compression ``int8`` replaces the
gradient reduce-scatter (:mod:`strategies.int8_reduce_scatter`).

With expert parallelism each experts module is sharded first, on its own: over the
``edp_shard`` ranks of the experts mesh (HSDP with ``edp_replicate``), along dim 1 (its
dim 0 is the EP axis'); the dense ``fully_shard`` calls leave expert parameters alone
(:mod:`strategies.expert_parallel`).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from planner.errors import SpecError
from planner.modules import find_blocks
from planner.parallel_dims import ParallelDims
from planner.spec import CompressionKind, DType, Plan
from planner.torch_dtypes import TORCH_DTYPES, mixed_precision_dtype
from strategies import expert_parallel
from strategies.int8_reduce_scatter import use_int8_reduce_scatter
from strategies.mesh import shard_mesh

__all__ = ["apply", "uses_fsdp", "mixed_precision", "shard_units"]

log = logging.getLogger(__name__)

_REDUCE_DTYPES = {
    CompressionKind.FP16: TORCH_DTYPES[DType.FP16],
    CompressionKind.BF16: TORCH_DTYPES[DType.BF16],
}


def uses_fsdp(plan: Plan) -> bool:
    """Whether the plan shards parameters (ZeRO >= 1 over dp_shard x cp > 1,
    :attr:`planner.parallel_dims.ParallelDims.shards_parameters`)."""
    return ParallelDims.of(plan.strategy).shards_parameters


def mixed_precision(plan: Plan) -> MixedPrecisionPolicy:
    """Parameter dtype from ``training.dtype`` (``None``, the parameters' own, for fp32);
    reduce dtype from compression, else fp32."""
    if plan.training.dtype not in TORCH_DTYPES:
        raise SpecError(
            f"training.dtype = {plan.training.dtype.value!r} is not supported by the runtime; "
            "use fp32, bf16 or fp16"
        )
    param_dtype = mixed_precision_dtype(plan.training.dtype)
    reduce_dtype = _REDUCE_DTYPES.get(plan.strategy.compression.kind)
    if reduce_dtype is None and param_dtype is not None:
        reduce_dtype = TORCH_DTYPES[DType.FP32]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def apply(
    model: nn.Module,
    mesh: DeviceMesh | None,
    plan: Plan,
    experts_mesh: expert_parallel.ExpertMesh | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over the data-parallel axes when the plan asks for it
    (and its experts over the experts mesh's shard ranks, for ``ep > 1``)."""
    ignored: set[nn.Parameter] = set()
    if experts_mesh is not None:
        if expert_parallel.fsdp_shards_experts(plan):
            _shard_experts(model, experts_mesh, plan)
        else:  # their replicas average them (strategies.expert_parallel)
            ignored = set(expert_parallel.expert_parameters(model))
    if not uses_fsdp(plan) or mesh is None:
        return model
    _shard(model, shard_mesh(mesh), plan, ignored)
    return model


def _shard_experts(model: nn.Module, experts_mesh: expert_parallel.ExpertMesh, plan: Plan) -> None:
    """``fully_shard`` each experts module over ``edp_shard`` (HSDP with
    ``edp_replicate``), along dim 1."""
    mesh = experts_mesh.fsdp
    modules = expert_parallel.experts_modules(model)
    for _, experts in modules:
        fully_shard(
            experts, mesh=mesh, reshard_after_forward=plan.strategy.zero == 3,
            mp_policy=mixed_precision(plan), shard_placement_fn=lambda _: Shard(1),
        )  # fmt: skip
    log.info("fsdp (experts): %d experts modules over %s", len(modules), mesh.mesh_dim_names)


def _shard(model: nn.Module, dp_mesh: DeviceMesh, plan: Plan, ignored: set[nn.Parameter]) -> None:
    """``fully_shard`` each block, then the root, over ``dp_mesh`` (1-D, or 2-D for HSDP),
    but for ``ignored`` parameters."""
    reshard = plan.strategy.zero == 3
    policy = mixed_precision(plan)
    blocks = find_blocks(model)
    options: dict[str, Any] = {"reshard_after_forward": reshard, "mp_policy": policy}
    if ignored:
        options["ignored_params"] = ignored
    units = shard_units(model, blocks)
    for unit in units:
        fully_shard(unit[0] if len(unit) == 1 else unit, mesh=dp_mesh, **options)
    fully_shard(model, mesh=dp_mesh, **options)
    if plan.strategy.compression.kind is CompressionKind.INT8:
        use_int8_reduce_scatter(model)
    log.info(
        "fsdp (zero=%d): %d units of %d blocks + root over %s, reshard_after_forward=%s, "
        "param %s, reduce %s",
        plan.strategy.zero,
        len(units),
        len(blocks),
        dp_mesh.mesh_dim_names,
        reshard,
        policy.param_dtype,
        policy.reduce_dtype,
    )


def shard_units(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[list[nn.Module]]:
    """The FSDP units of ``model``'s blocks: one per block, but blocks that share a
    parameter (ALBERT-style weight sharing) form one unit, as FSDP2 manages a parameter
    in one group only; a block sharing one with a module outside the blocks is left to
    the root's unit."""
    owner: dict[int, int] = {}  # parameter id -> the first block (index) that holds it
    group = list(range(len(blocks)))  # union-find over block indices

    def find(index: int) -> int:
        while group[index] != index:
            index = group[index] = group[group[index]]
        return index

    for index, (_, block) in enumerate(blocks):
        for param in block.parameters():
            first = owner.setdefault(id(param), index)
            group[find(index)] = find(first)
    inside = {f"{name}." for name, _ in blocks}
    outside = {
        id(param)
        for name, param in model.named_parameters(remove_duplicate=False)
        if not any(name.startswith(prefix) for prefix in inside)
    }
    with_root = {find(owner[key]) for key in outside if key in owner}
    units: dict[int, list[nn.Module]] = {}
    for index, (_, block) in enumerate(blocks):
        if find(index) not in with_root:
            units.setdefault(find(index), []).append(block)
    return list(units.values())
