"""Exports of a :class:`~planner.spec.Plan` to other training frameworks' settings.

Pure functions ``Plan -> str``, torch-free: a torchtitan job-config fragment (TOML),
Megatron-LM command-line arguments and a DeepSpeed config (JSON). What a target cannot
express raises :class:`~planner.errors.ExportError` naming the field, its value and
what to change; nothing that changes the math or the memory is dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.errors import UnknownNameError
from planner.export.deepspeed import to_deepspeed
from planner.export.megatron import to_megatron
from planner.export.torchtitan import to_torchtitan
from planner.spec import Plan
from planner.validate import check_plan

__all__ = ["TARGETS", "export_plan", "to_deepspeed", "to_megatron", "to_torchtitan"]

TARGETS: dict[str, Callable[[Plan], str]] = {
    "torchtitan": to_torchtitan,
    "megatron": to_megatron,
    "deepspeed": to_deepspeed,
}


def export_plan(plan: Plan, target: str) -> str:
    """``plan`` in the form ``target`` (a key of :data:`TARGETS`) takes; a plan that
    disagrees with itself (:func:`planner.validate.check_plan`) is refused first."""
    if target not in TARGETS:
        raise UnknownNameError("export target", target, TARGETS)
    check_plan(plan)
    return TARGETS[target](plan)
