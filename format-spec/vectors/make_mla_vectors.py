"""Build the mla_latent test vectors (python format-spec/vectors/make_mla_vectors.py).

Written from format-spec/container.md alone, with the standard library (and the `zstandard`
package for the zstd vector): it imports nothing of kvtool's, so kvtool's reader and writer are
checked against an independent reading of the spec (tests/test_vectors.py rebuilds the raw
vector with kvtool's writer and compares the bytes).

Both vectors are a tiny MLA model (2 layers, kv_lora_rank 8, rope_dim 4: 12 channels of one
latent per token and layer) and the 5 tokens and chunks of 2 of the other vectors. For each
vector NAME this writes NAME.kvc (the container) and NAME.kv.bin (the chunks' decoded latent
[1, 2, 5, 12] of the whole sequence, little-endian bfloat16).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS, KV_LORA_RANK, ROPE_DIM = 2, 8, 4
CHANNELS = KV_LORA_RANK + ROPE_DIM
TOKENS = [1, 17, 42, 999, 7]
CHUNK_SIZE = 2
ALIGNMENT = 64
METADATA = {"created_by": "kvtool format-spec vectors", "created_at": "2026-11-22T00:00:00Z"}
MAGIC, END_MAGIC = b"\x89KVC\r\n\x1a\n", b"\x89KVCEND\n"
VERSION = (1, 1)  # mla_latent came with 1.1 (container.md section 3.2)

# The model as kvtool records an MLA model: its identity names the latent layout in `extra`, so
# its fingerprint is never a K/V model's (container.md section 3.1). Keys in kvtool's order.
MODEL = {
    "name": "kvtool-vector-mla-model", "architecture": "DeepseekV3ForCausalLM", "num_layers": LAYERS,
    "num_attention_heads": 4, "num_kv_heads": 1, "head_dim": CHANNELS, "hidden_size": 16,
    "intermediate_size": 32, "vocab_size": 1000, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "rope": {"rope_theta": 10000.0, "rope_scaling": None},
    "extra": {"kv_layout": "mla_latent", "kv_lora_rank": KV_LORA_RANK, "qk_rope_head_dim": ROPE_DIM,
              "qk_nope_head_dim": 8, "v_head_dim": 8, "q_lora_rank": None},
}
VECTORS = {"mla_raw_bf16": "raw", "mla_zstd_bf16": "zstd"}
ZSTD_PARAMS = {"version": 1, "level": 3, "shuffle": "byteplane"}


def crc32c(data: bytes) -> int:
    """CRC-32C (container.md section 1), bit by bit from the reflected polynomial."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def bfloat16(value: float) -> bytes:
    """A float32's bfloat16, rounded to nearest even, little-endian."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return struct.pack("<H", ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)


def latent_values() -> list[float]:
    """[1, 2, 5, 12] on a 1/4096 grid in [-8, 8), the other vectors' hash formula, flat C order."""
    return [((i * 2654435761 + 12345) % 65536 - 32768) / 4096 for i in range(LAYERS * len(TOKENS) * CHANNELS)]


def chunk_bytes(values: list[float], start: int, end: int) -> bytes:
    """Tokens [start, end) of every layer: the chunk's [1, L, T, C] in C order."""
    out = bytearray()
    for layer in range(LAYERS):
        for token in range(start, end):
            at = (layer * len(TOKENS) + token) * CHANNELS
            out += b"".join(bfloat16(v) for v in values[at:at + CHANNELS])
    return bytes(out)


def byteplane(data: bytes, itemsize: int) -> bytes:
    """container.md 6.2: plane p holds byte k-1-p of every element."""
    n = len(data) // itemsize
    return b"".join(bytes(data[e * itemsize + itemsize - 1 - p] for e in range(n)) for p in range(itemsize))


def encode(codec: str, raw: bytes) -> tuple[bytes, int, dict]:
    if codec == "raw":
        return raw, 0, {"version": 1}
    import zstandard

    frame = zstandard.ZstdCompressor(level=ZSTD_PARAMS["level"], write_content_size=True).compress(byteplane(raw, 2))
    return frame, 1, dict(ZSTD_PARAMS)


def fingerprint(model: dict) -> str:
    hashed = {k: v for k, v in model.items() if k not in ("name", "fingerprint", "weights_digest")}
    text = json.dumps(hashed, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def build(codec: str) -> bytes:
    values = latent_values()
    out = bytearray(struct.pack("<8sHHIII40s", MAGIC, *VERSION, 64, ALIGNMENT, 0, bytes(40)))

    def blob(payload: bytes) -> dict:
        out.extend(bytes(-len(out) % ALIGNMENT))
        ref = {"offset": len(out), "length": len(payload), "crc32": crc32c(payload)}
        out.extend(payload)
        return ref

    chunks, previous = [], bytes(32)
    for start in range(0, len(TOKENS), CHUNK_SIZE):
        end = min(start + CHUNK_SIZE, len(TOKENS))
        previous = hashlib.sha256(previous + b"".join(struct.pack("<I", t) for t in TOKENS[start:end])).digest()
        payload, codec_id, params = encode(codec, chunk_bytes(values, start, end))
        ref = blob(payload)
        chunks.append({"start": start, "end": end, "prefix_hash": previous.hex(), "codec": codec,
                       "codec_id": codec_id, "codec_params": params, **ref,
                       "shape": [1, LAYERS, end - start, CHANNELS], "dtype": "bfloat16"})
    tokens = blob(b"".join(struct.pack("<I", t) for t in TOKENS))
    manifest = {
        "model": {**MODEL, "fingerprint": fingerprint(MODEL)},
        "kv": {"dtype": "bfloat16", "layout": "mla_latent",
               "latent": {"kv_lora_rank": KV_LORA_RANK, "rope_dim": ROPE_DIM}},
        "sequence": {"num_tokens": len(TOKENS), "chunk_size": CHUNK_SIZE, "tokens": tokens},
        "chunks": chunks, "extras": {}, "metadata": METADATA,
    }
    text = json.dumps(manifest, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    out.extend(bytes(-len(out) % 8))
    offset = len(out)
    out.extend(text)
    out.extend(struct.pack("<QQII8s", offset, len(text), crc32c(text), 0, END_MAGIC))
    return bytes(out)


def main() -> None:
    values = latent_values()
    decoded = chunk_bytes(values, 0, len(TOKENS))  # the whole sequence, [1, L, 5, C]
    for name, codec in VECTORS.items():
        (HERE / f"{name}.kvc").write_bytes(build(codec))
        (HERE / f"{name}.kv.bin").write_bytes(decoded)
    print(f"wrote {len(VECTORS)} mla_latent vectors to {HERE}")


if __name__ == "__main__":
    main()
