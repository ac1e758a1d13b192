"""Decoding holds at most twice one chunk's decoded size (format-spec/container.md §5, memory;
issue 46 finding 5: a 1 GiB zstd chunk took 8.4 GB in `inspect --stats` and `dump`), and the
streamed paths that keep it so write what they wrote before."""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from fixtures import blob_bytes, chunk_entry, make_identity, write_kv_file
from kvtool.errors import DecodeError
from kvtool.format import ContainerReader, ContainerWriter, ModelIdentity
from test_bad_input import _append_as_chunk0
from test_fuzz_standing import with_own_peak_rss

REPO = Path(__file__).resolve().parents[1]
CHUNK_MIB = 64

# In a fresh process (through the launcher: its ru_maxrss is its own, not pytest's peak), import
# what the command needs, open the file once, take the peak RSS as the baseline, run the command
# on its one chunk and print how far the peak grew.
_PROBE = """
import json, resource, sys
command, path, out = sys.argv[1:4]
import numpy, kvtool, kvtool.cli.app, kvtool.ops.inspect, kvtool.ops.dump, kvtool.ops.verify
from kvtool.format import ContainerReader
if command == "open":
    import torch
with ContainerReader(path) as reader:
    reader.manifest
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
base = peak()
if command == "open":
    with kvtool.open(path) as reader:
        tensor = reader.read_chunk(0)
    code = 0
else:
    argv = {"stats": ["inspect", "--stats", "--json", path], "verify": ["verify", "--json", path],
            "dump-safetensors": ["dump", path, "-o", out + ".safetensors"],
            "dump-npy": ["dump", path, "-o", out + ".npy"]}[command]
    code = kvtool.cli.app.run(argv)
print(json.dumps({"code": code, "growth": peak() - base}), file=sys.stderr)
"""


def _identity() -> ModelIdentity:
    return make_identity(num_layers=8, num_kv_heads=4, head_dim=128, name="memory-probe")


