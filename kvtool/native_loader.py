"""kvtool's C extensions (built by setup.py), each imported once and whole.

`_loaded` is set only after the import has finished, under a lock: a thread that saw it set
before the module was there (8 threads at once got None) fell back to the slow path for the
whole run. An extension that is missing (no compiler at install time) leaves its caller on its
reference path, said once in one line when the caller asks; an environment switch (`=0`) forces
the reference for tests and debugging.
"""

from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType

from .notices import notice

OFF = ("0", "false", "no", "off")


class NativeExtension:
    def __init__(self, name: str, switch: str, what: str, fallback: str) -> None:
        self.name = name  # the module under kvtool, e.g. "_cachegen_native"
        self.switch = switch  # the environment variable that turns it off
        self.what, self.fallback = what, fallback  # for the one-line notice
        self.error: str | None = None
        self._module: ModuleType | None = None
        self._loaded = False
        self._lock = threading.Lock()

    def module(self, warn: bool = False) -> ModuleType | None:
        """The extension, or None (switched off, or not built; `warn`: say so once)."""
        if os.environ.get(self.switch, "1").strip() in OFF:
            return None
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    try:
                        self._module = importlib.import_module(f"kvtool.{self.name}")
                    except ImportError as exc:  # pragma: no cover - depends on the build
                        self._module, self.error = None, str(exc)
                    self._loaded = True
        if self._module is None and warn:
            notice(f"native {self.what} unavailable ({self.error}); using {self.fallback} "
                   "(reinstall kvtool with a C compiler: pip install -e .)", key=self.name.strip("_"))
        return self._module
