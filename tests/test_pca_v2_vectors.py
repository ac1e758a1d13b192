"""The pca version-2 test vectors (format-spec/vectors/pca/v2, format-spec/pca.md §11.8), made by a
generator that imports nothing from kvtool: kvtool's reference coder reproduces their payloads and
decoded values byte for byte, their RoPE tables are §11.5's, their unit lists are what the
payloads' side bytes and unit tables give, and every unit decodes alone to what the whole chunk's
decoder gives."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from kvtool.codecs.pca import PcaCodec, native
from kvtool.codecs.pca import calibration as calmod
from kvtool.codecs.pca import reference2 as v2

HERE = Path(__file__).resolve().parents[1] / "format-spec" / "vectors" / "pca" / "v2"
_spec = importlib.util.spec_from_file_location("make_pca_v2_vectors", HERE / "make_pca_v2_vectors.py")
mv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mv)

ALL = list(mv.FROM_V1) + [mv.MANY, mv.FAR]


def vector(name: str) -> dict:
    meta = json.loads((HERE / f"{name}.json").read_text())
    storage = mv.STORAGE[meta["dtype"]]
    return dict(meta, raw=np.fromfile(HERE / f"{name}.in.bin", storage).reshape(meta["shape"]),
                payload=(HERE / f"{name}.payload.bin").read_bytes(),
                out=np.fromfile(HERE / f"{name}.out.bin", storage).reshape(meta["shape"]),
                cal=calmod.from_bytes((HERE.parent / f"{meta['params']['calibration']}.kvcal").read_bytes()))


@pytest.mark.parametrize("name", ALL)
def test_the_reference_writes_and_reads_each_vector_byte_for_byte(name):
    v = vector(name)
    p = v["params"]
    assert PcaCodec().validate_params(dict(p)) == p  # complete version-2 parameters, nothing unknown
    assert hashlib.sha256(v["payload"]).hexdigest() == v["payload_sha256"]
    payload = v2.encode_chunk(v["raw"], v["dtype"], v["cal"], p["step"], p["sinks"], p["position"],
                              p["unit"])
    assert payload == v["payload"]
    out = v2.decode_chunk(v["payload"], tuple(v["shape"]), v["dtype"], v["cal"], p["step"], p["position"])
    assert out.tobytes() == v["out"].tobytes()


@pytest.mark.skipif(not native.native_available(), reason="native pca coder not built (pip install -e .)")
@pytest.mark.parametrize("name", ALL)
def test_the_native_coder_writes_and_reads_each_vector_byte_for_byte(name):
    v = vector(name)
    p = v["params"]
    payload = native.encode_chunk_v2(np.array(v["raw"]), v["dtype"], v["cal"], p["step"], p["sinks"], p["position"],
                                     p["unit"])
    assert payload == v["payload"]
    out = native.decode_chunk_v2(v["payload"], tuple(v["shape"]), v["dtype"], v["cal"], p["step"], p["position"])
    assert out.tobytes() == v["out"].tobytes()


@pytest.mark.parametrize("name", ALL)
def test_each_unit_alone_and_the_listed_layout(name):
    v = vector(name)
    shape, dtype = tuple(v["shape"]), v["dtype"]
    lay, q = v2.decode_coefficients(v["payload"], shape, dtype)
    assert lay.spans.tolist() == v["units"]
    assert [int(n) for n in lay.reg_len] == v["regions"] and len(v["regions"]) == -(-len(v["units"]) // 2)
    for u in range(len(lay.spans)):
        row, comp, tok, val = v2.decode_unit(v["payload"], shape, dtype, u)
        assert np.array_equal(q[row, tok, comp], val)
    rope = HERE / f"{name}.rope.bin"
    assert rope.exists() == (lay.Tc > 0)
    if lay.Tc:
        cos, sin = v2.rope_tables(v["cal"], v["params"]["position"] + lay.n_sink, lay.Tc)
        assert rope.read_bytes() == cos.astype("<f4").tobytes() + sin.astype("<f4").tobytes()


def test_the_vectors_cover_what_section_11_asks():
    units = {name: vector(name)["units"] for name in ALL}
    assert units["bf16_sinks_only"] == []  # no coded token, no unit
    assert len(units[mv.MANY]) >= 50 and any(n < 64 for _, _, n in units[mv.MANY])  # short last units
    for name in mv.FROM_V1:  # the inputs are version 1's vectors'
        assert (HERE / f"{name}.in.bin").read_bytes() == (HERE.parent / f"{name}.in.bin").read_bytes()
    lay, q = v2.decode_coefficients(vector(mv.MANY)["payload"], (2, 2, 199, 8), "bfloat16")
    shift = np.where(lay.side == v2.ALL_ZERO, 0, lay.side >> 5).astype(np.int64)  # [rows, C]
    assert ((np.abs(q) >> shift[:, None, :]) >= v2.ESCAPE).any()  # escapes are coded


def test_the_far_vector_holds_what_no_other_does():
    """From position 2^32: section 11.5's tables differ from libm's (so a reader using libm fails
    it), an odd number of units (the last alone in its region), units of fewer than 31 raw bits
    (part of the end state unused, and zero), and values whose |acc| > 2^24 where f32(acc) rounds
    (section 5.2). Measured with kvtool's own functions, beside the facts the json records."""
    v = vector(mv.FAR)
    shape, dtype, p = tuple(v["shape"]), v["dtype"], v["params"]
    _, L, T, C = shape
    assert p["position"] >= 1 << 32 and p["sinks"] == 0 and 1.0 in v["cal"].inv_freq
    cos, sin = v2.rope_tables(v["cal"], p["position"], T)
    lcos, lsin = mv.libm_tables(v["cal"], p["position"], T)
    unlike = int(((cos != lcos) | (sin != lsin)).sum())
    assert unlike >= 1 and v["facts"]["rope_entries_unlike_libm"] >= 1
    lay, q = v2.decode_coefficients(v["payload"], shape, dtype)
    assert len(lay.spans) % 2 == 1 and len(lay.reg_len) == (len(lay.spans) + 1) // 2
    shift = np.where(lay.side == v2.ALL_ZERO, 0, lay.side >> 5).astype(np.int64)  # [rows, C]
    raw_bits = []
    for u in range(len(lay.spans)):
        row, comp, tok, val = v2.decode_unit(v["payload"], shape, dtype, u)
        raw_bits.append(int(shift[row, comp].sum() + (val != 0).sum()))
    assert min(raw_bits) < v2.BACK_BITS and min(raw_bits) == v["facts"]["fewest_raw_bits"]
    q = q.reshape(2, L, T, C)
    basis = v["cal"].basis.astype(np.int64)
    acc = np.concatenate([np.einsum("ltk,lck->ltc", q[part], basis[part]).ravel() for part in range(2)])
    big = acc[np.abs(acc) > 1 << 24]
    assert (big.astype(np.float32).astype(np.int64) != big).any()  # f32(acc) rounds at least once
    assert int(np.abs(acc).max()) == v["facts"]["max_abs_acc"]
    # readers that took libm's tables (version 1's, section 5), kept acc exact or fused a multiply-add
    # would not give NAME.out.bin (numpy rounds every operation; the vector is float32 so that a
    # last-bit difference is not rounded away)
    assert v["out"].dtype == np.float32
    lib = mv.mv1.to_storage(mv.inverse(q, v["cal"], lcos, lsin, p["step"]), dtype)
    assert lib.tobytes() != v["out"].tobytes() and v["facts"]["values_unlike_libm_reader"] >= 1
    for wrong, fact in (("acc", "values_unlike_unrounded_acc_reader"), ("fma", "values_unlike_fused_reader")):
        other = mv.mv1.to_storage(mv.inverse(q, v["cal"], cos, sin, p["step"], wrong=wrong), dtype)
        unlike = int((other[:, :, :] != v["out"]).sum())
        assert unlike >= 1 and unlike == v["facts"][fact], wrong

