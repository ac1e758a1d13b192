"""Hostile and damaged files, one hand-written case at a time: one test per error class.

Every crafted file starts from a valid one and changes one thing; `rebuild` (tests/fixtures.py)
recomputes the manifest CRC-32C and the trailer so each case reaches exactly the check it names.
The contract under test (format-spec/container.md §5): opening and reading a damaged file either
succeeds with the original data or raises a `KvtoolError` — never another exception, never a
hang, never an allocation beyond what the file justifies. Exhaustive and fuzzed damage (every
truncation, every flipped byte, random mutations) lives in test_fuzz_container.py.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool.dtypes import dtype_from_name
import zstandard

from kvtool import codecs
from kvtool.cli.app import run
from kvtool.codecs.base import Codec
from kvtool.errors import (
    BadHeader,
    BadTrailer,
    BlobOutOfBounds,
    BlobOverlap,
    ChecksumMismatch,
    CodecParamsInvalid,
    DecodeError,
    DuplicateField,
    InputFileError,
    KvtoolError,
    ManifestCorrupt,
    ManifestInvalid,
    ManifestTooLarge,
    MissingField,
    NotAKvtoolFile,
    ShapeMismatch,
    TruncatedFile,
    UnknownCodec,
    UnsupportedDtype,
    UnsupportedVersion,
)
from kvtool.format import ContainerReader

from fixtures import (
    MAGIC,
    TRAILER_FMT,
    TRAILER_SIZE,
    blob_bytes,
    chunk_entry,
    flip_byte,
    make_identity,
    mutated,
    pack_header,
    patch_blob,
    put,
    read_everything,
    rebuild,
    ref_prefix_hashes,
    same_tensor,
    split_file,
    time_limit,
    write_kv_file,
)

# --- the valid starting points (fast_dir, raw_file, zstd_file: tests/conftest.py) -------------


@pytest.fixture
def base(raw_file):
    return raw_file.path.read_bytes()


def expect(tmp_path, data: bytes, cls: type[KvtoolError]) -> KvtoolError:
    """Opening and reading everything raises exactly `cls`, with a one-line message."""
    path = put(tmp_path, data)
    with time_limit(10):
        # Any KvtoolError on purpose: the exact-type assert below then names the class that came
        # instead of `cls`, and also refuses a subclass (MissingField where ManifestInvalid is meant).
        with pytest.raises(KvtoolError) as info:
            read_everything(path)
    err = info.value
    assert type(err) is cls, f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    message = str(err)
    assert message and "\n" not in message
    return err


def test_rebuild_without_changes_is_the_identity(raw_file, zstd_file):
    for f in (raw_file, zstd_file):
        assert rebuild(f.path) == f.path.read_bytes()


# --- input paths -------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(InputFileError):
        ContainerReader(tmp_path / "nope.kvc")


def test_directory(tmp_path):
    with pytest.raises(InputFileError):
        ContainerReader(tmp_path)


# --- header ------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [
    b"hello, world\n" * 20,
    b"\x89PNG\r\n\x1a\n" + bytes(200),
    b"PK\x03\x04" + bytes(200),
    b"abcdefg",  # shorter than the magic and not a prefix of it
    MAGIC.replace(b"\r\n", b"\n") + bytes(200),  # a text-mode transfer ate the CR
], ids=["text", "png", "zip", "short", "text-mode"])
def test_not_a_kvtool_file(tmp_path, data):
    expect(tmp_path, data, NotAKvtoolFile)


def test_not_a_kvtool_file_safetensors(tmp_path):
    from safetensors.torch import save

    expect(tmp_path, save({"x": torch.zeros(3)}), NotAKvtoolFile)


def test_magic_off_by_one_byte(tmp_path, base):
    for i in range(8):
        data = bytearray(base)
        data[i] ^= 0x20
        expect(tmp_path, bytes(data), NotAKvtoolFile)


@pytest.mark.parametrize("major", [0, 2, 0xFFFF])
def test_unsupported_version(tmp_path, raw_file, major):
    err = expect(tmp_path, rebuild(raw_file.path, header=pack_header(major=major)), UnsupportedVersion)
    assert f"{major}.0" in str(err)


def test_newer_minor_version_is_read(tmp_path, raw_file):
    """Spec §9: a major-1 reader reads any 1.x file."""
    path = put(tmp_path, rebuild(raw_file.path, header=pack_header(minor=7)))
    with ContainerReader(path) as r:
        assert r.version == "1.7"
        assert same_tensor(r.read_range(0, 5), raw_file.kv)


@pytest.mark.parametrize("header", [
    pack_header(header_size=63),
    pack_header(header_size=128),
    pack_header(alignment=0),
    pack_header(alignment=32),  # power of two below the minimum
    pack_header(alignment=96),  # not a power of two
    pack_header(alignment=1 << 21),  # above the maximum
    pack_header(flags=1),
    pack_header(flags=0x80000000),
    pack_header(reserved=b"\x01" + bytes(39)),
    pack_header(reserved=bytes(39) + b"\xff"),
], ids=["size63", "size128", "align0", "align32", "align96", "align2M", "flag1", "flag31",
        "reserved0", "reserved39"])
def test_bad_header(tmp_path, raw_file, header):
    expect(tmp_path, rebuild(raw_file.path, header=header), BadHeader)


# --- trailer and truncation ----------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["empty", "magic-prefix", "header-only", "header+31", "last-byte",
                                 "no-trailer"])
def test_truncated_file(tmp_path, base, cut):
    data = {"empty": b"", "magic-prefix": base[:5], "header-only": base[:64],
            "header+31": base[:95], "last-byte": base[:-1], "no-trailer": base[:-TRAILER_SIZE],
            }[cut]
    expect(tmp_path, data, TruncatedFile)


def test_appended_bytes_hide_the_trailer(tmp_path, base):
    expect(tmp_path, base + b"\0", TruncatedFile)


def _with_trailer(base: bytes, **fields) -> bytes:
    offset, length, crc, reserved, end = struct.unpack(TRAILER_FMT, base[-TRAILER_SIZE:])
    values = {"offset": offset, "length": length, "crc": crc, "reserved": reserved, "end": end}
    values.update(fields)
    return base[:-TRAILER_SIZE] + struct.pack(TRAILER_FMT, values["offset"], values["length"],
                                              values["crc"], values["reserved"], values["end"])


def test_bad_trailer_reserved(tmp_path, raw_file):
    expect(tmp_path, rebuild(raw_file.path, reserved=1), BadTrailer)


def test_bad_trailer_ranges(tmp_path, base):
    offset, length = struct.unpack(TRAILER_FMT, base[-TRAILER_SIZE:])[:2]
    # the manifest range must end where the trailer begins
    expect(tmp_path, _with_trailer(base, length=length - 1), BadTrailer)
    expect(tmp_path, _with_trailer(base, length=length + 1), BadTrailer)
    expect(tmp_path, _with_trailer(base, offset=offset + 8), BadTrailer)
    # the offset must be a multiple of 8 (length adjusted so the range still ends at the trailer)
    expect(tmp_path, _with_trailer(base, offset=offset - 1, length=length + 1), BadTrailer)
    # and not inside the header
    body = len(base) - TRAILER_SIZE
    expect(tmp_path, _with_trailer(base, offset=56, length=body - 56), BadTrailer)
    expect(tmp_path, _with_trailer(base, offset=0, length=body), BadTrailer)
    # bytes between the manifest and the trailer
    inserted = base[:-TRAILER_SIZE] + b"\0" * 8 + base[-TRAILER_SIZE:]
    expect(tmp_path, inserted, BadTrailer)
    # a u64 so large that offset + length wraps in 64-bit arithmetic
    expect(tmp_path, _with_trailer(base, offset=2**64 - 8, length=len(base) - TRAILER_SIZE + 8),
           BadTrailer)


@pytest.mark.parametrize("length", [(64 << 20) + 1, 2**63, 2**64 - 1])
def test_manifest_too_large(tmp_path, base, length):
    expect(tmp_path, _with_trailer(base, length=length), ManifestTooLarge)


# --- manifest bytes --------------------------------------------------------------------------------


def _raw(raw_file) -> bytes:
    return split_file(raw_file.path).manifest_raw


def test_manifest_crc_mismatch(tmp_path, raw_file, base):
    crc = struct.unpack(TRAILER_FMT, base[-TRAILER_SIZE:])[2]
    expect(tmp_path, rebuild(raw_file.path, crc=crc ^ 1), ManifestCorrupt)
    # one flipped manifest byte with the old CRC
    data = bytearray(base)
    data[split_file(base).manifest_offset + 10] ^= 0x01
    expect(tmp_path, bytes(data), ManifestCorrupt)


@pytest.mark.parametrize("case", ["not-utf8", "overlong-utf8", "not-json", "truncated-json",
                                  "trailing-garbage", "empty", "bom", "nan", "infinity",
                                  "minus-infinity", "nan-in-list", "deep-array", "deep-object"])
def test_manifest_corrupt(tmp_path, raw_file, case):
    raw = _raw(raw_file)
    eps = b'"rms_norm_eps":1e-05'
    assert eps in raw
    new = {
        "not-utf8": raw.replace(b'"synthetic-tiny"', b'"synthetic-\xff\xfe"'),
        "overlong-utf8": raw.replace(b'"synthetic-tiny"', b'"synthetic-\xc0\xaf"'),
        "not-json": b"model: synthetic\n",
        "truncated-json": raw[:-1],
        "trailing-garbage": raw + b"x",
        "empty": b"",
        "bom": b"\xef\xbb\xbf" + raw,
        "nan": raw.replace(eps, b'"rms_norm_eps":NaN'),
        "infinity": raw.replace(eps, b'"rms_norm_eps":Infinity'),
        "minus-infinity": raw.replace(eps, b'"rms_norm_eps":-Infinity'),
        "nan-in-list": raw.replace(eps, b'"rms_norm_eps":[1,NaN]'),
        "deep-array": raw.replace(eps, b'"rms_norm_eps":' + b"[" * 100_000 + b"]" * 100_000),
        "deep-object": raw.replace(eps, b'"rms_norm_eps":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    }[case]
    assert new != raw
    expect(tmp_path, rebuild(raw_file.path, manifest_raw=new), ManifestCorrupt)


def test_manifest_huge_integer_literal(tmp_path, raw_file):
    raw = _raw(raw_file).replace(b'"vocab_size":1000', b'"vocab_size":' + b"9" * 5000)
    expect(tmp_path, rebuild(raw_file.path, manifest_raw=raw), ManifestCorrupt)


def test_manifest_overflowing_float_literal(tmp_path, raw_file):
    raw = _raw(raw_file).replace(b'"rms_norm_eps":1e-05', b'"rms_norm_eps":1e999')
    expect(tmp_path, rebuild(raw_file.path, manifest_raw=raw), ManifestCorrupt)


def test_manifest_lone_surrogate(tmp_path, raw_file, capsys):
    raw = _raw(raw_file).replace(b'"LlamaForCausalLM"', b'"Llama\\ud800"')
    expect(tmp_path, rebuild(raw_file.path, manifest_raw=raw), ManifestCorrupt)
    code = run(["verify", str(tmp_path / "bad.kvc"), "--json"])  # and the CLI says so in one line
    assert code == 2 and capsys.readouterr().err.count("\n") == 1


# --- manifest schema -------------------------------------------------------------------------------


def _set(path: str, value):
    def mutate(doc):
        *parents, last = path.split(".")
        obj = doc
        for key in parents:
            obj = obj[int(key)] if isinstance(obj, list) else obj[key]
        if isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value
    return mutate


INVALID = {
    "model-not-object": _set("model", []),
    "num_layers-string": _set("model.num_layers", "2"),
    "num_layers-bool": _set("model.num_layers", True),
    "num_layers-float": _set("model.num_layers", 2.0),
    "num_layers-0": _set("model.num_layers", 0),
    "num_layers-1025": _set("model.num_layers", 1025),
    "num_kv_heads-0": _set("model.num_kv_heads", 0),
    "num_kv_heads-1025": _set("model.num_kv_heads", 1025),
    "head_dim-4097": _set("model.head_dim", 4097),
    "name-not-string": _set("model.name", 5),
    "rope-not-object": _set("model.rope", 10000.0),
    "fingerprint-format": _set("model.fingerprint", "sha256:XYZ"),
    "fingerprint-upper": lambda d: d["model"].update(fingerprint=d["model"]["fingerprint"].upper()),
    "fingerprint-md5": _set("model.fingerprint", "md5:" + "0" * 32),
    "kv-not-object": _set("kv", "bfloat16"),
    "kv-layout": _set("kv.layout", "paged"),
    "num_tokens-0": _set("sequence.num_tokens", 0),
    "num_tokens-over-limit": _set("sequence.num_tokens", 2**24 + 1),
    "num_tokens-mismatch": _set("sequence.num_tokens", 4),
    "chunk_size-0": _set("sequence.chunk_size", 0),
    "chunk_size-65537": _set("sequence.chunk_size", 65537),
    "chunk_size-changed": _set("sequence.chunk_size", 3),
    "tokens-length": _set("sequence.tokens.length", 16),
    "tokens-offset-negative": _set("sequence.tokens.offset", -64),
    "tokens-offset-2^63": _set("sequence.tokens.offset", 2**63),
    "tokens-crc-2^32": _set("sequence.tokens.crc32", 2**32),
    "tokens-crc-negative": _set("sequence.tokens.crc32", -1),
    "chunks-not-list": _set("chunks", {}),
    "chunks-missing-one": lambda d: d["chunks"].pop(),
    "chunks-one-extra": lambda d: d["chunks"].append(dict(d["chunks"][-1])),
    "chunks-empty": _set("chunks", []),
    "chunks-reordered": lambda d: d["chunks"].reverse(),
    "chunk-not-object": _set("chunks.1", [1, 2]),
    "chunk-start": _set("chunks.1.start", 3),
    "chunk-end": _set("chunks.1.end", 5),
    "prefix-hash-upper": lambda d: d["chunks"][0].update(prefix_hash=d["chunks"][0]["prefix_hash"].upper()),
    "prefix-hash-short": lambda d: d["chunks"][0].update(prefix_hash=d["chunks"][0]["prefix_hash"][:63]),
    "prefix-hash-int": _set("chunks.0.prefix_hash", 12),
    "codec-name-id-disagree": _set("chunks.0.codec", "zstd"),
    "codec_id-negative": _set("chunks.0.codec_id", -1),
    "codec_id-string": _set("chunks.0.codec_id", "0"),
    "codec_params-not-object": _set("chunks.0.codec_params", [1]),
    "shape-channels": _set("chunks.0.shape", [2, 2, 2, 15]),
    "shape-tokens": _set("chunks.2.shape", [2, 2, 2, 16]),
    "shape-rank": _set("chunks.0.shape", [2, 2, 2, 2, 8]),
    "shape-empty": _set("chunks.0.shape", []),
    "shape-9-dims": _set("chunks.0.shape", [1] * 9),
    "shape-bool": _set("chunks.0.shape", [2, 2, True, 16]),
    "shape-negative": _set("chunks.0.shape", [2, 2, -2, 16]),
    "shape-not-list": _set("chunks.0.shape", "2,2,2,16"),
    "chunk-dtype-differs": _set("chunks.0.dtype", "float16"),
    "extras-not-object": _set("extras", []),
    "extra-unknown": lambda d: d["extras"].update(attention=d["extras"].pop("roi_mask")),
    "extra-not-object": _set("extras.roi_mask", 1),
    "roi_mask-shape": _set("extras.roi_mask.shape", [4]),
    "roi_mask-dtype": _set("extras.roi_mask.dtype", "bfloat16"),
    "hidden_states-bool": _set("extras.hidden_states.dtype", "bool"),
    "hidden_states-rank": _set("extras.hidden_states.shape", [5 * 32]),
    "hidden_states-tokens": _set("extras.hidden_states.shape", [4, 40]),
    "hidden_size-string": _set("model.hidden_size", "32"),
    "hidden_size-zero": _set("model.hidden_size", 0),
    "hidden_states-width": lambda d: d["extras"]["hidden_states"].update(  # consistent length, wrong width
        shape=[5, 16], length=d["extras"]["hidden_states"]["length"] // 2),
    "hidden_states-length": _set("extras.hidden_states.length", 322),
    "metadata-not-object": _set("metadata", ["a"]),
    "metadata-not-string": _set("metadata.created_by", 1),
    "top-level-list": None,
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_manifest_invalid(tmp_path, raw_file, case):
    if case == "top-level-list":
        data = rebuild(raw_file.path, manifest_raw=b"[]")
    else:
        data = mutated(raw_file, INVALID[case])
    expect(tmp_path, data, ManifestInvalid)


def test_codec_name_unknown_but_id_known(tmp_path, raw_file):
    """Spec §3.4: name and id MUST agree; §5 maps an unknown name to UnknownCodec. kvtool reports the
    disagreement (ManifestInvalid) — either is a clean rejection."""
    path = put(tmp_path, mutated(raw_file, _set("chunks.0.codec", "lz4")))
    with pytest.raises((ManifestInvalid, UnknownCodec)):
        read_everything(path)


def _required_paths(doc) -> list[str]:
    paths = [f"model.{k}" for k in ("name", "architecture", "num_layers", "num_kv_heads", "head_dim",
                                    "rope", "fingerprint")]
    paths += ["model", "kv", "kv.dtype", "kv.layout", "sequence", "sequence.num_tokens",
              "sequence.chunk_size", "sequence.tokens", "chunks"]
    paths += [f"sequence.tokens.{k}" for k in ("offset", "length", "crc32")]
    paths += [f"chunks.1.{k}" for k in ("start", "end", "prefix_hash", "codec", "codec_id",
                                        "codec_params", "offset", "length", "crc32", "shape", "dtype")]
    paths += [f"extras.{name}.{k}" for name in ("hidden_states", "roi_mask")
              for k in ("offset", "length", "crc32", "shape", "dtype")]
    return paths


def _delete(path: str):
    def mutate(doc):
        *parents, last = path.split(".")
        obj = doc
        for key in parents:
            obj = obj[int(key)] if isinstance(obj, list) else obj[key]
        del obj[last]
    return mutate


@pytest.mark.parametrize("path", _required_paths(None))
def test_missing_field(tmp_path, raw_file, path):
    err = expect(tmp_path, mutated(raw_file, _delete(path)), MissingField)
    assert repr(path.split(".")[-1]) in str(err)


@pytest.mark.parametrize("path", ["extras", "metadata"])
def test_optional_sections(tmp_path, raw_file, path):
    f = put(tmp_path, mutated(raw_file, _delete(path)))
    got = read_everything(f)
    assert got["tokens"] == raw_file.token_ids
    assert same_tensor(torch.cat(got["chunks"], dim=2), raw_file.kv)


def test_unknown_keys_are_ignored_at_top_level(tmp_path, raw_file):
    """Spec §3: readers MUST ignore unknown top-level keys (minor versions may add them)."""
    def mutate(doc):
        doc["future_section"] = {"anything": [1, 2, 3]}
        doc["model"]["future_fact"] = "x"
    got = read_everything(put(tmp_path, mutated(raw_file, mutate)))
    assert same_tensor(torch.cat(got["chunks"], dim=2), raw_file.kv)


@pytest.mark.parametrize("where", ["top", "model", "chunk", "codec_params", "extra", "tokens"])
def test_duplicate_field(tmp_path, raw_file, where):
    raw = _raw(raw_file).decode()
    if where == "top":
        doc = json.loads(raw)
        new = raw[:-1] + ',"kv":' + json.dumps(doc["kv"], separators=(",", ":")) + "}"
    elif where == "model":
        new = raw.replace('"num_layers":2,', '"num_layers":2,"num_layers":2,', 1)
    elif where == "chunk":
        new = raw.replace('"start":2,', '"start":2,"start":2,', 1)
    elif where == "codec_params":
        new = raw.replace('"codec_params":{"version":1}', '"codec_params":{"version":1,"version":1}', 1)
    elif where == "extra":
        new = raw.replace('"dtype":"bool"', '"dtype":"bool","dtype":"bool"', 1)
    else:
        new = raw.replace('"tokens":{', '"tokens":{"crc32":0,', 1)
    assert new != raw
    expect(tmp_path, rebuild(raw_file.path, manifest_raw=new.encode()), DuplicateField)


# --- blob placement -----------------------------------------------------------------------------


def test_blob_out_of_bounds(tmp_path, raw_file):
    parts = split_file(raw_file.path)
    end = parts.manifest_offset
    past = (end + 63) // 64 * 64
    cases = [
        _set("chunks.0.offset", past),  # starts in the manifest
        _set("chunks.0.offset", past + 64 * 1000),  # beyond the file
        _set("chunks.0.offset", 0),  # in the header
        _set("chunks.2.length", 10**12),  # ends far beyond the file
        _set("chunks.2.offset", 2**63 - 64),
        _set("sequence.tokens.offset", past - 64 if past - 64 + 20 > end else past),  # into the manifest
        _set("extras.hidden_states.offset", past),
    ]
    for mutate in cases:
        expect(tmp_path, mutated(raw_file, mutate), BlobOutOfBounds)


def test_blob_overlap_and_alignment(tmp_path, raw_file):
    doc = split_file(raw_file.path).manifest
    c0 = doc["chunks"][0]["offset"]
    cases = [
        _set("chunks.1.offset", c0),  # same bytes as chunk 0
        _set("sequence.tokens.offset", doc["chunks"][1]["offset"]),  # tokens inside chunk 1
        _set("chunks.0.length", doc["chunks"][0]["length"] + 1),  # runs into chunk 1
        _set("extras.roi_mask.offset", doc["extras"]["hidden_states"]["offset"]),
        _set("chunks.0.offset", c0 + 1),  # misaligned
        _set("chunks.1.offset", doc["chunks"][1]["offset"] + 32),  # misaligned for 64
        _set("sequence.tokens.offset", doc["sequence"]["tokens"]["offset"] - 8),
    ]
    for mutate in cases:
        expect(tmp_path, mutated(raw_file, mutate), BlobOverlap)
    # blobs at odd multiples of 64 are misaligned once the header says 128
    expect(tmp_path, rebuild(raw_file.path, header=pack_header(alignment=128)), BlobOverlap)


def test_smaller_header_alignment_still_reads(tmp_path, fast_dir):
    """Blobs written at 4096 are also at multiples of 64: lowering the header alignment is harmless."""
    f = write_kv_file(fast_dir / "a4096.kvc", num_tokens=3, chunk_size=2, alignment=4096)
    got = read_everything(put(tmp_path, rebuild(f.path, header=pack_header(alignment=64))))
    assert same_tensor(torch.cat(got["chunks"], dim=2), f.kv)


def test_zero_length_blob_shares_no_byte(tmp_path, raw_file):
    doc = split_file(raw_file.path).manifest

    def mutate(d):  # model.hidden_size is optional; without it a zero-width extra is legal
        d["model"].pop("hidden_size")
        d["extras"]["hidden_states"].update(offset=doc["chunks"][0]["offset"], length=0, crc32=0,
                                            shape=[5, 0])
    got = read_everything(put(tmp_path, mutated(raw_file, mutate)))
    assert got["extras"]["hidden_states"].shape == (5, 0)


# --- codecs and dtypes ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_id", [4, 99, 2**31 - 1])
def test_unknown_codec(tmp_path, raw_file, codec_id):
    def mutate(d):
        d["chunks"][1].update(codec="future", codec_id=codec_id)
    expect(tmp_path, mutated(raw_file, mutate), UnknownCodec)


def test_unknown_codec_cachegen_when_not_built(tmp_path, raw_file):
    if "cachegen" in codecs.codec_names():
        pytest.skip("this build has the cachegen codec")

    def mutate(d):
        d["chunks"][1].update(codec="cachegen", codec_id=2)
    expect(tmp_path, mutated(raw_file, mutate), UnknownCodec)


@pytest.mark.parametrize("codec,params", [
    ("raw", {"version": 1, "level": 3}),
    ("raw", {"version": 2}),
    ("raw", {"version": 0}),
    ("raw", {}),
    ("raw", {"version": "1"}),
    ("raw", {"version": True}),
    ("raw", {"version": 1.0}),
    ("zstd", {"version": 1, "level": 23, "shuffle": "none"}),
    ("zstd", {"version": 1, "level": -8, "shuffle": "none"}),
    ("zstd", {"version": 1, "level": "3", "shuffle": "none"}),
    ("zstd", {"version": 1, "level": True, "shuffle": "none"}),
    ("zstd", {"version": 1, "level": 3, "shuffle": "bitplane"}),
    ("zstd", {"version": 1, "level": 3, "shuffle": None}),
    ("zstd", {"version": 2, "level": 3, "shuffle": "none"}),
    ("zstd", {"version": 1, "level": 3, "shuffle": "none", "dict": 1}),
])
def test_codec_params_invalid(tmp_path, raw_file, zstd_file, codec, params):
    f = raw_file if codec == "raw" else zstd_file
    expect(tmp_path, mutated(f, _set("chunks.0.codec_params", params)), CodecParamsInvalid)


def test_zstd_params_without_shuffle_are_rejected_not_guessed(tmp_path):
    f = write_kv_file(tmp_path / "z.kvc", num_tokens=6, chunk_size=3, codec="zstd",
                      params={"version": 1, "level": 1, "shuffle": "none"})

    def drop(doc):
        for c in doc["chunks"]:
            del c["codec_params"]["shuffle"]

    dropped = tmp_path / "drop.kvc"
    dropped.write_bytes(rebuild(f.path, drop))
    with pytest.raises(CodecParamsInvalid):
        ContainerReader(dropped)


@pytest.mark.parametrize("where,dtype", [
    ("kv", "float64"), ("kv", "bf16"), ("kv", "int8"), ("kv", "float8_e4m3fn"), ("kv", ""),
    ("hidden_states", "float64"), ("hidden_states", "int32"), ("roi_mask", "uint8"),
])
def test_unsupported_dtype(tmp_path, raw_file, where, dtype):
    def mutate(d):
        if where == "kv":
            d["kv"]["dtype"] = dtype
            for c in d["chunks"]:
                c["dtype"] = dtype
        else:
            d["extras"][where]["dtype"] = dtype
    expect(tmp_path, mutated(raw_file, mutate), UnsupportedDtype)


def test_kv_dtype_not_a_string(tmp_path, raw_file):
    expect(tmp_path, mutated(raw_file, _set("kv.dtype", 2)), ManifestInvalid)


def test_deep_nesting_foreign_chunk_dtype_and_huge_codec_id_get_the_spec_errors(tmp_path):
    """Nesting over 64 levels, a chunk dtype outside the KV dtypes, and a huge unknown codec id
    get the errors container.md section 5 names."""
    from kvtool.errors import ManifestCorrupt, UnknownCodec, UnsupportedDtype

    f = write_kv_file(tmp_path / "a.kvc", num_tokens=6, chunk_size=3)
    cases = [
        (lambda d: d["metadata"].__setitem__("x", "y") or d.__setitem__("deep", [[[[0]]]] * 1) or
         d.__setitem__("deeper", json.loads("[" * 70 + "]" * 70)), ManifestCorrupt),
        (lambda d: d["chunks"][0].__setitem__("dtype", "float64"), UnsupportedDtype),
        (lambda d: d["chunks"][0].__setitem__("codec_id", 2**40), UnknownCodec),
    ]
    for i, (mutate, error) in enumerate(cases):
        path = tmp_path / f"m{i}.kvc"
        path.write_bytes(rebuild(f.path, mutate))
        with pytest.raises(error):
            ContainerReader(path)


# --- data integrity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["chunk", "tokens", "hidden_states", "roi_mask"])
@pytest.mark.parametrize("which", ["raw", "zstd"])
def test_checksum_mismatch(tmp_path, raw_file, zstd_file, target, which):
    f = raw_file if which == "raw" else zstd_file
    base = f.path.read_bytes()
    doc = split_file(base).manifest
    ref = {"chunk": doc["chunks"][1], "tokens": doc["sequence"]["tokens"],
           "hidden_states": doc["extras"]["hidden_states"], "roi_mask": doc["extras"]["roi_mask"]}[target]
    path = put(tmp_path, flip_byte(base, ref["offset"] + ref["length"] // 2))
    with ContainerReader(path) as r:  # opening checks the manifest, not the blobs
        if target == "chunk":
            assert same_tensor(r.read_chunk(0), f.chunk(0))  # other chunks are fine
            with pytest.raises(ChecksumMismatch):
                r.read_chunk(1)
            with pytest.raises(ChecksumMismatch):
                r.read_range(1, 3)
            with pytest.raises(ChecksumMismatch):
                r.chunk_payload(1)
            with r.source(1) as s:  # decoded, or copied into a buffer: checked as it goes
                with pytest.raises(ChecksumMismatch):
                    s.decode()
                with pytest.raises(ChecksumMismatch):
                    s.copy_into(memoryview(bytearray(s.length)))
            assert not r.blob_ok(r.chunks[1].blob)
        elif target == "tokens":
            with pytest.raises(ChecksumMismatch):
                r.token_ids()
            assert r.token_ids(verify=False).tolist() != f.token_ids
        else:
            with pytest.raises(ChecksumMismatch):
                r.read_extra(target)
    expect(tmp_path, flip_byte(base, ref["offset"]), ChecksumMismatch)


def test_checksum_mismatch_from_manifest_side(tmp_path, raw_file):
    """The stored bytes are intact but the manifest records another CRC."""
    def mutate(d):
        d["chunks"][2]["crc32"] ^= 0x80000000
    expect(tmp_path, mutated(raw_file, mutate), ChecksumMismatch)


def test_verify_false_skips_the_checksum(tmp_path, raw_file):
    base = raw_file.path.read_bytes()
    ref = split_file(base).manifest["chunks"][0]
    path = put(tmp_path, flip_byte(base, ref["offset"] + 1, 0x40))
    with ContainerReader(path) as r:
        t = r.read_chunk(0, verify=False)
        assert t.shape == (2, 2, 2, 16) and not same_tensor(t, raw_file.chunk(0))


def _frame(data: bytes, *, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(data)


def _planes(t: torch.Tensor) -> bytes:
    from kvtool.codecs.zstd import shuffle_planes

    return bytes(shuffle_planes(t.contiguous()))


def test_decode_error_zstd(tmp_path, zstd_file):
    """Corrupt zstd payloads whose CRC-32C has been recomputed: only the decoder can notice."""
    ref = chunk_entry(zstd_file)
    payload = blob_bytes(zstd_file.path, ref)
    expected = zstd_file.chunk(0).numel() * 4
    good = _planes(zstd_file.chunk(0))
    assert zstandard.ZstdDecompressor().decompress(payload) == good
    corrupt = {
        "bad-magic": b"\0\0\0\0" + payload[4:],
        "empty": b"",
        "three-bytes": payload[:3],
        "header-only": payload[:6],
        "truncated-frame": payload[:-5],
        "wrong-content-size": _frame(good[:-4]),
        "bigger-content-size": _frame(good + b"\0" * 4),
        "no-content-size-short": _frame(good[:-4], content_size=False),
        "no-content-size-long": _frame(good + b"\0" * 64, content_size=False),
        "raw-bytes-not-frame": good[: len(payload)],
        "skippable-frame": struct.pack("<II", 0x184D2A50, 4) + b"\0\0\0\0",
    }
    for name, bad in corrupt.items():
        assert len(bad) <= len(payload) + 1000
        data = patch_blob(zstd_file.path, ref, bad) if len(bad) <= ref["length"] else \
            _append_as_chunk0(zstd_file, bad)
        err = expect(tmp_path, data, DecodeError)
        assert "chunk" in str(err) or "zstd" in str(err), name
    assert expected == len(good)


def _append_as_chunk0(f, payload: bytes) -> bytes:
    """Place a payload larger than the original chunk 0 after the last blob, aligned."""
    parts = split_file(f.path)
    body = bytearray(parts.data)
    body += bytes(-len(body) % 64)
    off = len(body)
    body += payload

    def mutate(d):
        d["chunks"][0].update(offset=off, length=len(payload), crc32=_crc(payload))
    return rebuild(f.path, mutate, data=bytes(body))


def _crc(data: bytes) -> int:
    from fixtures import ref_crc32

    return ref_crc32(data)


def test_decode_error_raw_wrong_length(tmp_path, raw_file):
    ref = split_file(raw_file.path).manifest["chunks"][0]
    payload = blob_bytes(raw_file.path, ref)
    for bad in (payload[:-2], payload[:1], b""):
        expect(tmp_path, patch_blob(raw_file.path, ref, bad), DecodeError)


def test_decode_error_wrong_codec_recorded(tmp_path, zstd_file, raw_file):
    """A zstd payload labelled raw, and a raw payload labelled zstd."""
    def as_raw(d):
        d["chunks"][0].update(codec="raw", codec_id=0, codec_params={"version": 1})
    expect(tmp_path, mutated(zstd_file, as_raw), DecodeError)

    def as_zstd(d):
        d["chunks"][0].update(codec="zstd", codec_id=1,
                              codec_params={"version": 1, "level": 3, "shuffle": "none"})
    expect(tmp_path, mutated(raw_file, as_zstd), DecodeError)


def test_shuffle_flag_changes_decoded_values_only(tmp_path, zstd_file):
    """shuffle is part of the decoding: flipping it still decodes (no crash), to other values."""
    path = put(tmp_path, mutated(zstd_file, _set("chunks.0.codec_params.shuffle", "none")))
    with ContainerReader(path) as r:
        t = r.read_chunk(0)
    assert t.shape == zstd_file.chunk(0).shape and not same_tensor(t, zstd_file.chunk(0))


class _MisbehavingCodec(Codec):
    """A codec that decodes to the wrong shape or dtype: ShapeMismatch is unreachable with the
    built-in codecs (raw and zstd check the byte count and view to the declared shape), so the
    reader's last line of defence is exercised with this stand-in."""

    name = "misbehaving"
    codec_id = 250
    params_version = 1
    lossless = True

    def __init__(self, result):
        self.result = result

    def default_params(self):
        return {"version": 1}

    def validate_params(self, params):
        return self._check_version(params)

    def encode_host(self, kv, params):  # pragma: no cover - never used
        raise NotImplementedError

    def decode(self, payload, shape, dtype, params):
        return self.result(shape, dtype)

    def decode_array(self, payload, shape, dtype, params):  # what verify and inspect read
        tensor = self.result(shape, dtype_from_name(dtype))
        return tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


