"""The software facts of the runtime in ``strategies/`` that calibration prices runs with.

:class:`~planner.cost.CostOptions` defaults describe a GPU training stack (cuBLAS/NCCL
workspaces, a caching allocator's slack). Runs measured by ``plan measure`` count
tensor bytes (MemTracker on CPU, ``max_memory_allocated`` on GPU), use DDP's default
25 MiB gradient buckets and DTensor sequence parallelism (a linear keeps its
all-gathered input for the backward rather than gathering it again as Megatron does).
On CPU these are the CPU's own options, which ``plan`` searches with too
(:func:`~planner.cost.options.device_options`).
"""

from __future__ import annotations

from planner.cost import CostOptions
from planner.cost.options import DDP_BUCKET_MIB, device_options
from planner.frameworks import Framework, framework_options
from planner.hardware import HardwareProfile

__all__ = ["measured_run_options"]


def measured_run_options(profile: HardwareProfile) -> CostOptions:
    """Cost options matching what ``plan measure`` runs and counts on ``profile``'s device:
    the device's own (:func:`~planner.cost.options.device_options`); on GPUs with DDP's
    buckets, DTensor sequence parallelism and allocated bytes (no allocator slack); with
    this runtime's kernels (:data:`~planner.frameworks.KERNELS`)."""
    if profile.device_kind == "cpu":
        options = device_options("cpu")
    else:
        options = CostOptions(
            dp_bucket_mib=DDP_BUCKET_MIB, allocator_margin=0.0, sp_regather_input=False
        )
    return framework_options(Framework.PLANNER, options)
