"""Auto-parallelism planner and cost-model optimizer for PyTorch training.

The staged API: :func:`resolve_model` -> :func:`trace` -> estimate / plan -> :class:`Plan`
-> :func:`parallelize`. The decision core never imports ``torch.distributed``; the
runtime lives in the ``strategies`` package and is imported only when a plan is applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from planner.lazy import lazy_attributes

# Public names and the module that defines each, loaded on first use (PEP 562), so
# `import planner` and the CLI's light subcommands start without torch.
_LAZY = {
    "PlannerError": "planner.errors",
    "SpecError": "planner.errors",
    "ModelSpec": "planner.spec",
    "Cluster": "planner.spec",
    "Training": "planner.spec",
    "Strategy": "planner.spec",
    "Plan": "planner.spec",
    "load_document": "planner.spec",
    "resolve_model": "planner.models",
    "list_models": "planner.models",
    "fingerprint": "planner.models",
    "parameters_on_meta": "planner.models",
    "make_plan": "planner.planning",
    "search_plan": "planner.planning",
    "export_plan": "planner.export",
    "parse_target": "planner.frameworks",
    "import_config": "planner.importers",
    "ImportedRun": "planner.importers",
    "scale_plans": "planner.scaling",
    "ScaleTable": "planner.scale_math",
    "Pins": "planner.solve.search",
    "LossyCompression": "planner.solve.lossy",
    "trace": "planner.tracing",
}

if TYPE_CHECKING:
    from torch import nn

    from planner.errors import PlannerError, SpecError
    from planner.export import export_plan
    from planner.frameworks import parse_target
    from planner.importers import ImportedRun, import_config
    from planner.models import fingerprint, list_models, parameters_on_meta, resolve_model
    from planner.planning import make_plan, search_plan
    from planner.scale_math import ScaleTable
    from planner.scaling import scale_plans
    from planner.solve.lossy import LossyCompression
    from planner.solve.search import Pins
    from planner.spec import Cluster, ModelSpec, Plan, Strategy, Training, load_document
    from planner.tracing import trace

__all__ = [
    "__version__",
    "PlannerError",
    "SpecError",
    "ModelSpec",
    "Cluster",
    "Training",
    "Strategy",
    "Plan",
    "resolve_model",
    "list_models",
    "fingerprint",
    "parameters_on_meta",
    "make_plan",
    "search_plan",
    "export_plan",
    "parse_target",
    "import_config",
    "ImportedRun",
    "scale_plans",
    "ScaleTable",
    "Pins",
    "LossyCompression",
    "trace",
    "load_document",
    "parallelize",
]


# Public submodules, imported on first use: `import planner; planner.export.to_megatron`.
_SUBMODULES = ("export", "plots", "frameworks")

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals(), _SUBMODULES)


def parallelize(
    model: nn.Module,
    plan: Plan | str | Path | None = None,
    *,
    cluster: Cluster | None = None,
    training: Training | None = None,
    pins: Pins | None = None,
    lossy: LossyCompression | None = None,
    **options: Any,
) -> Any:
    """Apply ``plan`` (a :class:`Plan` or a path to its JSON) to ``model`` with torch.distributed.

    Call on every rank of an initialised process group (or in one process for a plan
    whose degrees are all 1). Returns a :class:`strategies.parallel_model.ParallelModel`
    that knows its plan (``.plan``): ``local_batch(inputs, targets)`` cuts a global
    batch to this rank's share, ``step(inputs, targets) -> loss`` runs forward and
    backward over the plan's micro-batches (and pipeline schedule),
    ``evaluate(inputs, targets) -> loss`` the forward alone (eval mode, no gradients),
    ``clip_grad_norm_(max_norm)`` clips by the whole model's norm, ``parameters()`` feeds
    the optimizer, and ``parallel(inputs)`` runs the forward (``pp = 1``).
    One-shot form: pass ``cluster`` (``num_gpus`` = the world size) and ``training``
    instead of a plan, and the model is planned first (:func:`make_plan`, with
    ``pins`` and the ``lossy`` compression it may choose); every rank computes the same
    plan. ``options`` go to
    :func:`strategies.apply.parallelize` (``loss_fn``; ``seed`` and ``init`` for a model
    built on the meta device; ``weights``, a Hugging Face directory or checkpoint). Raises
    :class:`PlannerError` on every rank when the plan does not fit the model or the
    world size (the ranks agree on it before building anything).
    """
    from planner.errors import SpecError
    from planner.models import handle_for_module, random_state_kept
    from planner.planning import make_plan
    from planner.spec import Plan, load_document
    from strategies.apply import parallelize as apply_plan  # the runtime, imported on use

    if plan is None:
        if cluster is None or training is None:
            raise SpecError(
                "parallelize needs a plan, or cluster= and training= to plan the model first"
            )
        with random_state_kept():
            plan = make_plan(handle_for_module(model), cluster, training, pins=pins, lossy=lossy)
    elif cluster is not None or training is not None or pins is not None or lossy is not None:
        raise SpecError(
            "give parallelize either a plan or cluster=/training= (with pins=, lossy=), not both"
        )
    if not isinstance(plan, Plan):
        plan = load_document(Plan, Path(plan))
    return apply_plan(model, plan, **options)
