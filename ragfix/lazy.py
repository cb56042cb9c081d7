"""Names of a package imported on first use (PEP 562 module ``__getattr__`` and ``__dir__``), so
importing the package, or one light module of it, does not import what its heavy names need
(torch, the frameworks)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for the module ``package`` whose public ``names`` (``{name:
    the module that defines it}``) are imported when first read.

    Use as ``__getattr__, __dir__ = lazy_exports(__name__, _LAZY)`` in the package's
    ``__init__``. ``__getattr__`` raises :class:`AttributeError` for any other name; ``__dir__``
    lists the module's own attributes and ``names``, sorted.
    """

    def __getattr__(name: str):
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *names])

    return __getattr__, __dir__


__all__ = ["lazy_exports"]
