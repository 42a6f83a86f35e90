"""Lazy package exports: a package ``__init__`` names what it exports and from which module, and
each name is imported on first use, so importing a package (e.g. a torch-free config) loads
nothing heavy. Imports nothing from stormshard (the floor)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str],
                 names: Iterable[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps an exported
    name to its submodule (relative to ``package``); any other attribute is tried as a submodule."""
    table = dict(exports)
    listed = sorted(set(names))

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module protocol's name
        if name in table:
            return getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(listed) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__
