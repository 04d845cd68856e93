"""Bytes counted at the collectives DTensor runs (tensor-parallel redistributions).

:class:`CollectiveBytes` is torch's ``CommDebugMode`` that also adds up the bytes of
each functional collective (the ops DTensor redistributes with), by kind and pass, in
the cost model's convention: the whole array (an all-gather's output, a reduce-scatter's
or all-reduce's input, an all-to-all's input). ``torch.distributed`` calls made
directly (DDP, FSDP2, a loss average) are not functional collectives and are left out.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor.debug import CommDebugMode

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


class CollectiveBytes(CommDebugMode):
    """``with CollectiveBytes() as counted: ...``; then ``counted.bytes`` maps
    ``(kind, "forward" | "backward")`` to bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
            return out
        packet = func._overloadpacket
        if "_c10d_functional" not in str(packet):
            return out
        kind = _FUNCTIONAL.get(str(packet).rsplit(".", 1)[-1])
        if kind is not None:
            array = out if kind == "all_gather" else args[0]
            phase = "backward" if self.advanced_module_tracker.is_bw else "forward"
            self.bytes[(kind, phase)] += _nbytes(array)
        return out


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(item) for item in value)
