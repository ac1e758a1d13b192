"""The native pca coder (kernels/pca_cpu.c) against the reference (kvtool/codecs/pca/reference.py):
the same payload bytes, the same decoded values, the same refusals of damaged payloads.

Geometries: the small one of test_pca (2 layers x 16 channels), an odd one (1 layer, 3 heads of
10: 30 channels, not a multiple of the C transform's 24-column block), the default model's
(30 layers, 3 KV heads x 64), and a wide one (2 heads of 16: the smallest the AVX2 forward step
takes, half a head a multiple of 8), each with a random calibration of that shape (the coder does not
care what the basis learned, only that it is within the spec's limits). The `heads*` geometries
have a block-diagonal basis (axes per KV head, as `kvtool calibrate --basis head` learns), which
the C coder multiplies block by block: heads of 64 (the default model's), of 8, 40 (24 + 16
columns) and 10 (not a multiple of 8: the dense product)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvtool.codecs import get_codec
from kvtool.codecs.pca import calibration as calmod
from kvtool.codecs.pca import native, params_for
from kvtool.codecs.pca import reference as ref
from kvtool.errors import DecodeError, NonFiniteValues, UsageError

pytestmark = pytest.mark.skipif(not native.native_available(), reason="native pca coder not built")
STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}


def random_calibration(L: int, H: int, D: int, per_head: bool = False, seed: int = 0) -> calmod.Calibration:
    rng = np.random.default_rng(seed)
    C = H * D
    if per_head:  # an orthonormal block per KV head, zeros elsewhere
        q = np.zeros((2, L, C, C))
        for h in range(H):
            q[:, :, h * D:(h + 1) * D, h * D:(h + 1) * D] = np.linalg.qr(rng.standard_normal((2, L, D, D)))[0]
    else:
        q, _ = np.linalg.qr(rng.standard_normal((2, L, C, C)))
    basis = np.rint(q * calmod.BASIS_ONE).clip(-32767, 32767).astype(np.int16)
    inv_freq = np.tile(1.0 / 10000 ** (np.arange(0, D, 2) / D), (L, 1)).astype(np.float32)
    if L > 1:
        inv_freq[1] *= 0.5  # one layer with other frequencies: its own RoPE table
    cal = calmod.Calibration(mean=(0.3 * rng.standard_normal((2, L, C))).astype(np.float32),
                             weight=np.exp(0.5 * rng.standard_normal((2, L, C))).astype(np.float32),
                             basis=basis, inv_freq=inv_freq, head_dim=D, model="test")
    cal.check()
    return calmod.remember(cal)


GEOMETRIES = {"small": (2, 2, 8), "odd": (1, 3, 10), "default": (30, 3, 64), "wide": (2, 2, 16),
              "heads": (30, 3, 64, True), "heads8": (2, 4, 8, True), "heads40": (1, 2, 40, True),
              "c120": (1, 3, 40), "heads56": (1, 2, 56, True),  # widths 56 past a multiple of 64 (AVX-512's tail)
              "heads10": (1, 3, 10, True)}
_cals: dict[str, calmod.Calibration] = {}


def cal_of(name: str) -> calmod.Calibration:
    if name not in _cals:
        _cals[name] = random_calibration(*GEOMETRIES[name])
    return _cals[name]


def raw_kv(cal: calmod.Calibration, tokens: int, dtype: str, seed: int, scale: float = 2.0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, cal.layers, tokens, cal.channels, generator=g) * scale + 0.3).to(getattr(torch, dtype))
    if dtype == "bfloat16":
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


CASES = [  # geometry, tokens, sinks, position, step, lanes
    ("small", 1, 4, 0, 0.5, 16), ("small", 5, 4, 2, 2.0, 3), ("small", 37, 4, 0, 0.5, 16),
    ("small", 64, 0, 300, 0.2, 1), ("small", 100, 4, 7, 0.9, 64), ("small", 256, 4, 0, 0.2, 16),
    ("small", 256, 4, 256, 2.0, 5), ("small", 3, 4, 0, 0.5, 16),  # all sinks
    ("odd", 1, 0, 0, 0.5, 16), ("odd", 33, 2, 1, 0.9, 7), ("odd", 200, 4, 1000, 0.2, 16),
    ("default", 1, 0, 5, 0.5, 16), ("default", 9, 4, 0, 2.0, 16), ("default", 40, 4, 256, 0.9, 2),
    ("heads", 1, 0, 5, 0.5, 16), ("heads", 40, 4, 256, 0.9, 2), ("heads8", 37, 4, 0, 0.5, 16),
    ("heads8", 256, 4, 256, 2.0, 5), ("heads40", 33, 2, 1, 0.9, 7), ("heads10", 20, 4, 3, 0.5, 16),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("geometry, tokens, sinks, position, step, lanes", CASES)
def test_native_bytes_and_values_are_the_reference(dtype, geometry, tokens, sinks, position, step, lanes):
    cal = cal_of(geometry)
    raw = raw_kv(cal, tokens, dtype, seed=tokens + lanes)
    want = ref.encode_chunk(raw, dtype, cal, step, sinks, position, lanes)
    got = native.encode_chunk(raw, dtype, cal, step, sinks, position, lanes)
    assert got == want
    out = native.decode_chunk(want, raw.shape, dtype, cal, step, position)
    assert same(out, ref.decode_chunk(want, raw.shape, dtype, cal, step, position))


def test_a_basis_per_head_is_multiplied_by_blocks():
    """The coder multiplies by blocks exactly where the basis is zero outside its heads' blocks and
    the head is a whole number of 8-column steps; the bytes agree either way (the cases above)."""
    assert native.block_diagonal(cal_of("heads").basis, 64) == 64
    assert native.block_diagonal(cal_of("heads8").basis, 8) == 8
    assert native.block_diagonal(cal_of("heads40").basis, 40) == 40
    assert native.block_diagonal(cal_of("heads10").basis, 10) == 0  # 10 columns: the dense product
    assert native.block_diagonal(cal_of("default").basis, 64) == 0
    one = cal_of("heads8").basis.copy()
    one[1, 1, 0, 8] = 1  # one entry outside the blocks
    assert native.block_diagonal(one, 8) == 0
    assert native.block_diagonal(cal_of("heads8").basis[..., :8, :8], 8) == 0  # one head: nothing to skip


def test_a_default_model_chunk_of_256_tokens():
    cal = cal_of("default")
    raw = raw_kv(cal, 256, "bfloat16", seed=3)
    want = ref.encode_chunk(raw, "bfloat16", cal, 0.5, 4, 0, 16)
    assert native.encode_chunk(raw, "bfloat16", cal, 0.5, 4, 0, 16) == want
    assert same(native.decode_chunk(want, raw.shape, "bfloat16", cal, 0.5, 0),
                ref.decode_chunk(want, raw.shape, "bfloat16", cal, 0.5, 0))


def test_the_thread_count_changes_nothing():
    cal = cal_of("default")
    raw = raw_kv(cal, 24, "bfloat16", seed=4)
    payloads = {native.encode_chunk(raw, "bfloat16", cal, 0.5, 4, 0, 16, threads=t) for t in (1, 2, 3, 8, 64)}
    assert len(payloads) == 1
    payload = payloads.pop()
    outs = [native.decode_chunk(payload, raw.shape, "bfloat16", cal, 0.5, 0, threads=t).tobytes() for t in (1, 2, 7)]
    assert outs[0] == outs[1] == outs[2]


def test_large_values_take_the_exact_path_and_agree():
    """Tokens whose |U| passes 2^15 (or whose sum of U^2 passes the int32 bound) are transformed
    in int64; with values this large some channels clamp at 2^23 - 1 too."""
    cal = cal_of("small")
    raw = raw_kv(cal, 40, "float32", seed=5)
    raw[:, :, 3] *= 60.0
    raw[0, 1, 7, 2] = 3e4
    for step in (8.0, 64.0):
        want = ref.encode_chunk(raw, "float32", cal, step, 4, 0, 16)
        assert native.encode_chunk(raw, "float32", cal, step, 4, 0, 16) == want
        assert same(native.decode_chunk(want, raw.shape, "float32", cal, step, 0),
                    ref.decode_chunk(want, raw.shape, "float32", cal, step, 0))


def test_the_same_refusals_as_the_reference_when_encoding():
    cal = cal_of("small")
    raw = raw_kv(cal, 12, "float32", seed=6)
    raw[1, 0, 9, 3] = 1e9  # its token's coefficients cannot be coded at a small step
    for coder in (ref, native):
        with pytest.raises(UsageError, match="too large for step"):
            coder.encode_chunk(raw, "float32", cal, 0.01, 4, 0, 16)
    raw[1, 0, 9, 3] = np.inf
    for coder in (ref, native):
        with pytest.raises(NonFiniteValues):
            coder.encode_chunk(raw, "float32", cal, 0.5, 4, 0, 16)
    raw[1, 0, 9, 3] = 0.0
    raw[0, 1, 0, 0] = np.nan  # in a sink: still refused, as the reference does
    for coder in (ref, native):
        with pytest.raises(NonFiniteValues):
            coder.encode_chunk(raw, "float32", cal, 0.5, 4, 0, 16)


def _outcome(coder, payload, shape, dtype, cal, step, position):
    try:
        return coder.decode_chunk(payload, shape, dtype, cal, step, position).tobytes()
    except DecodeError:
        return "refused"


@pytest.mark.parametrize("geometry, dtype, step, tokens", [
    ("small", "bfloat16", 2.0, 48), ("small", "float16", 0.2, 30), ("small", "float32", 0.9, 7),
    ("wide", "bfloat16", 0.2, 45)])  # wide: every AVX2 decode kernel, the inverse step too
def test_damaged_payloads_get_the_reference_decision(geometry, dtype, step, tokens):
    """Bit flips and truncations: the native decoder never crashes, and refuses exactly what
    the reference refuses; what both accept decodes to the same values."""
    cal = cal_of(geometry)
    raw = raw_kv(cal, tokens, dtype, seed=7)
    payload = ref.encode_chunk(raw, dtype, cal, step, 4, 0, 16)
    rng = np.random.default_rng(11)
    cases = [payload[:cut] for cut in sorted({0, 1, 23, 24, 25, 60, len(payload) // 2, len(payload) - 1}
                                             | set(rng.integers(0, len(payload), 20).tolist()))]
    cases.append(payload + b"\0\0\0\0")
    for _ in range(150):
        damaged = bytearray(payload)
        for i in rng.integers(0, len(damaged), size=int(rng.integers(1, 4))):
            damaged[i] ^= 1 << int(rng.integers(0, 8))
        cases.append(bytes(damaged))
    lanes, sinks, entries, sink_at, rows_at = ref.parse(payload, raw.shape, dtype)
    for r, field in [(0, 0), (1, 1), (2, 2), (3, 3), (0, 3)]:  # counts in the row table, off by one
        for delta in (1, -1):
            damaged = bytearray(payload)
            at = ref.HEADER.size + ref.ROW_ENTRY.size * r + 4 * field
            damaged[at:at + 4] = ((int.from_bytes(damaged[at:at + 4], "little") + delta) % 2**32).to_bytes(4, "little")
            cases.append(bytes(damaged))
    for value in (7 << 5, 0xFF, 31, 6 << 5):  # side bytes: shift 7, a component dropped, other tables
        damaged = bytearray(payload)
        damaged[rows_at + 1] = value
        cases.append(bytes(damaged))
    refused = 0
    for case in cases:
        want = _outcome(ref, case, raw.shape, dtype, cal, step, 0)
        got = _outcome(native, case, raw.shape, dtype, cal, step, 0)
        assert got == want
        refused += want == "refused"
    assert refused > len(cases) // 3


def test_a_header_that_names_more_sinks_than_tokens_is_refused():
    cal = cal_of("small")
    raw = raw_kv(cal, 6, "bfloat16", seed=8)
    payload = bytearray(ref.encode_chunk(raw, "bfloat16", cal, 0.5, 4, 0, 16))
    payload[20:24] = (7).to_bytes(4, "little")
    for coder in (ref, native):
        with pytest.raises(DecodeError):
            coder.decode_chunk(bytes(payload), raw.shape, "bfloat16", cal, 0.5, 0)


def test_f16_rounding_is_numpy_s():
    rng = np.random.default_rng(12)
    bits = np.concatenate([rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32),
                           np.array([0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFC00001, 0x7FFFFFFF,
                                     0x477FEFFF, 0x477FF000, 0x477FF001, 0x33000000, 0x33000001, 0x387FE000,
                                     0x387FF000, 0x38800000, 0, 0x80000000, 0x1, 0x33800000], np.uint32)])
    # around every f16 rounding boundary of the normal range too
    halves = np.arange(0x0400, 0x7C00, dtype=np.uint32)
    mid = (((halves + 112 * 1024) << 13) + 0x1000).astype(np.uint32)
    bits = np.concatenate([bits, mid, mid - 1, mid + 1, mid | 0x80000000])
    x = bits.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    got = np.frombuffer(native.native_module().f32_to_f16(x.tobytes()), np.uint16)
    assert np.array_equal(got, want)


def test_the_portable_transform_agrees_with_the_simd_one(tmp_path):
    """KVTOOL_PCA_SIMD=0 forces the portable transform, =avx2 no AVX-512 (read once per process: a
    subprocess); every path gives the same bytes."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, hashlib\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_pca_native import cal_of, raw_kv\n"
        "from kvtool.codecs.pca import native\n"
        "cal = cal_of('default'); raw = raw_kv(cal, 21, 'bfloat16', seed=9)\n"
        "p = native.encode_chunk(raw, 'bfloat16', cal, 0.5, 4, 0, 16)\n"
        "d = native.decode_chunk(p, raw.shape, 'bfloat16', cal, 0.5, 0)\n"
        "print(native.native_module().simd(), hashlib.sha256(p + d.tobytes()).hexdigest())\n")
    runs = {}
    for flag in ("1", "avx2", "0"):
        env = dict(os.environ, KVTOOL_PCA_SIMD=flag)
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
        path, digest = out.stdout.split()
        runs[path] = digest
    assert "portable" in runs and len(set(runs.values())) == 1


