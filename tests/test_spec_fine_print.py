"""The fine print of format-spec/container.md that a reader written from the spec alone had to
run the tool to learn (issue 28): each sentence added there is pinned here, on real bytes."""

from __future__ import annotations

import pytest
import torch

from fixtures import rebuild, write_kv_file
from kvtool.errors import CodecParamsInvalid, NotAKvtoolFile, TruncatedFile, UnsupportedVersion
from kvtool.format import ContainerReader
from kvtool.format.layout import MAGIC
from kvtool.format.reader import BytesSource


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_kv_file(tmp_path_factory.mktemp("fp") / "g.kvc", num_tokens=16, chunk_size=8,
                         dtype=torch.float32, codec="zstd")


def opened(data: bytes):
    with ContainerReader(BytesSource(data, "x.kvc")) as reader:
        reader.read_chunk(0)


@pytest.mark.parametrize("length,error", [(0, TruncatedFile), (5, TruncatedFile), (8, TruncatedFile),
                                          (63, TruncatedFile), (64, TruncatedFile), (95, TruncatedFile),
                                          (96, TruncatedFile)])
def test_a_file_too_short_for_its_structure(good, length, error):
    with pytest.raises(error):
        opened(good.path.read_bytes()[:length])


@pytest.mark.parametrize("length", [5, 8, 63, 80])
def test_the_magic_is_checked_before_the_length(good, length):
    data = bytearray(good.path.read_bytes()[:length])
    data[0] ^= 0xFF
    with pytest.raises(NotAKvtoolFile):
        opened(bytes(data))


def test_a_whole_header_is_checked_before_the_missing_trailer(good):
    """64 to 95 bytes: the header's checks come first (here its major version), then the length."""
    data = bytearray(good.path.read_bytes()[:80])
    assert data[:len(MAGIC)] == MAGIC
    data[8] = 99  # u16 version_major, little-endian, right after the 8-byte magic
    with pytest.raises(UnsupportedVersion):
        opened(bytes(data))


@pytest.mark.parametrize("version", ["missing", 1.0, True, "1", 0, 2])
def test_every_fault_of_a_codec_params_version_is_codec_params_invalid(good, version):
    def mutate(doc):
        params = doc["chunks"][0]["codec_params"]
        if version == "missing":
            del params["version"]
        else:
            params["version"] = version

    with pytest.raises(CodecParamsInvalid):
        opened(rebuild(good.path, mutate))


def _placed(good, moves: dict[int, int]) -> bytes:
    """The file with chunk i's blob offset set to moves[i] (CRCs left: placement is checked first)."""
    def mutate(doc):
        for index, offset in moves.items():
            doc["chunks"][index]["offset"] = offset
    return rebuild(good.path, mutate)


def test_placement_goes_blob_by_blob_bounds_then_alignment(good):
    from kvtool.errors import BlobOutOfBounds, BlobOverlap

    far = 1 << 40
    with pytest.raises(BlobOverlap, match="chunk 0: offset .* not a multiple"):  # chunk 0 misaligned comes first
        opened(_placed(good, {0: 64 + 8, 1: far}))
    with pytest.raises(BlobOutOfBounds, match="chunk 0"):  # chunk 0 out of bounds, chunk 1 misaligned
        opened(_placed(good, {0: far, 1: 64 + 8}))


def test_an_offset_below_64_is_out_of_bounds_not_invalid(good):
    from kvtool.errors import BlobOutOfBounds

    for offset in (0, 8, 63):
        with pytest.raises(BlobOutOfBounds):
            opened(_placed(good, {0: offset}))


def test_tensor_objects_name_their_dtype_as_store_md_tabulates():
    """store.md §4.3: the safetensors dtype code and the metadata's dtype name of each dtype."""
    import json
    import re
    import struct
    from pathlib import Path

    from kvtool.store.objects import check_tensor, encode_tensor

    text = (Path(__file__).resolve().parents[1] / "format-spec" / "store.md").read_text()
    table = dict(re.findall(r"\| `([A-Z0-9_]+)` \| `([a-z0-9_]+)` \|", text))
    assert len(table) == 12
    for code, name in table.items():
        value = torch.zeros(3, dtype=getattr(torch, name))
        data = encode_tensor("k", value)
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8:8 + n])
        assert (header["value"]["dtype"], header["__metadata__"]["dtype"]) == (code, name)
        assert check_tensor(data, "t").dtype == value.dtype


@pytest.mark.parametrize("segment,error", [({"version": 2, "stored_start": -1}, "UnsupportedVersion"),
                                           ({"version": 2}, "MissingField"),
                                           ({"version": 1, "stored_start": -1}, "ManifestInvalid"),
                                           ({"version": 0, "stored_start": 0}, "ManifestInvalid")])
