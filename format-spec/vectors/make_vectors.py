"""Build the test vectors in this folder (python format-spec/vectors/make_vectors.py).

Every vector is a tiny model (2 layers, 2 KV heads, head_dim 4: 8 channels) and
5 tokens cut into chunks of 2, so the last chunk is short. The KV values come
from an integer formula, so they are the same on every machine. For each vector
NAME this writes:
  NAME.kvc         the container
  NAME.kv.bin      the decoded KV_BLOB [2, 2, 5, 8] of the whole sequence, little-endian
and README.md's region tables. tests/test_vectors.py reads them byte for byte.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from kvtool.format import ContainerReader, ContainerWriter, ModelIdentity  # noqa: E402
from kvtool.format import layout  # noqa: E402

IDENTITY = ModelIdentity(
    name="kvtool-vector-model", architecture="LlamaForCausalLM", num_layers=2,
    num_attention_heads=4, num_kv_heads=2, head_dim=4, hidden_size=16, intermediate_size=32,
    vocab_size=1000, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope={"rope_theta": 10000.0, "rope_scaling": None})
TOKENS = [1, 17, 42, 999, 7]
CHUNK_SIZE = 2
ALIGNMENT = 64
METADATA = {"created_by": "kvtool format-spec vectors", "created_at": "2026-11-22T00:00:00Z"}

# The long vectors: 96 tokens in chunks of 64 and 32, enough symbols that the rANS lanes
# renormalise (words in every section, odd counts too), with a loud channel setting every token's scale
# near 48, then a token 256x louder and one 4096x quieter, so the Rice blocks take escapes; fp16 and fp32
# scales; other P, N and M than the short vector's.
LONG_TOKENS = [(i * 37 + 11) % 1000 for i in range(96)]
LONG_CHUNK_SIZE = 64

# name: (codec, params or None for defaults, dtype, with extras[, long])
VECTORS = {
    "raw_bf16": ("raw", None, torch.bfloat16, True),
    "raw_fp16": ("raw", None, torch.float16, False),
    "raw_fp32": ("raw", None, torch.float32, False),
    "zstd_bf16": ("zstd", {"version": 1, "level": 3, "shuffle": "byteplane"}, torch.bfloat16, False),
    "zstd_fp32_noshuffle": ("zstd", {"version": 1, "level": 3, "shuffle": "none"}, torch.float32, False),
    "cachegen_bf16": ("cachegen", None, torch.bfloat16, False),
    "cachegen_fp16_long": ("cachegen", {"version": 1, "bins": "k:0=32,1=16;v:*=16", "prob_bits": 12, "lanes": 3},
                           torch.float16, False, True),
    "cachegen_fp32_long": ("cachegen", {"version": 1, "bins": "kv:*=64", "prob_bits": 15, "lanes": 8},
                           torch.float32, False, True),
}


def source_kv(dtype: torch.dtype) -> torch.Tensor:
    """KV_BLOB [2, 2, 5, 8] on a 1/4096 grid in [-8, 8), from a multiplicative hash."""
    n = 2 * 2 * len(TOKENS) * 8
    i = torch.arange(n, dtype=torch.int64)
    grid = (i * 2654435761 + 12345) % 65536 - 32768  # [n]
    return (grid.to(torch.float32) / 4096).view(2, 2, len(TOKENS), 8).to(dtype)


def long_source_kv(dtype: torch.dtype) -> torch.Tensor:
    """KV_BLOB [2, 2, 96, 8]: the short vector's hash grid, with a loud and a quiet token and a loud channel."""
    n = 2 * 2 * len(LONG_TOKENS) * 8
    i = torch.arange(n, dtype=torch.int64)
    grid = ((i * 2654435761 + 12345) % 65536 - 32768).to(torch.float32) / 4096
    kv = grid.view(2, 2, len(LONG_TOKENS), 8)
    kv[..., 3] = 48 + kv[..., 3] / 64  # a loud channel, as real K caches have: every token's scale ~48,
    kv[:, :, 5] *= 256  # so the Rice codes are short, and the scale of a loud token escapes them
    kv[:, :, 9] /= 4096  # and of a quiet one (fp16 stays finite: 48.2 x 256 < 65504)
    return kv.to(dtype)


