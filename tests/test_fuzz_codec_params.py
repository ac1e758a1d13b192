"""The standing fuzzer of codec parameters and files mixing codecs (fuzz/fuzz_codec_params.py,
atheris; issue 46) runs for a bounded time: any exception other than a KvtoolError, a hang or a
runaway allocation fails it. Launched as tests/test_fuzz_standing.py launches the reader's fuzzer,
through a small process so that libFuzzer's -rss_limit_mb counts the fuzzer's own memory only."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_fuzz_standing import with_own_peak_rss

REPO = Path(__file__).resolve().parents[1]
SECONDS = int(os.environ.get("KVTOOL_FUZZ_CODEC_PARAMS_SECONDS", "20"))


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed (pip install atheris)")
def test_the_codec_params_fuzzer_finds_nothing_in_its_time(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    env = dict(os.environ, KVTOOL_CALIBRATION_PATH=str(REPO / "format-spec" / "vectors" / "pca"))
    out = subprocess.run(with_own_peak_rss([sys.executable, str(REPO / "fuzz" / "fuzz_codec_params.py"),
                                            f"-max_total_time={SECONDS}", "-rss_limit_mb=2048", "-timeout=10",
                                            f"-artifact_prefix={tmp_path}/", str(corpus)]),
                         capture_output=True, text=True, timeout=SECONDS + 120, cwd=tmp_path, env=env)
    crashes = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))
    assert out.returncode == 0 and not crashes, (crashes, out.stderr[-4000:])
    runs = re.search(r"Done (\d+) runs", out.stderr)
    assert runs and int(runs.group(1)) > 1000, out.stderr[-2000:]