def test_the_codec_uses_the_native_coder(monkeypatch, tmp_path):
    cal = calmod.Calibration(**{**cal_of("small").__dict__, "digest": ""}).save(tmp_path)
    monkeypatch.setenv("KVTOOL_CALIBRATION_PATH", str(tmp_path))
    monkeypatch.setattr(ref, "encode_chunk", None)  # any use of the reference would fail
    monkeypatch.setattr(ref, "decode_chunk", None)
    kv = torch.from_numpy(raw_kv(cal, 20, "float32", seed=10))
    codec = get_codec("pca")
    payload, p = codec.encode(kv, params_for(cal.digest, "95"))
    out = codec.decode(memoryview(payload), tuple(kv.shape), kv.dtype, p)
    assert out.shape == kv.shape


def test_a_missing_native_coder_is_one_notice_and_falls_back(monkeypatch, capsys):
    from kvtool import notices

    monkeypatch.setattr(native.EXTENSION, "_loaded", True)
    monkeypatch.setattr(native.EXTENSION, "_module", None)
    monkeypatch.setattr(native.EXTENSION, "error", "no module named kvtool._pca_native")
    notices.forget()
    assert native.coder() is ref
    assert native.coder() is ref
    err = capsys.readouterr().err
    assert err.count("native pca coder unavailable") == 1 and err.count("\n") == 1
    with pytest.raises(UsageError):
        native.coder("native")


