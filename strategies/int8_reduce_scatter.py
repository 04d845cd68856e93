"""An int8 gradient reduce-scatter for FSDP2 that cannot overflow.

FSDP2 lets a module replace its gradient reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``; input: one contiguous chunk per rank, in
rank order). Summing int8 values on the wire would overflow (two ranks' 100 + 100) and
lose the scale, so :class:`Int8ReduceScatter` never reduces in int8: each rank
quantizes every destination's chunk in blocks of ``BLOCK`` elements with an fp32
absmax scale per block (``value ~ q * scale``, ``|q| <= 127``), one all-to-all sends the
int8 blocks and one the scales, and each rank dequantizes what it received and sums
in fp32.

Wire bytes per gradient element: ``1 + 4 / BLOCK`` (fp32: 4, bf16: 2), of which a rank
sends ``(n - 1) / n`` as in a ring reduce-scatter. Error: rounding to the nearest step
is off by at most half a step, ``max|block| / 254``, per rank, so the reduced sum of
``n`` ranks is off by at most ``n * max|block| / 254`` per element (the mean: that over
``n``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = ["Int8ReduceScatter", "use_int8_reduce_scatter", "BLOCK"]

log = logging.getLogger(__name__)

BLOCK = 256  # elements per fp32 scale: 1.6% extra bytes
_INT8_MAX = 127


class Int8ReduceScatter(ReduceScatter):
    """Reduce-scatter by int8 all-to-all with per-block scales and a local fp32 sum."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"int8 reduce-scatter supports SUM and AVG, not {op}")
        world = group.size()
        blocks = _blocks(input_tensor.view(world, -1).float())
        scales = blocks.abs().amax(dim=-1, keepdim=True).div_(_INT8_MAX)
        quantized = torch.round(blocks / scales.clamp(min=torch.finfo(torch.float32).tiny))
        received = _all_to_all(quantized.to(torch.int8), group)
        received_scales = _all_to_all(scales, group)
        total = (received.float() * received_scales).sum(dim=0).flatten()
        if op == dist.ReduceOp.AVG:
            total /= world
        output_tensor.copy_(total[: output_tensor.numel()])


def _blocks(chunks: torch.Tensor) -> torch.Tensor:
    """``(ranks, elements)`` zero-padded and viewed as ``(ranks, blocks, BLOCK)``."""
    padding = -chunks.shape[1] % BLOCK
    return F.pad(chunks, (0, padding)).view(chunks.shape[0], -1, BLOCK)


def _all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Row ``i`` of ``tensor`` to rank ``i``; row ``j`` of the result came from rank ``j``."""
    received = torch.empty_like(tensor)
    dist.all_to_all_single(received, tensor.contiguous(), group=group)
    return received


def use_int8_reduce_scatter(model: nn.Module) -> int:
    """Give every FSDP2 module of ``model`` the int8 reduce-scatter; how many there are."""
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in modules:
        module.set_custom_reduce_scatter(Int8ReduceScatter())
    log.info("int8 reduce-scatter on %d FSDP modules (block %d)", len(modules), BLOCK)
    return len(modules)
