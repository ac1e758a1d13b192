"""What format-spec/pca.md says since a decoder written from the text alone read it (section 10's
"clarified" row of 2026-12-02), each held to kvtool's readers (the reference coders and the native
one) on the spec's own vectors: a coded component of zeros decodes to the same values; with no
coded token a version-1 reader ignores the side bytes and version 2 refuses any but 0xFF; tables
16 and 17 are one table; a version-2 payload's length is 11.2's formula; and, after a second such
decoder, section 3's calibration object layout: `head_dim` plain digits, the tensors' bytes back to
back from offset 0, no basis entry of -32768."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from kvtool.codecs.pca import calibration as calmod
from kvtool.codecs.pca import native
from kvtool.codecs.pca import reference as ref
from kvtool.codecs.pca import reference2 as ref2
from kvtool.errors import DecodeError

SPEC = Path(__file__).resolve().parents[1] / "format-spec"
VECTORS = SPEC / "vectors" / "pca"
_spec = importlib.util.spec_from_file_location("make_pca_vectors", VECTORS / "make_pca_vectors.py")
mv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mv)
HEADER = 24
ROW_ENTRY = 16


def vector(name: str, folder: Path = VECTORS) -> dict:
    meta = json.loads((folder / f"{name}.json").read_text())
    storage = mv.STORAGE[meta["dtype"]]
    digest = meta["params"]["calibration"]
    return dict(meta, raw=np.fromfile(folder / f"{name}.in.bin", storage).reshape(meta["shape"]),
                payload=(folder / f"{name}.payload.bin").read_bytes(),
                out=np.fromfile(folder / f"{name}.out.bin", storage).reshape(meta["shape"]),
                cal=calmod.from_bytes((VECTORS / f"{digest}.kvcal").read_bytes(), digest))


def decoders(version: int) -> list:
    found = [ref.decode_chunk if version == 1 else ref2.decode_chunk]
    if native.native_available():
        found.append(native.decode_chunk if version == 1 else native.decode_chunk_v2)
    return found


def decode_all(version: int, payload: bytes, v: dict) -> list[np.ndarray]:
    p = v["params"]
    return [decode(payload, tuple(v["shape"]), v["dtype"], v["cal"], p["step"], p["position"])
            for decode in decoders(version)]


def test_a_coded_component_of_zeros_decodes_to_the_same_values(monkeypatch):
    """6.1: a writer that codes a component of zeros (table 0, shift 0: Tc zero symbols) instead of
    marking it 0xFF makes another payload that every reader decodes to the same values."""
    v = vector("walk_bf16")
    p = v["params"]
    choose = ref.choose
    revived = []

    def choose_and_code_a_dead_component(m):
        side = choose(m)
        dead = np.argwhere(side == ref.ALL_ZERO)
        assert len(dead), "walk_bf16 has a component of zeros"
        side[tuple(dead[0])] = 0  # table 0, shift 0
        revived.append(tuple(dead[0]))
        return side

    monkeypatch.setattr(ref, "choose", choose_and_code_a_dead_component)
    payload = ref.encode_chunk(v["raw"], v["dtype"], v["cal"], p["step"], p["sinks"], p["position"], p["lanes"])
    assert revived and payload != v["payload"]
    for out in decode_all(1, payload, v):
        assert out.tobytes() == v["out"].tobytes()


def side_bytes_v1(payload: bytes, rows: int, channels: int, sink_bytes: int) -> int:
    """The offset of row 0's side bytes in a version-1 payload (4)."""
    return HEADER + ROW_ENTRY * rows + sink_bytes + (-sink_bytes) % 4


def test_with_no_coded_token_version_1_ignores_the_side_bytes_and_version_2_refuses_them():
    v1, v2 = vector("bf16_sinks_only"), vector("bf16_sinks_only", VECTORS / "v2")
    _, L, T, C = v1["shape"]
    assert struct.unpack_from("<I", v1["payload"], 20)[0] == T  # every token a sink: Tc = 0
    at = side_bytes_v1(v1["payload"], 2 * L, C, 2 * L * T * C * 2)
    assert v1["payload"][at:at + C] == b"\xff" * C  # as a writer MUST write them
    changed = bytearray(v1["payload"])
    changed[at] = 0
    for out in decode_all(1, bytes(changed), v1):
        assert out.tobytes() == v1["out"].tobytes()
    changed = bytearray(v2["payload"])
    assert changed[HEADER:HEADER + 2 * L * C] == b"\xff" * (2 * L * C)
    changed[HEADER] = 0
    for decode in decoders(2):
        with pytest.raises(DecodeError, match="without coded tokens has a coded component"):
            decode(bytes(changed), tuple(v2["shape"]), v2["dtype"], v2["cal"], v2["params"]["step"],
                   v2["params"]["position"])


