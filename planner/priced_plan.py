"""A saved plan priced again, on the graph and tensor-parallel layout the search priced it on.

``plan estimate --plan``, ``plan compare --profile`` and ``plan calibrate --from`` re-price
a plan under another hardware profile or other options. A zoo or spec-file transformer
is priced on its formula graph (:func:`~planner.cost.build.spec_graph`); any other model
(a Hugging Face config, ``module:function``, a small model, a module given in Python) is
built again on the meta device, checked against the plan's fingerprint, traced at the
plan's training shape, checked against ``plan.model_digest`` and priced with the plan's
own ``tp_layout``
(:func:`~planner.layouts.plan_layout`), so the price is the search's to the float.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torch import nn

from planner.cost import CostModel, CostOptions
from planner.cost.build import build_cost_model, spec_graph, stage_indices
from planner.cost.tp import TPAssignment
from planner.errors import SpecError
from planner.frameworks import parse_target
from planner.graph import OpGraph
from planner.hardware import HardwareProfile
from planner.layouts import FIXED_STYLE_PRICER, plan_layout
from planner.models import (
    SMALL_MODELS,
    ModelHandle,
    fingerprint,
    handle_for_module,
    is_import_path,
    random_state_kept,
    resolve_model,
)
from planner.planning import search_options
from planner.spec import Plan, Prediction
from planner.tracing import trace_for_training

__all__ = ["PricedPlan", "searched_options", "traced_plan_model"]


def searched_options(plan: Plan, source: str = "plan") -> CostOptions:
    """The cost options the search priced ``plan`` with: what its cluster's device runs,
    with the kernels of its target framework."""
    _check_profile_path(plan, source)
    return search_options(parse_target(plan.target, field="plan.target"), plan.cluster.gpu)


def _rebuilt_handle(
    plan: Plan, module: nn.Module | None, source: str, keep_buffers: bool, host_seed: int | None
) -> ModelHandle:
    """The model of :func:`traced_plan_model`; raises :class:`SpecError` when it cannot be
    built or is another model than the plan's."""
    origin = plan.model_source
    device = "meta" if host_seed is None else "cpu"
    if module is not None:
        handle = handle_for_module(module, name=plan.model_name, inputs=plan.inputs)
    elif origin and is_import_path(origin):
        handle = resolve_model(
            origin, keep_buffers=keep_buffers and host_seed is None, device=device, seed=host_seed
        )
    elif origin in SMALL_MODELS:
        handle = resolve_model(origin, device=device, seed=host_seed)
    elif origin and origin != "module":
        from planner.hf import resolve_hf_config  # transformers: only for such plans

        _check_relative_path("plan.model_source", origin, "plan --hf-config", source)
        handle = resolve_hf_config(origin, device=device, seed=host_seed)
    else:
        raise SpecError(
            f"{source}: the plan for {plan.model_name!r} was made for a module given in Python "
            "(plan.model_source is empty or 'module'): price it with "
            "planner.priced_plan.PricedPlan(plan, options, module=your_module)"
        )
    found = fingerprint(handle.module)
    if found != plan.model_fingerprint:
        raise SpecError(
            f"{source}: plan.model_fingerprint = {plan.model_fingerprint!r} but {origin!r} now "
            f"builds a model with fingerprint {found!r} (its parameters changed since the "
            "plan was made): make the plan again"
        )
    return handle


