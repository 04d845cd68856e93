"""Module FQN patterns (``layers.*.attention.wq``): ``*`` matches within one dotted
component, so a pattern names modules at exactly its depth."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import TypeVar

__all__ = ["fqn_matches", "match_fqns", "expand_patterns", "under_pattern"]

T = TypeVar("T")


@lru_cache(maxsize=1 << 16)  # the layout ILP asks about each block's modules per pattern
def fqn_matches(pattern: str, fqn: str) -> bool:
    """Whether ``fqn`` is one of the modules ``pattern`` names."""
    parts, names = pattern.split("."), fqn.split(".")
    return len(parts) == len(names) and all(
        fnmatchcase(n, p) for n, p in zip(names, parts, strict=True)
    )


def match_fqns(pattern: str, names: Iterable[str]) -> list[str]:
    """The ``names`` that ``pattern`` names, in order."""
    return [name for name in names if fqn_matches(pattern, name)]


def expand_patterns(patterns: Mapping[str, T], names: Iterable[str]) -> dict[str, T]:
    """Concrete ``{fqn: value}`` for every name a pattern names (later patterns win)."""
    names = list(names)
    return {
        name: value for pattern, value in patterns.items() for name in match_fqns(pattern, names)
    }


def under_pattern(pattern: str, root: str) -> bool:
    """Whether ``pattern`` names modules strictly inside ``root`` (``layers.*.mlp`` is
    under ``layers.3``)."""
    parts = pattern.split(".")
    depth = root.count(".") + 1
    return len(parts) > depth and fqn_matches(".".join(parts[:depth]), root)
