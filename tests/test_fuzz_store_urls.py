"""The standing fuzzer of store URLs (fuzz/fuzz_store_urls.py, atheris) for a bounded time, seeded
with issue 46's URL matrix: any exception other than a refusal in one line without the password
(or a password shown, or a URL taken for a folder, or redis-py's client refusing the options)
fails it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_fuzz_standing import with_own_peak_rss  # (the fuzzer charged for its own memory only)

REPO = Path(__file__).resolve().parents[1]
SECONDS = 20


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed (pip install atheris)")
def test_the_store_url_fuzzer_finds_nothing_in_its_time(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    out = subprocess.run(with_own_peak_rss([sys.executable, str(REPO / "fuzz" / "fuzz_store_urls.py"),
                                            f"-max_total_time={SECONDS}", "-rss_limit_mb=2048", "-timeout=10",
                                            f"-artifact_prefix={tmp_path}/", str(corpus)]),
                         capture_output=True, text=True, timeout=SECONDS + 120, cwd=tmp_path)
    crashes = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))
    assert out.returncode == 0 and not crashes, (crashes, out.stderr[-4000:])
    runs = re.search(r"Done (\d+) runs", out.stderr)
    assert runs and int(runs.group(1)) > 1000, out.stderr[-2000:]
    assert len(list(corpus.iterdir())) >= 40  # the matrix was its seed
