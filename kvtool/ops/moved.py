"""Names an operations module no longer defines, still answering: each with a one-line
`DeprecationWarning` that says what to use, and the object itself where it lives on elsewhere
(or an AttributeError saying the same where its replacement takes other arguments)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

#: name -> (what to use instead, a callable giving the object it now is, or None: gone)
Moved = dict[str, tuple[str, "Callable[[], Any] | None"]]


def moved_names(module: str, moved: Moved) -> Callable[[str], Any]:
    """A module's `__getattr__` answering its moved names (`moved`)."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        use, current = moved[name]
        if current is None:
            raise AttributeError(f"{module}.{name} was removed: use {use}")
        warnings.warn(f"{module}.{name} is deprecated: use {use}", DeprecationWarning, stacklevel=2)
        return current()

    return __getattr__
