"""The standing fuzzer of store URLs (fuzz/fuzz_store_urls.py, atheris) for a bounded time, seeded
with issue 46's URL matrix: any exception other than a refusal in one line without the password
(or a password shown, or a URL taken for a folder, or redis-py's client refusing the options)
fails it."""

from __future__ import annotations

import importlib.util

import pytest
from test_fuzz_standing import fuzzing_beside_its_partner  # (each fuzzer charged for its own memory only)


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed (pip install atheris)")
def test_the_store_url_fuzzer_finds_nothing_in_its_time(request):
    """(Beside the codec parameters' fuzzer when both run: test_fuzz_standing.SIDE_BY_SIDE.)"""
    corpus = fuzzing_beside_its_partner(request).check(min_runs=1000)
    assert len(list(corpus.iterdir())) >= 40  # the matrix was its seed