def _add_codec(monkeypatch, fake) -> None:
    """`fake` in the codec table for this test (as a build that ships it would have it)."""
    monkeypatch.setattr(codecs, "TABLE", codecs.TABLE + ((fake.codec_id, fake.name, "", ""),))
    monkeypatch.setitem(codecs._made, fake.codec_id, fake)


def test_a_codec_whose_module_cannot_load_says_why_in_one_line(monkeypatch):
    """A broken native build is named as such, not reported as an unknown codec."""
    from kvtool.errors import CodecUnavailable

    table = tuple((i, n, ".no_such_module" if n == "cachegen" else m, c) for i, n, m, c in codecs.TABLE)
    monkeypatch.setattr(codecs, "TABLE", table)
    monkeypatch.setattr(codecs, "_made", {})
    with pytest.raises(CodecUnavailable, match=r"codec cachegen: its module cannot load \(No module named") as err:
        codecs.get_codec(2)
    assert "\n" not in str(err.value) and codecs.get_codec("raw").name == "raw"


@pytest.mark.parametrize("result", [
    lambda shape, dtype: torch.zeros(1, dtype=dtype),
    lambda shape, dtype: torch.zeros(shape, dtype=torch.float32 if dtype != torch.float32 else torch.float16),
    lambda shape, dtype: torch.zeros(*shape[:-1], shape[-1] + 1, dtype=dtype),
], ids=["shape", "dtype", "channels"])
def test_shape_mismatch(tmp_path, raw_file, monkeypatch, result):
    fake = _MisbehavingCodec(result)
    _add_codec(monkeypatch, fake)

    def mutate(d):
        d["chunks"][1].update(codec=fake.name, codec_id=fake.codec_id, codec_params={"version": 1})
    expect(tmp_path, mutated(raw_file, mutate), ShapeMismatch)


