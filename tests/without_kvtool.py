"""Run a script in a fresh interpreter that cannot import kvtool (isolated mode, from another
folder, every import of kvtool refused even where it is installed): how the spec's vector
generators are shown to need nothing of kvtool (tests/test_pca_vectors.py, test_pca_v2_vectors.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_REFUSE = """
import importlib.abc, sys
class NoKvtool(importlib.abc.MetaPathFinder):  # kvtool may be installed: make it unimportable
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "kvtool":
            raise ImportError("kvtool is not available here")
sys.meta_path.insert(0, NoKvtool())
"""
_CHECK = """
try:
    import kvtool
except ImportError:
    print("no kvtool")
assert not [m for m in sys.modules if m.startswith("kvtool")]
"""


def run_without_kvtool(body: str, cwd: Path) -> list[str]:
    """`body`'s words on stdout after "no kvtool" (the script's own exit code must be 0)."""
    done = subprocess.run([sys.executable, "-I", "-c", _REFUSE + body + _CHECK], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()