def test_segment_keys_are_checked_in_the_order_segment_md_gives(good, segment, error):
    with pytest.raises(Exception) as caught:
        with ContainerReader(BytesSource(rebuild(good.path, lambda d: d.__setitem__("segment", segment)), "x")) as r:
            r.segment
    assert type(caught.value).__name__ == error


def test_a_fingerprint_mismatch_opens_and_fails_verify_with_exit_1(good, tmp_path, capsys):
    from kvtool.cli.app import run

    bad = tmp_path / "fp.kvc"
    bad.write_bytes(rebuild(good.path, lambda d: d["model"].__setitem__("fingerprint", "sha256:" + "0" * 64)))
    with ContainerReader(bad) as reader:  # opening does not recompute it
        reader.read_chunk(0)
    assert run(["verify", "--json", str(bad)]) == 1
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["checks"]["fingerprint"] == "BAD"


def test_a_zstd_frame_that_decodes_short_is_a_decode_error(good):
    import zstandard

    from fixtures import patch_blob, split_file
    from kvtool.errors import DecodeError

    ref = split_file(good.path).manifest["chunks"][0]
    short = zstandard.ZstdCompressor().compress(b"\0" * 100)
    with pytest.raises(DecodeError, match="100 bytes"):
        opened(patch_blob(good.path, ref, short))


@pytest.mark.parametrize("dtype,error", [("uint8", "UnsupportedDtype"), ("int64", "UnsupportedDtype"),
                                         ("float32", "ManifestInvalid"), ("bfloat16", "ManifestInvalid")])
def test_a_roi_mask_of_another_dtype(tmp_path, dtype, error):
    f = write_kv_file(tmp_path / "e.kvc", num_tokens=16, chunk_size=8, dtype=torch.float32, extras=True)

    def mutate(doc):
        doc["extras"]["roi_mask"]["dtype"] = dtype

    with pytest.raises(Exception) as caught:
        with ContainerReader(BytesSource(rebuild(f.path, mutate), "x")) as reader:
            reader.read_extra("roi_mask")
    assert type(caught.value).__name__ == error


@pytest.mark.parametrize("bins,when", [("k:0-=32,0=16;v:*=16", "decode"), ("k:0-1=32;v:*=16", "decode"),
                                       ("k:*=300;v:*=16", "open"), ("16\u00a0", "open"), ("\t16\n", "open"),
                                       ("k:0-=32;v:0-=32\t", None), (" K : 0- = 32 ; v : * = 32", None)])
def test_cachegen_bins_blanks_and_when_each_fault_is_found(tmp_path, bins, when):
    """cachegen.md §1: blanks are ASCII spaces and tabs only; the text is checked on open, the
    layers' coverage (it depends on the chunk's L) when a chunk is decoded."""
    from kvtool.errors import CodecParamsInvalid

    f = write_kv_file(tmp_path / "c.kvc", num_tokens=16, chunk_size=8, dtype=torch.float32, codec="cachegen")

    def mutate(doc):
        for chunk in doc["chunks"]:
            chunk["codec_params"]["bins"] = bins

    data = rebuild(f.path, mutate)
    if when == "open":
        with pytest.raises(CodecParamsInvalid):
            ContainerReader(BytesSource(data, "x")).close()
        return
    with ContainerReader(BytesSource(data, "x")) as reader:
        if when == "decode":
            with pytest.raises(CodecParamsInvalid):
                reader.read_chunk(0)
        else:  # the file's own table, with blanks: decodes
            reader.read_chunk(0)


DUP = '{"a": 1, "a": 2}'


@pytest.mark.parametrize("text,error", [
    ('{"x": %s, "y": [1, 2' % DUP, "DuplicateField"),  # a syntax error after the object closes
    ('{"x": {"a": 1, "a": 2, "b": [1, 2}, "y": 1}', "ManifestCorrupt"),  # ... and one inside it, before its brace
    ('{"x": %s, "y": NaN}' % DUP, "DuplicateField"),
    ('{"y": NaN, "x": %s}' % DUP, "ManifestCorrupt"),
    ('{"y": 1%s, "x": %s}' % ("0" * 50, DUP), "ManifestCorrupt"),
    ('{"y": "\\ud800", "x": %s}' % DUP, "DuplicateField"),  # after parsing: loses anywhere
    ('{"y": %s, "x": %s}' % ("[" * 70 + "]" * 70, DUP), "DuplicateField"),
])
def test_where_a_repeated_key_stands_in_the_order_of_checks(text, error):
    from kvtool.format.manifest import parse_manifest

    with pytest.raises(Exception) as caught:
        parse_manifest(text.encode(), data_end=1 << 20, alignment=64)
    assert type(caught.value).__name__ == error, caught.value


