"""How many GPUs, how long, what cost: plan a model at several cluster sizes.

Each size is planned by :func:`planner.planning.make_plan`, as ``plan search`` plans
one; the table (days to train a token budget, GPU-hours, cost, efficiency, the knee,
the deadline) is :mod:`planner.scale_math`'s arithmetic, whose docstring defines each
column. A size where no plan fits is a row with the search's reason, not an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from planner.cost import CostOptions
from planner.errors import InfeasibleError, SpecError
from planner.frameworks import Target
from planner.models import ModelHandle
from planner.planning import TOLERANCE, make_plan
from planner.scale_math import (
    KNEE_THRESHOLD,
    GpuSizes,
    ScaleTable,
    SizeFit,
    SizeMiss,
    scale_table,
)
from planner.solve.search import Headroom, Progress
from planner.spec import Cluster, Plan, Training

__all__ = ["scale_plans"]


def scale_plans(
    handle: ModelHandle,
    cluster: Cluster,
    training: Training,
    sizes: GpuSizes | Sequence[int],
    *,
    tokens: float,
    price_per_gpu_hour: float | None = None,
    deadline_days: float | None = None,
    knee_threshold: float = KNEE_THRESHOLD,
    options: CostOptions | None = None,
    progress: Progress | None = None,
    target: Target | str = "planner",
    headroom: Headroom | None = None,
    tolerance: float = TOLERANCE,
) -> ScaleTable:
    """Plan ``handle`` on ``cluster`` resized to each of ``sizes`` (GPU counts; the
    cluster's GPU, node size and links are kept) and tabulate training ``tokens``.

    ``price_per_gpu_hour`` adds the cost, ``deadline_days`` asks for the smallest size
    that trains in time (:attr:`ScaleTable.meets_deadline`). ``progress(done, total)``
    counts sizes; ``target``, ``headroom`` and ``tolerance`` go to each search
    (:func:`~planner.planning.search_plan`). Every size is checked before the first is planned; a size where
    nothing fits (:class:`InfeasibleError`) or no mesh of that many GPUs suits the
    model and batch (:class:`SpecError`) becomes a :class:`SizeMiss` row.
    """
    sizes = sizes if isinstance(sizes, GpuSizes) else GpuSizes.of(sizes)
    clusters = sizes.clusters(cluster)
    outcomes: list[SizeFit | SizeMiss] = []
    for done, sized in enumerate(clusters):
        if progress is not None:
            progress(done, len(clusters))
        plan_at = partial(make_plan, top_k=0, options=options, target=target,
                          headroom=headroom, tolerance=tolerance)  # fmt: skip
        outcomes.append(_plan_at(plan_at, handle, sized, training))
    if progress is not None:
        progress(len(clusters), len(clusters))
    return scale_table(
        outcomes, tokens=tokens, price_per_gpu_hour=price_per_gpu_hour,
        deadline_days=deadline_days, knee_threshold=knee_threshold, model=handle.name,
        cluster=cluster.name or cluster.gpu,
    )  # fmt: skip


def _plan_at(
    planner: Callable[[ModelHandle, Cluster, Training], Plan],
    handle: ModelHandle,
    cluster: Cluster,
    training: Training,
) -> SizeFit | SizeMiss:
    """The figures of ``planner``'s plan at ``cluster``'s size, or why there is none."""
    try:
        plan = planner(handle, cluster, training)
    except (InfeasibleError, SpecError) as exc:
        return SizeMiss(cluster.num_gpus, str(exc))
    prediction = plan.prediction
    assert prediction is not None  # the search always predicts its plan
    return SizeFit(
        gpus=cluster.num_gpus, strategy=plan.strategy.describe(),
        step_time_s=prediction.step_time_s,
        tokens_per_s=prediction.tokens_per_s_per_gpu * cluster.num_gpus, mfu=prediction.mfu,
        peak_memory_gib=prediction.peak_memory_gib,
        memory_limit_gib=prediction.memory_limit_gib,
    )  # fmt: skip
