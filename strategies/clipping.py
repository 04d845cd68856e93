"""Gradient clipping by the global L2 norm, right on every mesh; stock clipping guarded.

:func:`clip_grad_norm_` sums each gradient's squares where it lives (a tensor-parallel
shard, an FSDP shard, a pipeline stage) and all-reduces the sums over exactly the mesh
axes that split the gradient, so the norm is the single-process one.

Stock ``torch.nn.utils.clip_grad_norm_`` sees only local tensors: right for plain DDP,
FSDP/HSDP and context parallel (every gradient replicated or a DTensor on one mesh),
but silently wrong under a pipeline (each stage's own norm) and DDP over tensor-parallel
shards (each shard's norm), and it raises on the mix of tensors and DTensors plain TP
leaves. :func:`guard_stock_clipping` marks the parameters of such a model, and the
stock function (wrapped once, process-wide) raises for marked parameters, naming
``parallel.clip_grad_norm_``. Code that bound ``clip_grad_norm_`` by name before the
first guarded model was built keeps the unwrapped function.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel._data_parallel_utils import _unflatten_tensor

from planner.errors import SpecError

__all__ = ["clip_grad_norm_", "guard_stock_clipping", "stock_clipping_problem"]

_MARK = "_planner_stock_clipping"
_WRAPPED = "_planner_guarded"


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    *,
    extra_groups: tuple[dist.ProcessGroup, ...] = (),
) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; return
    the norm before clipping (a float32 scalar, equal on every rank).

    ``extra_groups`` are axes over which ranks hold *different* parameters (the pipeline
    axis): their sums are added up over them too.
    """
    grads = [_sharded_grad(p) for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = _squared_norm(grads, device)
    for group in extra_groups:
        dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    scale = max_norm / (math.sqrt(float(squares)) + 1e-6)
    if scale < 1.0:
        for grad in grads:
            grad.mul_(scale)
    return norm


def _sharded_grad(param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient, as the DTensor it is a shard of when DDP runs over tensor-parallel
    shards (``_pre_dp_module_transform`` keeps the layout in ``_st_info``); scaling it in
    place scales the local gradient."""
    assert param.grad is not None
    info = getattr(param, "_st_info", None)
    return param.grad if info is None else _unflatten_tensor(param.grad, info)


# A set of mesh axes a gradient is sharded over: each axis's name and its group's ranks.
_Axes = tuple[tuple[str, tuple[int, ...]], ...]


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all gradients, whole (not per shard): one all-reduce per sharding.

    Partial-sum DTensor gradients (sequence-parallel norms) are reduced first. Local
    shards are then summed per set of sharded mesh axes, and each sum is all-reduced over
    those axes only, in the order of the first gradient on each set (the same on every
    rank), over that gradient's groups; replicated gradients need no communication. The
    sets are told apart by their axes' names and ranks, not by the group objects a
    gradient's mesh holds: equal meshes built apart (a later plan in the process) hold
    distinct groups of the same ranks, and gradients of one set may carry either, which
    would pair different all-reduces on different ranks and leave them waiting.
    """
    sums: dict[_Axes, torch.Tensor] = {}
    groups: dict[_Axes, tuple[dist.ProcessGroup, ...]] = {}
    for grad in grads:
        axes: _Axes = ()
        local = grad
        if isinstance(grad, DTensor):
            whole = _without_partial(grad)
            mesh = whole.device_mesh
            dims = [d for d, p in enumerate(whole.placements) if not p.is_replicate()]
            names = mesh.mesh_dim_names or tuple(map(str, range(mesh.ndim)))
            held = tuple(mesh.get_group(d) for d in dims)
            axes = tuple(
                (names[d], tuple(dist.get_process_group_ranks(g)))
                for d, g in zip(dims, held, strict=True)
            )
            groups.setdefault(axes, held)
            local = whole.to_local()
        squares = local.detach().float().pow(2).sum()
        sums[axes] = sums[axes] + squares if axes in sums else squares
    total = torch.zeros((), device=device)
    for axes in sums:
        for group in groups.get(axes, ()):
            dist.all_reduce(sums[axes], group=group)
        total += sums[axes]
    return total


def _without_partial(grad: DTensor) -> DTensor:
    """``grad`` with partial-sum placements reduced to replicated ones."""
    if not any(placement.is_partial() for placement in grad.placements):
        return grad
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    return grad.redistribute(placements=placements)


def stock_clipping_problem(pp: int, tp: int, ep: int = 1) -> str | None:
    """Why stock ``clip_grad_norm_`` is wrong for a model split ``pp`` x ``tp`` with
    experts over ``ep`` ranks, or ``None``."""
    if pp > 1:
        return f"pipeline stages (pp = {pp}) each see only their own gradients"
    if tp > 1:
        return f"tensor-parallel shards (tp = {tp}) are not all DTensors on one mesh"
    if ep > 1:
        return f"expert-parallel shards (ep = {ep}) are DTensors on the experts' own mesh"
    return None


def guard_stock_clipping(params: Iterable[torch.Tensor], problem: str) -> None:
    """Make stock ``clip_grad_norm_`` raise with ``problem`` for any of ``params``."""
    for param in params:
        setattr(param, _MARK, problem)
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        function = module.clip_grad_norm_
        if not getattr(function, _WRAPPED, False):
            module.clip_grad_norm_ = _guarded(function)  # type: ignore[attr-defined]


def _guarded(stock: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(stock)
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        problem = next((getattr(p, _MARK) for p in params if hasattr(p, _MARK)), None)
        if problem is not None:
            raise SpecError(
                f"torch.nn.utils.clip_grad_norm_ cannot clip this parallel model: {problem}, "
                "so its norm would not be the model's; call parallel.clip_grad_norm_(max_norm) "
                "on the object planner.parallelize returned"
            )
        return stock(params, *args, **kwargs)

    setattr(clip_grad_norm_, _WRAPPED, True)
    return clip_grad_norm_
