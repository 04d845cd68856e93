"""Tensor-parallel layouts of a real model: solved, rehearsed and priced in one place.

:class:`ModelLayouts` answers, for one model and training set-up, "how does tensor
parallelism of degree ``tp`` (with or without sequence parallelism) run this model?":

1. the sharding ILP (:mod:`planner.solve.layout`) chooses every module's layout on the
   traced graph, priced by the cost model's own compute and link models;
2. the layout is rehearsed on fake tensors (:mod:`planner.rehearse`); where the
   model's code cannot run on shards, that region is kept whole and the ILP solves
   again (at most :data:`MAX_ATTEMPTS` times);
3. the answer is both the plan's ``tp_layout`` and the cost model's
   :class:`~planner.cost.tp.TPAssignment`, so what runs is what was priced.

A zoo transformer's layout is Megatron-LM's (pinned styles; the ILP fills in the
redistributions), priced by the formula rule of :mod:`planner.cost.tp`, which tests
hold equal to this one. :func:`plan_layout` re-derives a plan's own ``tp_layout`` with
the same rules, which is how a hand-written or edited plan is checked and priced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace

from torch import nn

from planner.cost.tp import TPAssignment
from planner.errors import InfeasibleError, SpecError
from planner.graph import OpGraph
from planner.models import ModelHandle, handle_for_module, random_state_kept
from planner.modules import find_blocks
from planner.rehearse import RehearsalFailure, rehearse
from planner.solve.layout import (
    LayoutConstraints,
    LayoutPricer,
    ModuleInfo,
    Roofline,
    root_patterns,
)
from planner.solve.program import TPLayout, constraints_from_modules, solve_tp_layout
from planner.solve.sharding import ShardingInfeasibleError
from planner.spec import Activation, Family, ModelSpec, ModuleTP, Plan, TPStyle
from planner.tracing import trace_for_training

__all__ = [
    "MAX_ATTEMPTS",
    "FIXED_STYLE_PRICER",
    "ModelLayouts",
    "module_info",
    "megatron_constraints",
    "plan_layout",
    "check_plan_layout",
    "layout_differences",
]

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 8  # ILP solves per (tp, sequence_parallel), each after a failed rehearsal
FIXED_STYLE_PRICER = Roofline(
    peak_flops=1e15, memory_bandwidth_GBps=3000, link_bandwidth_GBps=400, link_latency_us=5
)
"""When the styles are fixed (Megatron's, or a plan's own) the ILP only chooses where to
redistribute; these H100-like numbers rank choices that move fewer bytes first, on any
cluster, so the layout does not depend on the cluster it is priced for."""


def _unsplittable_matrices(module: nn.Module) -> list[str]:
    """Types of the modules in ``module``'s blocks holding a matrix that is not an
    ``nn.Linear`` or ``nn.Embedding`` weight (GPT-2's ``Conv1D``)."""
    return sorted(
        {
            type(m).__name__
            for _, block in find_blocks(module)
            for m in block.modules()
            if not isinstance(m, nn.Linear | nn.Embedding)
            and any(p.ndim >= 2 for p in m.parameters(recurse=False))
        }
    )


def module_info(module: nn.Module) -> ModuleInfo:
    """The facts of ``module`` the layout ILP needs (see :class:`ModuleInfo`)."""
    weights = {n for n, m in module.named_modules() if isinstance(m, nn.Linear | nn.Embedding)}
    params = {
        name: tuple(p for p, _ in m.named_parameters(recurse=False, remove_duplicate=False))
        for name, m in module.named_modules(remove_duplicate=False)
    }
    owners: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rpartition(".")[0])
    tied = tuple(tuple(dict.fromkeys(group)) for group in owners.values() if len(set(group)) > 1)
    ports = {name for name, names in params.items() if names}
    return ModuleInfo(
        frozenset(weights), frozenset(ports), tied, {n: p for n, p in params.items() if p}
    )


