"""Loader of the native CacheGen coder (`kvtool._cachegen_native`, built by setup.py).

When the extension is missing (no compiler at install time) the codec falls
back to the pure-Python reference and says so once, in one line. Set
KVTOOL_CACHEGEN_NATIVE=0 to force the reference (tests and debugging).
"""

from __future__ import annotations

from types import ModuleType

from ...devices import host_threads
from ...native_loader import NativeExtension

EXTENSION = NativeExtension("_cachegen_native", "KVTOOL_CACHEGEN_NATIVE", "CacheGen coder",
                            "the slow pure-Python reference")


def native_module(warn: bool = True) -> ModuleType | None:
    """The extension module, or None (forced off, or not built)."""
    return EXTENSION.module(warn)


def native_available() -> bool:
    return native_module(warn=False) is not None


def default_threads() -> int:
    return host_threads()
