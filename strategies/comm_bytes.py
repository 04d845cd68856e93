"""Bytes counted at the collectives DTensor runs (tensor-parallel redistributions).

:class:`CollectiveBytes` is a dispatch mode, as torch's ``CommDebugMode`` is, that
adds up the bytes of each functional collective (the ops DTensor redistributes with),
by kind and pass, in the cost model's convention: the whole array (an all-gather's
output, a reduce-scatter's or all-reduce's input, an all-to-all's input).
``torch.distributed`` calls made directly (DDP, FSDP2, a loss average, the experts'
all-to-all) are not functional collectives and are left out. It tracks no modules:
``CommDebugMode``'s module tracker breaks on a module called twice in one forward (an
activation module applied per expert).

Gloo has no all-to-all: on CPU, DTensor moves a shard to another dimension
(``Shard(a) -> Shard(b)``) with an all-gather and keeps its chunk
(``torch.distributed.tensor._collective_utils.shard_dim_alltoall``). That all-gather
is counted as the all-to-all it stands for (NCCL runs one), so the count is the
cluster's on any backend.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import DTensor, placement_types
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveBytes"]

_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


class CollectiveBytes(TorchDispatchMode):
    """``with CollectiveBytes() as counted: ...``; then ``counted.bytes`` maps
    ``(kind, "forward" | "backward")`` to bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self._all_to_all = False  # inside DTensor's shard-to-shard move

    def __enter__(self) -> CollectiveBytes:
        self._moves = placement_types.shard_dim_alltoall
        placement_types.shard_dim_alltoall = self._shard_to_shard
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        placement_types.shard_dim_alltoall = self._moves
        super().__exit__(*exc)

    def _shard_to_shard(self, local: torch.Tensor, *args: Any) -> torch.Tensor:
        self._all_to_all = True
        try:
            return self._moves(local, *args)
        finally:
            self._all_to_all = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into the collectives counted here
        out = func(*args, **(kwargs or {}))
        if isinstance(func, torch._ops.HigherOrderOperator):
            return out
        packet = str(func._overloadpacket)
        kind = _FUNCTIONAL.get(packet.rsplit(".", 1)[-1]) if "_c10d_functional" in packet else None
        if kind is not None and self._all_to_all:  # gloo's all-gather for an all-to-all
            self.bytes[("all_to_all", _phase())] += _nbytes(out)  # the whole array
        elif kind is not None:
            array = out if kind == "all_gather" else args[0]
            self.bytes[(kind, _phase())] += _nbytes(array)
        return out


def _phase() -> str:
    """``"backward"`` while autograd runs a graph task, else ``"forward"``."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(item) for item in value)