def megatron_constraints(spec: ModelSpec, sequence_parallel: bool) -> LayoutConstraints:
    """Megatron-LM's layout of the zoo transformer as ILP pins (torchtitan's llama plan).

    Attention ``wq/wk/wv`` and FFN ``w1``/``w3`` column-parallel, ``wo``/``w2``
    row-parallel, the token embedding vocabulary-parallel, the position embedding
    replicated, the output head column-parallel with the loss vocabulary-parallel,
    norms sequence-parallel under SP (else replicated); shared experts as the FFN, routers
    and routed experts whole (expert parallelism splits their tokens instead).
    """
    norm = TPStyle.SEQUENCE_PARALLEL if sequence_parallel else TPStyle.REPLICATE
    styles = {
        "tok_embeddings": TPStyle.VOCAB_PARALLEL,
        "layers.*.attention.wq": TPStyle.COLWISE,
        "layers.*.attention.wk": TPStyle.COLWISE,
        "layers.*.attention.wv": TPStyle.COLWISE,
        "layers.*.attention.wo": TPStyle.ROWWISE,
        "layers.*.feed_forward.w1": TPStyle.COLWISE,
        "layers.*.feed_forward.w2": TPStyle.ROWWISE,
        "layers.*.attention_norm": norm,
        "layers.*.ffn_norm": norm,
        "norm": norm,
        "output": TPStyle.COLWISE,
    }
    if spec.act is Activation.SWIGLU:
        styles["layers.*.feed_forward.w3"] = TPStyle.COLWISE
    if spec.num_shared_experts:  # Megatron-Core shards shared experts as a dense MLP
        styles["layers.*.feed_forward.shared_experts.w1"] = TPStyle.COLWISE
        styles["layers.*.feed_forward.shared_experts.w3"] = TPStyle.COLWISE
        styles["layers.*.feed_forward.shared_experts.w2"] = TPStyle.ROWWISE
    if spec.family is not Family.LLAMA:
        styles["pos_embeddings"] = TPStyle.REPLICATE
    return LayoutConstraints(styles=styles, loss_parallel=True)