@pytest.mark.parametrize("text,message", [
    ('{"y": %s, "z": "\\ud800"}' % ("[" * 70 + "]" * 70), "nested deeper"),
    ('{"z": "\\ud800", "y": %s}' % ("[" * 70 + "]" * 70), "lone surrogate"),
])
def test_after_parsing_the_first_in_document_order(text, message):
    from kvtool.errors import ManifestCorrupt
    from kvtool.format.manifest import parse_manifest

    with pytest.raises(ManifestCorrupt, match=message):
        parse_manifest(text.encode(), data_end=1 << 20, alignment=64)


# --- segment.md §3: re-encoding keys (RoPE) ------------------------------------------------------

def _ulp32(x):
    import numpy as np

    return np.spacing(np.abs(x).astype(np.float32)).astype(np.float64)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_the_frequencies_are_float32_as_the_spec_computes_them(scaling):
    """theta_j: the exponent 2j/D rounded to float32, each step of the table in float32."""
    import math

    import numpy as np

    from kvtool.engine.model import ModelConfig, rope_inv_freq

    D, b = 128, 500000.0
    config = ModelConfig(**{**_config_fields(), "head_dim": D, "rope_theta": b, "rope_scaling": scaling})
    got = rope_inv_freq(config).numpy()
    f32 = np.float32
    e = (np.arange(0, D, 2, dtype=f32) / f32(D)).astype(f32)
    # b ** e rounded once to float32 (numpy's own float32 pow was off by 2 ulp on an AVX-512 EPYC,
    # where it runs vectorised code), then 1 / it in float32
    t = (f32(1) / np.power(np.float64(b), e.astype(np.float64)).astype(f32)).astype(f32)
    if scaling is None:
        want = t
    elif scaling["rope_type"] == "linear":
        want = (t / f32(4.0)).astype(f32)
    else:
        f, lo, hi, O = f32(8), f32(1), f32(4), f32(8192)
        w = (f32(2) * f32(math.pi) / t).astype(f32)
        s = ((O / w - lo) / (hi - lo)).astype(f32)
        mixed = ((f32(1) - s) * t / f + s * t).astype(f32)
        want = np.where(w > O / lo, t / f, np.where(w < O / hi, t, mixed)).astype(f32)
    assert np.array_equal(got, want) or np.max(np.abs(got - want) / _ulp32(want)) <= 1  # (pow may round its last bit)


def _config_fields():
    return dict(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1,
                num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                max_position_embeddings=4096, tie_word_embeddings=True)


@pytest.mark.parametrize("delta", [1, 37, -5, 4093, 131071])
def test_a_turn_is_within_2_float32_ulp_of_the_exact_one(delta):
    import numpy as np

    from kvtool.engine.model import rerotate_keys

    gen = torch.Generator().manual_seed(delta & 0xFFFF)
    D = 64
    k = torch.randn(3, 2, D, generator=gen)
    inv = (1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)))
    old = torch.tensor([0, 7, 100])
    got = rerotate_keys(k, inv, old, old + delta).numpy().astype(np.float64)
    angles = float(delta) * inv.numpy().astype(np.float64)
    cos, sin = np.cos(angles).astype(np.float32).astype(np.float64), np.sin(angles).astype(np.float32).astype(np.float64)
    x, y = k.numpy()[..., :D // 2].astype(np.float64), k.numpy()[..., D // 2:].astype(np.float64)
    exact = np.concatenate([x * cos - y * sin, y * cos + x * sin], axis=-1)
    size = np.concatenate([np.abs(x * cos) + np.abs(y * sin), np.abs(y * cos) + np.abs(x * sin)], axis=-1)
    assert np.all(np.abs(got - exact) <= 2 * _ulp32(size))  # (a turn that cancels carries its terms' rounding)


def test_reading_model_rope_theta_default_legacy_type_and_llama3_keys():
    from kvtool.engine.loader import _rope_from_hf
    from kvtool.engine.model import ModelConfig, rope_inv_freq
    from kvtool.errors import ModelError

    assert _rope_from_hf({}) == (10000.0, None)  # rope_theta absent: 10000
    assert _rope_from_hf({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}) == \
        (5e5, {"rope_type": "linear", "factor": 2.0})  # the legacy key read as rope_type, not kept
    assert _rope_from_hf({"rope_scaling": {"rope_type": "default"}}) == (10000.0, None)
    for missing in ("factor", "original_max_position_embeddings"):
        scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
        del scaling[missing]
        with pytest.raises(ModelError, match=missing):
            rope_inv_freq(ModelConfig(**{**_config_fields(), "rope_scaling": scaling}))
