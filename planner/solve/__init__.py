"""Solvers: the per-operator sharding ILP, its mapping to TP layouts, and the stage DP.

All three take plain numbers, numpy arrays and the torch-free
:class:`~planner.graph.OpGraph`, never torch objects.
"""

from __future__ import annotations

from planner.solve.layout import Roofline, build_layout_problem
from planner.solve.program import TPLayout, solve_tp_layout
from planner.solve.sharding import (
    ShardingEdge,
    ShardingInfeasibleError,
    ShardingNode,
    ShardingProblem,
    ShardingSolution,
    ShardingTimeoutError,
    solve_sharding,
)
from planner.solve.stages import StagePartition, partition_stages, to_fqns

__all__ = [
    "Roofline",
    "ShardingEdge",
    "ShardingInfeasibleError",
    "ShardingNode",
    "ShardingProblem",
    "ShardingSolution",
    "ShardingTimeoutError",
    "StagePartition",
    "TPLayout",
    "build_layout_problem",
    "partition_stages",
    "solve_sharding",
    "solve_tp_layout",
    "to_fqns",
]
