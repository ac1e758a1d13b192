"""The committed test vectors decode to their committed tensors, byte for byte."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvtool.format import ContainerReader

VECTORS_DIR = Path(__file__).resolve().parents[1] / "format-spec" / "vectors"
_spec = importlib.util.spec_from_file_location("make_vectors", VECTORS_DIR / "make_vectors.py")
make_vectors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_vectors)

ALL = sorted(make_vectors.VECTORS)
BYTE_EXACT_CODECS = {"raw", "cachegen"}  # zstd output may change with the zstd library


def _vector(name: str) -> Path:
    path = VECTORS_DIR / f"{name}.kvc"
    if name not in make_vectors.available():
        pytest.skip(f"codec of {name} is not in this build")
    assert path.exists(), f"{path} missing: run python format-spec/vectors/make_vectors.py"
    return path


@pytest.mark.parametrize("name", ALL)
def test_vector_decodes_to_committed_tensor(name):
    path = _vector(name)
    expected = (VECTORS_DIR / f"{name}.kv.bin").read_bytes()
    assert make_vectors.decoded_bytes(path) == expected


@pytest.mark.parametrize("name", ALL)
def test_writer_reproduces_vector(name, tmp_path):
    path = _vector(name)
    codec = make_vectors.VECTORS[name][0]
    rebuilt = tmp_path / "v.kvc"
    make_vectors.build(name, rebuilt)
    if codec in BYTE_EXACT_CODECS:
        assert rebuilt.read_bytes() == path.read_bytes()
    else:
        assert make_vectors.decoded_bytes(rebuilt) == make_vectors.decoded_bytes(path)


@pytest.mark.parametrize("name", ALL)
def test_vector_regions_tile_the_file(name):
    """Header, blobs, padding, manifest and trailer cover every byte exactly once."""
    path = _vector(name)
    pos = 0
    for offset, length, _ in make_vectors.regions(path):
        assert offset == pos
        pos += length
    assert pos == path.stat().st_size


def test_raw_vector_layout_by_hand():
    """Parse raw_bf16.kvc with struct and slicing only, as a reader in another language would."""
    import json
    import struct

    import crc32c

    data = (VECTORS_DIR / "raw_bf16.kvc").read_bytes()
    assert data[:8] == b"\x89KVC\r\n\x1a\n"
    major, minor, header_size, alignment, flags = struct.unpack_from("<HHIII", data, 8)
    assert (major, minor, header_size, alignment, flags) == (1, 0, 64, 64, 0)
    offset, length, crc, reserved, end_magic = struct.unpack("<QQII8s", data[-32:])
    assert end_magic == b"\x89KVCEND\n" and reserved == 0
    assert offset + length + 32 == len(data)
    manifest_bytes = data[offset:offset + length]
    assert crc32c.crc32c(manifest_bytes) == crc
    manifest = json.loads(manifest_bytes)
    expected = torch.frombuffer(bytearray((VECTORS_DIR / "raw_bf16.kv.bin").read_bytes()),
                                dtype=torch.bfloat16).view(2, 2, 5, 8)
    for chunk in manifest["chunks"]:
        blob = data[chunk["offset"]:chunk["offset"] + chunk["length"]]
        assert crc32c.crc32c(blob) == chunk["crc32"]
        got = torch.frombuffer(bytearray(blob), dtype=torch.bfloat16).view(chunk["shape"])
        assert torch.equal(got, expected[:, :, chunk["start"]:chunk["end"]])
    tok = manifest["sequence"]["tokens"]
    assert list(struct.unpack_from("<5I", data, tok["offset"])) == make_vectors.TOKENS


def test_vectors_validate_against_json_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import json

    schema = json.loads((VECTORS_DIR.parent / "manifest.schema.json").read_text())
    for name in make_vectors.available():
        with ContainerReader(VECTORS_DIR / f"{name}.kvc") as r:
            jsonschema.validate(r.manifest.to_json(), schema)


def test_vector_extras():
    with ContainerReader(VECTORS_DIR / "raw_bf16.kvc") as r:
        for name, tensor in make_vectors.extras().items():
            assert torch.equal(r.read_extra(name), tensor)


def test_the_spec_prints_the_phi_table_the_coders_use():
    """cachegen.md section 5: PHI is normative data in format-spec/cachegen_phi.txt, with its SHA-256."""
    import hashlib
    import struct

    from kvtool.codecs.cachegen import _tables

    spec = Path(__file__).resolve().parents[1] / "format-spec"
    values = [int(line) for line in (spec / "cachegen_phi.txt").read_text().split()]
    assert values == list(_tables.PHI) and len(values) == 513
    digest = hashlib.sha256(struct.pack("<513I", *values)).hexdigest()
    assert digest == "21d0f44bb1fb044363be6a83132dfccdcad5c46d648d5fce1ae7e8d1e5cc3380"
    assert digest in (spec / "cachegen.md").read_text()


def test_the_bins_grammar_rules_the_spec_states():
    from kvtool.codecs.cachegen import resolve_bins
    from kvtool.errors import UsageError

    assert resolve_bins("24", 3) == [24] * 6  # a bare INT: every K and V layer
    assert resolve_bins("default", 9) == [32] * 18  # fewer than 10 layers: 32 everywhere
    assert resolve_bins("default", 10) == [32] * 10 + [32, 32] + [16] * 8
    for bad in ("k:3-3=16;v:*=16", "k:5-3=16;v:*=16", "k:*=16,0=32;v:*=16", "k:0=16;v:*=16"):
        with pytest.raises(UsageError):
            resolve_bins(bad, 4)


@pytest.mark.parametrize("name", ["cachegen_fp16_long", "cachegen_fp32_long"])
def test_long_cachegen_vectors_exercise_what_real_files_do(name, monkeypatch):
    """Renormalisation words in every section, odd word counts (a padding u16), Rice escapes,
    fp16 and fp32 scales, and P, N and M other than the short vector's."""
    from kvtool.codecs.cachegen import payload as framing
    from kvtool.codecs.cachegen import reference, resolve_bins

    escapes = []
    rice = framing._Reader.rice

    def counting_rice(self, base, k, w):
        escapes.append(bool(self.bits[self.pos:self.pos + 16].all()) and self.pos + 16 <= self.n)
        return rice(self, base, k, w)

    monkeypatch.setattr(framing._Reader, "rice", counting_rice)
    path = _vector(name)
    words, headers = [], []
    with ContainerReader(path) as reader:
        assert reader.manifest.num_tokens == 96 and [c.num_tokens for c in reader.chunks] == [64, 32]
        for c in reader.chunks:
            _, L, T, C = c.shape
            bins = resolve_bins(c.codec_params["bins"], L)
            _, _, h = reference.decode_symbols(reader.chunk_payload(c.index), reference.DTYPE_CODES[reader.kv_dtype],
                                               2 * L, T, C, bins)
            words += h.words
            headers.append(h)
    assert all(w > 0 for w in words) and any(w % 2 for w in words)
    assert any(escapes)
    assert {h.dtype_code for h in headers} == {1 if "fp16" in name else 2}
    assert {h.prob_bits for h in headers} == ({12} if "fp16" in name else {15})
    assert {h.lanes for h in headers} == ({3} if "fp16" in name else {8})


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith("cachegen")])
def test_the_reference_coder_decodes_every_cachegen_vector_as_committed(name):
    """The pure-Python reference (the spec in code) and the native coder agree on every vector."""
    from kvtool.codecs.cachegen import cachegen_decode

    path = _vector(name)
    parts = []
    with ContainerReader(path) as reader:
        for c in reader.chunks:
            parts.append(cachegen_decode(reader.chunk_payload(c.index), c.shape, reader.kv_dtype, c.codec_params,
                                         impl="reference"))
    kv = torch.cat(parts, dim=2).contiguous()
    assert kv.view(torch.uint8).numpy().tobytes() == (VECTORS_DIR / f"{name}.kv.bin").read_bytes()
