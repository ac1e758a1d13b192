"""Hostile codec parameters (issue 46, findings 2 and 6): a chunk's `codec_params` edited with the
manifest's CRC-32C recomputed, so the edit reaches the parser and the decoders.

- every field of every codec's parameters is checked for its type and range where they are parsed:
  `"quality": []` in a pca chunk was a `TypeError: unhashable type: 'list'` in inspect, verify,
  dump and `kvtool.open`; now one line, exit 2, `CodecParamsInvalid`;
- pca's `position` must be the chunk's first token's position (the container gives it), and the
  payload header's lanes `N` and sink tokens `S` must be what `lanes`, `sinks` and `position` say
  (format-spec/pca.md §2, §7): an edited `position` changed the decoded KV and `verify` said OK;
- `step` is in the parameters only (pca version 1 carries it nowhere else): an edit of it within
  its range cannot be seen, shown below as the one case that still gets through.

pca's calibration here is the test vectors' (format-spec/vectors/pca: 2 layers, one KV head of 8),
found through KVTOOL_CALIBRATION_PATH: nothing is learned."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvtool
from fixtures import cli, make_identity, rebuild, write_kv_file
from kvtool.codecs import get_codec
from kvtool.codecs.pca import calibration as calmod
from kvtool.errors import CodecParamsInvalid, DecodeError, KvtoolError
from kvtool.format import ContainerReader
from kvtool.format.reader import BytesSource

VECTORS = Path(__file__).resolve().parents[1] / "format-spec" / "vectors" / "pca"
CALIBRATION = json.loads((VECTORS / "bf16_sinks.json").read_text())["params"]["calibration"]  # L = 2, C = 8
IDENTITY = make_identity(num_layers=2, num_kv_heads=1, head_dim=8)
PCA = {"version": 1, "calibration": CALIBRATION, "quality": "97", "step": 0.8, "sinks": 4, "lanes": 16}
CODECS = {  # each codec's parameters as a writer records them
    "raw": {"version": 1},
    "zstd": {"version": 1, "level": 3, "shuffle": "byteplane"},
    "cachegen": {"version": 1, "bins": "default", "prob_bits": 14, "lanes": 4},
    "pca": PCA,
}


@pytest.fixture(autouse=True)
def vectors_calibration(monkeypatch):
    monkeypatch.setenv("KVTOOL_CALIBRATION_PATH", str(VECTORS))
    calmod._loaded.clear()
    yield
    calmod._loaded.clear()


def kv_file(path: Path, codec: str = "pca", per_chunk=None):
    return write_kv_file(path, identity=IDENTITY, num_tokens=12, chunk_size=4, codec=codec,
                         params=dict(CODECS[codec]), codecs_per_chunk=per_chunk)


def edited(tmp_path: Path, source: Path, chunk: int, key: str, value, name: str = "edited.kvc") -> Path:
    """`source` with chunk `chunk`'s codec_params[key] set to `value` (the manifest CRC recomputed)."""
    def edit(doc):
        doc["chunks"][chunk]["codec_params"][key] = value

    out = tmp_path / name
    out.write_bytes(rebuild(source, edit))
    return out


def one_line_refusal(capsys, tmp_path, path: Path, code: int, *words: str) -> str:
    """inspect, verify and dump each refuse `path` with exit `code` and one error line holding
    `words`; the error line is returned."""
    lines = []
    for argv in (["inspect", path], ["verify", path], ["dump", path, "-o", tmp_path / "out.npy"]):
        rc, out, err = cli(capsys, *argv)
        assert rc == code, (argv, rc, out, err)
        assert "Traceback" not in out + err
        assert err.count("\n") == 1 and err.startswith("kvtool: error:"), (argv, err)
        assert all(w in err for w in words), (argv, err)
        lines.append(err.strip())
    return lines[0]


def read_all(path: Path) -> None:
    """kvtool.open, then every chunk decoded (numpy)."""
    with kvtool.open(path) as reader:
        for c in reader.chunks:
            reader.read_chunk_array(c.index)


# --------------------------------------------------------------------------- finding 2
def test_quality_as_a_list_is_one_line_not_a_type_error(tmp_path, capsys):
    bad = edited(tmp_path, kv_file(tmp_path / "p.kvc").path, 1, "quality", [])
    line = one_line_refusal(capsys, tmp_path, bad, 2, "quality [] is not one of")
    assert line.endswith("pca: quality [] is not one of 99, 97, 95, 89")
    with pytest.raises(CodecParamsInvalid, match="quality"):
        read_all(bad)


