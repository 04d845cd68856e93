"""The software facts of the runtime in ``strategies/`` that calibration prices runs with.

:class:`~planner.cost.CostOptions` defaults describe a GPU training stack (cuBLAS/NCCL
workspaces, a caching allocator's slack). Runs measured by ``plan measure`` count
tensor bytes (MemTracker on CPU, ``max_memory_allocated`` on GPU), use DDP's default
25 MiB gradient buckets and DTensor sequence parallelism (a linear keeps its
all-gathered input for the backward rather than gathering it again as Megatron does).
On CPU they overlap DDP's bucket all-reduces (gloo's own thread) with the backward, but
not FSDP's all-gathers (no CUDA streams to prefetch on) nor PowerSGD's reductions (on
gloo the runtime's ``ordered_powersgd_hook`` waits for each bucket before the backward
goes on, to keep the ranks' collectives in one order).
"""

from __future__ import annotations

from planner.cost import CostOptions
from planner.hardware import HardwareProfile

__all__ = ["DDP_BUCKET_MIB", "measured_run_options"]

DDP_BUCKET_MIB = 25.0  # torch.nn.parallel.DistributedDataParallel bucket_cap_mb default


def measured_run_options(profile: HardwareProfile) -> CostOptions:
    """Cost options matching what ``plan measure`` runs and counts on ``profile``'s device."""
    if profile.device_kind == "cpu":
        return CostOptions(
            overlap_grad_reduce=True,  # gloo reduces DDP buckets on its own thread
            overlap_param_gather=False,  # no streams: FSDP2 gathers before it computes
            overlap_powersgd=False,  # strategies.compression.ordered_powersgd_hook waits
            sp_regather_input=False,
            dp_bucket_mib=DDP_BUCKET_MIB,
            allocator_margin=0.0,
            workspace_gib=0.0,
        )
    return CostOptions(dp_bucket_mib=DDP_BUCKET_MIB, allocator_margin=0.0, sp_regather_input=False)
