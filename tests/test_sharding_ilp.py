"""The generic sharding ILP on seeded random cost tables, checked against brute force."""

import itertools
import math

import numpy as np
import pulp
import pytest

from planner.errors import InfeasibleError, SpecError
from planner.solve.sharding import (
    ShardingEdge,
    ShardingInfeasibleError,
    ShardingNode,
    ShardingProblem,
    ShardingTimeoutError,
    format_bytes,
    solve_sharding,
)


def random_problem(
    seed: int,
    *,
    nodes: int = 6,
    strategies: int = 3,
    edges: int = 8,
    illegal: float = 0.2,
    budget: float = math.inf,
) -> ShardingProblem:
    """Random node costs (s), memories (bytes) and edge tables with some illegal entries."""
    rng = np.random.default_rng(seed)
    names = tuple(f"s{j}" for j in range(strategies))
    node_list = []
    for i in range(nodes):
        compute = rng.uniform(0, 1e-3, strategies)
        compute[1:][rng.random(strategies - 1) < illegal / 2] = np.inf  # keep one legal
        comm = rng.uniform(0, 1e-4, strategies)
        memory = rng.uniform(0, 1e6, strategies)
        node_list.append(ShardingNode(f"n{i}", names, compute, comm, memory))
    edge_list = []
    for _ in range(edges):
        u, v = rng.choice(nodes, 2, replace=False)
        table = rng.uniform(0, 1e-3, (strategies, strategies))
        table[rng.random((strategies, strategies)) < illegal] = np.inf
        edge_list.append(ShardingEdge(f"n{u}", f"n{v}", table))
    return ShardingProblem(tuple(node_list), tuple(edge_list), budget)


def brute_force(problem: ShardingProblem) -> float:
    """The best objective over every assignment that fits the budget (inf if none)."""
    best = math.inf
    for combo in itertools.product(*(node.strategies for node in problem.nodes)):
        choice = {node.name: s for node, s in zip(problem.nodes, combo, strict=True)}
        if problem.memory_of(choice) <= problem.memory_budget_bytes:
            best = min(best, problem.objective_s(choice))
    return best


BUDGET = 2.5e6  # binds on some seeds, leaves others infeasible


@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force_on_random_tables(seed):
    problem = random_problem(seed, budget=BUDGET)
    expected = brute_force(problem)
    if not math.isfinite(expected):
        with pytest.raises(ShardingInfeasibleError):
            solve_sharding(problem)
        return
    solution = solve_sharding(problem)
    assert solution.status == "optimal"
    assert solution.objective_s == pytest.approx(expected, rel=1e-6)
    assert solution.objective_s == pytest.approx(problem.objective_s(solution.choice))
    assert solution.memory_bytes <= problem.memory_budget_bytes
    assert solution.num_variables > len(problem.nodes)


def test_random_seeds_cover_infeasible_and_binding_budgets():
    limited = [brute_force(random_problem(seed, budget=BUDGET)) for seed in range(12)]
    unlimited = [brute_force(random_problem(seed)) for seed in range(12)]
    assert not all(math.isfinite(best) for best in limited)
    assert any(math.isfinite(a) and a > b for a, b in zip(limited, unlimited, strict=True))


def test_memory_budget_that_nothing_fits_names_the_memory_family():
    problem = random_problem(3, illegal=0.0, budget=1.0)
    with pytest.raises(ShardingInfeasibleError) as caught:
        solve_sharding(problem)
    assert caught.value.family == "memory_budget"
    assert "memory_budget" in str(caught.value)
    least = min(
        problem.memory_of(dict(zip([n.name for n in problem.nodes], combo, strict=True)))
        for combo in itertools.product(*(n.strategies for n in problem.nodes))
    )
    assert format_bytes(least) in str(caught.value)  # the least memory any assignment needs
    assert isinstance(caught.value, InfeasibleError)


def test_incompatible_edge_names_the_edge_family_and_the_edge():
    names = ("R", "S0")
    nodes = tuple(ShardingNode(f"n{i}", names, [1e-3, 1e-3], [0, 0], [0, 0]) for i in range(3))
    edges = (
        ShardingEdge("n0", "n1", [[0, np.inf], [np.inf, 0]]),
        ShardingEdge("n1", "n2", [[np.inf, np.inf], [np.inf, np.inf]]),
    )
    with pytest.raises(ShardingInfeasibleError) as caught:
        solve_sharding(ShardingProblem(nodes, edges))
    assert caught.value.family == "edge_consistency"
    assert "n1 -> n2" in str(caught.value)


def test_cycle_of_compatible_edges_that_cannot_agree_is_edge_family():
    names = ("a", "b")
    nodes = tuple(ShardingNode(f"n{i}", names, [0, 0], [0, 0], [0, 0]) for i in range(3))
    differ = [[np.inf, 0], [0, np.inf]]  # neighbours must pick different strategies
    edges = (
        ShardingEdge("n0", "n1", differ),
        ShardingEdge("n1", "n2", differ),
        ShardingEdge("n2", "n0", differ),
    )
    with pytest.raises(ShardingInfeasibleError) as caught:
        solve_sharding(ShardingProblem(nodes, edges))
    assert caught.value.family == "edge_consistency"
    assert "cycle" in str(caught.value)


def test_node_without_legal_strategy_is_one_strategy_family():
    node = ShardingNode("lonely", ("R", "S0"), [np.inf, np.inf], [0, 0], [0, 0])
    with pytest.raises(ShardingInfeasibleError) as caught:
        solve_sharding(ShardingProblem((node,), ()))
    assert caught.value.family == "one_strategy"
    assert "lonely" in str(caught.value)


