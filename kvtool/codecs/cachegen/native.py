"""Loader of the native CacheGen coder (`kvtool._cachegen_native`, built by setup.py).

When the extension is missing (no compiler at install time) the codec falls
back to the pure-Python reference and says so once, in one line. Set
KVTOOL_CACHEGEN_NATIVE=0 to force the reference (tests and debugging).
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

from ...devices import host_threads
from ...notices import notice

_module: ModuleType | None = None
_error: str | None = None
_loaded = False
_lock = threading.Lock()


def _load() -> None:
    """Import the extension once. `_loaded` is set after the import has finished, under a lock:
    a thread that saw it set before the module was (8 threads at once got None) fell back to the
    slow reference for the whole run."""
    global _module, _error, _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        try:
            from ... import _cachegen_native as m  # type: ignore[attr-defined]

            _module = m
        except ImportError as exc:  # pragma: no cover - depends on the build
            _module, _error = None, str(exc)
        _loaded = True


def native_module(warn: bool = True) -> ModuleType | None:
    """The extension module, or None (forced off, or not built)."""
    if os.environ.get("KVTOOL_CACHEGEN_NATIVE", "1").strip() in ("0", "false", "no", "off"):
        return None
    _load()
    if _module is None and warn:
        notice(f"native CacheGen coder unavailable ({_error}); using the slow pure-Python reference "
               "(reinstall kvtool with a C compiler: pip install -e .)", key="cachegen_native")
    return _module


def native_available() -> bool:
    return native_module(warn=False) is not None


def default_threads() -> int:
    return host_threads()