def test_tables_16_and_17_are_one_table():
    tables = json.loads((SPEC / "pca_tables.json").read_text())
    assert tables["freq"][16] == tables["freq"][17] and tables["cost_q8"][16] == tables["cost_q8"][17]
    others = [row for i, row in enumerate(tables["freq"]) if i != 17]
    assert len({tuple(row) for row in others}) == 31  # no other two alike


@pytest.mark.parametrize("name", sorted(p.name[:-len(".json")] for p in (VECTORS / "v2").glob("*.json")))
def test_a_version_2_payload_is_as_long_as_11_2_says(name):
    v = vector(name, VECTORS / "v2")
    _, L, T, C = v["shape"]
    S = struct.unpack_from("<I", v["payload"], 20)[0]
    itemsize = 4 if v["dtype"] == "float32" else 2
    regions = v["regions"]
    align4 = lambda n: n + (-n) % 4  # noqa: E731
    assert len(v["payload"]) == (HEADER + align4(2 * L * C) + align4(2 * L * S * C * itemsize)
                                 + 2 * len(regions) + sum(regions))
    assert len(regions) == -(-len(v["units"]) // 2)


# --------------------------------------------------------------------------- section 3's object layout
def _rewritten(data: bytes, edit) -> bytes:
    """The calibration object `data` with its safetensors header edited by `edit(header)` (in place),
    written back compact and padded with spaces to a multiple of 8, the data unchanged."""
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def _one_object() -> bytes:
    return next(VECTORS.glob("*.kvcal")).read_bytes()


def test_the_rewriting_itself_keeps_an_object_readable():
    data = _one_object()
    same = _rewritten(data, lambda h: None)
    assert calmod.from_bytes(same).head_dim == calmod.from_bytes(data).head_dim


@pytest.mark.parametrize("head_dim", ["+{}", "0{}", "{} ", "{}.0", "{}_0", "1" * 5000])
def test_a_head_dim_other_than_plain_decimal_digits_is_refused(head_dim):
    data = _one_object()
    d = calmod.from_bytes(data).head_dim
    bad = _rewritten(data, lambda h: h["__metadata__"].update(head_dim=head_dim.format(d)))
    with pytest.raises(DecodeError, match="head_dim"):
        calmod.from_bytes(bad)


@pytest.mark.parametrize("how", ["gap", "overlap", "short"])
def test_tensor_bytes_that_leave_a_gap_overlap_or_miss_their_size_are_refused(how):
    """§3: the tensors' byte ranges follow each other from offset 0 to the file's end, each its
    element count times its dtype's size."""
    data = _one_object()

    def edit(h):
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        first, second = h[names[0]], h[names[1]]
        if how == "gap":  # the second tensor starts 4 bytes later (and ends 4 later: the last one then runs out)
            second["data_offsets"] = [second["data_offsets"][0] + 4, second["data_offsets"][1] + 4]
        elif how == "overlap":
            second["data_offsets"] = [second["data_offsets"][0] - 4, second["data_offsets"][1] - 4]
        else:
            first["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][1] - 4]

    with pytest.raises(DecodeError, match="not a calibration object"):
        calmod.from_bytes(_rewritten(data, edit))


def test_a_basis_entry_of_minus_32768_is_refused():
    cal = calmod.from_bytes(_one_object())
    basis = cal.basis.copy()
    basis[0, 0, 0, 0] = -32768
    object.__setattr__(cal, "basis", basis)  # (frozen: the bytes a careless writer would make)
    with pytest.raises(DecodeError, match="-32768"):
        calmod.from_bytes(cal.to_bytes())


@pytest.mark.parametrize("tensor, value", [("weight", 2.0 ** -97), ("mean", 2.0 ** 101), ("mean", -(2.0 ** 101))])
def test_a_weight_or_mean_that_could_overflow_the_inverse_is_refused(tensor, value):
    """§3: weights at least 2^-96 and means within 2^100, so section 5.2 never makes an infinity
    (and then a NaN) in float32; the bounds themselves are accepted."""
    cal = calmod.from_bytes(_one_object())
    for v, ok in ((value, False), (2.0 ** -96 if tensor == "weight" else np.sign(value) * 2.0 ** 100, True)):
        array = getattr(cal, tensor).copy()
        array[1, 0, 0] = v
        object.__setattr__(cal, tensor, array)
        if ok:
            assert calmod.from_bytes(cal.to_bytes()).digest
        else:
            with pytest.raises(DecodeError, match="2\\^-96|2\\^100"):
                calmod.from_bytes(cal.to_bytes())