def test_memory_budget_changes_the_choice():
    fast_big = ShardingNode("n0", ("R", "S0"), [1e-3, 2e-3], [0, 0], [100.0, 10.0])
    unlimited = solve_sharding(ShardingProblem((fast_big,), ()))
    tight = solve_sharding(ShardingProblem((fast_big,), (), memory_budget_bytes=50.0))
    assert unlimited.choice == {"n0": "R"}
    assert tight.choice == {"n0": "S0"}
    assert tight.memory_bytes == 10.0


def test_a_layout_that_must_split_a_weight_takes_the_cheapest_split():
    """``shard_one_of``: keeping both weights whole is cheapest, but one must split."""
    names = ("R", "S0")
    nodes = (
        ShardingNode("n0", names, [1e-3, 3e-3], [0, 0], [0, 0]),
        ShardingNode("n1", names, [1e-3, 2e-3], [0, 0], [0, 0]),
    )
    assert solve_sharding(ShardingProblem(nodes, ())).choice == {"n0": "R", "n1": "R"}
    forced = ShardingProblem(nodes, (), shard_one_of=(("n0", (1,)), ("n1", (1,))))
    assert solve_sharding(forced).choice == {"n0": "R", "n1": "S0"}


def test_a_split_that_cannot_run_is_the_sharded_weight_family():
    names = ("R", "S0")
    illegal = ShardingNode("n0", names, [1e-3, np.inf], [0, 0], [0, 0])
    with pytest.raises(ShardingInfeasibleError) as caught:
        solve_sharding(ShardingProblem((illegal,), (), shard_one_of=(("n0", (1,)),)))
    assert caught.value.family == "sharded_weight"
    nodes = tuple(ShardingNode(f"n{i}", names, [1e-3, 1e-3], [0, 0], [0, 0]) for i in range(2))
    whole_only = ShardingEdge("n0", "n1", [[0, np.inf], [np.inf, np.inf]])  # n0 split: no n1
    with pytest.raises(ShardingInfeasibleError) as caught:
        solve_sharding(ShardingProblem(nodes, (whole_only,), shard_one_of=(("n0", (1,)),)))
    assert caught.value.family == "sharded_weight"


def test_time_limit_returns_the_incumbent_and_says_so():
    # Dense random tables on a loopy graph: CBC does not prove optimality in 0.5 s.
    problem = random_problem(0, nodes=40, strategies=5, edges=120, illegal=0.0, budget=18e6)
    for limit in (0.5, 1.0, 2.0):  # a loaded machine may have no incumbent at 0.5 s yet
        try:
            solution = solve_sharding(problem, time_limit_s=limit)
            break
        except ShardingTimeoutError:
            continue
    else:
        pytest.fail("CBC found no incumbent within 2 s")
    assert solution.status == "time_limit_incumbent"
    assert "time limit" in solution.note and "not proven optimal" in solution.note
    assert math.isfinite(solution.objective_s)
    assert solution.objective_s == pytest.approx(problem.objective_s(solution.choice))
    assert solution.memory_bytes <= problem.memory_budget_bytes
    stats = solution.solver_stats()  # what the plan records
    assert stats.ilp_status == "time_limit_incumbent"
    assert stats.ilp_objective == solution.objective_s and stats.notes == (solution.note,)


def test_cbc_works_in_its_own_temporary_directory(tmp_path, monkeypatch):
    seen = []
    original = pulp.LpProblem.solve

    def spy(self, solver=None, **kwargs):
        seen.append(solver.tmpDir)
        return original(self, solver, **kwargs)

    monkeypatch.setattr(pulp.LpProblem, "solve", spy)
    solve_sharding(random_problem(1), tmp_dir=str(tmp_path))
    assert len(seen) == 1
    assert seen[0].startswith(str(tmp_path)) and seen[0] != str(tmp_path)
    assert list(tmp_path.iterdir()) == []  # removed afterwards, .mps and .sol included


def test_identical_blocks_share_variables_so_cost_is_per_type():
    solution = solve_sharding(random_problem(2))
    assert set(solution.choice) == {f"n{i}" for i in range(6)}
    assert solution.note.startswith("sharding ILP optimal")


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ShardingNode("n", ("R", "S0"), [0.0], [0, 0], [0, 0]), "compute_s"),
        (lambda: ShardingNode("n", ("R", "R"), [0, 0], [0, 0], [0, 0]), "repeats"),
        (lambda: ShardingNode("n", ("R",), [0], [0], [-1]), "memory_bytes"),
        (
            lambda: ShardingProblem(
                (ShardingNode("a", ("R",), [0], [0], [0]),), (ShardingEdge("a", "b", [[0]]),)
            ),
            "unknown node 'b'",
        ),
        (
            lambda: ShardingProblem(
                (ShardingNode("a", ("R",), [0], [0], [0]),), (ShardingEdge("a", "a", [[0, 1]]),)
            ),
            "expected (1, 1)",
        ),
        (lambda: ShardingProblem((), (), memory_budget_bytes=0.0), "memory_budget_bytes"),
    ],
)
def test_bad_input_names_the_field(build, field):
    with pytest.raises(SpecError, match=field.replace("(", r"\(").replace(")", r"\)")):
        build()


def test_time_limit_must_be_positive():
    with pytest.raises(SpecError, match="time_limit_s"):
        solve_sharding(random_problem(0), time_limit_s=0)
