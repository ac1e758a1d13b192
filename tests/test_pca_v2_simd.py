"""pca bitstream version 2's native coder on each of its paths (kernels/pca_units.inc and
pca_units_simd.inc): 16 units a vector where the CPU has AVX-512, the scalar chains elsewhere
(KVTOOL_PCA_SIMD=0, =avx2). Every path writes the reference's bytes and reads the reference's
values, on the same inputs: unit counts that are not a multiple of 16 (and rows of more than 64
units), a row's shorter last unit, escapes, sinks, a basis per head, the version-2 test vectors,
and damaged payloads (the reference's decision)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtool.codecs.pca import calibration as calmod
from kvtool.codecs.pca import native
from kvtool.codecs.pca import reference2 as v2
from kvtool.errors import DecodeError

from test_pca_native import random_calibration, raw_kv

pytestmark = pytest.mark.skipif(not native.native_available(), reason="native pca coder not built (pip install -e .)")

VECTORS = Path(__file__).resolve().parents[1] / "format-spec" / "vectors" / "pca" / "v2"
STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}
N_VECTORS = 11  # the version-2 vectors (format-spec/pca.md §11.8), each a case too

CASES = [  # (L, H, D[, per head]), tokens, dtype, sinks, position, step, unit
    ((2, 2, 16), 204, "bfloat16", 4, 0, 0.05, 64),  # 100 units a row (a batch of 64, then 36), escapes
    ((1, 3, 10), 33, "float16", 4, 2, 0.25, 128),  # 3-4 units a row
    ((2, 2, 16), 70, "float32", 0, 1000, 1.0, 192),  # odd counts, a short last unit
    ((2, 2, 16, True), 90, "bfloat16", 4, 0, 0.6, 64),  # a basis per KV head
    ((2, 2, 8), 40, "bfloat16", 4, 0, 3.0, 64),  # few live components
    ((3, 2, 32), 150, "bfloat16", 4, 7, 0.3, 320),  # 14-15 units a row: one vector, lanes left idle
]


def _vector_cases():
    for meta_file in sorted(VECTORS.glob("*.json")):
        meta = json.loads(meta_file.read_text())
        p, name = meta["params"], meta_file.stem
        raw = np.fromfile(VECTORS / f"{name}.in.bin", STORAGE[meta["dtype"]]).reshape(meta["shape"])
        cal = calmod.from_bytes((VECTORS.parent / f"{p['calibration']}.kvcal").read_bytes())
        yield name, cal, raw, meta["dtype"], p["sinks"], p["position"], p["step"], p["unit"]


def _outcome(decode):
    try:
        return decode().tobytes()
    except DecodeError:
        return "refused"


def check_v2_cases() -> dict:
    """Every case's native payload and values against the reference; what the cases covered."""
    seen = {"cases": 0, "odd_rows": 0, "batches": 0, "escapes": 0, "refused": 0}
    cases = [(f"case{i}", random_calibration(*g) if len(g) == 4 else random_calibration(*g, seed=i),
              None, dtype, sinks, position, step, unit) + (tokens,)
             for i, (g, tokens, dtype, sinks, position, step, unit) in enumerate(CASES)]
    cases += [c + (None,) for c in _vector_cases()]
    for name, cal, raw, dtype, sinks, position, step, unit, tokens in cases:
        if raw is None:
            raw = raw_kv(cal, tokens, dtype, seed=tokens)
        want = v2.encode_chunk(raw, dtype, cal, step, sinks, position, unit)
        assert native.encode_chunk_v2(raw, dtype, cal, step, sinks, position, unit, threads=1) == want, name
        ref = v2.decode_chunk(want, raw.shape, dtype, cal, step, position)
        got = native.decode_chunk_v2(want, raw.shape, dtype, cal, step, position, threads=1)
        assert got.tobytes() == ref.tobytes(), name
        lay, q = v2.decode_coefficients(want, raw.shape, dtype)
        per_row = np.bincount(lay.spans[:, 0], minlength=raw.shape[1] * 2) if len(lay.spans) else np.zeros(1)
        seen["cases"] += 1
        seen["odd_rows"] += int((per_row % 16 != 0).sum())
        seen["batches"] += int((per_row > 64).sum())
        shift = np.where(lay.side == v2.ALL_ZERO, 0, lay.side >> 5).astype(np.int64)
        seen["escapes"] += int(((np.abs(q) >> shift[:, None, :]) >= v2.ESCAPE).sum())
    # damage: flipped bits and cut streams, the reference's decision
    cal = random_calibration(2, 2, 16, seed=0)
    raw = raw_kv(cal, 204, "bfloat16", seed=204)
    payload = v2.encode_chunk(raw, "bfloat16", cal, 0.05, 4, 0, 64)
    rng = np.random.default_rng(11)
    for _ in range(60):
        bad = bytearray(payload)
        i = int(rng.integers(v2.HEADER.size, len(bad)))
        bad[i] ^= 1 << int(rng.integers(8))
        bad = bytes(bad)
        ref_out = _outcome(lambda: v2.decode_chunk(bad, raw.shape, "bfloat16", cal, 0.05, 0))
        nat_out = _outcome(lambda: native.decode_chunk_v2(bad, raw.shape, "bfloat16", cal, 0.05, 0, threads=1))
        assert ref_out == nat_out
        seen["refused"] += ref_out == "refused"
    return seen


def test_the_default_path_is_the_reference():
    seen = check_v2_cases()
    assert seen["cases"] == len(CASES) + N_VECTORS and seen["odd_rows"] and seen["batches"] and seen["escapes"]
    assert seen["refused"] > 10  # most flips land in low or sign bits, which decode to other values


def check_in_a_subprocess(tmp_path, env: dict[str, str], path_check: str) -> None:
    """All cases in a new process with `env` (the coder reads its settings once per process),
    `path_check` an assertion that the process took the path meant."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_pca_v2_simd import check_v2_cases\n"
        "from kvtool.codecs.pca import native\n"
        f"assert {path_check}\n"
        "print(check_v2_cases()['cases'])\n")
    out = subprocess.run([sys.executable, str(script)], env=dict(os.environ, **env), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == [str(len(CASES) + N_VECTORS)], out.stderr[-2000:]


@pytest.mark.parametrize("flag,path", [("0", "portable"), ("avx2", "avx2")])
def test_the_fallback_paths_are_the_reference(tmp_path, flag, path):
    """The same cases with KVTOOL_PCA_SIMD=0 (the scalar chains) and =avx2 (no AVX-512: AVX2's
    8-unit loops where a row's reads stay inside the payload, the scalar chains elsewhere)."""
    if path == "avx2" and native.native_module().simd() != "avx512":
        pytest.skip("the default run above is the AVX2 path on this CPU")
    check_in_a_subprocess(tmp_path, {"KVTOOL_PCA_SIMD": flag}, f"native.native_module().simd() == {path!r}")


def test_both_unit_readers_are_the_reference(tmp_path):
    """Version 2's AVX-512 unit decoder reads table entries and words either by gathers or by
    scalar loads (the default on AMD CPUs: bench/RESULTS.md §44); the one this CPU does not use
    by default, forced with KVTOOL_PCA_GATHER in a subprocess, gives the same as the reference."""
    if native.native_module().simd() != "avx512":
        pytest.skip("no AVX-512 path on this CPU")
    other = not native.native_module().units_gather()
    check_in_a_subprocess(tmp_path, {"KVTOOL_PCA_GATHER": "1" if other else "0"},
                          f"native.native_module().units_gather() is {other!r}")
