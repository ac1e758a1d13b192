"""The pca test vectors (format-spec/vectors/pca, format-spec/pca.md section 9): every coder
reproduces their payloads and decoded values byte for byte, their calibration objects and RoPE
tables are what they say, the spec's walk-through is what the files give, and damaged copies of
them are refused as section 7 says.

Three decoders are checked: the reference (numpy), the native C coder (when built) and
`make_pca_vectors.spec_decode`, a scalar decoder that follows the text of pca.md step by step;
the generator's writer (`spec_encode`) and that decoder import nothing from kvtool: every table
they use is in format-spec/ (pca.md and pca_tables.json, whose SHA-256 pca.md gives)."""

from __future__ import annotations

import hashlib
import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtool.codecs import get_codec
from kvtool.codecs.pca import PcaCodec, native
from kvtool.codecs.pca import calibration as calmod
from kvtool.codecs.pca import reference as ref
from kvtool.errors import DecodeError

HERE = Path(__file__).resolve().parents[1] / "format-spec" / "vectors" / "pca"
_spec = importlib.util.spec_from_file_location("make_pca_vectors", HERE / "make_pca_vectors.py")
mv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mv)

ALL = list(mv.VECTORS)
needs_native = pytest.mark.skipif(not native.native_available(),
                                  reason="native pca coder not built (pip install -e .)")


def vector(name: str) -> dict:
    v = mv.load(name)
    v["spec_cal"] = v["cal"]  # the generator's own reading of the object (format-spec/ alone)
    v["cal"] = calmod.from_bytes(v["cal_bytes"], v["params"]["calibration"])  # kvtool's
    v["step"], v["sinks"], v["position"], v["lanes"] = (v["params"][k] for k in ("step", "sinks", "position", "lanes"))
    v["S"] = struct.unpack_from("<I", v["payload"], 20)[0]
    return v


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------- the files
@pytest.mark.parametrize("name", ALL)
def test_the_files_are_what_their_json_says(name):
    v = vector(name)
    digest = v["params"]["calibration"]
    assert hashlib.sha256(v["cal_bytes"]).hexdigest() == digest  # the object is named by its bytes
    assert hashlib.sha256(v["payload"]).hexdigest() == v["meta"]["payload_sha256"]
    assert PcaCodec().validate_params(dict(v["params"])) == v["params"]  # complete, nothing unknown
    _, L, T, C = v["shape"]
    assert (v["cal"].layers, v["cal"].channels, v["cal"].head_dim) == (L, C, v["spec_cal"].head_dim)
    assert v["S"] == mv.sink_count(T, v["sinks"], v["position"])
    for suffix in ("json", "in.bin", "payload.bin", "out.bin", "rope.bin"):
        path = HERE / f"{name}.{suffix}"
        assert not path.exists() or path.stat().st_size < 4096  # small enough to read by hand
    assert (HERE / f"{name}.rope.bin").exists() == (T > v["S"])


def test_the_calibration_objects_are_the_generator_s():
    """Exact rationals for the basis, grid values for the rest, one fixed file layout: the same
    bytes on any machine; and only the objects the vectors name are in the folder."""
    names = set()
    for args in mv.CALIBRATIONS.values():
        layers = args[0]
        data = mv.calibration_bytes(mv.make_calibration(*args))
        digest = hashlib.sha256(data).hexdigest()
        assert (HERE / f"{digest}.kvcal").read_bytes() == data
        stored = calmod.from_bytes(data, digest)
        b = stored.basis.astype(np.float64) / calmod.BASIS_ONE  # orthonormal within its Q14 rounding
        for p in range(2):
            for layer in range(layers):
                assert np.abs(b[p, layer].T @ b[p, layer] - np.eye(stored.channels)).max() < 1e-3
        names.add(f"{digest}.kvcal")
    assert {p.name for p in HERE.glob("*.kvcal")} == names
    assert {vector(name)["params"]["calibration"] + ".kvcal" for name in ALL} == names


