"""The calibrated cost model: step time, MFU/HFU and peak memory per GPU.

Modules, each named for what it prices: :mod:`~planner.cost.compute` (operators,
roofline), :mod:`~planner.cost.communication` (collectives, link tiers),
:mod:`~planner.cost.memory` (model states, activations, in-flight micro-batches, a
rank's peak), :mod:`~planner.cost.pipeline` (schedules, the even stage split),
:mod:`~planner.cost.flops` (MFU/HFU conventions), :mod:`~planner.cost.tp` (what a
tensor-parallel layout splits), :mod:`~planner.cost.segment` (one segment type's
cost), :mod:`~planner.cost.ranks` (per-pipeline-rank sums),
:mod:`~planner.cost.compression` (fp16/bf16, int8 and PowerSGD gradient compression),
:mod:`~planner.cost.data_parallel` (gradient reduction, compression and optimizer
seconds per step), :mod:`~planner.cost.throughput` (FLOPs, MFU/HFU, the prediction),
:mod:`~planner.cost.model` (:class:`CostModel`, the facade), :mod:`~planner.cost.build`
(the one place a cost model is set up, for the search and ``plan estimate`` alike),
:mod:`~planner.cost.run` (the ``plan estimate`` contract).
"""

from __future__ import annotations

from planner.cost.build import build_cost_model
from planner.cost.model import CostModel, SegmentCost
from planner.cost.options import AttentionKernel, CostOptions
from planner.cost.run import RunConfig, estimate_run, prediction_to_dict
from planner.cost.spec_graph import graph_from_spec

__all__ = [
    "AttentionKernel",
    "CostModel",
    "CostOptions",
    "RunConfig",
    "SegmentCost",
    "build_cost_model",
    "estimate_run",
    "graph_from_spec",
    "prediction_to_dict",
]