# --------------------------------------------------------------------------- every SIMD path
# Cases that drive each SIMD kernel and its portable tail: token counts around the blocks of 8 and 16
# (raw parts), 16 (rANS steps) and 72 (the encoder's transform), lanes that are multiples of 8
# (AVX2 rANS) and not (portable), steps from 0.05 to 16 (shifts 0..6, escapes, components not
# coded at all), a spiky token (escapes; the int64 transform), rows with nothing coded.
SIMD_CASES = [  # geometry, tokens, sinks, step, lanes, dtype, scale
    ("wide", 1, 0, 0.5, 16, "bfloat16", 2.0), ("wide", 7, 0, 0.05, 8, "float32", 2.0),
    ("wide", 12, 4, 2.0, 16, "float16", 2.0), ("wide", 13, 4, 0.5, 24, "bfloat16", 2.0),
    ("wide", 37, 4, 0.05, 16, "float32", 2.0), ("wide", 41, 4, 16.0, 16, "bfloat16", 2.0),
    ("wide", 76, 4, 0.5, 5, "float16", 2.0), ("wide", 77, 4, 2.0, 64, "float32", 2.0),
    ("wide", 150, 4, 0.05, 16, "bfloat16", 2.0), ("wide", 33, 4, 1024.0, 16, "float32", 0.01),
    ("default", 45, 4, 0.05, 16, "bfloat16", 2.0), ("default", 20, 0, 2.0, 8, "float16", 2.0),
    ("odd", 30, 4, 0.5, 16, "float32", 2.0),
    ("heads", 45, 4, 0.05, 16, "bfloat16", 2.0), ("heads8", 76, 4, 0.5, 16, "float32", 2.0),
    ("heads8", 41, 4, 16.0, 16, "bfloat16", 2.0), ("heads40", 77, 4, 2.0, 8, "float16", 2.0),
    ("wide", 150, 4, 0.5, 32, "bfloat16", 2.0),  # 32 lanes: the decoder's other register-held loop
    ("wide", 150, 4, 0.5, 48, "float32", 2.0),  # 48 lanes: three AVX-512 registers of states
    ("c120", 40, 4, 0.5, 16, "bfloat16", 2.0), ("heads56", 37, 4, 0.5, 16, "float32", 2.0),
]


