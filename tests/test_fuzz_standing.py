"""The standing coverage-guided fuzzer (fuzz/fuzz_reader.py, atheris) runs for a bounded time in CI:
any exception other than a KvtoolError, a hang or a runaway allocation fails it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECONDS = int(os.environ.get("KVTOOL_FUZZ_SECONDS", "45"))


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed (pip install atheris)")
def test_the_reader_fuzzer_finds_nothing_in_its_time(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    out = subprocess.run([sys.executable, str(REPO / "fuzz" / "fuzz_reader.py"), f"-max_total_time={SECONDS}",
                          "-rss_limit_mb=2048", "-timeout=10", f"-artifact_prefix={tmp_path}/", str(corpus),
                          str(REPO / "format-spec" / "vectors")],
                         capture_output=True, text=True, timeout=SECONDS + 120, cwd=tmp_path)
    crashes = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))
    assert out.returncode == 0 and not crashes, (crashes, out.stderr[-4000:])
    assert "Done" in out.stderr and "runs in" in out.stderr
