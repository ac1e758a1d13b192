"""CacheGen codec: bitstream identity (native == reference), exact round trip,
robustness against corrupt payloads, bins table parsing, stats."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.codecs.cachegen import (
    CacheGenCodec,
    cachegen_decode,
    cachegen_encode,
    cachegen_params,
    cachegen_payload_stats,
    cachegen_reference_roundtrip,
    canonical_bins_spec,
    native_available,
    parse_bins_spec,
    resolve_bins,
)
from kvtool.codecs.cachegen import reference as ref
from kvtool.errors import CodecParamsInvalid, DecodeError, NonFiniteValues, UsageError

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BITVIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
needs_native = pytest.mark.skipif(not native_available(), reason="native CacheGen coder not built")
IMPLS = ["reference"] + (["native"] if native_available() else [])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITVIEW[t.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def kv_like(shape, dtype, seed=0, k_std=2.2, v_std=0.9):
    g = torch.Generator().manual_seed(seed)
    two, L, T, C = shape
    x = torch.randn(shape, generator=g)
    x[0] *= k_std
    x[1] *= v_std
    if C >= 4:  # a few outlier channels, as in real K
        x[0, :, :, :: max(1, C // 3)] *= 4
    return x.to(dtype)


# --------------------------------------------------------------------------- bins table
def test_default_bins_match_lmcache():
    assert resolve_bins("default", 30) == [32] * 10 + [16] * 20 + [32] * 2 + [16] * 28
    assert resolve_bins("default", 9) == [32] * 18
    assert resolve_bins("default", 10) == [32] * 10 + [32] * 2 + [16] * 8
    assert canonical_bins_spec("default", 30) == "k:0-10=32,10-=16;v:0-2=32,2-=16"
    assert canonical_bins_spec("default", 4) == "k:0-=32;v:0-=32"


@pytest.mark.parametrize(
    "spec,L,want",
    [
        ("16", 3, [16] * 6),
        ("kv:*=8", 2, [8] * 4),
        ("k:0-2=32,2-=16;v:*=64", 4, [32, 32, 16, 16, 64, 64, 64, 64]),
        ("k:0=4,1=256;v:0-2=6", 2, [4, 256, 6, 6]),
        (" K:0-10=32 , 10- = 16 ; V:0-2=32,2-=16 ", 3, [32, 32, 32, 32, 32, 16]),
    ],
)
def test_bins_spec_parses(spec, L, want):
    assert resolve_bins(spec, L) == want
    # the canonical form resolves to the same table
    assert resolve_bins(canonical_bins_spec(spec, L), L) == want


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("", "empty"),
        ("k=32", "lacks"),
        ("q:0-=32", "unknown group"),
        ("k:0-=32", "V layer"),
        ("k:0-2=32;v:*=16", "K layer(s) 2-3"),
        ("k:0-=3;v:*=16", "outside 4..256"),
        ("k:0-=300;v:*=16", "outside 4..256"),
        ("k:0-=x;v:*=16", "not a non-negative integer"),
        ("k:3-1=16;v:*=16", "empty"),
        ("k:a-b=16;v:*=16", "layer range"),
        ("k:0-=32,1=16;v:*=16", "given bins twice"),
        ("k:0-=16;;v:*=16", "empty part"),
        ("k:;v:*=16", "no entries"),
        ("k:0-=16,v:*=16", "separate groups with ';'"),
        ("k:0-16;v:*=16", "should look like"),
    ],
)
def test_bins_spec_errors_are_clear(spec, needle):
    with pytest.raises(UsageError) as ei:
        resolve_bins(spec, 4)
    assert needle in str(ei.value)


def test_params_validation():
    codec = CacheGenCodec()
    p = codec.validate_params(codec.default_params())
    assert p == {"version": 1, "bins": "default", "prob_bits": 14, "lanes": 32}
    assert codec.validate_params({"version": 1}) == p
    for bad in [
        None,
        {},
        {"version": 2},
        {"version": 1, "extra": 1},
        {"version": 1, "bins": 5},
        {"version": 1, "bins": "k:0-=1"},
        {"version": 1, "prob_bits": 9},
        {"version": 1, "prob_bits": 16},
        {"version": 1, "lanes": 0},
        {"version": 1, "lanes": 65},
        {"version": 1, "lanes": True},
    ]:
        with pytest.raises(CodecParamsInvalid):
            codec.validate_params(bad)
    with pytest.raises(UsageError):
        cachegen_params(prob_bits=20)
    with pytest.raises(UsageError):
        parse_bins_spec("nonsense")


def test_registered_as_codec_2():
    from kvtool.codecs import get_codec

    assert isinstance(get_codec(2), CacheGenCodec) and get_codec("cachegen") is get_codec(2)
    assert CacheGenCodec.codec_id == 2 and CacheGenCodec.name == "cachegen" and not CacheGenCodec.lossless


# --------------------------------------------------------------------------- quantization semantics
def test_quantization_formula_and_zero_tokens():
    x = torch.tensor([[[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [-4.0, 4.0, 1.0, -1.0]]])
    q, scales = ref.quantize(x, [32])  # M = 15
    M = 15
    assert scales.tolist() == [[2.0, 0.0, 4.0]]
    want0 = [round(v * M / 2.0 + M) for v in [1.0, -2.0, 0.5, 0.0]]  # 22.5 -> 22 (half to even)
    assert q[0, 0].tolist() == [22, 0, 19, 15] == [int(np.round(v * M / 2.0 + M)) for v in [1.0, -2.0, 0.5, 0.0]]
    assert want0[1] == 0
    assert q[0, 1].tolist() == [M] * 4  # all-zero token: no division by zero, all symbols M
    assert q[0, 2].tolist() == [0, 30, 19, 11]
    deq = ref.dequantize(q, scales, [32], torch.float32)
    assert deq[0, 1].tolist() == [0.0] * 4
    assert deq[0, 2, :2].tolist() == [-4.0, 4.0]  # the max is reproduced exactly


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiny_scales_are_quantized_like_normal_ones(impl, dtype):
    # M / scale overflows fp32 below ~2^-121: such tokens are pre-scaled by 2^64 (exact)
    base = torch.tensor([1.0, -0.5, 0.25, 0.0, -1.0, 0.75], dtype=torch.float32)
    rows = [base * 2.0**-130, base * 2.0**-101, base * 2.0**-99, base * 2.0**-125, base]
    kv = torch.stack(rows).view(1, 1, 5, 6).repeat(2, 1, 1, 1).to(dtype)
    params = cachegen_params("32")
    payload, rec = cachegen_encode(kv, params, impl=impl)
    out = cachegen_decode(payload, kv.shape, dtype, rec, impl=impl)
    assert same_bits(out, cachegen_reference_roundtrip(kv, rec))
    q, _ = ref.quantize(kv.view(2, 5, 6), [32, 32])
    assert (q == q[:, 4:5]).all()  # every token's symbols equal those of the unscaled row
    assert same_bits(out[:, :, :, 0], kv[:, :, :, 0])  # the max element comes back exactly


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_exact_default_bins(impl, dtype):
    kv = kv_like((2, 11, 19, 24), dtype, seed=1)
    payload, params = cachegen_encode(kv, None, impl=impl)
    assert params == {"version": 1, "bins": "k:0-10=32,10-=16;v:0-2=32,2-=16", "prob_bits": 14, "lanes": 32}
    out = cachegen_decode(memoryview(payload), kv.shape, dtype, params, impl=impl)
    assert same_bits(out, cachegen_reference_roundtrip(kv, params))
    assert out.shape == kv.shape and out.dtype == dtype
    # quantization error is bounded by half a step of each token's scale
    err = (out.float() - kv.float()).abs()
    scale = kv.float().abs().amax(-1, keepdim=True)
    step = torch.cat([torch.tensor([1 / 15] * 10 + [1 / 7]), torch.tensor([1 / 15] * 2 + [1 / 7] * 9)]).view(2, 11, 1, 1)
    assert bool((err <= scale * step * 0.5 * 1.001 + out.float().abs() * 2**-7 + 1e-30).all())


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,params",
    [
        ((2, 1, 1, 1), cachegen_params()),
        ((2, 3, 5, 7), cachegen_params("k:0=4,1-=256;v:*=5")),
        ((2, 2, 40, 70), cachegen_params("16", prob_bits=10, lanes=7)),
        ((2, 2, 33, 64), cachegen_params("kv:*=32", prob_bits=15, lanes=64)),
        ((2, 12, 17, 40), cachegen_params(lanes=1)),
    ],
)
def test_native_and_reference_bytes_identical(dtype, shape, params):
    kv = kv_like(shape, dtype, seed=sum(shape))
    a, pa = cachegen_encode(kv, params, impl="native")
    b, pb = cachegen_encode(kv, params, impl="reference")
    assert pa == pb
    assert a == b
    d1 = cachegen_decode(a, shape, dtype, pa, impl="native")
    d2 = cachegen_decode(a, shape, dtype, pa, impl="reference")
    assert same_bits(d1, d2) and same_bits(d1, cachegen_reference_roundtrip(kv, pa))


@needs_native
def test_bytes_do_not_depend_on_thread_count():
    kv = kv_like((2, 7, 64, 48), torch.bfloat16, seed=3)
    outs = {cachegen_encode(kv, None, threads=t, impl="native")[0] for t in (1, 2, 3, 8)}
    assert len(outs) == 1
    payload = outs.pop()
    params = cachegen_encode(kv, None, impl="native")[1]
    decs = [cachegen_decode(payload, kv.shape, kv.dtype, params, threads=t, impl="native") for t in (1, 2, 5)]
    assert all(same_bits(d, decs[0]) for d in decs)


# A fixed input built from integer arithmetic only (no RNG), so its encoding is
# the same on every platform and torch version. A change of this digest is a
# change of the bitstream: bump the format version and the golden vectors.
GOLDEN_SHA256 = "7f2a9078dccef109ac54d45c93d3f896f4e5b65c879c3d830bff14541bb40e7f"


def golden_input() -> torch.Tensor:
    two, L, T, C = 2, 3, 9, 10
    i = torch.arange(two * L * T * C, dtype=torch.int64)
    v = ((i * 7919) % 2003 - 1001).to(torch.float32) / 250.0
    v[::37] = 0.0
    x = v.view(two, L, T, C)
    x[0, 1, 4] = 0.0  # an all-zero token
    x[1, 2, 5] = 1.5  # a constant token
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("impl", IMPLS)
def test_golden_digest_is_stable(impl):
    payload, params = cachegen_encode(golden_input(), cachegen_params("k:0-2=32,2-=16;v:*=16"), impl=impl)
    assert params["bins"] == "k:0-2=32,2-=16;v:0-=16"
    assert hashlib.sha256(payload).hexdigest() == GOLDEN_SHA256


def test_header_layout():
    kv = kv_like((2, 3, 5, 40), torch.float16, seed=4)
    payload, p = cachegen_encode(kv, cachegen_params(lanes=16))
    assert payload[:2] == b"CG" and payload[2] == 1 and payload[3] == 1 and payload[4] == 14 and payload[5] == 16
    assert payload[6:8] == b"\0\0"
    assert struct.unpack_from("<III", payload, 8) == (6, 5, 40)
    assert list(payload[20:26]) == [15] * 6 and payload[26:28] == b"\0\0"
    lens = struct.unpack_from("<6I", payload, 28)
    assert 28 + 24 + sum(lens) == len(payload) and all(n % 4 == 0 for n in lens)


# --------------------------------------------------------------------------- property tests
VALUE_KINDS = ["normal", "constant_tokens", "zeros", "sparse", "tiny", "subnormal", "huge", "outliers"]


def make_values(kind, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "constant_tokens":
        x = x[..., :1].expand(shape).clone()
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "sparse":
        x = x * (torch.rand(shape, generator=g) < 0.1)
        x[..., 0, :] = 0.0
    elif kind == "tiny":  # subnormal range of fp16 / bf16
        x = x * 1e-6
    elif kind == "subnormal":  # scales below 2^-100: the pre-scaled path
        x = x * (1e-7 if dtype == torch.float16 else 1e-39)
    elif kind == "huge":
        x = (x * 1e4).clamp(-6e4, 6e4) if dtype == torch.float16 else x * 1e30
    elif kind == "outliers":
        x[..., :: 3] *= 50
    return x.to(dtype)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    L=st.integers(1, 3),
    T=st.integers(1, 12),
    C=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(VALUE_KINDS),
    bins=st.sampled_from(["default", "4", "16", "kv:*=32", "k:0=256,1-=8;v:*=5", "255"]),
    prob_bits=st.integers(10, 15),
    lanes=st.sampled_from([1, 3, 32, 64]),
    seed=st.integers(0, 2**16),
)
def test_property_roundtrip(L, T, C, dtype, kind, bins, prob_bits, lanes, seed):
    kv = make_values(kind, (2, L, T, C), dtype, seed)
    params = cachegen_params(bins, prob_bits, lanes)
    want = cachegen_reference_roundtrip(kv, params)
    payload, rec = cachegen_encode(kv, params, impl="reference")
    if native_available():
        nat, rec2 = cachegen_encode(kv, params, impl="native")
        assert nat == payload and rec2 == rec
        assert same_bits(cachegen_decode(payload, kv.shape, dtype, rec, impl="native"), want)
    assert same_bits(cachegen_decode(payload, kv.shape, dtype, rec, impl="reference"), want)
    assert bool(torch.isfinite(want).all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(impl, dtype, bad):
    kv = kv_like((2, 2, 4, 8), dtype)
    kv[1, 1, 3, 5] = bad
    with pytest.raises(NonFiniteValues):
        cachegen_encode(kv, None, impl=impl)


def test_encode_usage_errors():
    with pytest.raises(UsageError):
        cachegen_encode(torch.zeros(3, 1, 1, 1), None)
    with pytest.raises(UsageError):
        cachegen_encode(torch.zeros(2, 1, 1, 1, dtype=torch.float64), None)
    with pytest.raises(UsageError):
        cachegen_encode(torch.zeros(2, 1, 0, 4), None)
    with pytest.raises(UsageError):
        cachegen_encode(torch.zeros(2, 3, 1, 4), cachegen_params("k:0-2=16;v:*=16"))


def test_non_contiguous_input():
    kv = kv_like((2, 2, 6, 16), torch.bfloat16, seed=9)
    nc = kv.transpose(2, 3).contiguous().transpose(2, 3)
    assert not nc.is_contiguous()
    assert cachegen_encode(nc, None)[0] == cachegen_encode(kv, None)[0]


# --------------------------------------------------------------------------- corruption
def _outcome(payload, shape, dtype, params, impl):
    try:
        out = cachegen_decode(payload, shape, dtype, params, impl=impl)
    except DecodeError:
        return None
    assert out.shape == shape and out.dtype == dtype
    assert bool(torch.isfinite(out).all())
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_every_truncation_is_a_decode_error(impl):
    kv = kv_like((2, 1, 5, 6), torch.bfloat16, seed=5)
    payload, params = cachegen_encode(kv, cachegen_params(lanes=4))
    for n in range(len(payload)):
        with pytest.raises(DecodeError):
            cachegen_decode(payload[:n], kv.shape, kv.dtype, params, impl=impl)
    with pytest.raises(DecodeError):
        cachegen_decode(payload + b"\0\0\0\0", kv.shape, kv.dtype, params, impl=impl)


def test_random_byte_flips_never_crash_and_impls_agree():
    kv = kv_like((2, 1, 6, 8), torch.float16, seed=6)
    payload, params = cachegen_encode(kv, cachegen_params(lanes=4))
    rng = random.Random(1234)
    errors = 0
    trials = 600
    for trial in range(trials):
        b = bytearray(payload)
        for _ in range(1 + trial % 3):
            pos = rng.randrange(len(b))
            b[pos] ^= 1 << rng.randrange(8) if trial % 2 else rng.randrange(1, 256)
        outs = [_outcome(bytes(b), kv.shape, kv.dtype, params, impl) for impl in IMPLS]
        if outs[0] is None:
            errors += 1
        if len(outs) == 2:
            assert (outs[0] is None) == (outs[1] is None), f"impls disagree on trial {trial}"
            if outs[0] is not None:
                assert same_bits(outs[0], outs[1])
    assert errors > trials // 3  # most corruptions are detected (final-state and padding checks)


@pytest.mark.parametrize("impl", IMPLS)
def test_mismatched_declarations_are_decode_errors(impl):
    kv = kv_like((2, 2, 4, 8), torch.bfloat16, seed=7)
    payload, params = cachegen_encode(kv, None)
    with pytest.raises(DecodeError):
        cachegen_decode(payload, (2, 2, 4, 9), kv.dtype, params, impl=impl)
    with pytest.raises(DecodeError):
        cachegen_decode(payload, (2, 2, 5, 8), kv.dtype, params, impl=impl)
    with pytest.raises(DecodeError):
        cachegen_decode(payload, (2, 2, 4, 8), torch.float16, params, impl=impl)
    with pytest.raises(DecodeError):
        cachegen_decode(payload, (2, 2, 4, 8), kv.dtype, dict(params, bins="16"), impl=impl)
    with pytest.raises(DecodeError):
        cachegen_decode(payload, (2, 2, 4, 8), kv.dtype, dict(params, lanes=4), impl=impl)
    with pytest.raises(DecodeError):
        cachegen_decode(payload, (1, 2, 4, 8), kv.dtype, params, impl=impl)
    with pytest.raises(DecodeError):
        cachegen_decode(b"", (2, 2, 4, 8), kv.dtype, params, impl=impl)


# --------------------------------------------------------------------------- stats
def test_payload_stats_account_for_every_bit():
    kv = kv_like((2, 12, 64, 96), torch.bfloat16, seed=8)
    payload, params = cachegen_encode(kv, None)
    s = cachegen_payload_stats(payload, kv.shape, params)
    parts = s["bits_per_value_by_part"]
    assert set(parts) == {"header", "scales", "tables", "lane_states", "payload", "padding"}
    assert abs(sum(parts.values()) - s["bits_per_value"]) < 1e-9
    assert all(s[f"bpv_{k}"] == v for k, v in parts.items())
    assert abs(sum(s["share"].values()) - 1.0) < 1e-9
    assert s["bytes"] == len(payload) and s["values"] == kv.numel()
    assert s["bins"] == resolve_bins(params["bins"], 12) and s["lanes"] == 32 and s["prob_bits"] == 14
    assert s["bits_per_value"] < 4.5 and s["ratio_vs_bf16"] > 3.5
    assert parts["tables"] < 0.3 and parts["scales"] < 0.3


def test_missing_native_coder_is_one_notice_and_falls_back(monkeypatch, capsys):
    from kvtool import notices
    from kvtool.codecs.cachegen import native

    monkeypatch.setattr(native.EXTENSION, "_loaded", True)
    monkeypatch.setattr(native.EXTENSION, "_module", None)
    monkeypatch.setattr(native.EXTENSION, "error", "no module named kvtool._cachegen_native")
    notices.forget()
    kv = kv_like((2, 1, 3, 4), torch.bfloat16)
    payload, params = cachegen_encode(kv, None)
    out = cachegen_decode(payload, kv.shape, kv.dtype, params)  # no second notice
    err = capsys.readouterr().err
    assert err.count("native CacheGen coder unavailable") == 1 and err.count("\n") == 1
    assert same_bits(out, cachegen_reference_roundtrip(kv, params))
    notices.set_quiet(True)
    notices.forget()
    cachegen_encode(kv, None)
    notices.set_quiet(False)
    assert capsys.readouterr().err == ""  # --quiet silences it


@needs_native
def test_scalar_and_simd_decoders_agree(tmp_path):
    """The native decoder picks an AVX2 row loop at run time; KVTOOL_CACHEGEN_SIMD=0 forces
    the scalar one (read once per process, hence the subprocess)."""
    import os
    import subprocess
    import sys

    kv = kv_like((2, 3, 40, 72), torch.bfloat16, seed=11)
    payload, params = cachegen_encode(kv, cachegen_params("k:0=32,1-=16;v:*=8", lanes=32))
    here = cachegen_decode(payload, kv.shape, kv.dtype, params, impl="native")
    (tmp_path / "p.bin").write_bytes(payload)
    code = (
        "import sys, torch\n"
        "from kvtool.codecs.cachegen import cachegen_decode\n"
        f"p = open({str(tmp_path / 'p.bin')!r}, 'rb').read()\n"
        f"d = cachegen_decode(p, {tuple(kv.shape)!r}, torch.bfloat16, {params!r}, impl='native')\n"
        "sys.stdout.buffer.write(d.view(torch.int16).numpy().tobytes())\n"
    )
    env = dict(os.environ, KVTOOL_CACHEGEN_SIMD="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout
    assert out == bits(here).numpy().tobytes()
    assert same_bits(here, cachegen_reference_roundtrip(kv, params))


@needs_native
def test_simd_and_portable_coders_agree_byte_for_byte(tmp_path):
    """The encoder (quantization, rANS) and the decoder have AVX2 paths picked at run time;
    KVTOOL_CACHEGEN_SIMD=0 forces the portable code (read once per process, hence the
    subprocess). Both must write the same payloads and decode the same values: every dtype,
    lane counts below 8, not a multiple of 8 and a partial last group, P from 10 to 15, tiny
    and zero tokens (the pre-scale and the all-zero row)."""
    import os
    import subprocess
    import sys

    cases = []
    for i, (dtype, shape, spec, lanes, P) in enumerate([
        (torch.bfloat16, (2, 3, 40, 72), "k:0=32,1-=16;v:*=8", 32, 14),
        (torch.float16, (2, 2, 33, 100), "kv:*=256", 24, 15),
        (torch.float32, (2, 2, 17, 45), "k:*=64;v:*=4", 13, 10),
        (torch.bfloat16, (2, 1, 9, 6), "16", 5, 12),
        (torch.float16, (2, 2, 21, 130), "k:0=128,1=32;v:*=16", 64, 11),
    ]):
        kv = kv_like(shape, dtype, seed=20 + i)
        kv[0, 0, 0] = 0                       # an all-zero token
        kv[1, -1, 1] = kv[1, -1, 1] * 1e-30   # tiny tokens (subnormal or zero in 16-bit dtypes)
        params = cachegen_params(spec, lanes=lanes, prob_bits=P)
        payload, params = cachegen_encode(kv, params, impl="native")
        here = cachegen_decode(payload, kv.shape, kv.dtype, params, impl="native")
        torch.save(kv, tmp_path / f"kv{i}.pt")
        cases.append((i, str(dtype).removeprefix("torch."), params, payload, bits(here).numpy().tobytes()))
    code = (
        "import sys, torch\n"
        "from kvtool.codecs.cachegen import cachegen_decode, cachegen_encode\n"
        "i, params = int(sys.argv[1]), eval(sys.argv[2])\n"
        f"kv = torch.load({str(tmp_path)!r} + f'/kv{{i}}.pt')\n"
        "p, _ = cachegen_encode(kv, params, impl='native')\n"
        "d = cachegen_decode(p, kv.shape, kv.dtype, params, impl='native')\n"
        "v = d.view(torch.int32 if d.element_size() == 4 else torch.int16)\n"
        "sys.stdout.buffer.write(len(p).to_bytes(8, 'little') + p + v.numpy().tobytes())\n"
    )
    env = dict(os.environ, KVTOOL_CACHEGEN_SIMD="0")
    for i, _, params, payload, values in cases:
        out = subprocess.run([sys.executable, "-c", code, str(i), repr(params)], env=env, capture_output=True,
                             check=True).stdout
        n = int.from_bytes(out[:8], "little")
        assert out[8:8 + n] == payload, f"case {i}: the portable encoder wrote other bytes"
        assert out[8 + n:] == values, f"case {i}: the portable decoder gave other values"


def test_a_scale_of_minus_zero_is_a_negative_scale():
    """cachegen.md section 4: a scale with its sign bit set, -0.0 included, is rejected."""
    from kvtool.codecs.cachegen.payload import _scale_ok

    assert _scale_ok(np.array([0x0000, 0x3C00], dtype=np.uint16), 1)  # +0.0 and 1.0 in fp16
    assert not _scale_ok(np.array([0x8000], dtype=np.uint16), 1)  # -0.0 in fp16
    assert not _scale_ok(np.array([0x8000], dtype=np.uint16), 0)  # -0.0 in bf16
    assert not _scale_ok(np.array([0x80000000], dtype=np.uint32), 2)  # -0.0 in fp32


def test_the_fingerprints_number_form_is_the_spec_s():
    """container.md section 3.1: integers in decimal; other numbers in the shortest round-trip digits,
    positional for decimal exponents -4..15 with at least one fraction digit, else d[.ddd]e±XX."""
    from kvtool.identity import canonical_json

    cases = {1e-05: "1e-05", 0.0001: "0.0001", 100000.0: "100000.0", 1.5e16: "1.5e+16",
             1e15: "1000000000000000.0", 0.1: "0.1", -0.0: "-0.0", 123456789012345680.0: "1.2345678901234568e+17"}
    for value, text in cases.items():
        assert canonical_json(value).decode() == text
    assert canonical_json({"b": 1, "a": "é\n"}).decode() == '{"a":"é\\n","b":1}'


# --------------------------------------------------------------------------- table budget (spec section 8)
def _hostile_payload(layers: int, T: int, C: int, M: int, N: int = 1) -> bytes:
    """Valid header, all-zero side information (2 bits per channel: the cheapest there is),
    lane states at 2^16 and one word: the C decoder used to build every channel's tables for it."""
    side = ((16 + 5 + T + 10 + 5 + C + 5 + 5 + C + 31) // 32) * 4
    sec = bytes(side) + struct.pack("<I", 1 << 16) * N + bytes(4)
    hdr = bytearray(20 + ((layers + 3) & ~3) + 4 * layers)
    hdr[0:6] = bytes([0x43, 0x47, 1, 0, 14, N])
    struct.pack_into("<III", hdr, 8, layers, T, C)
    hdr[20:20 + layers] = bytes([M]) * layers
    struct.pack_into(f"<{layers}I", hdr, 20 + ((layers + 3) & ~3), *[len(sec)] * layers)
    return bytes(hdr) + sec * layers


@pytest.mark.parametrize("impl", IMPLS)
def test_decoder_tables_beyond_the_budget_are_refused_before_decoding(impl):
    """1 token x 65,536 channels, 256 bins: a 33 KB payload whose tables would take 77 MB
    (2,300x) is DecoderMemoryExceeded, at once, on every decoder path."""
    import time

    from kvtool.errors import DecoderMemoryExceeded

    C = 1 << 16
    payload = _hostile_payload(2, 1, C, 127)
    params = {"version": 1, "bins": "256", "prob_bits": 14, "lanes": 1}
    t0 = time.perf_counter()
    with pytest.raises(DecoderMemoryExceeded, match="decoder tables"):
        cachegen_decode(payload, (2, 1, 1, C), torch.bfloat16, params, impl=impl)
    assert time.perf_counter() - t0 < 2.0  # refused from the header: no side information read
    assert issubclass(DecoderMemoryExceeded, DecodeError)
    # the same geometry with 32 bins fits the budget: it gets past the check and fails as corrupt
    with pytest.raises(DecodeError) as info:
        cachegen_decode(_hostile_payload(2, 1, C, 15), (2, 1, 1, C), torch.bfloat16,
                        dict(params, bins="32"), impl=impl)
    assert not isinstance(info.value, DecoderMemoryExceeded)


@pytest.mark.parametrize("bins", ["default", "256"])
def test_many_channel_one_token_chunks_still_decode(bins):
    """A 1-token tail chunk of 8 KV heads x 128 (1,024 channels per K/V) of real-like KV, at the
    default and at the largest bins, and an all-zero 1-token chunk of 8,192 channels at 64 bins
    (the cheapest payload there is), are within the budget and decode exactly."""
    impl = IMPLS[-1]
    params = cachegen_params(bins)
    for kv in (kv_like((2, 4, 1, 1024), torch.bfloat16, seed=3),
               torch.zeros((2, 2, 1, 8192), dtype=torch.bfloat16) if bins == "default" else None):
        if kv is None:
            continue
        p = params if kv.abs().sum() else cachegen_params("64")
        payload, rec = cachegen_encode(kv, p, impl=impl)
        out = cachegen_decode(payload, kv.shape, kv.dtype, rec, impl=impl)
        assert same_bits(out, cachegen_reference_roundtrip(kv, rec))


def test_encoder_will_not_write_a_chunk_beyond_the_table_budget():
    """The writer follows the spec too: an all-zero 1-token chunk of 8,192 channels at 256 bins
    compresses to ~2 bits per value, too little for its tables: UsageError, nothing written."""
    kv = torch.zeros((2, 2, 1, 8192), dtype=torch.bfloat16)
    with pytest.raises(UsageError, match="tables"):
        cachegen_encode(kv, cachegen_params("256"), impl=IMPLS[-1])
