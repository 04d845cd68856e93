"""The per-operator sharding ILP, solved with CBC through PuLP.

Each node ``n`` of a block's operator graph has candidate strategies ``S_n`` (for a
linear: replicate, column-, row-sharded; see :mod:`planner.solve.layout`) with a
compute time ``c[n,s]`` (s), a communication time ``k[n,s]`` (s) and a memory
``m[n,s]`` (bytes per device). Each edge ``e = (u, v)`` carries the resharding time
``R_e[s,t]`` (s) between the producer's strategy ``s`` and the consumer's ``t``;
``R_e[s,t] = inf`` marks an illegal pair, a non-finite node cost an illegal strategy.
Identical blocks share one set of variables: the problem is built once per segment
type and its answer applies to every segment of that type.

Variables::

    x[n,s] in {0, 1}        node n uses strategy s           (legal s only)
    y[e,s,t] in [0, 1]      edge e joins producer s to consumer t (legal pairs only)

Objective (seconds)::

    min  sum_n sum_s (c[n,s] + k[n,s]) x[n,s]  +  sum_e sum_{s,t} R_e[s,t] y[e,s,t]

Constraint families (each constraint is named after its family)::

    one_strategy_n{n}:           sum_s x[n,s] = 1                         for every node
    edge_consistency_e{e}_s{s}:  sum_t y[e,s,t] = x[u,s]                  for every edge, s
    edge_consistency_e{e}_t{t}:  sum_s y[e,s,t] = x[v,t]                  for every edge, t
    edge_consistency_e{e}_t{t}:  x[v,t] <= sum_{s legal with t} x[u,s]    free edges, t
    tied_k{k}_m{i}_{label}:      sum_{s: L[a,s]=label} x[a,s] = sum_{t: L[b,t]=label} x[b,t]
    memory_budget:               sum_n sum_s m[n,s] x[n,s] <= budget
    sharded_weight:              sum_{(n,s) in W} x[n,s] >= 1     when W is given

The two marginal equalities are the tight (local-polytope) linearisation of
``y = x[u,s] * x[v,t]``: with binary ``x`` they force ``y`` to the product, so ``y``
can stay continuous, and since illegal pairs have no ``y``, choosing both ends of an
illegal pair is infeasible. An edge whose legal pairs all cost nothing (a placement
that must simply match) needs no ``y``: one inequality per consumer strategy says its
producer chose a compatible one. A tie (``ShardingTie``) makes nodes that share a
weight choose strategies with the same label (the weight's placement). ``W``
(``ShardingProblem.shard_one_of``) lists the strategies that split a parameter: given,
the layout must split at least one (a tensor-parallel group that splits no work is
not tensor parallelism, however cheap keeping everything whole would be). Internally
times are scaled to microseconds and memory to fractions of the budget, so CBC's
tolerances do not swallow small costs.

CBC runs with a time limit in its own temporary directory. On timeout the best
incumbent is returned with status ``time_limit_incumbent``; when the ILP is
infeasible, :class:`ShardingInfeasibleError` names the constraint family to relax.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pulp

from planner.errors import InfeasibleError, PlannerError, SpecError
from planner.spec import SolverStats

__all__ = [
    "ShardingNode",
    "ShardingEdge",
    "ShardingTie",
    "ShardingProblem",
    "ShardingSolution",
    "ShardingInfeasibleError",
    "ShardingTimeoutError",
    "solve_sharding",
]

log = logging.getLogger(__name__)

Family = Literal["one_strategy", "edge_consistency", "tied", "memory_budget", "sharded_weight"]
Status = Literal["optimal", "time_limit_incumbent"]
Outcome = Literal["optimal", "incumbent", "infeasible", "no_solution"]
ALL_FAMILIES: tuple[Family, ...] = (
    "one_strategy", "edge_consistency", "tied", "memory_budget", "sharded_weight"
)  # fmt: skip
_US_PER_S = 1e6


class ShardingInfeasibleError(InfeasibleError):
    """The sharding ILP has no solution; ``family`` names the constraint family to relax."""

    def __init__(self, family: Family, message: str) -> None:
        super().__init__(f"sharding ILP infeasible ({family}): {message}")
        self.family = family


class ShardingTimeoutError(PlannerError):
    """CBC hit its time limit before finding any feasible sharding."""


def _as_vector(values: Sequence[float] | np.ndarray, what: str, size: int) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.shape != (size,):
        raise SpecError(f"{what} has shape {array.shape}, expected ({size},): one per strategy")
    return array


@dataclass(frozen=True)
class ShardingNode:
    """One operator and its candidate strategies; arrays are indexed like ``strategies``.

    ``compute_s`` and ``comm_s`` are seconds per step (``inf`` marks an illegal
    strategy), ``memory_bytes`` bytes per device.
    """

    name: str
    strategies: tuple[str, ...]
    compute_s: np.ndarray
    comm_s: np.ndarray
    memory_bytes: np.ndarray

    def __post_init__(self) -> None:
        size = len(self.strategies)
        if size == 0:
            raise SpecError(f"node {self.name!r} has no strategies: give at least one")
        if len(set(self.strategies)) != size:
            raise SpecError(f"node {self.name!r} repeats a strategy name: {self.strategies}")
        for attribute in ("compute_s", "comm_s", "memory_bytes"):
            vector = _as_vector(getattr(self, attribute), f"node {self.name!r} {attribute}", size)
            object.__setattr__(self, attribute, vector)
        if not np.all(np.isfinite(self.memory_bytes)) or np.any(self.memory_bytes < 0):
            raise SpecError(
                f"node {self.name!r} memory_bytes {self.memory_bytes.tolist()} must be finite and >= 0"
            )

    @property
    def cost_s(self) -> np.ndarray:
        """Compute plus communication seconds per strategy."""
        return self.compute_s + self.comm_s

    @property
    def legal(self) -> np.ndarray:
        return np.isfinite(self.cost_s)


@dataclass(frozen=True)
class ShardingEdge:
    """A tensor from ``src`` to ``dst``: ``cost_s[s, t]`` seconds to reshard, ``inf`` illegal."""

    src: str
    dst: str
    cost_s: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost_s", np.asarray(self.cost_s, dtype=float))
        if self.cost_s.ndim != 2:
            raise SpecError(
                f"edge {self.src}->{self.dst} cost_s has shape {self.cost_s.shape}: "
                "expected [producer strategies x consumer strategies]"
            )

    @property
    def free(self) -> bool:
        """Every legal pair costs nothing: the edge only says which pairs may meet."""
        finite = self.cost_s[np.isfinite(self.cost_s)]
        return not np.any(finite)


@dataclass(frozen=True)
class ShardingTie:
    """Nodes that must choose strategies with equal labels (modules sharing a weight).

    ``labels[i][s]`` labels strategy ``s`` of node ``nodes[i]`` (the weight's placement).
    """

    nodes: tuple[str, ...]
    labels: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class ShardingProblem:
    """Nodes, edges and the per-device memory budget (bytes; ``inf`` for none);
    ``shard_one_of``: (node, strategy indices) that split a parameter, of which the
    solution takes at least one (empty: no such constraint)."""

    nodes: tuple[ShardingNode, ...]
    edges: tuple[ShardingEdge, ...]
    memory_budget_bytes: float = math.inf
    ties: tuple[ShardingTie, ...] = ()
    shard_one_of: tuple[tuple[str, tuple[int, ...]], ...] = ()
    index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {node.name: i for i, node in enumerate(self.nodes)}
        if len(index) != len(self.nodes):
            raise SpecError("node names must be unique in a sharding problem")
        for edge in self.edges:
            for end in (edge.src, edge.dst):
                if end not in index:
                    raise SpecError(f"edge {edge.src}->{edge.dst} names unknown node {end!r}")
            expected = (
                len(self.nodes[index[edge.src]].strategies),
                len(self.nodes[index[edge.dst]].strategies),
            )
            if edge.cost_s.shape != expected:
                raise SpecError(
                    f"edge {edge.src}->{edge.dst} cost_s has shape {edge.cost_s.shape}, "
                    f"expected {expected} (producer x consumer strategies)"
                )
        for tie in self.ties:
            for name, labels in zip(tie.nodes, tie.labels, strict=True):
                if name not in index or len(labels) != len(self.nodes[index[name]].strategies):
                    raise SpecError(f"tie names {name!r}: unknown node or one label per strategy")
        for name, picks in self.shard_one_of:
            if name not in index or not all(
                0 <= s < len(self.nodes[index[name]].strategies) for s in picks
            ):
                raise SpecError(f"shard_one_of names {name!r}: unknown node or strategy index")
        if not self.memory_budget_bytes > 0:
            raise SpecError(
                f"memory_budget_bytes = {self.memory_budget_bytes} must be > 0 (inf for no limit)"
            )
        object.__setattr__(self, "index", index)

    def node(self, name: str) -> ShardingNode:
        return self.nodes[self.index[name]]

    def objective_s(self, choice: dict[str, str]) -> float:
        """Total seconds of an assignment node -> strategy name (``inf`` if illegal)."""
        picks = {node.name: node.strategies.index(choice[node.name]) for node in self.nodes}
        total = sum(float(node.cost_s[picks[node.name]]) for node in self.nodes)
        return total + sum(float(e.cost_s[picks[e.src], picks[e.dst]]) for e in self.edges)

    def memory_of(self, choice: dict[str, str]) -> float:
        """Bytes per device of an assignment."""
        return sum(
            float(node.memory_bytes[node.strategies.index(choice[node.name])])
            for node in self.nodes
        )


@dataclass(frozen=True)
class ShardingSolution:
    """The chosen strategy per node and how CBC got there."""

    choice: dict[str, str]  # node name -> strategy name
    objective_s: float  # seconds, recomputed from the tables for the chosen strategies
    memory_bytes: float  # per device, for the chosen strategies
    status: Status  # "optimal", or "time_limit_incumbent": best found, not proven optimal
    solve_time_s: float  # building the ILP and running CBC
    num_variables: int
    num_constraints: int
    time_limit_s: float

    @property
    def note(self) -> str:
        """A line for the plan's solver notes; says when the incumbent is not proven optimal."""
        if self.status == "time_limit_incumbent":
            return (
                f"sharding ILP hit its {self.time_limit_s:g} s time limit: using the best "
                f"incumbent (objective {self.objective_s:.6g} s), not proven optimal"
            )
        return f"sharding ILP optimal (objective {self.objective_s:.6g} s)"

    def solver_stats(self, base: SolverStats | None = None) -> SolverStats:
        """``base`` (the plan's solver record) with this ILP's status, objective, time and note."""
        base = base or SolverStats()
        return base.model_copy(
            update={
                "ilp_status": self.status,
                "ilp_objective": self.objective_s,
                "ilp_time_s": self.solve_time_s,
                "notes": (*base.notes, self.note),
            }
        )


@dataclass
class _Model:
    """A PuLP problem and its variables, built one constraint family at a time."""

    problem: ShardingProblem
    lp: pulp.LpProblem
    x: list[dict[int, pulp.LpVariable]]
    y: list[dict[tuple[int, int], pulp.LpVariable]]

    @classmethod
    def build(cls, problem: ShardingProblem, *, objective: str = "time") -> _Model:
        lp = pulp.LpProblem("sharding", pulp.LpMinimize)
        x = [
            {
                s: lp.add_variable(f"x_n{n}_s{s}", 0, 1, cat=pulp.LpBinary)
                for s in np.flatnonzero(node.legal).tolist()
            }
            for n, node in enumerate(problem.nodes)
        ]
        y = [cls._edge_variables(lp, problem, k, edge, x) for k, edge in enumerate(problem.edges)]
        model = cls(problem, lp, x, y)
        model.lp += model._memory_term() if objective == "memory" else model._time_term()
        return model

    @staticmethod
    def _edge_variables(
        lp: pulp.LpProblem,
        problem: ShardingProblem,
        k: int,
        edge: ShardingEdge,
        x: list[dict[int, pulp.LpVariable]],
    ) -> dict[tuple[int, int], pulp.LpVariable]:
        if edge.free:
            return {}
        src, dst = x[problem.index[edge.src]], x[problem.index[edge.dst]]
        return {
            (s, t): lp.add_variable(f"y_e{k}_s{s}_t{t}", 0, 1)
            for s in src
            for t in dst
            if np.isfinite(edge.cost_s[s, t])
        }

    def _time_term(self) -> pulp.LpAffineExpression:
        terms = [
            (var, float(node.cost_s[s]) * _US_PER_S)
            for node, xs in zip(self.problem.nodes, self.x, strict=True)
            for s, var in xs.items()
        ]
        terms += [
            (var, float(edge.cost_s[s, t]) * _US_PER_S)
            for edge, ys in zip(self.problem.edges, self.y, strict=True)
            for (s, t), var in ys.items()
        ]
        return pulp.LpAffineExpression(terms)

    def _memory_term(self) -> pulp.LpAffineExpression:
        scale = self._memory_scale()
        return pulp.LpAffineExpression(
            (var, float(node.memory_bytes[s]) / scale)
            for node, xs in zip(self.problem.nodes, self.x, strict=True)
            for s, var in xs.items()
        )

    def _memory_scale(self) -> float:
        budget = self.problem.memory_budget_bytes
        if math.isfinite(budget):
            return budget
        return max(1.0, max(float(node.memory_bytes.max()) for node in self.problem.nodes))

    def add_one_strategy(self) -> None:
        for n, xs in enumerate(self.x):
            self.lp += pulp.lpSum(xs.values()) == 1, f"one_strategy_n{n}"

    def add_edge_consistency(self) -> None:
        for k, (edge, ys) in enumerate(zip(self.problem.edges, self.y, strict=True)):
            src, dst = self.x[self.problem.index[edge.src]], self.x[self.problem.index[edge.dst]]
            if edge.free:
                legal = np.isfinite(edge.cost_s)
                for t, var in dst.items():
                    row = [x for s, x in src.items() if legal[s, t]]
                    self.lp += var <= pulp.lpSum(row), f"edge_consistency_e{k}_t{t}"
                continue
            for s, var in src.items():
                row = [y for (ys_, _), y in ys.items() if ys_ == s]
                self.lp += pulp.lpSum(row) == var, f"edge_consistency_e{k}_s{s}"
            for t, var in dst.items():
                column = [y for (_, yt), y in ys.items() if yt == t]
                self.lp += pulp.lpSum(column) == var, f"edge_consistency_e{k}_t{t}"

    def add_tied(self) -> None:
        for k, tie in enumerate(self.problem.ties):
            first = self.x[self.problem.index[tie.nodes[0]]]
            for i, name in enumerate(tie.nodes[1:], start=1):
                other = self.x[self.problem.index[name]]
                for label in sorted(set(tie.labels[0]) | set(tie.labels[i])):
                    left = [v for s, v in first.items() if tie.labels[0][s] == label]
                    right = [v for s, v in other.items() if tie.labels[i][s] == label]
                    self.lp += pulp.lpSum(left) == pulp.lpSum(right), f"tied_k{k}_m{i}_{label}"

    def add_memory_budget(self) -> None:
        if math.isfinite(self.problem.memory_budget_bytes):
            self.lp += self._memory_term() <= 1.0, "memory_budget"

    def add_sharded_weight(self) -> None:
        if not self.problem.shard_one_of:
            return
        picks = [
            xs[s]
            for name, strategies in self.problem.shard_one_of
            for s in strategies
            if s in (xs := self.x[self.problem.index[name]])  # legal strategies only
        ]
        self.lp += pulp.lpSum(picks) >= 1, "sharded_weight"

    def run(self, time_limit_s: float, tmp_dir: str | None) -> Outcome:
        """Solve with CBC in a private temporary directory."""
        solver = pulp.COIN_CMD(
            path=pulp.PULP_CBC_CMD.pulp_cbc_path, msg=False, timeLimit=time_limit_s, keepFiles=False
        )
        with tempfile.TemporaryDirectory(prefix="planner-cbc-", dir=tmp_dir) as private:
            solver.tmpDir = private
            self.lp.solve(solver)
        if self.lp.sol_status == pulp.LpSolutionOptimal:
            return "optimal"
        if self.lp.sol_status == pulp.LpSolutionIntegerFeasible:
            return "incumbent"
        return "infeasible" if self.lp.status == pulp.LpStatusInfeasible else "no_solution"

    def choice(self) -> dict[str, str]:
        return {
            node.name: node.strategies[max(xs, key=lambda s: xs[s].varValue or 0.0)]
            for node, xs in zip(self.problem.nodes, self.x, strict=True)
        }


def _build(problem: ShardingProblem, families: Sequence[Family], objective: str = "time") -> _Model:
    model = _Model.build(problem, objective=objective)
    builders = {
        "one_strategy": model.add_one_strategy,
        "edge_consistency": model.add_edge_consistency,
        "tied": model.add_tied,
        "memory_budget": model.add_memory_budget,
        "sharded_weight": model.add_sharded_weight,
    }
    for family in families:
        builders[family]()
    return model


def solve_sharding(
    problem: ShardingProblem, *, time_limit_s: float = 10.0, tmp_dir: str | None = None
) -> ShardingSolution:
    """Choose one strategy per node minimising total seconds within the memory budget.

    CBC writes its files in a fresh temporary directory (under ``tmp_dir`` if given)
    that is removed afterwards. Raises :class:`ShardingInfeasibleError` naming the
    constraint family that makes the problem infeasible, and
    :class:`ShardingTimeoutError` when the time limit passes before any solution.
    """
    if not time_limit_s > 0:
        raise SpecError(f"time_limit_s = {time_limit_s} must be > 0 seconds")
    _check_every_node_has_a_strategy(problem)
    if problem.shard_one_of and not any(
        problem.node(name).legal[s] for name, picks in problem.shard_one_of for s in picks
    ):
        raise ShardingInfeasibleError("sharded_weight", _NOTHING_SPLITS)
    start = time.perf_counter()
    model = _build(problem, ALL_FAMILIES)
    outcome = model.run(time_limit_s, tmp_dir)
    elapsed = time.perf_counter() - start
    if outcome in ("optimal", "incumbent"):
        return _solution(model, outcome, elapsed, time_limit_s)
    if outcome == "no_solution":
        raise _timeout(time_limit_s, model)
    raise _diagnose_infeasible(problem, time_limit_s, tmp_dir)


def _timeout(time_limit_s: float, model: _Model) -> ShardingTimeoutError:
    return ShardingTimeoutError(
        f"CBC found no feasible sharding within time_limit_s = {time_limit_s:g} s "
        f"({model.lp.numVariables()} variables): raise time_limit_s"
    )


def _solution(
    model: _Model, outcome: Outcome, elapsed: float, time_limit_s: float
) -> ShardingSolution:
    choice = model.choice()
    status: Status = "optimal" if outcome == "optimal" else "time_limit_incumbent"
    solution = ShardingSolution(
        choice=choice,
        objective_s=model.problem.objective_s(choice),
        memory_bytes=model.problem.memory_of(choice),
        status=status,
        solve_time_s=elapsed,
        num_variables=model.lp.numVariables(),
        num_constraints=model.lp.numConstraints(),
        time_limit_s=time_limit_s,
    )
    log.info(
        "sharding ILP: %s, %d variables, %d constraints, objective %.6g s, %.3f s",
        status, solution.num_variables, solution.num_constraints, solution.objective_s, elapsed,
    )  # fmt: skip
    return solution


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.50 KiB"`` (binary units)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while abs(nbytes) >= 1024 and power < len(units) - 1:
        nbytes /= 1024
        power += 1
    return f"{nbytes:.2f} {units[power]}"


def _check_every_node_has_a_strategy(problem: ShardingProblem) -> None:
    for node in problem.nodes:
        if not node.legal.any():
            raise ShardingInfeasibleError(
                "one_strategy",
                f"node {node.name!r} has no strategy with a finite cost among "
                f"{list(node.strategies)}: give it at least one legal strategy",
            )


_NOTHING_SPLITS = "no layout that splits a parameter over the group is consistent"


def _diagnose_infeasible(
    problem: ShardingProblem, time_limit_s: float, tmp_dir: str | None
) -> PlannerError:
    """Re-solve without a family at a time, minimising memory, to tell which is to blame."""
    if problem.shard_one_of:
        free = _build(problem, ("one_strategy", "edge_consistency", "tied", "memory_budget"))
        outcome = free.run(time_limit_s, tmp_dir)
        if outcome == "no_solution":
            return _timeout(time_limit_s, free)
        if outcome != "infeasible":
            return ShardingInfeasibleError("sharded_weight", _NOTHING_SPLITS)
    without_memory = _build(problem, ("one_strategy", "edge_consistency", "tied"), "memory")
    outcome = without_memory.run(time_limit_s, tmp_dir)
    if outcome == "no_solution":
        return _timeout(time_limit_s, without_memory)
    if outcome != "infeasible":
        needed = problem.memory_of(without_memory.choice())
        bound = "needs" if outcome == "optimal" else "needs at most"
        return ShardingInfeasibleError(
            "memory_budget",
            f"the least-memory sharding {bound} {format_bytes(needed)} per device, "
            f"memory_budget_bytes allows {format_bytes(problem.memory_budget_bytes)}: "
            "raise the budget, use a larger tp degree or shard more (ZeRO-3, recompute)",
        )
    if problem.ties:
        untied = _build(problem, ("one_strategy", "edge_consistency"), "memory")
        if untied.run(time_limit_s, tmp_dir) in ("optimal", "incumbent"):
            names = "; ".join(" and ".join(tie.nodes) for tie in problem.ties)
            return ShardingInfeasibleError(
                "tied",
                f"nodes sharing a weight ({names}) cannot place it alike: replicate them, "
                "or give them strategies that shard the same dim",
            )
    return ShardingInfeasibleError("edge_consistency", _blocking_edge(problem))


def _blocking_edge(problem: ShardingProblem) -> str:
    """Arc consistency: the first edge that leaves a node without a compatible strategy."""
    domains = {node.name: set(np.flatnonzero(node.legal).tolist()) for node in problem.nodes}
    changed = True
    while changed:
        changed = False
        for edge in problem.edges:
            legal = np.isfinite(edge.cost_s)
            src_ok = {s for s in domains[edge.src] if any(legal[s, t] for t in domains[edge.dst])}
            dst_ok = {t for t in domains[edge.dst] if any(legal[s, t] for s in domains[edge.src])}
            if not src_ok or not dst_ok:
                return (
                    f"edge {edge.src} -> {edge.dst} allows no pair of their remaining strategies: "
                    "allow a resharding between them (a finite cost) or more strategies"
                )
            if src_ok != domains[edge.src] or dst_ok != domains[edge.dst]:
                domains[edge.src], domains[edge.dst] = src_ok, dst_ok
                changed = True
    return (
        "no assignment satisfies every edge at once (a cycle of incompatible reshardings): "
        "allow more reshardings (finite edge costs)"
    )