class ModelLayouts:
    """The layout at each ``(tp, sequence_parallel)`` of one model, found on first use.

    ``graph`` is the traced model at the training sequence length and dtype (made on
    first use by ``trace`` when not given); ``pricer`` prices operators and collectives
    as the cost model does. With ``megatron`` (zoo transformers) the styles are
    Megatron-LM's and a failed rehearsal is an error, not a retry.
    """

    def __init__(
        self,
        handle: ModelHandle,
        graph: OpGraph | None,
        pricer: LayoutPricer,
        *,
        trace: Callable[[], OpGraph] | None = None,
        time_limit_s: float = 10.0,
    ) -> None:
        self.handle = handle
        self._graph = graph
        self._trace = trace
        self.pricer = pricer
        self.time_limit_s = time_limit_s
        self.info = module_info(handle.module)
        self._layouts: dict[tuple[int, bool], TPLayout | None] = {}
        self._why_not: dict[tuple[int, bool], str] = {}
        self._kept_whole: dict[int, str] = {}  # tp -> the rehearsal failure that kept all whole

    @property
    def graph(self) -> OpGraph:
        if self._graph is None:
            assert self._trace is not None, "ModelLayouts needs a graph or a way to trace"
            self._graph = self._trace()
        return self._graph

    @property
    def megatron(self) -> bool:
        return self.handle.spec is not None

    def layout(self, tp: int, sequence_parallel: bool) -> TPLayout | None:
        """The layout, or ``None`` when sequence parallelism cannot run on this model."""
        key = (tp, sequence_parallel)
        if key not in self._layouts:
            self._layouts[key] = self._find(tp, sequence_parallel)
        return self._layouts[key]

    def why_not(self, tp: int, sequence_parallel: bool) -> str | None:
        """Why no layout at ``(tp, sequence_parallel)`` is worth running (``None``: one is):
        none runs, or the best shards no parameter (every rank would do the same work).
        A zoo transformer's Megatron layout runs but for sequence parallelism beside
        routed experts, which this runtime's token dispatch cannot run on a shard."""
        if tp == 1:
            return None
        if self.megatron:
            spec = self.handle.spec
            if not (sequence_parallel and spec is not None and spec.moe):
                return None
            self.layout(tp, sequence_parallel)
            return self._why_not.get((tp, sequence_parallel))
        if sequence_parallel and (whole := self.why_not(tp, False)) is not None:
            return whole  # what keeps the weights whole keeps sequence parallelism out too
        layout = self.layout(tp, sequence_parallel)
        if (
            sequence_parallel
            and layout is not None
            and _same_modules(layout, self.layout(tp, False))
        ):
            return (
                "it would shard nothing, its layout being tp's alone (no "
                f"block boundary keeps a residual stream split along a sequence); {_WITHOUT_SP}"
            )
        if layout is not None and not layout.shards_parameters:
            others = _unsplittable_matrices(self.handle.module)
            if tp in self._kept_whole:
                held = f"the layouts that do failed when run: {self._kept_whole[tp]}"
            elif others:
                held = (
                    f"its blocks' matrices are in {', '.join(others)} modules, and torch's "
                    "tensor-parallel styles split nn.Linear and nn.Embedding"
                )
            else:
                held = "every module holding one runs only whole here"
            return (
                f"no layout at tp {tp} splits a weight of the model's blocks ({held}): every "
                "rank would repeat the same work; leave tp to the search"
            )
        return self._why_not.get((tp, sequence_parallel))

    def assignment(self, tp: int, sequence_parallel: bool) -> TPAssignment:
        """The layout as the cost model prices it."""
        layout = self.layout(tp, sequence_parallel)
        if layout is None:
            raise InfeasibleError(
                f"tp {tp} with sequence parallelism cannot run {self.handle.name!r}: "
                f"{self._why_not[(tp, sequence_parallel)]}"
            )
        return layout.assignment

    def _base(self, sequence_parallel: bool) -> LayoutConstraints:
        if self.megatron:
            assert self.handle.spec is not None
            return megatron_constraints(self.handle.spec, sequence_parallel)
        return LayoutConstraints(shard_parameters=True)

    def _find(self, tp: int, sp: bool) -> TPLayout | None:
        constraints = self._base(sp)
        for _ in range(MAX_ATTEMPTS):
            try:
                layout = self._solve(tp, sp, constraints)
            except ShardingInfeasibleError as exc:
                if not sp:
                    raise
                self._why_not[(tp, sp)] = (
                    "no layout keeps the residual stream sharded through every module "
                    f"({exc}); {_WITHOUT_SP}"
                )
                return None
            failure = rehearse(self.handle, self.graph, layout.modules, tp=tp)
            if failure is None:
                return layout
            log.info("tp %d%s: %s; keeping it whole", tp, " sp" if sp else "", failure.describe())
            if self.megatron:
                raise SpecError(
                    f"Megatron layout of {self.handle.name!r} at tp {tp} does not run: "
                    f"{failure.describe()}"
                )
            region = self._region(failure)
            if region is None and not constraints.whole_after_blocks:
                constraints = replace(constraints, whole_after_blocks=True)  # the model's code
                continue
            if region is None or region in constraints.replicated:
                return self._give_up(tp, sp, constraints, failure)
            constraints = replace(constraints, replicated=constraints.replicated | {region})
        return self._give_up(tp, sp, constraints, None)

    def _solve(self, tp: int, sp: bool, constraints: LayoutConstraints) -> TPLayout:
        """The cheapest layout that splits some weight of the blocks; where none can (every
        such module kept whole), the cheapest at all, which :meth:`why_not` refuses."""
        try:
            return solve_tp_layout(
                self.graph, tp=tp, pricer=self.pricer, sequence_parallel=sp, info=self.info,
                constraints=constraints, time_limit_s=self.time_limit_s,
            )  # fmt: skip
        except ShardingInfeasibleError as exc:
            if exc.family != "sharded_weight":
                raise
            return self._solve(tp, sp, replace(constraints, shard_parameters=False))

    def _give_up(
        self, tp: int, sp: bool, constraints: LayoutConstraints, failure: RehearsalFailure | None
    ) -> TPLayout | None:
        """Sequence parallelism is not offered; without it, everything stays whole."""
        reason = failure.describe() if failure else f"{MAX_ATTEMPTS} regions failed on shards"
        if sp:
            self._why_not[(tp, sp)] = (
                f"the model's code does not run on sequence shards ({reason}); {_WITHOUT_SP}"
            )
            return None
        log.info("tp %d: %s; every module stays whole (TP shards nothing)", tp, reason)
        self._kept_whole[tp] = reason
        whole = replace(constraints, replicated=frozenset({"*"}))  # "*": every top-level module
        return self._solve(tp, sp, whole)

    def _region(self, failure: RehearsalFailure) -> str | None:
        """The pattern to keep whole: the failing block child (``layers.*.attn``) or the
        failing module outside the blocks; ``None`` when the failure is in a block's or
        the model's own code."""
        graph = self.graph
        blocks = {
            s.fqn: s.type_id for s in graph.segments if graph.types[s.type_id].kind == "block"
        }
        for fqn in reversed(failure.stack or (failure.module,)):
            for root, type_id in blocks.items():
                if fqn.startswith(root + "."):
                    child = fqn[len(root) + 1 :].split(".")[0]
                    pattern = root_patterns(graph, type_id)
                    base = pattern[0] if len(pattern) == 1 else root
                    return f"{base}.{child}"
            if fqn and fqn not in blocks and not any(r.startswith(fqn + ".") for r in blocks):
                return fqn
        return None


def _same_modules(layout: TPLayout, other: TPLayout | None) -> bool:
    return other is not None and layout.modules == other.modules


_WITHOUT_SP = (
    "run without sequence parallelism (--no-sequence-parallel; Pins(sequence_parallel=False))"
)


def _execution_order(graph: OpGraph) -> dict[str, int]:
    """Module FQN patterns (``layers.*.attention.wq``) and FQNs by first use in ``graph``."""
    order: dict[str, int] = {}
    for segment in graph.segments:
        seg_type = graph.types[segment.type_id]
        roots = (
            [segment.fqn, *root_patterns(graph, segment.type_id)]
            if seg_type.kind == "block"
            else [""]
        )
        order.setdefault(segment.fqn, len(order))
        for node in seg_type.nodes:
            for root in roots:
                order.setdefault(".".join(p for p in (root, node.module) if p), len(order))
    return order