def test_codec_crash_becomes_decode_error(tmp_path, raw_file, monkeypatch):
    def boom(shape, dtype):
        raise RuntimeError("internal decoder failure")
    fake = _MisbehavingCodec(boom)
    _add_codec(monkeypatch, fake)

    def mutate(d):
        d["chunks"][0].update(codec=fake.name, codec_id=fake.codec_id, codec_params={"version": 1})
    expect(tmp_path, mutated(raw_file, mutate), DecodeError)


# --- conditions only `verify` reports -------------------------------------------------------------------


def _verify_json(path, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    code = run(["verify", str(path), "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out)


def test_verify_prefix_hash_mismatch(tmp_path, raw_file, capsys):
    other = ref_prefix_hashes([t + 1 for t in raw_file.token_ids], 2)[1]
    path = put(tmp_path, mutated(raw_file, _set("chunks.1.prefix_hash", other)))
    read_everything(path)  # the reader itself does not recompute prefix hashes
    code, result = _verify_json(path, capsys)
    assert code == 1 and result["ok"] is False
    assert [c["prefix_hash"] for c in result["chunks"]] == ["ok", "BAD", "ok"]
    assert any("prefix hash" in p for p in result["problems"])
    assert result["problem_types"] == ["PrefixHashMismatch"]  # format-spec/container.md section 5


def test_verify_token_ids_changed_breaks_every_prefix_hash(tmp_path, raw_file, capsys):
    doc = split_file(raw_file.path).manifest
    ref = doc["sequence"]["tokens"]
    ids = bytearray(blob_bytes(raw_file.path, ref))
    ids[0] ^= 1  # token 0 changes: every chunk's chained hash changes
    path = put(tmp_path, patch_blob(raw_file.path, ref, bytes(ids)))
    code, result = _verify_json(path, capsys)
    assert code == 1
    assert [c["prefix_hash"] for c in result["chunks"]] == ["BAD", "BAD", "BAD"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_verify_non_finite_values(tmp_path, value, codec, capsys):
    ident = make_identity()
    from fixtures import make_kv

    kv = make_kv(ident, 5)
    kv[1, 1, 3, 7] = value  # chunk 1
    f = write_kv_file(tmp_path / "nan.kvc", num_tokens=5, chunk_size=2, kv=kv, codec=codec)
    code, result = _verify_json(f.path, capsys)
    assert code == 1 and result["ok"] is False
    assert [c["finite"] for c in result["chunks"]] == ["ok", "BAD", "ok"]
    assert any("non-finite" in p for p in result["problems"])
    assert result["problem_types"] == ["NonFiniteValues"]


def test_verify_nan_written_into_raw_chunk(tmp_path, raw_file, capsys):
    """NaN bytes put into an existing raw chunk, CRC-32C recomputed: only the finiteness check sees it."""
    ref = split_file(raw_file.path).manifest["chunks"][2]
    payload = bytearray(blob_bytes(raw_file.path, ref))
    payload[6:8] = b"\xc0\x7f"  # bf16 NaN (0x7FC0), little-endian
    path = put(tmp_path, patch_blob(raw_file.path, ref, bytes(payload)))
    code, result = _verify_json(path, capsys)
    assert code == 1 and result["chunks"][2]["finite"] == "BAD"
    assert result["chunks"][2]["checksum"] == "ok"


def test_verify_fingerprint_mismatch(tmp_path, raw_file, capsys):
    path = put(tmp_path, mutated(raw_file, _set("model.vocab_size", 1001)))
    code, result = _verify_json(path, capsys)
    assert code == 1 and result["checks"]["fingerprint"] == "BAD"


def test_verify_corrupt_token_ids_leaves_prefix_hashes_unchecked(tmp_path, raw_file, capsys):
    base = raw_file.path.read_bytes()
    ref = split_file(base).manifest["sequence"]["tokens"]
    code, result = _verify_json(put(tmp_path, flip_byte(base, ref["offset"] + 2)), capsys)
    assert code == 1 and result["checks"]["token_ids"] == "BAD"
    assert [c["prefix_hash"] for c in result["chunks"]] == ["unchecked"] * 3
    assert [c["checksum"] for c in result["chunks"]] == ["ok"] * 3


def test_verify_collects_every_problem(tmp_path, raw_file, capsys):
    base = raw_file.path.read_bytes()
    doc = split_file(base).manifest
    data = flip_byte(base, doc["chunks"][0]["offset"] + 3)
    data = flip_byte(data, doc["extras"]["roi_mask"]["offset"])
    path = put(tmp_path, data)
    code, result = _verify_json(path, capsys)
    assert code == 1
    assert result["chunks"][0]["checksum"] == "BAD" and result["chunks"][0]["decode"] == "skipped"
    assert result["chunks"][1]["checksum"] == "ok"
    assert result["checks"]["extra:roi_mask"] == "BAD"
    assert len(result["problems"]) == 2


# --- huge declared sizes -----------------------------------------------------------------------------


_MEMORY_PROBE = """
import resource, sys
from kvtool.errors import KvtoolError
from fixtures import read_everything
read_everything(sys.argv[1])  # warm up: imports, first mmap, codec tables
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))  # 48 MiB more, no further
for path in sys.argv[2:]:
    try:
        read_everything(path)
    except KvtoolError:
        pass
print("ok")
"""


def test_huge_declared_sizes_allocate_nothing(tmp_path, raw_file, zstd_file):
    hostile: list[bytes] = []

    def refused(data: bytes, cls):
        hostile.append(data)
        return expect(tmp_path, data, cls)

    def huge_model(d):  # 1024 layers x 1024 heads x 4096 dims: ~10^13 values per chunk
        d["model"].update(num_layers=1024, num_kv_heads=1024, head_dim=4096)
        for c in d["chunks"]:
            c["shape"] = [2, 1024, c["end"] - c["start"], 1024 * 4096]
    err = refused(mutated(raw_file, huge_model), ManifestInvalid)
    assert "limit" in str(err)

    def huge_tokens(d):  # 2^24 tokens, 1 chunk each: the chunk count check, not an allocation
        d["sequence"].update(num_tokens=2**24, chunk_size=1)
        d["sequence"]["tokens"]["length"] = 4 * 2**24
    refused(mutated(raw_file, huge_tokens), ManifestInvalid)

    def huge_hidden(d):  # 10^12 values in an extra (of a manifest without the optional model.hidden_size)
        d["model"].pop("hidden_size")
        d["extras"]["hidden_states"].update(shape=[5, 2 * 10**11], length=5 * 2 * 10**11 * 2)
    refused(mutated(raw_file, huge_hidden), BlobOutOfBounds)

    refused(mutated(raw_file, _set("chunks.0.length", 10**12)), BlobOutOfBounds)
    refused(mutated(raw_file, _set("sequence.tokens.length", 4 * 10**12)), ManifestInvalid)

    # a zstd frame header that claims 10^12 bytes of content
    ref = chunk_entry(zstd_file)
    frame = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", 10**12) + b"\x01\x00\x00"
    refused(patch_blob(zstd_file.path, ref, frame), DecodeError)
    # a zstd bomb without a content size: 64 MiB of zeros in a few KiB
    cobj = zstandard.ZstdCompressor(level=3, write_content_size=False).compressobj()
    zero = bytes(1 << 20)
    bomb = b"".join(cobj.compress(zero) for _ in range(64)) + cobj.flush()
    assert len(bomb) < 64 << 10
    refused(_append_as_chunk0(zstd_file, bomb), DecodeError)

    # Read them all again in a fresh process whose address space may grow by 48 MiB and no more:
    # an allocation the declared sizes asked for is a MemoryError there, not a refusal.
    paths = [str(put(tmp_path, data, f"hostile{i}.kvc")) for i, data in enumerate(hostile)]
    probe = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(zstd_file.path), *paths],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])})
    assert probe.returncode == 0 and probe.stdout.strip() == "ok", f"a hostile file made the reader allocate: " \
        f"{probe.stderr.strip().splitlines()[-1:] }"


