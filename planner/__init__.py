"""Auto-parallelism planner and cost-model optimizer for PyTorch training.

The staged API: :func:`resolve_model` -> :func:`trace` -> estimate / plan -> :class:`Plan`
-> :func:`parallelize`. The decision core never imports ``torch.distributed``; the
runtime lives in the ``strategies`` package and is imported only when a plan is applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from planner.errors import PlannerError
from planner.models import fingerprint, list_models, resolve_model
from planner.solve.make_plan import make_plan
from planner.solve.search import Pins
from planner.spec import Cluster, ModelSpec, Plan, Strategy, Training, load_document
from planner.trace import trace

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "__version__",
    "PlannerError",
    "ModelSpec",
    "Cluster",
    "Training",
    "Strategy",
    "Plan",
    "resolve_model",
    "list_models",
    "fingerprint",
    "make_plan",
    "Pins",
    "trace",
    "load_document",
    "parallelize",
]


def parallelize(model: nn.Module, plan: Plan | str | Path, **options: Any) -> Any:
    """Apply ``plan`` (a :class:`Plan` or a path to its JSON) to ``model`` with torch.distributed.

    Call on every rank of an initialised process group (or in one process for a plan
    whose degrees are all 1). Returns the parallel model, or for pipeline plans a
    runner with ``step(inputs, targets) -> loss``, ``parameters()`` and ``state_dict()``.
    ``options`` go to :func:`strategies.apply.parallelize` (``loss_fn``,
    ``loss_parallel``). Raises :class:`PlannerError` before any collective when the
    plan does not fit the model or the world size.
    """
    from strategies.apply import parallelize as apply_plan  # the runtime, imported on use

    if not isinstance(plan, Plan):
        plan = load_document(Plan, Path(plan))
    return apply_plan(model, plan, **options)
