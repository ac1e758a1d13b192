"""The native modules load once, whole, whatever the number of threads asking at once (issue 27,
item 8: `_loaded` was set before the import finished, and threads that asked meanwhile got None
and fell back to the slow reference for the whole run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = r"""
import importlib.abc, sys, threading, time

class SlowImport(importlib.abc.MetaPathFinder):
    # widens the window a real import leaves open (disk, dlopen) so that the race shows every time
    def find_spec(self, name, path=None, target=None):
        if name == NAME:
            time.sleep(0.3)
        return None

NAME = sys.argv[1]
sys.meta_path.insert(0, SlowImport())
if NAME.endswith("_cachegen_native"):
    from kvtool.codecs.cachegen.native import native_module as loader
    load = lambda: loader(warn=False)
else:
    from kvtool.connectors.paged_native import native_module as load
start = threading.Barrier(8)
got = []

def ask():
    start.wait()
    got.append(load() is not None)

threads = [threading.Thread(target=ask) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sum(got), len(got))
"""


@pytest.mark.parametrize("module", ["kvtool._cachegen_native", "kvtool._paged_native"])
def test_every_thread_that_asks_at_once_gets_the_native_module(module):
    pytest.importorskip(module)
    out = subprocess.run([sys.executable, "-c", SCRIPT, module], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["8", "8"]