@pytest.mark.parametrize("key, value", [
    ("quality", {}), ("quality", None), ("quality", 97), ("calibration", []), ("step", []), ("step", "0.8"),
    ("step", None), ("sinks", {}), ("lanes", 1.0), ("position", "4"), ("version", []), ("version", None),
])
def test_every_pca_field_of_the_wrong_type_is_refused_where_it_is_parsed(tmp_path, capsys, key, value):
    bad = edited(tmp_path, kv_file(tmp_path / "p.kvc").path, 1, key, value)
    one_line_refusal(capsys, tmp_path, bad, 2, "pca:")
    with pytest.raises(CodecParamsInvalid):
        read_all(bad)


def test_a_long_hostile_quality_is_shown_cut_short_and_escaped(tmp_path, capsys):
    bad = edited(tmp_path, kv_file(tmp_path / "p.kvc").path, 0, "quality", "\x1b[2J" + "9" * 5000)
    line = one_line_refusal(capsys, tmp_path, bad, 2, "quality")
    assert "\x1b" not in line and len(line) < 300


def test_a_value_of_any_size_is_shown_in_one_short_line():
    """An int past 4,300 digits has no repr (Python refuses to make one): from the Python API, a
    pca quality or bitstream of 5,000 digits was Python's own ValueError, not the refusal."""
    from kvtool.codecs.pca import PcaCodec, bitstream_version
    from kvtool.errors import shown

    assert shown(10 ** 5000) == "(an integer of 16610 bits)" and shown("x" * 100) == repr("x" * 100)[:40] + "..."
    params = {"version": 1, "calibration": "ab" * 32, "quality": 10 ** 5000, "step": 0.8}
    with pytest.raises(CodecParamsInvalid, match=r"^pca: quality \(an integer of 16610 bits\) is not one of"):
        PcaCodec().validate_params(params)
    for bad in (10 ** 5000, True, 2.0, "02", 3):
        with pytest.raises(CodecParamsInvalid, match="^pca: the bitstream version is 1 or 2$"):
            bitstream_version(bad)
    assert [bitstream_version(v) for v in (None, 1, 2, "1", "2")] == [1, 1, 2, 1, 2]


# --------------------------------------------------------------------------- finding 6
@pytest.mark.parametrize("chunk, position", [(1, 100), (1, 0), (0, 1), (2, 4)])
def test_an_edited_position_is_refused(tmp_path, capsys, chunk, position):
    """Before: the keys decoded at other angles and verify said OK."""
    bad = edited(tmp_path, kv_file(tmp_path / "p.kvc").path, chunk, "position", position)
    line = one_line_refusal(capsys, tmp_path, bad, 2, "'position'")
    assert line.endswith(f"pca: 'position' is {position}, but the chunk's first token is at position {4 * chunk}")
    with pytest.raises(CodecParamsInvalid, match="position"):
        read_all(bad)