@pytest.mark.parametrize("name", [n for n in ALL if n != "bf16_sinks_only"])
def test_the_rope_tables_are_pinned(name):
    """pca.md section 5: every coder takes calibration.rope_tables; the vectors hold what it gave."""
    v = vector(name)
    _, L, T, C = v["shape"]
    cos, sin = mv.rope_of(name, L, T - v["S"])
    want_cos, want_sin = calmod.rope_tables(v["cal"], v["position"] + v["S"], T - v["S"])
    assert same(cos, want_cos) and same(sin, want_sin)


def test_the_vectors_cover_what_a_decoder_meets():
    dtypes, lanes, shifts, odd_words, positions, partial_byte = set(), set(), set(), False, [], False
    for name in ALL:
        v = vector(name)
        trace: dict = {}
        mv.spec_decode(v["payload"], v["shape"], v["dtype"], v["spec_cal"], v["step"], v["position"], trace=trace)
        dtypes.add(v["dtype"])
        lanes.add(v["lanes"])
        positions.append((v["position"], v["S"], v["shape"][2]))
        for row in trace.get("rows", []) if name != mv.EDGES else []:  # fp16_edges: noise, not coefficients
            coded = v["shape"][2] > v["S"]
            assert (0xFF in row["side"]) and row["counts"][3] == int(coded)  # zero components, one escape
            shifts |= {b >> 5 for b in row["side"] if b != 0xFF}
            odd_words |= row["counts"][0] % 2 == 1
            partial_byte |= row["counts"][1] % 8 != 0  # lo bits that do not fill their last byte
    assert dtypes == {"bfloat16", "float16", "float32"}
    assert {1, 2, 3, 4, 16} <= lanes
    assert shifts == set(range(7)) and odd_words and partial_byte
    assert any(0 < s < t and p > 0 for p, s, t in positions)  # some sinks, the chunk not at 0
    assert any(s == 4 and p == 0 for p, s, t in positions)  # S = 4 exact tokens at position 0
    assert any(s == 0 and p > 4 for p, s, t in positions)  # past the sinks
    assert any(s == t for p, s, t in positions)  # nothing coded


def test_a_vector_decodes_to_float16_infinities_and_subnormals():
    """pca.md section 5.2: a value past the float16 maximum is an infinity (both signs here), and
    values below 2^-14 are float16 subnormals, not zero."""
    out = vector(mv.EDGES)["output"].astype(np.float32)
    assert np.isposinf(out).any() and np.isneginf(out).any()
    assert ((out != 0) & (np.abs(out) < 2.0 ** -14)).any()


def _turn_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pairs: list[tuple[int, int, int]]) -> np.ndarray:
    """x [L, Tc, C] turned forward by (first channel, second channel, frequency) pairs."""
    out = x.copy()
    for i, j, f in pairs:
        a, b, c, s = x[..., i], x[..., j], cos[..., f], sin[..., f]
        out[..., i], out[..., j] = (a * c - b * s).astype(np.float32), (b * c + a * s).astype(np.float32)
    return out