def simd_case_raw(geometry, tokens, dtype, scale, step, seed):
    """raw_kv's values with token 5 scaled up (escapes; the int64 transform at the larger steps,
    where its coefficients stay within the per-token limit)"""
    cal = cal_of(geometry)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, cal.layers, tokens, cal.channels, generator=g) * scale + 0.3
    if tokens > 5:
        x[:, :, 5] *= 30.0 if step >= 0.5 else 3.0
    x = x.to(getattr(torch, dtype))
    return cal, x.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else x.numpy()


def side_bytes(payload: bytes, shape, dtype) -> np.ndarray:
    _, L, T, C = shape
    lanes, _, entries, _, pos = ref.parse(payload, shape, dtype)
    out = []
    for e in entries:
        out.append(np.frombuffer(payload, np.uint8, count=C, offset=pos))
        pos += sum(ref._row_sizes(C, lanes, *e))
    return np.concatenate(out)


def check_simd_cases() -> dict:
    """Each case's payload and values against the reference; what the cases covered."""
    seen = {"shifts": set(), "escapes": 0, "dead": 0, "empty_rows": 0}
    for i, (geometry, tokens, sinks, step, lanes, dtype, scale) in enumerate(SIMD_CASES):
        cal, raw = simd_case_raw(geometry, tokens, dtype, scale, step, seed=20 + i)
        want = ref.encode_chunk(raw, dtype, cal, step, sinks, 3, lanes)
        assert native.encode_chunk(raw, dtype, cal, step, sinks, 3, lanes) == want, (i, "encode")
        got = native.decode_chunk(want, raw.shape, dtype, cal, step, 3)
        assert same(got, ref.decode_chunk(want, raw.shape, dtype, cal, step, 3)), (i, "decode")
        sides = side_bytes(want, raw.shape, dtype)
        seen["shifts"] |= set((sides[sides != 0xFF] >> 5).tolist())
        seen["dead"] += int((sides == 0xFF).sum())
        entries = ref.parse(want, raw.shape, dtype)[2]
        seen["escapes"] += sum(e[3] for e in entries)
        seen["empty_rows"] += sum(e[0] == 0 for e in entries)
    return seen


