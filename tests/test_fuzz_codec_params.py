"""The standing fuzzer of codec parameters and files mixing codecs (fuzz/fuzz_codec_params.py,
atheris; issue 46) runs for a bounded time: any exception other than a KvtoolError, a hang or a
runaway allocation fails it. Launched as tests/test_fuzz_standing.py launches the reader's fuzzer,
through a small process so that libFuzzer's -rss_limit_mb counts the fuzzer's own memory only."""

from __future__ import annotations

import importlib.util

import pytest

from test_fuzz_standing import fuzzing_beside_its_partner


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed (pip install atheris)")
def test_the_codec_params_fuzzer_finds_nothing_in_its_time(request):
    """(Beside the store URL fuzzer when both run: test_fuzz_standing.SIDE_BY_SIDE.)"""
    fuzzing_beside_its_partner(request).check(min_runs=1000)
