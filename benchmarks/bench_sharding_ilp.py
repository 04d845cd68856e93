"""Solve time of the tensor-parallel layout ILP (target: one Llama-3-8B block at tp=8 < 1 s).

Traces each model on meta tensors, keeps only its block segments (one shared segment
type) for the "block" rows and the whole model for the "model" rows, builds the ILP
(operators, and conversion nodes at the module boundaries where the runtime can
redistribute) and solves it with CBC. Prints the ILP size (operators, ports and
conversions; edges; variables; constraints), CBC's status, the objective (predicted
seconds of one micro-batch's forward and backward over every segment in scope, from the
roofline numbers below), the time to build and to solve (median of three solves), and
whether the answer is Megatron-LM's layout (found, not pinned). The ILP is the same
size whatever the number of blocks: identical blocks share one set of variables.

    python benchmarks/bench_sharding_ilp.py
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from planner.graph import OpGraph
from planner.layouts import module_info
from planner.models import resolve_model
from planner.solve.layout import ModuleInfo, Roofline, build_layout_problem
from planner.solve.program import layout_from_solution
from planner.solve.sharding import solve_sharding
from planner.tracing import trace

H100 = Roofline(
    peak_flops=989e12, memory_bandwidth_GBps=3350, link_bandwidth_GBps=450, link_latency_us=3
)
CASES = (("llama3-8b", 8192, 8), ("gpt3-175b", 2048, 8))
REPEATS = 3


def blocks_only(graph: OpGraph) -> OpGraph:
    """The graph's block segments alone: the ILP of one block type."""
    blocks = graph.blocks
    types = {s.type_id: graph.types[s.type_id] for s in blocks}
    return replace(graph, segments=blocks, types=types)


def measure(
    graph: OpGraph, tp: int, sequence_parallel: bool, info: ModuleInfo
) -> dict[str, object]:
    start = time.perf_counter()
    layout_problem = build_layout_problem(
        graph, tp=tp, pricer=H100, sequence_parallel=sequence_parallel, info=info
    )
    build_s = time.perf_counter() - start
    solutions = [solve_sharding(layout_problem.problem) for _ in range(REPEATS)]
    solution = solutions[0]
    layout = layout_from_solution(layout_problem, solution, info)
    return {
        "ops": len(layout_problem.problem.nodes),
        "edges": len(layout_problem.problem.edges),
        "vars": solution.num_variables,
        "cons": solution.num_constraints,
        "status": solution.status,
        "objective_ms": solution.objective_s * 1e3,
        "build_s": build_s,
        "solve_s": statistics.median(s.solve_time_s for s in solutions),
        "megatron": all(
            layout.styles.get(f"layers.*.{m}") is not None
            and layout.styles[f"layers.*.{m}"].value == style
            for m, style in (
                ("attention.wq", "colwise"),
                ("attention.wo", "rowwise"),
                ("feed_forward.w1", "colwise"),
                ("feed_forward.w2", "rowwise"),
            )
        ),
    }


def main() -> None:
    header = (
        f"{'model':<11} {'scope':<6} {'tp':>3} {'sp':>3} {'ops':>5} {'edges':>5} {'vars':>6} "
        f"{'cons':>6} {'status':<8} {'objective':>11} {'build':>8} {'solve':>8} megatron"
    )
    print(header)
    print("-" * len(header))
    for name, seq, tp in CASES:
        start = time.perf_counter()
        handle = resolve_model(name, seq_len=seq)
        graph = trace(handle, batch_size=1, seq_len=seq)
        trace_s = time.perf_counter() - start
        info = module_info(handle.module)
        for scope, scoped in (("block", blocks_only(graph)), ("model", graph)):
            for sp in (False, True):
                row = measure(scoped, tp, sp, info)
                print(
                    f"{name:<11} {scope:<6} {tp:>3} {'yes' if sp else 'no':>3} {row['ops']:>5} "
                    f"{row['edges']:>5} {row['vars']:>6} {row['cons']:>6} {row['status']:<8} "
                    f"{row['objective_ms']:>8.3f} ms {row['build_s']:>6.3f} s "
                    f"{row['solve_s']:>6.3f} s {'yes' if row['megatron'] else 'NO'}"
                )
        print(f"{name:<11} (trace on meta tensors: {trace_s:.2f} s, not part of the ILP time)")
    print("target: one Llama-3-8B block at tp=8 solves in < 1 s")


if __name__ == "__main__":
    main()
