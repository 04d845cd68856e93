"""Auto-parallelism planner and cost-model optimizer for PyTorch training.

The staged API: :func:`resolve_model` -> :func:`trace` -> estimate / plan -> :class:`Plan`
-> :func:`parallelize`. The decision core never imports ``torch.distributed``; the
runtime lives in the ``strategies`` package and is imported only when a plan is applied.
"""

from __future__ import annotations

__version__ = "0.1.0"

from planner.errors import PlannerError
from planner.models import fingerprint, list_models, resolve_model
from planner.spec import Cluster, ModelSpec, Plan, Strategy, Training

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
]
