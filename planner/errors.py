"""User-facing errors.

Every mistake a user can make (unknown preset, bad field, a model that does not fit)
raises a subclass of :class:`PlannerError`. The CLI prints its message and exits with
status 2 instead of a traceback; library callers can catch it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "PlannerError",
    "SpecError",
    "UnknownNameError",
    "TraceError",
    "InfeasibleError",
    "PlanMismatchError",
    "ExportError",
    "one_line",
]


class PlannerError(Exception):
    """Base class for errors caused by user input; the message says what to change."""


class SpecError(PlannerError):
    """An input document or argument has an invalid field."""


class UnknownNameError(PlannerError):
    """A name (preset, GPU profile, schedule...) is not known."""

    def __init__(self, what: str, name: str, known: Iterable[str]) -> None:
        known = sorted(known)
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        super().__init__(f"unknown {what} {name!r}.{hint} Known: {', '.join(known)}.")
        self.name = name
        self.known = known


class TraceError(PlannerError):
    """A model could not be traced into an operator graph."""


class InfeasibleError(PlannerError):
    """No configuration fits; the message says how much memory is needed and what to change."""


class PlanMismatchError(PlannerError):
    """A plan, profile or measurement was made for a different model or world size."""


class ExportError(PlannerError):
    """A plan uses something the target framework cannot express; the message says what."""


def one_line(exc: BaseException) -> str:
    """``TypeName: message`` of ``exc`` on one line (at most 300 characters), for messages
    that quote an error the user's code raised."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