@pytest.mark.parametrize("bins", ["²", "k:²=16;v:*=16", "k:0-" + "9" * 5000 + "=16;v:*=16", "9" * 5000,
                                  "k:٣-=16;v:*=16"])
def test_bins_of_other_digits_or_thousands_of_digits_are_one_line_errors(bins, tmp_path, raw_file, capsys):
    """str.isdigit() accepts '²' and Arabic-Indic digits, which int() refuses; 5,000 digits hit Python's
    integer-string limit: both were tracebacks, from --bins and from a file's recorded bins alike."""
    from kvtool.codecs.cachegen import CacheGenCodec
    from kvtool.errors import CodecParamsInvalid, UsageError

    with pytest.raises(CodecParamsInvalid):
        CacheGenCodec().validate_params({"version": 1, "bins": bins, "prob_bits": 14, "lanes": 32})
    code = run(["compress", str(raw_file.path), "-o", str(tmp_path / "c.kvc"), "--codec", "cachegen", "--bins", bins])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kvtool: error: bins spec") and err.count("\n") == 1
    assert issubclass(CodecParamsInvalid, Exception) and issubclass(UsageError, Exception)


def test_an_empty_file_names_its_path_once(tmp_path, capsys):
    empty = tmp_path / "empty.kvc"
    empty.write_bytes(b"")
    assert run(["inspect", str(empty)]) == 2
    assert capsys.readouterr().err == f"kvtool: error: {empty}: file is empty\n"


