"""The standing fuzzer of codec parameters and files mixing codecs (fuzz/fuzz_codec_params.py,
atheris; issue 46) runs for a bounded time: any exception other than a KvtoolError, a hang or a
runaway allocation fails it. Launched as tests/test_fuzz_standing.py launches the reader's fuzzer,
through a small process so that libFuzzer's -rss_limit_mb counts the fuzzer's own memory only."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from test_fuzz_standing import run_fuzzer

REPO = Path(__file__).resolve().parents[1]
SECONDS = int(os.environ.get("KVTOOL_FUZZ_CODEC_PARAMS_SECONDS", "20"))


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed (pip install atheris)")
def test_the_codec_params_fuzzer_finds_nothing_in_its_time(tmp_path):
    env = dict(os.environ, KVTOOL_CALIBRATION_PATH=str(REPO / "format-spec" / "vectors" / "pca"))
    run_fuzzer("fuzz_codec_params.py", tmp_path, SECONDS, min_runs=1000, env=env)
