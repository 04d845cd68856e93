"""Lazy package attributes (PEP 562): a public name is imported on its first use, so
importing a package loads none of its heavy dependencies (torch, scipy) until needed."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str,
    homes: Mapping[str, str],
    namespace: dict[str, Any],
    submodules: Collection[str] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose names live in ``homes``
    (name -> defining module) or are its public ``submodules`` (``package.name``,
    imported on first use as after ``import package.name``); a loaded name is cached in
    the package ``namespace``."""

    def getattr_(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")  # binds itself on the package
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *homes, *submodules})

    return getattr_, dir_
