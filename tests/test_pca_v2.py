"""pca bitstream version 2 (format-spec/pca.md §11): the reference coder's round trip is version 1's
quantizer with §11.5's RoPE tables, every unit decodes alone from its own segment, the layout's
refusals, the RoPE tables without libm, and the codec reading both versions.

Calibrations here are random (tests/test_pca_native.random_calibration): the layout does not
depend on the model."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kvtool.codecs import get_codec
from kvtool.codecs.pca import PcaCodec, params_for
from kvtool.codecs.pca import calibration as calmod
from kvtool.codecs.pca import reference as v1
from kvtool.codecs.pca import native
from kvtool.codecs.pca import reference2 as v2
from kvtool.errors import CodecParamsInvalid, DecodeError, NonFiniteValues, UsageError

from test_pca_native import random_calibration, raw_kv


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


_cals: dict[tuple, calmod.Calibration] = {}


def cal_of(L: int, H: int, D: int) -> calmod.Calibration:
    if (L, H, D) not in _cals:
        _cals[(L, H, D)] = random_calibration(L, H, D, seed=L * 100 + H * 10 + D)
    return _cals[(L, H, D)]


def expected_q(raw, dtype, cal, step, sinks, position):
    """§11's coefficients: version 1's forward (§5.1) with §11.5's tables."""
    T = raw.shape[2]
    s = min(T, max(0, sinks - position))
    x = v1.from_dtype(raw, dtype)[:, :, s:]
    tables = v2.rope_tables(cal, position + s, T - s)
    q = v1.forward(x, cal, position + s, step, tables=tables)
    return q.reshape(2 * raw.shape[1], T - s, raw.shape[3]), s, tables


CASES = [  # (L, H, D), tokens, dtype, sinks, position, step, unit
    ((2, 2, 8), 40, "bfloat16", 4, 0, 0.5, 64),
    ((2, 2, 8), 40, "bfloat16", 4, 0, 3.0, 64),  # few live components, short units
    ((1, 3, 10), 33, "float16", 4, 2, 0.25, 128),
    ((2, 2, 16), 70, "float32", 0, 1000, 1.0, 192),  # a unit that is not a power of two
    ((2, 2, 16), 256, "bfloat16", 4, 0, 0.8, 768),
    ((1, 2, 8), 3, "bfloat16", 4, 0, 1.0, 512),  # sinks only: no unit at all
]


@pytest.mark.parametrize("geometry, tokens, dtype, sinks, position, step, unit", CASES)
def test_round_trip_is_version_one_quantizer_with_the_exact_tables(geometry, tokens, dtype, sinks, position, step,
                                                                   unit):
    cal = cal_of(*geometry)
    raw = raw_kv(cal, tokens, dtype, seed=tokens)
    payload = v2.encode_chunk(raw, dtype, cal, step, sinks, position, unit)
    q, s, tables = expected_q(raw, dtype, cal, step, sinks, position)
    lay, got_q = v2.decode_coefficients(payload, raw.shape, dtype)
    assert np.array_equal(got_q, q)
    out = v2.decode_chunk(payload, raw.shape, dtype, cal, step, position)
    want = np.empty_like(out)
    want[:, :, :s] = raw[:, :, :s]
    if s < tokens:
        want[:, :, s:] = v1.to_dtype(v1.inverse(q.reshape(2, cal.layers, tokens - s, -1), cal, position + s, step,
                                                tables=tables), dtype)
    assert same(out, want)
    assert v2.encode_chunk(raw, dtype, cal, step, sinks, position, unit) == payload  # deterministic