@pytest.mark.parametrize("chunk, key, value", [
    (1, "lanes", 8),  # the payload's header says 16
    (0, "sinks", 0),  # chunk 0's header holds 4 sink tokens
    (0, "sinks", 2),
    (1, "sinks", 6),  # from position 4, sinks 6 make 2 sink tokens; the header holds 0
])
def test_lanes_and_sinks_that_disagree_with_the_payload_header_are_refused(tmp_path, capsys, chunk, key, value):
    bad = edited(tmp_path, kv_file(tmp_path / "p.kvc").path, chunk, key, value)
    for argv in (["inspect", "--stats", bad], ["verify", bad], ["dump", bad, "-o", tmp_path / "out.npy"]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 1 and "Traceback" not in out + err, (argv, rc, err)
        assert err.count("\n") == 1 and "pca: the payload's header holds" in err, (argv, err)
    with pytest.raises(DecodeError, match="payload's header"):
        read_all(bad)


def test_the_same_fields_unedited_decode_as_written(tmp_path, capsys):
    f = kv_file(tmp_path / "p.kvc")
    for argv in (["inspect", "--stats", f.path], ["verify", f.path]):
        assert cli(capsys, *argv)[0] == 0
    with kvtool.open(f.path) as reader:
        assert [c.codec_params["position"] for c in reader.chunks] == [0, 4, 8]


@pytest.mark.xfail(strict=True, reason="pca version 1 records `step` in codec_params only (pca.md §2): an "
                                       "edit within [2^-10, 2^10] decodes to other values that no check can see")
def test_an_edited_step_is_seen(tmp_path, capsys):
    bad = edited(tmp_path, kv_file(tmp_path / "p.kvc").path, 1, "step", 0.5)
    assert cli(capsys, "verify", bad)[0] != 0


def test_a_store_objects_position_is_its_store_start(tmp_path):
    """A chunk object holds one chunk from `store.start` (store.md §4): its pca position is that,
    not 0; an edited one is refused there too."""
    from kvtool.store.objects import encode_chunk

    f = kv_file(tmp_path / "p.kvc")
    with kvtool.open(f.path) as reader:
        payload, params = reader.chunk_payload(1), reader.chunks[1].codec_params
        expected = reader.read_chunk_array(1)
        reader_model = reader.model
    assert params["position"] == 4
    data = encode_chunk(reader_model, "bfloat16", b"\x11" * 32, 4, f.token_ids[4:8], payload=payload,
                        codec="pca", params=params)
    with ContainerReader(BytesSource(data, "object")) as obj:
        assert np.array_equal(obj.read_chunk_array(0), expected)
    moved = rebuild(data, lambda doc: doc["store"].__setitem__("start", 8))
    with pytest.raises(CodecParamsInvalid, match="'position' is 4, but the chunk's first token is at position 8"):
        ContainerReader(BytesSource(moved, "object"))


# --------------------------------------------------------------------------- every codec, a fixed table
EDGE_VALUES = [[], {}, None, -1, 0, 2 ** 63, 10 ** 39, 1.5, 1e308, "NaN", "nan", True, "", "default",
               "\x1b[2J" * 10, [1, 2]]


def _cases():
    for codec, params in CODECS.items():
        for key in [*params, "colour"]:
            for value in EDGE_VALUES:
                yield codec, key, value


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    calmod._loaded.clear()
    mp = pytest.MonkeyPatch()
    mp.setenv("KVTOOL_CALIBRATION_PATH", str(VECTORS))
    folder = tmp_path_factory.mktemp("codec-params")
    try:
        return {codec: kv_file(folder / f"{codec}.kvc", codec).path for codec in CODECS}
    finally:
        mp.undo()


@pytest.mark.parametrize("codec", list(CODECS))
def test_every_edge_value_of_every_codecs_parameters_is_a_kvtool_answer(seeds, tmp_path, capsys, codec):
    """Each key (and an unknown one) of each codec's parameters set to each value of a fixed table:
    parameters the codec refuses are one line and exit 2 in inspect, verify and dump, and
    CodecParamsInvalid from kvtool.open; parameters it accepts are read to the end, each command
    exiting 0 or with one error line. Never another exception."""
    checked = 0
    for _, key, value in (c for c in _cases() if c[0] == codec):
        params = dict(CODECS[codec], **{key: value})
        try:
            get_codec(codec).validate_params(dict(params))
            accepted = True
        except CodecParamsInvalid:
            accepted = False
        path = edited(tmp_path, seeds[codec], 1, key, value)
        for argv in (["inspect", "--stats", path], ["verify", path], ["dump", path, "-o", tmp_path / "out.npy"]):
            rc, out, err = cli(capsys, *argv)
            assert "Traceback" not in out + err, (codec, key, value, argv, err[-2000:])
            one_line = err.count("\n") == 1 and err.startswith("kvtool: error:")
            assert rc == 0 or one_line, (codec, key, value, argv, err)
            assert accepted or rc == 2, (codec, key, value, argv, rc, err)
        try:
            read_all(path)
        except KvtoolError as exc:
            assert accepted or isinstance(exc, CodecParamsInvalid), (codec, key, value, exc)
        checked += 1
    assert checked == (len(CODECS[codec]) + 1) * len(EDGE_VALUES)


def test_a_file_mixing_every_codec_reads_and_refuses_as_each_codec_does(tmp_path, capsys):
    """A valid file whose chunks are raw, zstd, cachegen and pca (what `store get` gives after a
    prefix was stored in several codecs), then each chunk's parameters swapped for another codec's."""
    per_chunk = [(c, dict(p)) for c, p in CODECS.items()]
    f = write_kv_file(tmp_path / "mixed.kvc", identity=IDENTITY, num_tokens=16, chunk_size=4,
                      codecs_per_chunk=per_chunk)
    # (inspect of pca and cachegen chunks together, KeyError 'bpv_sinks' in cli/inspect.py's totals, is
    # finding 2's other half, fixed with the CLI's rendering)
    for argv in (["verify", f.path], ["dump", f.path, "-o", tmp_path / "out.npy"]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 0 and "Traceback" not in out + err, (argv, err)
    read_all(f.path)
    for i, (codec, _) in enumerate(per_chunk):
        other = per_chunk[(i + 1) % len(per_chunk)][1]

        def swap(doc, i=i, other=other):
            doc["chunks"][i]["codec_params"] = dict(other, position=4 * i) if "calibration" in other else dict(other)

        bad = tmp_path / f"swapped{i}.kvc"
        bad.write_bytes(rebuild(f.path, swap))
        for argv in (["verify", bad], ["dump", bad, "-o", tmp_path / "out.npy"]):
            rc, out, err = cli(capsys, *argv)
            assert rc in (1, 2) and err.count("\n") == 1 and "Traceback" not in out + err, (codec, argv, err)
        with pytest.raises(KvtoolError):
            read_all(bad)
