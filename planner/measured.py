"""What a real run measured: the :class:`MeasuredProfile` document ``plan measure`` writes.

A measured profile carries the plan it ran (so it can be re-priced and refitted on its
own), fingerprints of the model and the plan (so it is never compared with another
plan), the step time (median and spread over the timed steps), a per-phase breakdown
of one profiled step, the peak memory of every rank, and provenance (host, date, torch
version, method). Units: ``_s`` seconds, ``_gib`` 2^30 bytes.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.errors import PlanMismatchError
from planner.spec import GpuCount, Plan

__all__ = [
    "MEASURED_SCHEMA_VERSION",
    "PHASES",
    "Provenance",
    "MeasuredProfile",
    "plan_fingerprint",
    "check_same_plan",
    "step_statistics",
]

MEASURED_SCHEMA_VERSION: Literal[1] = 1
# Phases of one step; communication phases are "comm" or "comm_<mesh axis>".
PHASES = ("forward", "backward", "optimizer", "other")
_Seconds = Annotated[float, Field(ge=0)]
_GiB = Annotated[float, Field(ge=0)]


class Provenance(BaseModel):
    """Where and how a measurement was taken."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    host: str
    date: str  # ISO 8601, UTC
    torch_version: str
    device: str  # e.g. "cpu (gloo, 2 ranks, 1 thread each)" or a GPU name
    method: str  # how step time, phases and memory were taken


class MeasuredProfile(BaseModel):
    """Step time, phases and peak memory of ``steps`` timed steps of ``plan``."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    schema_version: Literal[1] = MEASURED_SCHEMA_VERSION
    model_name: str
    model_fingerprint: str
    plan_fingerprint: str
    plan: Plan
    world_size: GpuCount
    warmup_steps: int = Field(ge=0)
    step_times_s: tuple[_Seconds, ...] = Field(min_length=1)
    step_time_median_s: float = Field(gt=0)
    step_time_p10_s: float = Field(gt=0)
    step_time_p90_s: float = Field(gt=0)
    phases_s: dict[str, float] = {}  # one profiled step, exclusive seconds per phase
    peak_memory_gib: tuple[_GiB, ...] = ()  # per rank, in rank order
    memory_method: str = ""
    provenance: Provenance

    @model_validator(mode="after")
    def _check_consistency(self) -> Self:
        if self.plan_fingerprint != plan_fingerprint(self.plan):
            raise ValueError(
                f"plan_fingerprint {self.plan_fingerprint!r} does not match the embedded plan "
                f"({plan_fingerprint(self.plan)!r}): the file was edited or is corrupt"
            )
        if self.model_fingerprint != self.plan.model_fingerprint:
            raise ValueError(
                f"model_fingerprint {self.model_fingerprint!r} differs from the plan's "
                f"{self.plan.model_fingerprint!r}"
            )
        if self.peak_memory_gib and len(self.peak_memory_gib) != self.world_size:
            raise ValueError(
                f"peak_memory_gib has {len(self.peak_memory_gib)} entries for "
                f"world_size {self.world_size}: give one per rank"
            )
        return self

    @property
    def peak_memory_max_gib(self) -> float:
        """The largest peak over the ranks (0 when memory was not measured)."""
        return max(self.peak_memory_gib, default=0.0)


def plan_fingerprint(plan: Plan) -> str:
    """A short hash of what decides a run's cost: model, training, strategy, stages, layout.

    The prediction, runners-up and solver statistics do not enter it, so a plan
    re-priced with another hardware profile keeps its fingerprint.
    """
    decided = plan.model_dump(
        mode="json",
        include={"model_fingerprint", "training", "strategy", "mesh", "stages", "tp_layout"},
    )
    decided["num_gpus"] = plan.cluster.num_gpus
    text = json.dumps(decided, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_same_plan(plan: Plan, measured: MeasuredProfile, *, source: str = "measured") -> None:
    """Raise :class:`PlanMismatchError` unless ``measured`` ran ``plan`` on its model."""
    if plan.model_fingerprint != measured.model_fingerprint:
        raise PlanMismatchError(
            f"{source} was measured on model {measured.model_name!r} (fingerprint "
            f"{measured.model_fingerprint}) but the plan is for {plan.model_name!r} (fingerprint "
            f"{plan.model_fingerprint}): compare a plan with a measurement of that plan"
        )
    expected = plan_fingerprint(plan)
    if measured.plan_fingerprint != expected:
        raise PlanMismatchError(
            f"{source} ran plan {measured.plan_fingerprint} "
            f"({measured.plan.strategy.describe()}) but the plan given is {expected} "
            f"({plan.strategy.describe()}): measure this plan with 'plan measure' first"
        )


def step_statistics(times_s: list[float]) -> tuple[float, float, float]:
    """(median, 10th percentile, 90th percentile) of step times in seconds."""
    if len(times_s) < 2:
        return times_s[0], times_s[0], times_s[0]
    deciles = statistics.quantiles(times_s, n=10, method="inclusive")
    return statistics.median(times_s), deciles[0], deciles[-1]