def test_the_generator_needs_nothing_of_kvtool(tmp_path):
    """In a fresh interpreter that cannot import kvtool (isolated mode, from elsewhere, every import
    of kvtool refused), the generator's own writer codes every vector's input to its payload, its
    own reader gives its output, unit list and region lengths, and its §11.5 tables are the files'."""
    from without_kvtool import run_without_kvtool

    script = f"""
import importlib.util, json
import numpy as np
spec = importlib.util.spec_from_file_location("mv2", {str(HERE / "make_pca_v2_vectors.py")!r})
mv = importlib.util.module_from_spec(spec); spec.loader.exec_module(mv)
here = mv.HERE
for name, (meta, raw) in mv.inputs().items():
    p, dtype = meta["params"], meta["dtype"]
    saved = json.loads((here / f"{{name}}.json").read_text())
    assert saved["params"] == p and (here / f"{{name}}.in.bin").read_bytes() == raw.tobytes(), name
    cal = mv.calibration(p["calibration"])
    payload = mv.spec_encode2(raw, dtype, cal, p["step"], p["sinks"], p["position"], p["unit"])
    assert payload == (here / f"{{name}}.payload.bin").read_bytes(), name
    out = mv.spec_decode2(payload, raw.shape, dtype, cal, p["step"], p["position"])
    assert out.tobytes() == (here / f"{{name}}.out.bin").read_bytes(), name
    lay = mv.parse2(payload, raw.shape, dtype)
    assert [list(s) for s in lay["spans"]] == saved["units"] and lay["reg_len"] == saved["regions"], name
    if lay["Tc"]:
        cos, sin = mv.rope_tables(cal, p["position"] + lay["S"], lay["Tc"])
        assert cos.tobytes() + sin.tobytes() == (here / f"{{name}}.rope.bin").read_bytes(), name
print("ok", len(mv.inputs()))
"""
    assert run_without_kvtool(script, tmp_path) == ["ok", str(len(ALL)), "no", "kvtool"]