@pytest.mark.parametrize("geometry, tokens, dtype, sinks, position, step, unit", CASES[:5])
def test_every_unit_decodes_alone_from_its_own_stream(geometry, tokens, dtype, sinks, position, step, unit):
    """Unit u, decoded one symbol at a time from a payload where every byte that is not its own
    (other regions, and its partner's part of its region) is zeroed, gives the coefficients the
    whole-chunk decoder gives, at the positions the side bytes name."""
    cal = cal_of(*geometry)
    raw = raw_kv(cal, tokens, dtype, seed=tokens)
    payload = v2.encode_chunk(raw, dtype, cal, step, sinks, position, unit)
    lay, q = v2.decode_coefficients(payload, raw.shape, dtype)
    assert len(lay.spans) > 2
    head = int(lay.reg_at[0])  # header, side bytes, sinks, unit table
    covered = np.zeros(q.shape, bool)
    for u in range(len(lay.spans)):
        at, n = int(lay.reg_at[u // 2]), int(lay.reg_len[u // 2])
        comp, tok, tab, shift = v2._unit_meta(lay, u)
        stream = lay.stream(payload, u)
        sym, x, words = v2._rans_scalar(stream, tab)
        own = v2._raw_parts(stream, sym, x, words, shift)[1]  # the bytes of the region that are u's
        alone = bytearray(len(payload))
        alone[:head] = payload[:head]
        mine = slice(at, at + own) if u % 2 == 0 else slice(at + n - own, at + n)
        alone[mine] = payload[mine]
        row, comp, tok, val = v2.decode_unit(bytes(alone), raw.shape, dtype, u)
        assert np.array_equal(q[row, tok, comp], val)
        assert not covered[row, tok, comp].any()  # no two units write one position
        covered[row, tok, comp] = True
    live = np.repeat((lay.side != v2.ALL_ZERO)[:, None, :], lay.Tc, 1)
    assert np.array_equal(covered, live)  # and together they write every coded one


def test_unit_spans_follow_the_side_bytes_alone():
    side = np.full((3, 8), v2.ALL_ZERO, np.uint8)
    side[0, [1, 4, 5]] = 0x21
    side[2, 0] = 0x00
    assert v2.unit_spans(side, 100, 64).tolist() == [[0, 0, 64], [0, 64, 64], [0, 128, 64], [0, 192, 64],
                                                     [0, 256, 44], [2, 0, 64], [2, 64, 36]]
    assert v2.unit_spans(np.full((2, 4), v2.ALL_ZERO, np.uint8), 100, 64).shape == (0, 3)


def _payload(unit=64, step=0.5):
    cal = cal_of(2, 2, 8)
    raw = raw_kv(cal, 40, "bfloat16", seed=40)
    return cal, raw, v2.encode_chunk(raw, "bfloat16", cal, step, 4, 0, unit)


def test_damage_is_refused_or_decodes_without_a_crash():
    cal, raw, payload = _payload()
    lay = v2.parse(payload, raw.shape, "bfloat16")
    with pytest.raises(DecodeError, match="bytes"):
        v2.decode_chunk(payload[:-1], raw.shape, "bfloat16", cal, 0.5, 0)
    with pytest.raises(DecodeError, match="bytes"):
        v2.decode_chunk(payload + b"\0", raw.shape, "bfloat16", cal, 0.5, 0)
    bad = bytearray(payload)
    bad[6] = 65  # units of 65 x 64 symbols: past 4096
    with pytest.raises(DecodeError, match="header"):
        v2.parse(bytes(bad), raw.shape, "bfloat16")
    bad = bytearray(payload)
    bad[4] = 1  # a version-1 reader's header on version 2's bytes
    with pytest.raises(DecodeError, match="version 2"):
        v2.parse(bytes(bad), raw.shape, "bfloat16")
    table = int(lay.reg_at[0]) - 2 * len(lay.reg_len)
    n0, n1 = struct.unpack_from("<HH", payload, table)
    bad = bytearray(payload)
    struct.pack_into("<HH", bad, table, 7, n1 + n0 - 7)  # a region shorter than its two states
    with pytest.raises(DecodeError, match="states"):
        v2.parse(bytes(bad), raw.shape, "bfloat16")
    bad = bytearray(payload)
    struct.pack_into("<HH", bad, table, n0 + 1, n1 - 1)  # a boundary moved: the same total length
    with pytest.raises(DecodeError):
        v2.decode_chunk(bytes(bad), raw.shape, "bfloat16", cal, 0.5, 0)
    rng = np.random.default_rng(0)
    for _ in range(200):  # flipped bytes: refused with DecodeError or decoded, never anything else
        bad = bytearray(payload)
        i = int(rng.integers(v2.HEADER.size, len(bad)))
        bad[i] ^= 1 << int(rng.integers(8))
        try:
            v2.decode_chunk(bytes(bad), raw.shape, "bfloat16", cal, 0.5, 0)
        except DecodeError:
            pass


def test_sincos_is_libms_to_the_last_bit_of_float32_where_positions_are_ordinary():
    inv = np.float32(1.0) / np.float32(10000) ** (np.arange(0, 128, 2, dtype=np.float32) / np.float32(128))
    pos = np.concatenate([np.arange(0, 4096), np.arange(1 << 20, (1 << 20) + 512), [(1 << 29) - 1]]).astype(np.float64)
    angle = pos[:, None] * inv.astype(np.float64)[None, :]
    s, c = v2.sincos(angle)
    assert np.abs(s - np.sin(angle)).max() < 1e-14 and np.abs(c - np.cos(angle)).max() < 1e-14
    agree = (s.astype(np.float32) == np.sin(angle).astype(np.float32)).mean()
    assert agree > 0.9999  # f32 ties of libm's rounding aside, the same tables


def test_sincos_pinned_values():
    """§11.5's operations give these float64 bits on every platform (numpy fuses nothing)."""
    got = v2.sincos(np.array([0.0, 1.0, 5.0, 70000.0, 3.0e6]))
    want_sin = ["0x0.0p+0", "0x1.aed548f090ceep-1", "-0x1.eaf81f5e09933p-1", "-0x1.a59e631ba6f3dp-1",
                "-0x1.c1c972eb2f877p-1"]  # the last: libm's ends in ...878, one float64 ulp away
    want_cos = ["0x1.0000000000000p+0", "0x1.14a280fb5068cp-1", "0x1.22785706b4adap-2", "0x1.227c3863b3ce7p-1",
                "0x1.e93a1503a252dp-2"]
    assert [float(x).hex() for x in got[0]] == [float.fromhex(h).hex() for h in want_sin]
    assert [float(x).hex() for x in got[1]] == [float.fromhex(h).hex() for h in want_cos]


def test_the_rope_tables_are_libm_free_and_used_by_both_sides():
    cal = cal_of(2, 2, 16)
    cos, sin = v2.rope_tables(cal, 1000, 5)
    angle = np.arange(1000, 1005, dtype=np.float64)[None, :, None] * cal.inv_freq.astype(np.float64)[:, None, :]
    s, c = v2.sincos(angle)
    assert same(cos, c.astype(np.float32)) and same(sin, s.astype(np.float32))


# --------------------------------------------------------------------------- through the codec
@pytest.fixture()
def cal_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(tmp_path / "cal"))
    monkeypatch.delenv("KVTOOL_CALIBRATION_PATH", raising=False)
    calmod._loaded.clear()
    saved = cal_of(2, 2, 16).save(tmp_path / "cal")
    yield saved
    calmod._loaded.clear()


def test_the_codec_writes_version_two_on_request_and_reads_both(cal_dir):
    codec = get_codec("pca")
    kv = (torch.randn(2, 2, 300, 32, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    assert params_for(cal_dir.digest, "97")["version"] == 1  # the default stays version 1 (§11.7)
    outs = {}
    for version in (1, 2):
        params = codec.validate_params(params_for(cal_dir.digest, "97", version=version))
        payload, recorded = codec.encode(kv, params)
        assert payload[4] == version and recorded["version"] == version
        out = codec.decode(memoryview(payload), tuple(kv.shape), kv.dtype, recorded)
        outs[version] = out
        stats = codec.payload_stats(memoryview(payload), tuple(kv.shape), recorded)
        assert stats["bytes"] == len(payload)
        if version == 2:
            assert stats["units"] == v2.units_of(payload, tuple(kv.shape), "bfloat16") > 1
            other = dict(recorded, version=1, lanes=16)
            other.pop("unit")
            with pytest.raises(DecodeError, match="version"):  # the header's version is the parameters'
                codec.decode(memoryview(payload), tuple(kv.shape), kv.dtype, other)
            with pytest.raises(DecodeError, match="units"):
                codec.decode(memoryview(payload), tuple(kv.shape), kv.dtype, dict(recorded, unit=1024))
    # the same quantizer; here §11.5's tables are libm's to the last float32 bit, so the same values
    assert torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("unit", [48, 32, 100, 8192, 4160, True])
def test_a_unit_that_is_not_a_multiple_of_64_up_to_4096_is_refused(unit):
    with pytest.raises(CodecParamsInvalid, match="unit"):
        PcaCodec().validate_params({"version": 2, "calibration": "a" * 64, "step": 1.0, "unit": unit})


# --------------------------------------------------------------------------- the native decoder
needs_native = pytest.mark.skipif(not native.native_available(), reason="native pca coder not built (pip install -e .)")


@needs_native
@pytest.mark.parametrize("geometry, tokens, dtype, sinks, position, step, unit",
                         CASES + [((2, 2, 16, True), 90, "bfloat16", 4, 0, 0.6, 64),  # a basis per KV head
                                  ((30, 3, 64), 256, "bfloat16", 4, 256, 0.8, 768)])  # the default model's shape
def test_the_native_decoder_gives_the_reference_values(geometry, tokens, dtype, sinks, position, step, unit):
    cal = random_calibration(*geometry) if len(geometry) == 4 or geometry[0] == 30 else cal_of(*geometry)
    raw = raw_kv(cal, tokens, dtype, seed=tokens)
    payload = v2.encode_chunk(raw, dtype, cal, step, sinks, position, unit)
    want = v2.decode_chunk(payload, raw.shape, dtype, cal, step, position)
    for threads in (1, 3):
        assert same(native.decode_chunk_v2(payload, raw.shape, dtype, cal, step, position, threads=threads), want)


@needs_native
@pytest.mark.parametrize("geometry, tokens, dtype, sinks, position, step, unit",
                         CASES + [((2, 2, 16, True), 90, "bfloat16", 4, 0, 0.6, 64),  # a basis per KV head
                                  ((30, 3, 64), 256, "bfloat16", 4, 256, 0.8, 768),  # the default model's shape
                                  ((2, 2, 16), 200, "bfloat16", 4, 0, 0.05, 64)])  # a fine step: escapes, shift 6
def test_the_native_encoder_writes_the_reference_bytes(geometry, tokens, dtype, sinks, position, step, unit):
    cal = random_calibration(*geometry) if len(geometry) == 4 or geometry[0] == 30 else cal_of(*geometry)
    raw = raw_kv(cal, tokens, dtype, seed=tokens)
    want = v2.encode_chunk(raw, dtype, cal, step, sinks, position, unit)
    for threads in (1, 3):
        assert native.encode_chunk_v2(raw, dtype, cal, step, sinks, position, unit, threads=threads) == want


@needs_native
def test_the_native_encoder_refuses_what_the_reference_refuses():
    cal = cal_of(2, 2, 8)
    raw = raw_kv(cal, 20, "float32", seed=1)
    raw[1, 0, 2, 3] = np.inf
    with pytest.raises(NonFiniteValues):
        native.encode_chunk_v2(raw, "float32", cal, 1.0, 4, 0)
    raw = raw_kv(cal, 20, "float32", seed=1, scale=4000.0)  # coefficients past 2^16 a token at the finest step
    with pytest.raises(UsageError, match="too large"):
        v2.encode_chunk(raw, "float32", cal, 2.0 ** -10, 4, 0)
    with pytest.raises(UsageError, match="too large"):
        native.encode_chunk_v2(raw, "float32", cal, 2.0 ** -10, 4, 0)
    with pytest.raises(UsageError, match="multiple of 64"):
        native.encode_chunk_v2(raw, "float32", cal, 1.0, 4, 0, unit=100)


def _outcome(decode):
    try:
        return decode().tobytes()
    except DecodeError:
        return "refused"


@needs_native
def test_damaged_payloads_get_the_reference_decision_from_the_native_decoder():
    """Flipped bits anywhere after the header: the native decoder refuses what the reference
    refuses (DecodeError) and decodes to the same values what both accept."""
    cal, raw, payload = _payload()
    rng = np.random.default_rng(7)
    refused = 0
    for _ in range(300):
        bad = bytearray(payload)
        i = int(rng.integers(v2.HEADER.size, len(bad)))
        bad[i] ^= 1 << int(rng.integers(8))
        bad = bytes(bad)
        ref_out = _outcome(lambda: v2.decode_chunk(bad, raw.shape, "bfloat16", cal, 0.5, 0))
        nat_out = _outcome(lambda: native.decode_chunk_v2(bad, raw.shape, "bfloat16", cal, 0.5, 0, threads=1))
        assert ref_out == nat_out
        refused += ref_out == "refused"
    assert refused > 100  # most damage is seen


@needs_native
def test_a_pair_of_the_largest_units_cannot_reach_the_region_limit():
    """The refusal 'a pair of units exceeds 65535 bytes' (both coders) cannot be reached: the
    writer's choice (§6.1) costs at most what shift 0 with the table of the most frequent escape
    costs, so a symbol takes at most that table's dearest symbol plus 16 escape bits and a sign,
    18.5 bits: a pair of 4096-symbol units stays under 19 KB. Every coefficient an escape at
    shift 0 (|q| 1000-1063 everywhere, float32, tokens 4096 of one component each) reaches the
    bound; both coders write it, and with units of 64 too."""
    cal = random_calibration(1, 2, 8, seed=1)  # C = 16: a token's sum of |q| stays under 2^16
    T, step, dtype = 4096, 2.0 ** -4, "float32"
    rng = np.random.default_rng(0)
    want_q = rng.choice([-1, 1], size=(2, 1, T, 16)) * rng.integers(1000, 1064, size=(2, 1, T, 16))
    raw = v1.inverse(want_q, cal, 0, step, tables=v2.rope_tables(cal, 0, T))
    bits = min(max(np.log2(4096 / v2.FREQ[t, s]) + (s > 0) + 16 * (s == v2.ESCAPE) for s in range(v2.ESCAPE + 1))
               for t in range(len(v2.FREQ)))
    bound = 2 * (4 + 2 + int(np.ceil(4096 * bits / 8)) + 1)  # two states, rounding of words and raw bytes
    assert bits < 19 and bound < 0xFFFF // 3
    payload = native.encode_chunk_v2(raw, dtype, cal, step, 0, 0, 4096, threads=1)
    assert v2.encode_chunk(raw, dtype, cal, step, 0, 0, 4096) == payload
    lay, q = v2.decode_coefficients(payload, raw.shape, dtype)
    assert (lay.side >> 5 == 0).all() and (np.abs(q) >= 15).all()  # shift 0, every symbol an escape
    assert len(lay.reg_len) == 16 and 0.99 * bound < lay.reg_len.max() <= bound
    want = v2.decode_chunk(payload, raw.shape, dtype, cal, step, 0)
    assert same(native.decode_chunk_v2(payload, raw.shape, dtype, cal, step, 0, threads=1), want)
    small = native.encode_chunk_v2(raw, dtype, cal, step, 0, 0, 64, threads=1)
    assert v2.encode_chunk(raw, dtype, cal, step, 0, 0, 64) == small
    assert v2.units_of(small, raw.shape, dtype) == 2 * 16 * T // 64
    assert same(native.decode_chunk_v2(small, raw.shape, dtype, cal, step, 0, threads=1), want)
    assert same(v2.decode_chunk(small, raw.shape, dtype, cal, step, 0), want)