def extras() -> dict[str, torch.Tensor]:
    hidden = (torch.arange(len(TOKENS) * 16, dtype=torch.float32) / 8 - 5).view(len(TOKENS), 16)
    return {"hidden_states": hidden, "roi_mask": torch.tensor([0, 1, 1, 0, 1], dtype=torch.bool)}


def available() -> dict[str, tuple]:
    from kvtool import codecs

    names = set(codecs.codec_names())
    return {k: v for k, v in VECTORS.items() if v[0] in names}


def build(name: str, path: Path) -> None:
    codec, params, dtype, with_extras = VECTORS[name][:4]
    long = len(VECTORS[name]) > 4 and VECTORS[name][4]
    kv = long_source_kv(dtype) if long else source_kv(dtype)
    tokens, chunk_size = (LONG_TOKENS, LONG_CHUNK_SIZE) if long else (TOKENS, CHUNK_SIZE)
    with ContainerWriter(path, IDENTITY, tokens, kv_dtype=dtype, chunk_size=chunk_size,
                         alignment=ALIGNMENT, metadata=METADATA) as writer:
        for start, end in writer.chunk_ranges():
            writer.write_chunk(kv[:, :, start:end], codec, params)
        if with_extras:
            for extra_name, tensor in extras().items():
                writer.write_extra(extra_name, tensor)


def decoded_bytes(path: Path) -> bytes:
    with ContainerReader(path) as reader:
        kv = reader.read_range(0, reader.num_tokens)
        return kv.contiguous().view(torch.uint8).numpy().tobytes()


def regions(path: Path) -> list[tuple[int, int, str]]:
    """(offset, length, description) of every byte region, in file order."""
    with ContainerReader(path) as r:
        m = r.manifest
        out = [(0, layout.HEADER_SIZE, f"header: magic, version {r.version}, alignment {r.header.alignment}")]
        for c in m.chunks:
            out.append((c.blob.offset, c.blob.length,
                        f"chunk {c.index}: tokens [{c.start}, {c.end}), {c.codec}, crc32 {c.blob.crc32:#010x}"))
        out.append((m.tokens.offset, m.tokens.length, f"token ids, {m.num_tokens} x u32"))
        for e in m.extras.values():
            out.append((e.blob.offset, e.blob.length, f"extra {e.name} {e.dtype} {list(e.shape)}"))
        t = r.trailer
        out.append((t.manifest_offset, t.manifest_length, "manifest (UTF-8 JSON)"))
        out.append((r.file_size - layout.TRAILER_SIZE, layout.TRAILER_SIZE,
                    f"trailer: manifest offset {t.manifest_offset}, length {t.manifest_length}, "
                    f"crc32 {t.manifest_crc32:#010x}, end magic"))
    out.sort()
    filled, pos = [], 0
    manifest_offset = r.trailer.manifest_offset
    for off, length, what in out:
        if off > pos:  # padding MUST be zero (container.md section 2.3): say which rule makes it
            why = ("the manifest starts at a multiple of 8 (container.md section 2.2)" if off == manifest_offset
                   else f"blobs start at multiples of the alignment, {r.header.alignment}")
            filled.append((pos, off - pos, f"zero padding: {why}"))
        filled.append((off, length, what))
        pos = off + length
    return filled


def main() -> None:
    lines = []
    for name in available():
        path = HERE / f"{name}.kvc"
        build(name, path)
        (HERE / f"{name}.kv.bin").write_bytes(decoded_bytes(path))
        lines.append(f"### {name}.kvc ({path.stat().st_size} bytes)\n")
        lines.append("| offset | length | region |\n|---:|---:|---|")
        lines += [f"| {o} | {n} | {w} |" for o, n, w in regions(path)]
        lines.append("")
    readme = (HERE / "README.md").read_text()
    marker = "<!-- regions -->"
    head = readme.split(marker)[0]
    (HERE / "README.md").write_text(head + marker + "\n\n" + "\n".join(lines))
    print(f"wrote {len(available())} vectors to {HERE}")


if __name__ == "__main__":
    main()
