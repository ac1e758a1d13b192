"""Package attributes loaded on first use (PEP 562), so that importing a package imports only
what its caller uses: `import kvtool` imports no torch, a request's checks read `store.names`
without a backend, `format.layout` without the reader.

    __getattr__, __dir__ = lazy_attributes(__name__, {"Name": ".module", "alias": (".module", "name")})

A module is relative to the package (or absolute); an attribute found once is kept in the package,
so later lookups do not come here. Nothing else of kvtool's is imported here.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_attributes(package: str, where: dict[str, str | tuple[str, str]]) -> tuple[Callable, Callable]:
    """`(__getattr__, __dir__)` for `package`: each name to its module, or to (module, name there)."""

    def __getattr__(name: str):
        target = where.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = target if isinstance(target, tuple) else (target, name)
        value = getattr(importlib.import_module(module, package), attribute)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__