def test_a_negative_chunk_index_is_refused_not_read_as_a_range(tmp_path, raw_file, capsys):
    assert run(["dump", str(raw_file.path), "-o", str(tmp_path / "d.npy"), "--chunks", "-1"]) == 2
    assert "--chunks: cannot read '-1'" in capsys.readouterr().err


def test_a_full_disk_names_the_output_not_the_temp_file(tmp_path, raw_file, monkeypatch, capsys):
    import errno

    from kvtool.format import writer as writer_module

    class FillsUp:  # the temp file: the header fits, then the disk is full
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_fdopen = writer_module.os.fdopen
    monkeypatch.setattr(writer_module.os, "fdopen", lambda *a, **k: FillsUp(real_fdopen(*a, **k)))
    out = tmp_path / "z.kvc"
    assert run(["compress", str(raw_file.path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"kvtool: error: {out}: cannot write (No space left on device)\n"
    assert not out.exists() and not list(tmp_path.glob(".z.kvc.*"))  # the temp file is gone


def test_a_manifest_of_millions_of_empty_objects_is_refused_before_it_is_parsed():
    """20 million `{}` took 1.9 GB and 21 s to refuse; the container budget refuses it first
    (bench/RESULTS.md has the time and memory), while brackets inside strings do not count."""
    from kvtool.format.manifest import container_budget, load_json

    hostile = b"[" + b"{}," * 2_000_000 + b"{}]"
    with pytest.raises(ManifestCorrupt, match="JSON objects and arrays"):
        load_json(hostile)
    braces_in_a_string = b'{"metadata": {"note": "' + b"{[" * 1_000_000 + b'\\"{"}}'
    assert load_json(braces_in_a_string)["metadata"]["note"].startswith("{[{[")
    at_the_limit = b"[" + b",".join([b"[]"] * (container_budget(10_000) - 1)) + b"]"
    at_the_limit += b" " * (10_000 - len(at_the_limit))
    assert len(load_json(at_the_limit)) == container_budget(10_000) - 1


@pytest.mark.parametrize("offset,message", [(4093, "is not a multiple of 8"), (8, "lies inside the 64-byte header")])
def test_a_bad_manifest_offset_is_named_for_what_is_wrong(tmp_path, raw_file, offset, message, capsys):
    from kvtool.format import layout

    data = bytearray(Path(raw_file.path).read_bytes())
    trailer = layout.Trailer.unpack(bytes(data[-32:]), len(data))
    data[-32:] = layout.Trailer(offset, trailer.manifest_length, trailer.manifest_crc32).pack()
    path = tmp_path / "t.kvc"
    path.write_bytes(bytes(data))
    assert run(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"manifest offset {offset} {message}" in err and err.count("\n") == 1


def test_the_number_and_nesting_limits_are_those_the_spec_states():
    """container.md section 3: 40 digits for integers, the sign not counted, no digit limit for
    numbers with a fraction or exponent (they must be finite); a value of depth 65 is rejected,
    whether the containers are objects or arrays."""
    from kvtool.format.manifest import load_json

    assert load_json(b"1" * 40) == int("1" * 40) and load_json(b"-" + b"1" * 40) == -int("1" * 40)
    with pytest.raises(ManifestCorrupt, match="41 digits"):
        load_json(b"1" * 41)
    assert load_json(b"1." + b"1" * 60) > 1 and load_json(b"1" * 60 + b".5") > 1
    # a long run of digits inside a string is no integer (the parse that bounds integers runs then)
    assert load_json(b'{"a":"' + b"7" * 80 + b'","b":12}') == {"a": "7" * 80, "b": 12}
    with pytest.raises(ManifestCorrupt, match="41 digits"):
        load_json(b'{"a":"x","b":[1,2,' + b"9" * 41 + b"]}")
    with pytest.raises(ManifestCorrupt, match="not finite"):
        load_json(b"1e400")
    for depth, ok in ((64, True), (65, False)):
        arrays = b"[" * depth + b"1" + b"]" * depth  # the 1 has depth `depth`
        objects = b'{"a":' * depth + b"1" + b"}" * depth
        for doc in (arrays, objects):
            if ok:
                load_json(doc)
            else:
                with pytest.raises(ManifestCorrupt, match="nested deeper"):
                    load_json(doc)