def _one_chunk_file(path: Path, codec: str, params: dict | None) -> int:
    """A file of one bf16 chunk of CHUNK_MIB MiB, mostly zeros with enough noise that its zstd
    payload stays within the 1024x decoded-size rule; returns the decoded size."""
    identity = _identity()
    channels = identity.num_kv_heads * identity.head_dim
    tokens = (CHUNK_MIB << 20) // (2 * identity.num_layers * channels * 2)
    kv = torch.zeros(2, identity.num_layers, tokens, channels, dtype=torch.bfloat16)
    noise = (CHUNK_MIB << 20) // 1024
    kv.view(-1)[:noise] = (torch.randn(noise, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    with ContainerWriter(path, identity, [i % 1000 for i in range(tokens)], kv_dtype="bfloat16",
                         chunk_size=tokens) as writer:
        writer.write_chunk(kv, codec, params)
    return kv.numel() * 2


@pytest.fixture(scope="module")
def one_chunk_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory")
    files = {}
    for name, codec, params in [("raw", "raw", None),
                                ("zstd", "zstd", None),
                                ("zstd-none", "zstd", {"version": 1, "level": 1, "shuffle": "none"})]:
        files[name] = (folder / f"{name}.kvc", _one_chunk_file(folder / f"{name}.kvc", codec, params))
    return files


@pytest.mark.parametrize("codec", ["raw", "zstd", "zstd-none"])
@pytest.mark.parametrize("command", ["stats", "verify", "dump-safetensors", "dump-npy", "open"])
def test_decoding_one_chunk_grows_memory_by_at_most_twice_its_size(one_chunk_files, tmp_path, command, codec):
    path, decoded = one_chunk_files[codec]
    out = subprocess.run(with_own_peak_rss([sys.executable, "-c", _PROBE, command, str(path), str(tmp_path / "out")]),
                         capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stderr.strip().splitlines()[-1])
    assert result["code"] == 0, out.stderr[-3000:]
    assert result["growth"] <= 2 * decoded, (
        f"{command} on a {decoded >> 20} MiB {codec} chunk: peak RSS grew by {result['growth'] >> 20} MiB")


# --- the streamed paths write what they wrote before ---------------------------------------------


def _old_safetensors(path: Path, chunks: list[int], layers: list[int]) -> bytes:
    """What dump wrote before it streamed: the tensors built whole, `safetensors.torch.save`d."""
    from safetensors.torch import save

    with ContainerReader(path) as reader:
        m = reader.manifest
        kv = torch.cat([reader.read_chunk(i)[:, layers] for i in chunks], dim=2)
        positions = np.concatenate([np.arange(m.chunks[i].start, m.chunks[i].end) for i in chunks])
        per_token = kv.view(2, len(layers), kv.shape[2], m.num_kv_heads, m.head_dim)
        tensors = {"token_ids": torch.from_numpy(reader.token_ids()[positions]),
                   "positions": torch.from_numpy(positions.astype(np.int64))}
        for j, layer in enumerate(layers):
            tensors[f"layers.{layer}.key"] = per_token[0, j].contiguous()
            tensors[f"layers.{layer}.value"] = per_token[1, j].contiguous()
        for name in m.extras:
            tensors[name] = reader.read_extra(name)[positions].contiguous()
        meta = {**m.metadata, "model": m.model["name"], "fingerprint": m.model["fingerprint"],
                "kv_dtype": m.kv_dtype, "source": str(path)}
        if m.model.get("weights_digest"):
            meta["weights_digest"] = m.model["weights_digest"]
    return save(tensors, metadata=meta)


def _split_safetensors(data: bytes) -> tuple[dict, list, bytes]:
    """(metadata, the tensors' header entries in order, the data): safetensors keeps no order
    among the metadata's keys (two saves of one dict may differ there), so they compare as a dict."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    return header.pop("__metadata__"), list(header.items()), data[8 + size:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunks,layers", [(None, None), ("0,2", "1"), ("1-2", "0-1")])
def test_dump_safetensors_is_what_safetensors_writes(tmp_path, dtype, chunks, layers):
    f = write_kv_file(tmp_path / "in.kvc", identity=make_identity(num_layers=3), num_tokens=11, chunk_size=4,
                      dtype=dtype, codec="zstd", extras=True)
    with ContainerReader(f.path) as reader:
        picked_chunks = [0, 2] if chunks == "0,2" else [1, 2] if chunks else [0, 1, 2]
        picked_layers = [1] if layers == "1" else [0, 1] if layers else [0, 1, 2]
    from kvtool.ops.dump import dump

    out = tmp_path / "out.safetensors"
    dump(f.path, out, chunks=chunks, layers=layers)
    new, old = out.read_bytes(), _old_safetensors(f.path, picked_chunks, picked_layers)
    assert len(new) == len(old)
    assert _split_safetensors(new) == _split_safetensors(old)


def test_dump_safetensors_metadata_escapes_as_safetensors_does(tmp_path):
    """The file's metadata is free text: control characters, quotes, non-ASCII are escaped (or
    not) exactly as safetensors' own JSON writer does."""
    metadata = {"prompt": 'a "quoted"\\ line\nand \x1b[2J\x07 \u00e9\u4e2d \U0001f600 \x7f\t\r\x08\x0c'}
    identity = make_identity()
    with ContainerWriter(tmp_path / "m.kvc", identity, list(range(6)), kv_dtype="float32", chunk_size=4,
                         metadata=metadata) as writer:
        for start, end in writer.chunk_ranges():
            writer.write_chunk(torch.randn(2, 2, end - start, 16), "raw")
    from kvtool.ops.dump import dump

    dump(tmp_path / "m.kvc", tmp_path / "m.safetensors")
    new, old = (tmp_path / "m.safetensors").read_bytes(), _old_safetensors(tmp_path / "m.kvc", [0, 1], [0, 1])
    size = int.from_bytes(new[:8], "little")
    assert size == int.from_bytes(old[:8], "little") and new[8 + size:] == old[8 + size:]
    assert _split_safetensors(new) == _split_safetensors(old)
    assert json.dumps(metadata["prompt"], ensure_ascii=False)[1:-1].encode() in old[:8 + size]  # (as escaped)
    assert json.dumps(metadata["prompt"], ensure_ascii=False)[1:-1].encode() in new[:8 + size]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dump_npy_is_what_np_save_writes(tmp_path, dtype):
    from kvtool.dtypes import to_float64
    from kvtool.ops.dump import dump

    f = write_kv_file(tmp_path / "in.kvc", identity=make_identity(num_layers=3), num_tokens=11, chunk_size=4,
                      dtype=dtype, codec="zstd")
    dump(f.path, tmp_path / "new.npy", chunks="0,2", layers="0,2")
    with ContainerReader(f.path) as reader:
        kv = np.concatenate([reader.read_chunk_array(i)[:, [0, 2]] for i in (0, 2)], axis=2)
        name = reader.manifest.kv_dtype
    np.save(tmp_path / "old.npy", to_float64(kv, name).astype(np.float32) if name == "bfloat16" else kv)
    assert (tmp_path / "new.npy").read_bytes() == (tmp_path / "old.npy").read_bytes()


# --- the streamed zstd decoder refuses what the whole-frame one refused ----------------------------


@pytest.mark.parametrize("shuffle", ["byteplane", "none"])
def test_zstd_decodes_streamed_to_the_same_values(tmp_path, shuffle):
    params = {"version": 1, "level": 3, "shuffle": shuffle}
    f = write_kv_file(tmp_path / "z.kvc", num_tokens=9, chunk_size=4, codec="zstd", params=params)
    with ContainerReader(f.path) as reader:
        for i in range(3):
            assert torch.equal(reader.read_chunk(i), f.chunk(i))


def test_a_zstd_frame_followed_by_a_skippable_frame_is_a_decode_error(tmp_path):
    """Exactly one frame (container.md §6.2): a skippable frame after it decodes to nothing, so
    only the frame's own length tells it is there."""
    f = write_kv_file(tmp_path / "z.kvc", num_tokens=4, chunk_size=4, codec="zstd")
    ref = chunk_entry(f)
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(
        zstandard.ZstdDecompressor().decompress(blob_bytes(f.path, ref)))
    for extra in (struct.pack("<II", 0x184D2A50, 4) + b"1234", zstandard.ZstdCompressor().compress(b"")):
        bad = tmp_path / "bad.kvc"
        bad.write_bytes(_append_as_chunk0(f, frame + extra))
        with ContainerReader(bad) as reader, pytest.raises(DecodeError, match="after its frame"):
            reader.read_chunk_array(0)
    good = tmp_path / "good.kvc"  # the same frame alone decodes
    good.write_bytes(_append_as_chunk0(f, frame))
    with ContainerReader(good) as reader:
        assert torch.equal(reader.read_chunk(0), f.chunk(0))
