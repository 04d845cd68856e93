"""The plans ``plan calibrate`` runs on a CPU: the probe model trained in each way this
runtime parallelizes it (DDP, FSDP, tensor parallel with and without sequence
parallelism, a pipeline).

The eager DDP step (:func:`~planner.calibrate.microbench.training_step_sample`) prices
what every plan pays per operator and parameter tensor, but not what only the others
pay: DTensor's dispatch per operator and per parameter tensor, FSDP2's hooks and copies
per unit, the pipeline schedule's actions, and the wait of each of their many small
collectives for the other ranks, which a back-to-back sweep never sees. ``plan
calibrate`` measures these runs as ``plan measure`` would and refits the profile's
framework and collective overheads to them
(:func:`~planner.calibrate.refit.refit_profile`, what ``plan calibrate --from`` does
with runs of your own), so that a plan made on the profile prices what ``plan measure``
then sees, whichever runtime the search picks.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from planner.assemble import assemble_plan
from planner.calibrate.fit import CalibrationError, FitResult, rms
from planner.calibrate.microbench import PROBE_MICRO_BATCH, PROBE_MODEL
from planner.calibrate.options import measured_run_options
from planner.calibrate.refit import (
    RefitParameter,
    parameters_shown,
    refit_profile,
    with_parameters,
)
from planner.hardware import HardwareProfile
from planner.measured import MeasuredProfile
from planner.models import resolve_model
from planner.parallel_dims import ParallelDims
from planner.priced_plan import PricedPlan
from planner.spec import Cluster, DType, Plan, Schedule, Strategy, Training

__all__ = [
    "PROBE_PIPELINE_MICROBATCHES", "PROBE_PARAMETERS", "probe_strategies", "probe_plans",
    "refit_to_probe_runs",
]  # fmt: skip

PROBE_PIPELINE_MICROBATCHES = 4  # a pipeline's micro-batches per step (its bubble shows)

# What only the runtime's distributed wrappers and its training loop pay, which a DDP
# step never shows (milliseconds per call in a CPU's eager Python: 2 ranks on 2 cores,
# tiny-llama under tp 2 took 5x its DDP step, under FSDP 3x): the probe plans fit them,
# and the per-operator overhead the eager step measured within a factor of two of it
# (their DDP plan times the same step again, over more repeats); their tiny messages
# leave the sweep's bandwidth and latency as they were
PROBE_PARAMETERS: tuple[RefitParameter, ...] = (
    RefitParameter("framework overhead per operator scale", ("op_overhead_us",), "scale",
                   0.5, 2.0),
    RefitParameter("DTensor overhead per sharded operator (us)", ("dtensor_op_overhead_us",),
                   "add", 0.0, 2000.0),
    RefitParameter("FSDP2 overhead per unit call (us)", ("fsdp_call_overhead_us",),
                   "add", 0.0, 5000.0),
    RefitParameter("training loop overhead per step (us)", ("step_overhead_us",),
                   "add", 0.0, 20_000.0),
    RefitParameter("pipeline schedule overhead per run (us)", ("pipeline_step_overhead_us",),
                   "add", 0.0, 50_000.0),
)  # fmt: skip


def probe_strategies(world: int) -> dict[str, Strategy]:
    """The probe's strategies over ``world`` ranks by name, each rank training
    :data:`~planner.calibrate.microbench.PROBE_MICRO_BATCH` sequences a step: data
    parallel and FSDP over every rank; with an even ``world``, tensor parallel (with and
    without sequence parallelism) and two-stage pipelines (1F1B over several micro-batches,
    zero-bubble over one), each over pairs of ranks and data parallel over the pairs
    (FSDP2's ZeRO-1 under the pipelines, where DDP cannot run)."""
    per_rank = PROBE_MICRO_BATCH
    plans = {
        "DP": Strategy(dp=world, micro_batch_size=per_rank),
        "FSDP": Strategy(dp=world, zero=3, micro_batch_size=per_rank),
    }
    if world % 2:
        return plans
    pairs = world // 2
    split = 2 * per_rank  # sequences a pair of ranks trains
    return plans | {
        "TP": Strategy(dp=pairs, tp=2, micro_batch_size=split),
        "TP+SP": Strategy(dp=pairs, tp=2, sequence_parallel=True, micro_batch_size=split),
        "PP": _replicable(Strategy(
            dp=pairs, pp=2, micro_batch_size=split // PROBE_PIPELINE_MICROBATCHES,
            num_microbatches=PROBE_PIPELINE_MICROBATCHES, schedule=Schedule.ONE_F_ONE_B,
        )),
        "PP ZB x1": _replicable(Strategy(
            dp=pairs, pp=2, micro_batch_size=split, schedule=Schedule.ZERO_BUBBLE,
        )),
    }  # fmt: skip


def _replicable(strategy: Strategy) -> Strategy:
    """``strategy``, its data parallelism FSDP2's ZeRO-1 where DDP cannot replicate it
    (:meth:`~planner.parallel_dims.ParallelDims.ddp_blocker`: under a pipeline)."""
    if ParallelDims.of(strategy).ddp_blocker(tied=False) is None:
        return strategy
    return Strategy.model_validate({**strategy.model_dump(), "zero": 1})


def probe_plans(world: int, ranks_per_node: int, profile: str) -> list[Plan]:
    """The plans of :func:`probe_strategies` for ``world`` ranks, ``ranks_per_node`` to a
    node, on the hardware profile named ``profile`` (fp32, AdamW, clipped)."""
    handle = resolve_model(PROBE_MODEL)
    cluster = Cluster(gpu=profile, num_gpus=world, gpus_per_node=min(ranks_per_node, world))
    training = Training(global_batch_size=world * PROBE_MICRO_BATCH, dtype=DType.FP32)
    return [
        assemble_plan(handle, cluster, training, strategy)
        for strategy in probe_strategies(world).values()
    ]


def refit_to_probe_runs(
    profile: HardwareProfile, runs: Sequence[MeasuredProfile], stamp: str
) -> tuple[HardwareProfile, FitResult]:
    """``profile`` with the runtime's overheads fitted to the probe plans' ``runs``: the
    DTensor parameter overhead on their optimizer phases
    (:func:`_with_dtensor_param_overhead`), then :data:`PROBE_PARAMETERS` on their step
    times (:func:`~planner.calibrate.refit.refit_profile`), and the fit's report (each
    fitted field's value; RMS log error of the step times before and after). Raises
    :class:`CalibrationError` naming the runs when the fit does not converge."""
    profile = _with_dtensor_param_overhead(profile, runs, stamp)
    options = measured_run_options(profile)
    try:
        fitted, report = refit_profile(
            profile, runs, options=options, stamp=f"{stamp}: probe plans",
            parameters=parameters_shown(PROBE_PARAMETERS, profile, runs, options),
        )  # fmt: skip
    except CalibrationError as error:
        raise CalibrationError(
            f"the probe plans ({', '.join(r.plan.strategy.describe() for r in runs)}): {error}; "
            "or skip them (plan calibrate --no-probe-runs)"
        ) from error
    values = {"dtensor_param_overhead_us": profile.dtensor_param_overhead_us or 0.0}
    values |= report.fitted
    before = np.array([math.log(1 + e.error) for e in report.before])
    after = np.array([math.log(1 + e.error) for e in report.after])
    return fitted, FitResult(values, rms(before), rms(after), len(runs), report.at_bound)


def _with_dtensor_param_overhead(
    profile: HardwareProfile, runs: Sequence[MeasuredProfile], stamp: str
) -> HardwareProfile:
    """``profile`` with ``dtensor_param_overhead_us``: the median, over the ``runs`` that
    hold DTensor parameters, of what their optimizer phase took beyond its price, per
    parameter tensor (a step-time fit sees totals, not where they go)."""
    options = measured_run_options(profile)

    def optimizer_s(priced: PricedPlan, overhead_us: float) -> float:
        trial = profile.model_copy(update={"dtensor_param_overhead_us": overhead_us})
        return priced.estimate(trial).breakdown_s["optimizer"]

    per_us = []
    for run in runs:
        priced = PricedPlan(run.plan, options)
        bare = optimizer_s(priced, 0.0)
        slope = optimizer_s(priced, 1.0) - bare
        if slope > 0 and "optimizer" in run.phases_s:
            per_us.append(max(run.phases_s["optimizer"] - bare, 0.0) / slope)
    if not per_us:
        return profile
    how = (
        f"{stamp}: the optimizer phase of {len(per_us)} probe plan(s) holding DTensor "
        "parameters, beyond its price, per parameter tensor (median)"
    )
    return with_parameters(profile, {"dtensor_param_overhead_us": statistics.median(per_us)}, how)