def test_every_simd_path_is_the_reference():
    seen = check_simd_cases()
    assert seen["shifts"] == set(range(7)) and seen["escapes"] and seen["dead"] and seen["empty_rows"]


@pytest.mark.parametrize("flag,path", [("0", "portable"), ("avx2", "avx2")])
def test_every_portable_path_is_the_reference(tmp_path, flag, path):
    """The same cases with KVTOOL_PCA_SIMD=0 (portable loops) and =avx2 (the AVX2 paths where the
    CPU has AVX-512 too), read once per process: a subprocess."""
    if path == "avx2" and native.native_module().simd() != "avx512":
        pytest.skip("the default run above is the AVX2 path on this CPU")
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_pca_native import check_simd_cases\n"
        "from kvtool.codecs.pca import native\n"
        f"assert native.native_module().simd() == {path!r}\n"
        "check_simd_cases()\n"
        "print('ok')\n")
    env = dict(os.environ, KVTOOL_PCA_SIMD=flag)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-2000:]


def test_kept_rope_tables_are_the_calibrations(monkeypatch):
    """The coder slices kept tables of positions 0..n; they are calibration.rope_tables's numbers for
    any range (version 1; version 2: reference2.rope_tables's, §11.5), past what is kept too
    (computed afresh there)."""
    from kvtool.codecs.pca import reference2

    cal = cal_of("small")  # two layers with their own frequencies: two rows
    prep = native._Prepared(cal)
    monkeypatch.setattr(prep, "_rope_limit", 5000)
    for version, make in ((1, calmod.rope_tables), (2, reference2.rope_tables)):
        for start, tokens in ((0, 1), (300, 256), (4090, 10), (0, 5000), (4999, 2), (70000, 3)):
            want = make(prep.rope, start, tokens)
            got = prep.rope_tables(start, tokens, version=version)
            assert all(g.flags.c_contiguous and same(g, w) for g, w in zip(got, want)), (version, start, tokens)
        assert prep._rope_kept[version][0].shape[1] == 5000
