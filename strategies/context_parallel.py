"""Context parallelism: the sequence split over the ``cp`` mesh axis, all-gather attention.

Each cp rank holds one contiguous shard of every sequence (rank ``i`` of ``cp`` holds
tokens ``[i * s / cp, (i + 1) * s / cp)``; no load balancing, so under a causal mask
the last rank does the most attention work). In every attention layer the rank keeps
its own queries and all-gathers keys and values over the cp group with an
autograd-aware all-gather (all-gather forward, reduce-scatter of the gradients
backward), the "all-gather based CP" of Llama 3. Positions (RoPE, position embeddings)
are global and the causal mask is shifted by the shard's offset, so the activations
equal a slice of the single-process ones.

The collectives are plain c10d ``all_gather_into_tensor``/``reduce_scatter_tensor``
(both on gloo and NCCL); functional collectives' ``all_gather_single_autograd`` gave
the same numbers but in our runs now and then aborted a gloo process at exit
("terminate called without an active exception", torch 2.13).

Parameters are replicated over cp; their gradients are averaged over the data axes and
cp together (:func:`strategies.mesh.shard_mesh`, :func:`strategies.mesh.replicate_mesh`),
and the loss (a mean over local tokens, equal counts per rank) is averaged over all
ranks, so a run matches one process. torch's experimental ``context_parallel`` (ring
attention) targets CUDA SDPA kernels and is not used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.errors import SpecError
from planner.models.transformer import Transformer
from planner.spec import Axis, Plan
from strategies.mesh import axis_rank

__all__ = ["apply", "AllGatherShard", "sequence_slice"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AllGatherShard:
    """Shard ``index`` of ``count`` contiguous sequence shards, gathered over ``group``."""

    index: int
    count: int
    group: dist.ProcessGroup

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All shards of ``x`` (batch, local seq, ...) joined on dim 1; backward reduce-scatters."""
        gathered = _GatherSequence.apply(x, self.group)
        assert isinstance(gathered, torch.Tensor)
        return gathered


class _GatherSequence(torch.autograd.Function):
    """All-gather on dim 1 over ``group``; backward reduce-scatters the gradient on dim 1.

    Backward sums every rank's gradient for this rank's shard: each rank's loss depends
    on every shard's keys and values.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        local = x.movedim(1, 0).contiguous()
        gathered = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local, group=group)
        return gathered.movedim(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        full = grad.movedim(1, 0).contiguous()
        local = full.new_empty((full.shape[0] // dist.get_world_size(ctx.group), *full.shape[1:]))
        dist.reduce_scatter_tensor(local, full, group=ctx.group)
        return local.movedim(0, 1), None


def apply(model: nn.Module, mesh: DeviceMesh | None, plan: Plan) -> nn.Module:
    """Make every zoo :class:`Transformer` in ``model`` run on its sequence shard (in place)."""
    cp = plan.strategy.cp
    if cp == 1 or mesh is None:
        return model
    transformers = [module for module in model.modules() if isinstance(module, Transformer)]
    if not transformers:
        raise SpecError(
            f"strategy.cp = {cp} but {type(model).__name__} contains no zoo Transformer: "
            "context parallel needs attention that gathers keys and values over the cp "
            "group; use cp = 1 for this model"
        )
    shard = AllGatherShard(axis_rank(mesh, Axis.CP), cp, mesh.get_group(Axis.CP.value))
    for transformer in transformers:
        transformer.shard_sequence(shard)
    log.info("context parallel: cp=%d, this rank holds sequence shard %d", cp, shard.index)
    return model


def sequence_slice(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Contiguous shard ``index`` of ``count`` of ``tensor`` (batch, seq, ...) on the sequence dim."""
    if tensor.shape[1] % count:
        raise SpecError(
            f"sequence length {tensor.shape[1]} is not divisible by cp({count}): choose "
            "training.seq_len divisible by cp"
        )
    return tensor.chunk(count, dim=1)[index]
