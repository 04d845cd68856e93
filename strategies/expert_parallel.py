"""Expert parallelism: each MoE layer's routed experts split over an EP group, tokens
sent to them by all-to-all (dropless), as :class:`planner.parallel_dims.ParallelDims`
defines it.

Every experts module (:func:`planner.models.moe.is_experts`: the zoo's and
transformers' grouped ``gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]``) keeps on
EP rank ``r`` only experts ``[r E / ep, (r + 1) E / ep)``: its weights become DTensors
``Shard(0)`` over the ``ep`` axis of the experts mesh (:func:`build_expert_mesh`), so
checkpoints, deferred initialisation and clipping see the whole tensors. Its forward
becomes the EP dispatch (:func:`ep_forward`):

1. the tokens (replicated over the ``tp`` ranks) are cut into ``tp`` contiguous chunks,
   each tp rank routing its own (backward: the gradients are all-gathered);
2. the routed (token, expert) pairs are sorted by expert, the per-expert counts
   exchanged, and the rows sent by ``all_to_all_single`` to the rank holding each
   expert, computed there (:func:`planner.models.moe.expert_mlp`) and sent back;
3. the pairs are unsorted, weighted and summed per token, and the tp chunks
   all-gathered (backward: each rank keeps its chunk's gradient).

Expert gradients are averaged over the expert replicas: under ZeRO >= 1 by FSDP2
(:func:`strategies.fsdp.apply` shards experts over ``edp_shard`` and replicates them
over ``edp_replicate``), otherwise by :func:`reduce_replica_gradients` (DDP ignores
them). The bytes handed to the all-to-alls are counted by :func:`count_alltoall`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from planner.errors import SpecError
from planner.models.moe import expert_mlp, is_experts
from planner.modules import expert_parallel_blocker
from planner.parallel_dims import ParallelDims
from planner.spec import Plan
from strategies.mesh import device_type

__all__ = [
    "EXPERT_MESH_DIMS",
    "ExpertMesh",
    "build_expert_mesh",
    "experts_modules",
    "expert_parameters",
    "expert_parameter_names",
    "apply",
    "ep_forward",
    "reduce_replica_gradients",
    "set_gradient_sync",
    "replica_group",
    "count_alltoall",
    "AllToAllBytes",
]

log = logging.getLogger(__name__)

EXPERT_MESH_DIMS = ("pp", "edp_replicate", "edp_shard", "ep")


@dataclass(frozen=True)
class ExpertMesh:
    """The experts mesh ``pp x edp_replicate x edp_shard x ep`` over all ranks: EP groups
    of ``ep`` consecutive ranks; ``edp_shard`` the ranks that shard one EP rank's experts
    (ZeRO >= 1; under ZeRO 0 all expert replicas of the stage), ``edp_replicate`` those
    that replicate them; ``replicas`` the two joined (every expert replica)."""

    mesh: DeviceMesh
    replicas: DeviceMesh

    @property
    def ep(self) -> DeviceMesh:
        return self.mesh["ep"]

    @property
    def fsdp(self) -> DeviceMesh:
        """FSDP2's mesh for the experts: ``edp_shard``, with ``edp_replicate`` outside
        (HSDP) when it replicates."""
        if self.mesh["edp_replicate"].size() > 1:
            return self.mesh["edp_replicate", "edp_shard"]
        return self.mesh["edp_shard"]


def build_expert_mesh(plan: Plan) -> ExpertMesh | None:
    """The plan's :class:`ExpertMesh`, ``None`` for ``ep = 1`` (collective: every rank
    calls it, once)."""
    dims = ParallelDims.of(plan.strategy)
    if dims.ep == 1:
        return None
    shard = dims.expert_shard_ranks if dims.zero >= 1 else dims.expert_replicas
    sizes = (dims.pp, dims.expert_replicas // shard, shard, dims.ep)
    mesh = init_device_mesh(device_type(), sizes, mesh_dim_names=EXPERT_MESH_DIMS)
    replicas = mesh["edp_replicate", "edp_shard"]._flatten("edp")
    log.info(
        "experts mesh: %s",
        " x ".join(f"{n}({s})" for n, s in zip(EXPERT_MESH_DIMS, sizes, strict=True)),
    )
    return ExpertMesh(mesh, replicas)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model``'s routed-experts modules (grouped 3-D weights), with their FQNs."""
    return [(name, module) for name, module in model.named_modules() if is_experts(module)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model``'s experts modules."""
    return [p for _, module in experts_modules(model) for p in module.parameters()]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The FQNs (in ``model``) of its experts modules' parameters."""
    return [
        f"{fqn}.{name}" if fqn else name
        for fqn, module in experts_modules(model)
        for name, _ in module.named_parameters()
    ]


@dataclass(frozen=True)
class _Groups:
    """Where one experts module's tokens go: the EP group and the tp group."""

    ep: dist.ProcessGroup
    ep_size: int
    tp: dist.ProcessGroup | None
    tp_size: int
    tp_rank: int
    grad_scale: float  # expert replicas / dense replicas (see _expert_gradient_scale)


def apply(
    model: nn.Module, mesh: DeviceMesh | None, experts_mesh: ExpertMesh | None, plan: Plan
) -> nn.Module:
    """Shard ``model``'s experts over the EP axis and run them by all-to-all (in place)."""
    if experts_mesh is None:
        return model
    modules = experts_modules(model)
    blocker = expert_parallel_blocker(model)
    if blocker is not None:
        raise SpecError(f"plan.strategy.ep = {plan.strategy.ep}: {blocker}")
    if not modules and plan.strategy.pp == 1:  # a pipeline chunk may hold dense blocks only
        raise SpecError(
            f"plan.strategy.ep = {plan.strategy.ep} but {type(model).__name__} has no experts "
            "module (grouped gate_up_proj [experts, 2 ffn, hidden] and down_proj [experts, "
            "hidden, ffn] parameters): use ep = 1"
        )
    ep_mesh = experts_mesh.ep
    tp = plan.strategy.tp
    groups = _Groups(
        ep=ep_mesh.get_group(), ep_size=ep_mesh.size(),
        tp=mesh["tp"].get_group() if tp > 1 and mesh is not None else None,
        tp_size=tp, tp_rank=mesh["tp"].get_local_rank() if tp > 1 and mesh is not None else 0,
        grad_scale=_expert_gradient_scale(ParallelDims.of(plan.strategy)),
    )  # fmt: skip
    for _, module in modules:
        _shard_experts(module, ep_mesh)
        module.forward = functools.partial(ep_forward, module, groups)
    log.info(
        "expert parallel: ep=%d, %d experts modules, %s experts per rank, tokens split over "
        "tp=%d, expert replicas %d",
        groups.ep_size,
        len(modules),
        _experts_per_rank(modules, groups.ep_size),
        tp,
        ParallelDims.of(plan.strategy).expert_replicas,
    )
    return model


def _expert_gradient_scale(dims: ParallelDims) -> float:
    """What an expert weight's gradient is multiplied by, so that averaging it over the
    expert replicas gives the mean over data replicas of their losses' gradients.

    Each rank's loss is its own tokens' mean, and dense gradients are averaged over the
    ``dp x cp`` replicas. An expert's gradient sums what every rank of its EP group
    routed to it (the tp ranks of a replica each its chunk of the same loss), so the
    mean over its ``expert_replicas`` holds ``1 / expert_replicas`` of the sum over all
    ranks where the dense mean holds ``1 / replicas``."""
    return dims.expert_replicas / dims.replicas


def _experts_per_rank(modules: list[tuple[str, nn.Module]], ep: int) -> str:
    counts = sorted({int(_weight(m, "gate_up_proj").shape[0]) // ep for _, m in modules})
    return "/".join(map(str, counts)) or "no"


def _shard_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Replace ``module``'s grouped weights by DTensors ``Shard(0)`` over ``ep_mesh``."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in ("gate_up_proj", "down_proj"):
        param = module._parameters[name]
        assert param is not None
        per_rank = param.shape[0] // ep  # ep divides them: parallelize checked the model
        local = param.detach()[rank * per_rank : (rank + 1) * per_rank]
        dtensor = DTensor.from_local(
            local.clone(), ep_mesh, [Shard(0)], run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip
        module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def _weight(module: nn.Module, name: str) -> torch.Tensor:
    """This rank's experts of ``module``'s weight ``name`` (a DTensor's local shard; DDP
    over tensor-parallel shards hands the local tensor itself)."""
    weight = getattr(module, name)
    return weight.to_local() if isinstance(weight, DTensor) else weight


def ep_forward(
    module: nn.Module,
    groups: _Groups,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts module's forward under EP: ``(tokens, hidden)`` in and out, the same
    on every tp rank, equal to the single-process forward."""
    if isinstance(hidden_states, DTensor):
        raise SpecError(
            f"{type(module).__name__}: expert parallelism takes the tokens as a local tensor "
            "replicated over tp, but the tensor-parallel layout hands a DTensor; lay the "
            "experts module out 'replicate' with a plain input"
        )
    x, weights = _split_tokens(groups, hidden_states, top_k_weights)
    index = top_k_index.chunk(groups.tp_size)[groups.tp_rank] if groups.tp_size > 1 else top_k_index
    out = _dispatch_compute_combine(module, groups, x, index)
    tokens, top_k = index.shape
    combined = (out.view(tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)
    combined = combined.to(hidden_states.dtype)
    if groups.tp_size > 1:
        combined = _GatherTokens.apply(combined, groups.tp, groups.tp_size, groups.tp_rank)
    return combined


def _split_tokens(
    groups: _Groups, hidden: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This tp rank's contiguous chunk of the tokens and their routing weights."""
    if groups.tp_size == 1:
        return hidden, weights
    if hidden.shape[0] % groups.tp_size:
        raise SpecError(
            f"expert parallelism splits each micro-batch's {hidden.shape[0]} tokens (micro_batch"
            f"_size x seq_len / cp) over tp({groups.tp_size}) ranks: choose micro_batch_size "
            "and seq_len so that their product is divisible by tp"
        )

    def chunk(tensor: torch.Tensor) -> torch.Tensor:
        return _SplitTokens.apply(tensor, groups.tp, groups.tp_size, groups.tp_rank)

    return chunk(hidden), chunk(weights)


def _dispatch_compute_combine(
    module: nn.Module, groups: _Groups, x: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """Each routed pair's expert output ``(tokens * top_k, hidden)``, in pair order."""
    top_k = index.shape[-1]
    local_experts = _weight(module, "gate_up_proj").shape[0]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=local_experts * groups.ep_size)
    received = _exchange_counts(counts, groups).view(groups.ep_size, local_experts)
    sent_per_rank = counts.view(groups.ep_size, local_experts).sum(dim=1).tolist()
    received_per_rank = received.sum(dim=1).tolist()
    rows = _AllToAll.apply(x[order // top_k], received_per_rank, sent_per_rank, groups.ep)
    # received rows come by source rank, then expert: regroup them by expert
    expert_of_row = torch.repeat_interleave(
        torch.arange(local_experts, device=rows.device).repeat(groups.ep_size),
        received.reshape(-1),
    )
    by_expert = torch.argsort(expert_of_row, stable=True)
    computed = expert_mlp(_local_experts(module, groups), rows[by_expert],
                          received.sum(dim=0).tolist())  # fmt: skip
    back = _AllToAll.apply(
        computed[torch.argsort(by_expert)], sent_per_rank, received_per_rank, groups.ep
    )
    return back[torch.argsort(order)]


def _exchange_counts(counts: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """How many rows each rank of the EP group sends to each of this rank's experts
    (``[source rank, local expert]`` flattened), from every rank's per-expert ``counts``."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=groups.ep)
    return received


def _local_experts(module: nn.Module, groups: _Groups) -> SimpleNamespace:
    """This rank's experts of ``module`` as :func:`expert_mlp` takes them, their weights'
    gradients scaled by ``groups.grad_scale``."""
    gate_up, down = (_weight(module, name) for name in ("gate_up_proj", "down_proj"))
    if groups.grad_scale != 1:
        gate_up = _ScaleGradient.apply(gate_up, groups.grad_scale)
        down = _ScaleGradient.apply(down, groups.grad_scale)
    return SimpleNamespace(gate_up_proj=gate_up, down_proj=down, _apply_gate=module._apply_gate)


# ---- collectives with gradients


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows: ``input_splits[r]`` rows go to rank ``r``,
    ``output_splits[r]`` come from it; backward sends the gradients back the same way."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    for counter in _COUNTERS:
        counter.add(rows)
    dist.all_to_all_single(out, rows, output_splits, input_splits, group=group)
    return out


class _ScaleGradient(torch.autograd.Function):
    """The identity; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad * ctx.scale, None


class _SplitTokens(torch.autograd.Function):
    """This rank's contiguous chunk (dim 0) of a tensor replicated over ``group``;
    backward all-gathers the chunks' gradients."""

    @staticmethod
    def forward(
        ctx: Any, whole: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int
    ) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return whole.chunk(size)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_gather(grad, ctx.group, ctx.size), None, None, None


class _GatherTokens(torch.autograd.Function):
    """The chunks (dim 0) of every rank of ``group``, concatenated; backward keeps this
    rank's chunk of the gradient."""

    @staticmethod
    def forward(
        ctx: Any, chunk: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int
    ) -> torch.Tensor:
        ctx.size, ctx.rank = size, rank
        return _all_gather(chunk, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.chunk(ctx.size)[ctx.rank].contiguous(), None, None, None


def _all_gather(chunk: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    chunk = chunk.contiguous()
    parts = [torch.empty_like(chunk) for _ in range(size)]
    dist.all_gather(parts, chunk, group=group)
    return torch.cat(parts)


# ---- expert gradients under ZeRO 0


def replica_group(experts_mesh: ExpertMesh | None, plan: Plan) -> dist.ProcessGroup | None:
    """The group averaging expert gradients outside FSDP2 (ZeRO 0, or no expert
    sharding): this rank's expert replicas, or ``None`` when there are none or FSDP2
    reduces them (:func:`fsdp_shards_experts`)."""
    dims = ParallelDims.of(plan.strategy)
    if experts_mesh is None or dims.expert_replicas == 1 or fsdp_shards_experts(plan):
        return None
    return experts_mesh.replicas.get_group()


def fsdp_shards_experts(plan: Plan) -> bool:
    """Whether FSDP2 shards the experts (ZeRO >= 1 over more than one expert shard rank)."""
    dims = ParallelDims.of(plan.strategy)
    return dims.ep > 1 and dims.zero >= 1 and dims.expert_shard_ranks > 1


_SYNC = "_planner_expert_gradient_sync"  # on the root module: a list holding one bool


def reduce_replica_gradients(
    root: nn.Module, params: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> int:
    """Average each of ``params``' gradients over ``group`` when it accumulates, unless
    :func:`set_gradient_sync` turned it off on ``root`` (gradient accumulation: the
    last micro-batch averages the sum; a pipeline schedule averages every micro-batch,
    which averaging's linearity makes the same); returns how many parameters it hooks."""
    size = dist.get_world_size(group)
    sync = [True]
    setattr(root, _SYNC, sync)

    def average(param: torch.Tensor) -> None:
        grad = param.grad
        if not sync[0] or grad is None:
            return
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=group)
        local.div_(size)

    for param in params:
        param.register_post_accumulate_grad_hook(average)
    return len(params)


def set_gradient_sync(root: nn.Module, sync: bool) -> None:
    """Whether the next backward averages expert gradients over their replicas (as DDP's
    ``no_sync`` for the dense ones); nothing for a model without such averaging."""
    flag = getattr(root, _SYNC, None)
    if flag is not None:
        flag[0] = sync


# ---- counting the all-to-all payload


class AllToAllBytes:
    """Bytes handed to the EP all-to-alls (the rows, not the counts) while counting."""

    def __init__(self) -> None:
        self.bytes = 0

    def add(self, rows: torch.Tensor) -> None:
        self.bytes += rows.numel() * rows.element_size()


_COUNTERS: list[AllToAllBytes] = []


@contextlib.contextmanager
def count_alltoall() -> Iterator[AllToAllBytes]:
    """``with count_alltoall() as counted: ...``; ``counted.bytes`` after (this rank,
    forward and backward)."""
    counter = AllToAllBytes()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)