def plan_layout(handle: ModelHandle, graph: OpGraph, plan: Plan, pricer: LayoutPricer) -> TPLayout:
    """``plan.tp_layout`` re-derived on ``graph`` by the ILP's rules and rehearsed.

    Raises :class:`SpecError` naming the module when the plan's layout breaks a rule
    (a sequence-sharded activation reaching attention, a redistribution the plan does
    not declare, a tied weight placed two ways) or does not run on the model's code.
    """
    strategy = plan.strategy
    pinned = replace(constraints_from_modules(graph, plan.tp_layout), exhaustive=True)
    try:
        layout = _solve_plan(handle, graph, plan, pricer, pinned)
    except (ShardingInfeasibleError, SpecError) as exc:
        raise _explain_mismatch(handle, graph, plan, pricer, exc) from None
    differences = layout_differences(plan.tp_layout, layout.modules, graph)
    if differences:
        raise SpecError(f"plan.tp_layout is inconsistent: {differences[0]}")
    failure = rehearse(handle, graph, layout.modules, tp=strategy.tp)
    if failure is not None:
        raise SpecError(
            f"plan.tp_layout does not run on {handle.name!r} at tp {strategy.tp}: "
            f"{failure.describe()}; keep that module replicated"
        )
    return layout


def _solve_plan(
    handle: ModelHandle, graph: OpGraph, plan: Plan, pricer: LayoutPricer,
    constraints: LayoutConstraints,
) -> TPLayout:  # fmt: skip
    return solve_tp_layout(
        graph, tp=plan.strategy.tp, pricer=pricer,
        sequence_parallel=plan.strategy.sequence_parallel, info=module_info(handle.module),
        constraints=constraints,
    )  # fmt: skip


def _explain_mismatch(
    handle: ModelHandle, graph: OpGraph, plan: Plan, pricer: LayoutPricer, exc: Exception
) -> SpecError:
    """The first module (in execution order) whose entry differs from what its styles need."""
    tp = plan.strategy.tp
    styles_only = LayoutConstraints(
        styles={k: m.style for k, m in plan.tp_layout.items() if m.style is not TPStyle.BOUNDARY}
    )
    try:
        needed = _solve_plan(handle, graph, plan, pricer, styles_only)
    except (ShardingInfeasibleError, SpecError) as styles_exc:
        return SpecError(f"plan.tp_layout's styles cannot run at tp {tp}: {styles_exc}")
    differences = layout_differences(plan.tp_layout, needed.modules, graph)
    if differences:
        return SpecError(f"plan.tp_layout is inconsistent at tp {tp}: {differences[0]}")
    return SpecError(f"plan.tp_layout cannot run at tp {tp}: {exc}")


def check_plan_layout(plan: Plan, module: nn.Module) -> TPLayout | None:
    """``plan.tp_layout`` checked against ``module`` by the planner's rules and a rehearsal
    (``None`` without tensor parallelism); raises :class:`SpecError` naming the module."""
    if plan.strategy.tp == 1:
        return None
    with random_state_kept():  # one rank checks for all: it must not draw apart
        handle = handle_for_module(module, name=plan.model_name, inputs=plan.inputs)
        graph = trace_for_training(handle, plan.training)
        return plan_layout(handle, graph, plan, FIXED_STYLE_PRICER)


def layout_differences(
    given: Mapping[str, ModuleTP], derived: Mapping[str, ModuleTP], graph: OpGraph | None = None
) -> list[str]:
    """Where a plan's layout and the one its rules imply differ, one line each, in the
    order the model runs its modules (``graph`` given) or by name."""
    order = _execution_order(graph) if graph is not None else {}
    keys = sorted(set(given) | set(derived), key=lambda k: (order.get(k, len(order)), k))
    lines = []
    for fqn in keys:
        mine, implied = given.get(fqn), derived.get(fqn)
        if mine == implied:
            continue
        if implied is None:
            lines.append(f"plan.tp_layout[{fqn!r}] names no module with parameters of the model")
        elif mine is None:
            if (
                implied.style is TPStyle.REPLICATE
                and implied.input is None
                and implied.output is None
            ):
                continue
            lines.append(
                f"module {fqn!r} needs an entry: {implied.model_dump(mode='json', exclude_defaults=True)}"
            )
        else:
            lines.append(
                f"plan.tp_layout[{fqn!r}] = {mine.model_dump(mode='json', exclude_defaults=True)} but the "
                f"layout it belongs to needs {implied.model_dump(mode='json', exclude_defaults=True)}"
            )
    return lines