def traced_plan_model(
    plan: Plan, module: nn.Module | None = None, source: str = "plan", keep_buffers: bool = False,
    host_seed: int | None = None,
) -> tuple[ModelHandle, OpGraph]:  # fmt: skip
    """The traced model ``plan`` was made for, built again on the meta device from
    ``plan.model_source`` (or ``module``, built by the caller; ``keep_buffers``: a
    ``module:function``'s buffers as its ``__init__`` computes them, to train it;
    ``host_seed``: built on the CPU instead, seeded so, with the values its ``__init__``
    gives every tensor) and
    checked against the plan's fingerprint, and its trace at the plan's training shape,
    checked against the graph the plan was priced on (``plan.model_digest``): a config
    edit that keeps the parameter shapes (experts per token, heads of another width) is
    refused."""
    with random_state_kept():
        handle = _rebuilt_handle(plan, module, source, keep_buffers, host_seed)
        graph = trace_for_training(handle, plan.training)
    if plan.model_digest and graph.digest != plan.model_digest:
        raise SpecError(
            f"{source}: {plan.model_source or plan.model_name!r} now traces to another model "
            f"than the plan priced (plan.model_digest = {plan.model_digest!r}, now "
            f"{graph.digest!r}): its code or config changed in what the parameter shapes do "
            "not show (experts per token, head width, an operator); make the plan again"
        )
    return handle, graph


def _check_profile_path(plan: Plan, source: str) -> None:
    if plan.cluster.gpu.endswith(".json"):  # a profile file, as given to plan
        _check_relative_path("plan.cluster.gpu", plan.cluster.gpu, "the cluster", source)


def _check_relative_path(field: str, value: str, given_to: str, source: str) -> None:
    """Raise naming the plan's field when a path it keeps as given does not resolve here."""
    if not Path(value).exists():
        raise SpecError(
            f"{source}: {field} = {value!r} (the path given to {given_to}) does not exist "
            f"from {os.getcwd()}: run where the plan was made, or set {field} to an "
            "absolute path"
        )


class PricedPlan:
    """``plan``'s graph, built once, and its cost model under any profile.

    ``options`` are the cost options to price with (the search's: the device's own with
    the target's kernels; ``plan compare``'s: what ``plan measure`` runs); ``module`` is
    the model when the plan was made for a module given in Python.
    """

    def __init__(
        self,
        plan: Plan,
        options: CostOptions,
        *,
        module: nn.Module | None = None,
        source: str = "plan",
    ) -> None:
        _check_profile_path(plan, source)
        self.plan = plan
        self.options = options
        self.handle: ModelHandle | None = None
        if plan.model is not None:
            self.graph: OpGraph = spec_graph(plan.model, plan.training, options)
        else:
            self.handle, self.graph = traced_plan_model(plan, module, source)
        self._assignment: TPAssignment | None = None

    def cost_model(self, profile: HardwareProfile | None = None) -> CostModel:
        """The cost model the search built for the plan, under ``profile`` (default: the
        plan's cluster's)."""
        plan = self.plan
        training = plan.training.model_copy(update={"seq_len": None})  # the graph's length
        return build_cost_model(
            self.graph, plan.cluster, training,
            causal=plan.model.causal if plan.model is not None else None,
            options=self.options, profile=profile, tp_layouts=self._layouts(),
        )  # fmt: skip

    def estimate(self, profile: HardwareProfile | None = None) -> Prediction:
        """The plan's step time and memory under ``profile``, on its own pipeline stages."""
        stages = stage_indices(self.graph, self.plan.stages) if self.plan.stages else None
        return self.cost_model(profile).estimate(self.plan.strategy, stages=stages)

    def _layouts(self) -> Callable[[int, bool], TPAssignment] | None:
        """A traced model's layouts: the plan's own (a formula graph: Megatron's)."""
        if self.handle is None:
            return None
        handle = self.handle

        def assignment(tp: int, sequence_parallel: bool) -> TPAssignment:
            strategy = self.plan.strategy
            if (tp, sequence_parallel) != (strategy.tp, strategy.sequence_parallel):
                raise SpecError(
                    f"the plan's layout is for tp {strategy.tp} (sequence parallel "
                    f"{strategy.sequence_parallel}), not tp {tp} ({sequence_parallel})"
                )
            if self._assignment is None:
                layout = plan_layout(handle, self.graph, self.plan, FIXED_STYLE_PRICER)
                self._assignment = layout.assignment
            return self._assignment

        return assignment