@pytest.mark.parametrize("name", ["bf16_heads", "fp16_heads_blocks"])
def test_a_reader_that_pairs_the_channels_otherwise_fails_the_three_head_vectors(name):
    """Section 5's pairs (h*D + i, h*D + D/2 + i) give NAME.out.bin; the interleaved pairs
    (h*D + 2i, h*D + 2i + 1) and pairs across heads (i, i + C/2) do not."""
    v = vector(name)
    trace: dict = {}
    mv.spec_decode(v["payload"], v["shape"], v["dtype"], v["spec_cal"], v["step"], v["position"], trace=trace)
    _, L, T, C = v["shape"]
    S, D = v["S"], v["spec_cal"].head_dim
    cos, sin = mv.rope_of(name, L, T - S)
    x = np.array([[[trace["x"][(0, layer, t, c)][2] for c in range(C)] for t in range(T - S)] for layer in range(L)],
                 np.float32)  # K before the turn
    spec = [(h * D + i, h * D + D // 2 + i, i) for h in range(C // D) for i in range(D // 2)]
    interleaved = [(h * D + 2 * i, h * D + 2 * i + 1, i) for h in range(C // D) for i in range(D // 2)]
    across = [(i, i + C // 2, i % (D // 2)) for i in range(C // 2)]
    want = v["output"][0, :, S:]
    assert same(mv.to_storage(_turn_pairs(x, cos, sin, spec), v["dtype"]), want)
    for pairs in (interleaved, across):
        assert (mv.to_storage(_turn_pairs(x, cos, sin, pairs), v["dtype"]) != want).any()


def test_the_vectors_pin_several_kv_heads_and_a_basis_per_head():
    """C = 18 (3 heads of 6): the pairs of section 5 inside each head, two zero bytes after each
    row's side bytes (C mod 4 = 2), and one object whose basis is zero outside the heads' blocks
    (section 5.3), alongside one whose basis mixes the heads."""
    forms = set()
    for name in ALL:
        cal = vector(name)["spec_cal"]
        heads = cal.channels // cal.head_dim
        if heads == 1:
            continue
        assert cal.channels % 4 == 2  # the side bytes' padding of section 4
        blocks = np.kron(np.eye(heads, dtype=bool), np.ones((cal.head_dim, cal.head_dim), dtype=bool))
        forms.add(bool((cal.basis[..., ~blocks] == 0).all()))
    assert forms == {True, False}


def test_the_tables_file_is_the_one_pca_md_names_and_kvtool_s():
    """pca.md §6.2 gives pca_tables.json's SHA-256; its tables are kvtool's, every row 12-bit."""
    import json

    data = mv.TABLES_FILE.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert digest == mv.TABLES_SHA256 and digest in mv.SPEC.read_text()
    tables = json.loads(data)
    assert np.array_equal(np.array(tables["freq"]), ref.FREQ) and np.array_equal(np.array(tables["cost_q8"]), ref.COST)
    assert (tables["prob_bits"], tables["symbols"]) == (12, 16)
    assert all(sum(row) == 4096 and min(row) >= 1 for row in tables["freq"])


def test_the_generator_needs_nothing_of_kvtool(tmp_path):
    """Run in a fresh interpreter that cannot import kvtool (isolated mode, from elsewhere, every
    import of kvtool refused): the
    generator's writer codes every vector's input to its payload and its decoder gives its output."""
    from without_kvtool import run_without_kvtool

    script = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("mv", {str(HERE / "make_pca_vectors.py")!r})
mv = importlib.util.module_from_spec(spec); spec.loader.exec_module(mv)
for name in mv.VECTORS:
    v = mv.load(name); p = v["params"]
    assert mv.spec_encode(v["input"], v["dtype"], v["cal"], p["step"], p["sinks"], p["position"], p["lanes"]) \
        == v["payload"], name
    out = mv.spec_decode(v["payload"], v["shape"], v["dtype"], v["cal"], p["step"], p["position"])
    assert out.tobytes() == v["output"].tobytes(), name
print("ok", len(mv.VECTORS))
"""
    assert run_without_kvtool(script, tmp_path) == ["ok", str(len(ALL)), "no", "kvtool"]


# --------------------------------------------------------------------------- the coders
@pytest.mark.parametrize("name", ALL)
def test_the_reference_encoder_writes_the_payload(name):
    v = vector(name)
    assert ref.encode_chunk(v["input"], v["dtype"], v["cal"], v["step"], v["sinks"], v["position"],
                            v["lanes"]) == v["payload"]


@pytest.mark.parametrize("name", ALL)
def test_the_reference_decoder_gives_the_values(name):
    v = vector(name)
    out = ref.decode_chunk(v["payload"], v["shape"], v["dtype"], v["cal"], v["step"], v["position"])
    assert same(out, v["output"])


@needs_native
@pytest.mark.parametrize("name", ALL)
def test_the_native_coder_writes_the_payload_and_gives_the_values(name):
    v = vector(name)
    assert native.encode_chunk(np.array(v["input"]), v["dtype"], v["cal"], v["step"], v["sinks"], v["position"],
                               v["lanes"]) == v["payload"]
    out = native.decode_chunk(v["payload"], v["shape"], v["dtype"], v["cal"], v["step"], v["position"])
    assert same(out, v["output"])


@pytest.mark.parametrize("name", ALL)
def test_a_decoder_written_from_the_text_gives_the_values(name):
    """With the pinned tables, and with the spec's formula for them."""
    v = vector(name)
    _, L, T, C = v["shape"]
    tables = mv.rope_of(name, L, T - v["S"]) or (None, None)
    for cos, sin in (tables, (None, None)):
        out = mv.spec_decode(v["payload"], v["shape"], v["dtype"], v["spec_cal"], v["step"], v["position"], cos, sin)
        assert same(out, v["output"])


@pytest.mark.parametrize("name", ALL)
def test_the_codec_finds_the_calibration_by_its_digest_and_decodes(name, monkeypatch):
    """As a reader of a container would: the parameters name the object, the search path finds it."""
    monkeypatch.setenv("KVTOOL_CALIBRATION_PATH", str(HERE))
    calmod._loaded.clear()
    try:
        v = vector(name)
        out = get_codec("pca").decode(memoryview(v["payload"]), v["shape"], getattr(torch, v["dtype"]),
                                      v["params"])
        storage = {"bfloat16": torch.int16, "float16": torch.float16, "float32": torch.float32}[v["dtype"]]
        assert out.contiguous().view(storage).numpy().tobytes() == v["output"].tobytes()
    finally:
        calmod._loaded.clear()


def test_the_spec_prints_what_the_files_give():
    """pca.md section 9 is rendered from the files (make_pca_vectors.py writes it): no table drifts."""
    text = mv.SPEC.read_text()
    section = text.split(mv.BEGIN)[1].split(mv.END)[0]
    assert section == "\n" + mv.walkthrough()
    for name in ALL:
        assert f"`{name}`" in section


# --------------------------------------------------------------------------- damaged copies (section 7)
def _set_u32(data: bytearray, at: int, value: int) -> None:
    data[at:at + 4] = struct.pack("<I", value)


def _walk_damage(kind: str) -> tuple[bytes, str]:
    """A damaged copy of walk_bf16's payload and the reference's words for what is wrong."""
    v = vector(mv.WALK)
    data = bytearray(v["payload"])
    lanes, S, entries, sink_at, rows_at = ref.parse(v["payload"], v["shape"], v["dtype"])
    row0 = 24  # the row table's first entry: words, lo bits, sign bits, escapes
    side0 = rows_at
    states0 = side0 + 8
    words0 = states0 + 4 * lanes
    if kind == "magic":
        data[0:4] = b"KVPD"
        return bytes(data), "not a pca payload"
    if kind == "version":
        data[4] = 2
        return bytes(data), "not a pca payload"
    if kind == "reserved byte":
        data[7] = 1
        return bytes(data), "not a pca payload"
    if kind == "dtype":
        data[5] = 1  # says fp16, the chunk is bf16
        return bytes(data), "header does not match"
    if kind == "lanes 0":
        data[6] = 0
        return bytes(data), "header does not match"
    if kind == "lanes 65":
        data[6] = 65
        return bytes(data), "header does not match"
    if kind == "rows":
        _set_u32(data, 8, 4)
        return bytes(data), "header does not match"
    if kind == "channels":
        _set_u32(data, 16, 16)
        return bytes(data), "header does not match"
    if kind == "lo bits":  # 20 -> 19: the same 3 bytes, so the length still holds
        assert entries[0][1] == 20
        _set_u32(data, row0 + 4, 19)
        return bytes(data), "low-bit count"
    if kind == "sign bits":  # 13 -> 12: the same 2 bytes
        assert entries[0][2] == 13
        _set_u32(data, row0 + 8, 12)
        return bytes(data), "sign-bit count"
    if kind == "escapes":  # 1 -> 0: lo 3 + sign 2 (+ escape 2) bytes pad to 8 either way
        assert entries[0][3] == 1
        _set_u32(data, row0 + 12, 0)
        return bytes(data), "escape count"
    if kind == "words end early":  # row 0's 2 words dropped, the table saying 0: the length holds
        assert entries[0][0] == 2
        _set_u32(data, row0, 0)
        del data[words0:words0 + 4]
        return bytes(data), "end early"
    if kind == "final state":  # lane 0 of row 0 one more: the same symbols, another end
        _set_u32(data, states0, struct.unpack_from("<I", data, states0)[0] + 1)
        return bytes(data), "does not end where it began"
    if kind == "escape too large":  # row 1's escape: m = (15 + 65535) << shift > 32767
        at = len(data) - 3
        assert struct.unpack_from("<H", data, at)[0] == 266
        data[at:at + 2] = b"\xff\xff"
        return bytes(data), "exceeds 32767"
    if kind == "truncated row table":
        return bytes(data[:40]), "shorter than its row table"
    raise AssertionError(kind)


DAMAGE = ["magic", "version", "reserved byte", "dtype", "lanes 0", "lanes 65", "rows", "channels", "lo bits",
          "sign bits", "escapes", "words end early", "final state", "escape too large", "truncated row table"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damage_is_refused_by_every_decoder(kind):
    v = vector(mv.WALK)
    damaged, reason = _walk_damage(kind)
    args = (damaged, v["shape"], v["dtype"], v["cal"], v["step"], v["position"])
    with pytest.raises(DecodeError, match=reason):
        ref.decode_chunk(*args)
    with pytest.raises(mv.SpecError):
        mv.spec_decode(*args)
    if native.native_available():
        with pytest.raises(DecodeError):
            native.decode_chunk(*args)


def test_a_token_whose_coefficients_sum_past_2_16_is_refused(monkeypatch):
    """A writer cannot make one (it refuses to code it), so the reference's forward transform is
    replaced to write one: all eight V coefficients of a token at 10000 (a sum of 80000)."""
    v = vector(mv.WALK)
    _, L, T, C = v["shape"]
    q = np.zeros((2, L, T - v["S"], C), np.int64)
    q[1, 0, 1] = 10000
    q[0, 0, 2, 0] = -3
    monkeypatch.setattr(ref, "forward", lambda x, cal, start, step: q)
    payload = ref.encode_chunk(v["input"], v["dtype"], v["cal"], v["step"], v["sinks"], v["position"], v["lanes"])
    monkeypatch.undo()
    args = (payload, v["shape"], v["dtype"], v["cal"], v["step"], v["position"])
    with pytest.raises(DecodeError, match="sum past"):
        ref.decode_chunk(*args)
    with pytest.raises(mv.SpecError, match="token sum"):
        mv.spec_decode(*args)
    if native.native_available():
        with pytest.raises(DecodeError):
            native.decode_chunk(*args)
    q[1, 0, 1] = 8192  # 65536: the limit itself is allowed
    monkeypatch.setattr(ref, "forward", lambda x, cal, start, step: q)
    payload = ref.encode_chunk(v["input"], v["dtype"], v["cal"], v["step"], v["sinks"], v["position"], v["lanes"])
    monkeypatch.undo()
    out = ref.decode_chunk(payload, v["shape"], v["dtype"], v["cal"], v["step"], v["position"])
    assert same(out, mv.spec_decode(payload, v["shape"], v["dtype"], v["cal"], v["step"], v["position"]))


def test_a_calibration_of_other_layers_is_refused():
    v = vector("bf16_sinks")  # 2 layers; the walk-through's object has 1 (and the same channels)
    other = vector(mv.WALK)["cal"]
    args = (v["payload"], v["shape"], v["dtype"], other, v["step"], v["position"])
    with pytest.raises(DecodeError, match="calibration is for"):
        ref.decode_chunk(*args)
    if native.native_available():
        with pytest.raises(DecodeError, match="calibration is for"):
            native.decode_chunk(*args)


def test_padding_is_not_read():
    """pca.md section 4: padding is written as zeros and a reader does not look at it."""
    v = vector(mv.WALK)
    data = bytearray(v["payload"])
    for at in (147, 166, 167, 179):  # row 0's tail pad, row 1's word pad and tail pad (section 9.2)
        assert data[at] == 0
        data[at] = 0xA5
    data[142] |= 0xF0  # row 0's lo bits: 20 of 24, the last byte's high nibble unused
    args = (bytes(data), v["shape"], v["dtype"], v["cal"], v["step"], v["position"])
    assert same(ref.decode_chunk(*args), v["output"])
    assert same(mv.spec_decode(*args), v["output"])
    if native.native_available():
        assert same(native.decode_chunk(*args), v["output"])
