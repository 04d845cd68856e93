"""Exports of a :class:`~planner.spec.Plan` to other training frameworks' settings.

Pure functions ``Plan -> str``, torch-free: a torchtitan job-config fragment (TOML),
Megatron-LM command-line arguments and a DeepSpeed config (JSON). What a target cannot
express raises :class:`~planner.errors.ExportError` naming the field, its value and
what to change; nothing that changes the math or the memory is dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.errors import SpecError
from planner.export.deepspeed import to_deepspeed
from planner.export.megatron import to_megatron
from planner.export.torchtitan import to_torchtitan
from planner.frameworks import Framework, Target, parse_target
from planner.spec import Plan
from planner.validate import check_plan

__all__ = ["TARGETS", "export_plan", "to_deepspeed", "to_megatron", "to_torchtitan"]

TARGETS: dict[Framework, Callable[[Plan, Target], str]] = {
    Framework.TORCHTITAN: to_torchtitan,
    Framework.MEGATRON: to_megatron,
    Framework.DEEPSPEED: to_deepspeed,
}


def export_plan(plan: Plan, target: str | Target) -> str:
    """``plan`` in the form ``target`` takes: ``framework`` or ``framework==version``
    (:func:`planner.frameworks.parse_target`; a framework of :data:`TARGETS`). A bare
    framework means the release the plan was searched for (``plan.target``), else the
    newest. A plan that disagrees with itself (:func:`planner.validate.check_plan`) is
    refused first."""
    if isinstance(target, str):
        planned = parse_target(plan.target, field="plan.target")
        bare = "==" not in target
        target = parse_target(target, field="--to")
        if bare and planned.framework is target.framework:
            target = planned
    if target.framework not in TARGETS:
        known = ", ".join(framework.value for framework in TARGETS)
        raise SpecError(
            f"export target = {str(target)!r}: the planner's own runtime runs plans as they "
            f"are ('plan run'); export to one of {known}"
        )
    check_plan(plan)
    return TARGETS[target.framework](plan, target)
