"""Container I/O and lossless codecs, peers side by side on the same tensors.

    python bench/bench_container.py [--tokens 2048] [--source model|synthetic] [--repeat 3]

Table 1: write and read throughput of kvtool raw (each chunk's `ChunkSource` decoded,
a checked private copy of the mapped bytes, or copied straight into the destination,
checked as copied) vs safetensors save/load vs torch.save/torch.load.
Table 2: zstd with and without byte-plane shuffling: ratio and MB/s both ways.
MB/s are of decoded KV bytes. With --source model the KV comes from the embedded
default model (SmolLM2-135M) on offline text; synthetic KV is labelled as such.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool import codecs  # noqa: E402
from kvtool.format import ContainerReader, ContainerWriter, ModelIdentity  # noqa: E402


def model_kv(num_tokens: int, dtype: torch.dtype):
    """KV of the default model on offline text (Python's own stdlib source)."""
    from kvtool.ops.capture import capture_kv

    return capture_kv(None, _offline_text(), num_tokens, dtype)


def _offline_text() -> str:
    import inspect
    import json as json_module

    return inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)


def synthetic_kv(num_tokens: int, dtype: torch.dtype, layers=30, heads=3, head_dim=64):
    """Gaussian KV with the default model's scales (K std 2.2 with outlier channels, V std 0.9)."""
    g = torch.Generator().manual_seed(0)
    c = heads * head_dim
    k = torch.randn(layers, num_tokens, c, generator=g) * 2.2
    k[:, :, :: c // 6] *= 4  # a few outlier channels, ~4x the median
    v = torch.randn(layers, num_tokens, c, generator=g) * 0.9
    kv = torch.stack([k, v]).to(dtype)  # [2, L, T, C]
    ident = ModelIdentity(name="synthetic", architecture="LlamaForCausalLM", num_layers=layers,
                          num_attention_heads=9, num_kv_heads=heads, head_dim=head_dim,
                          hidden_size=576, intermediate_size=1536, vocab_size=49152,
                          rms_norm_eps=1e-5, tie_word_embeddings=True,
                          rope={"rope_theta": 100000.0, "rope_scaling": None})
    return kv, list(range(num_tokens)), ident


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def drop_cache(path: Path) -> None:
    """Evict a file from the page cache where the OS allows it, so reads are honest."""
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    except (AttributeError, OSError):
        pass


def io_table(kv, tokens, ident, tmp: Path, repeat: int) -> list[tuple]:
    mb = kv.numel() * kv.element_size() / 1e6
    chunk = 256
    kvc, sft, pt = tmp / "a.kvc", tmp / "a.safetensors", tmp / "a.pt"

    # The same tensors for every peer: one contiguous KV_BLOB per chunk.
    chunks = {f"chunk{i}": kv[:, :, s:s + chunk].contiguous() for i, s in enumerate(range(0, kv.shape[2], chunk))}

    def write_kvc():  # includes fsync of the file and its directory (atomic, durable)
        with ContainerWriter(kvc, ident, tokens, kv_dtype=kv.dtype, chunk_size=chunk) as w:
            for blob in chunks.values():
                w.write_chunk(blob, "raw")

    def write_sft():
        save_file(chunks, sft)

    def write_pt():
        torch.save(chunks, pt)

    # Every reader ends the same way: the chunk's values copied into a preallocated
    # destination (what a loader feeding an engine does), so the copy is common cost.
    dest = {k: torch.empty_like(v) for k, v in chunks.items()}

    def read_kvc_decode():  # a checked private copy, then the common copy into the destination
        with ContainerReader(kvc) as r:
            for i in range(len(r.chunks)):
                with r.source(i) as s:
                    dest[f"chunk{i}"].copy_(s.decode())

    def read_kvc_copy_into():  # straight into the destination, checked as copied (one pass)
        with ContainerReader(kvc) as r:
            for i in range(len(r.chunks)):
                with r.source(i) as s:
                    s.copy_into(memoryview(dest[f"chunk{i}"].view(-1).view(torch.uint8).numpy()))

    def read_sft():
        for k, v in load_file(sft).items():
            dest[k].copy_(v)

    def read_pt():
        for k, v in torch.load(pt, weights_only=True).items():
            dest[k].copy_(v)

    rows = []
    for name, write, read, path in [
        ("kvtool raw, source(i).decode() + CRC-32C (write: fsync + rename)", write_kvc, read_kvc_decode, kvc),
        ("kvtool raw, source(i).copy_into(dest) + CRC-32C", write_kvc, read_kvc_copy_into, kvc),
        ("safetensors save_file / load_file", write_sft, read_sft, sft),
        ("torch.save / torch.load", write_pt, read_pt, pt),
    ]:
        w = best_of(repeat, write)
        r = best_of(repeat, read)
        rows.append((name, mb / w, mb / r, path.stat().st_size / 1e6))
    return rows


def zstd_table(kv, repeat: int) -> list[tuple]:
    mb = kv.numel() * kv.element_size() / 1e6
    zstd = codecs.get_codec("zstd")
    rows = []
    chunk_list = [kv[:, :, s:s + 256].contiguous() for s in range(0, kv.shape[2], 256)]
    for level in (1, 3, 19):
        for shuffle in ("none", "byteplane"):
            if level == 19 and repeat > 1 and shuffle == "none":
                pass
            params = zstd.validate_params({"version": 1, "level": level, "shuffle": shuffle})
            payloads = []

            def enc():
                payloads.clear()
                payloads.extend(zstd.encode(c, params)[0] for c in chunk_list)

            te = best_of(1 if level == 19 else repeat, enc)

            def dec():
                for p, c in zip(payloads, chunk_list):
                    zstd.decode(memoryview(p), tuple(c.shape), c.dtype, params)

            td = best_of(repeat, dec)
            size = sum(len(p) for p in payloads)
            rows.append((f"zstd-{level} {'shuffled' if shuffle == 'byteplane' else 'plain'}",
                         mb * 1e6 / size, mb / te, mb / td))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--source", choices=["model", "synthetic"], default="model")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sources = []
    if args.source == "model":
        try:
            sources = [(f"{d} KV of SmolLM2-135M on Python stdlib source", *model_kv(args.tokens, dt))
                       for d, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16))]
        except ImportError as err:
            print(f"(model KV unavailable: {err}; using SYNTHETIC KV)")
    if not sources:
        sources = [(f"SYNTHETIC {d} KV (Gaussian, default-model scales)", *synthetic_kv(args.tokens, dt))
                   for d, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16))]
    print(f"# kvtool bench_container: {args.tokens} tokens, 1 thread, best of {args.repeat}, page cache warm\n")
    print("Read = open the file and copy every chunk into a preallocated tensor.\n")
    for label, kv, tokens, ident in sources:
        print(f"## {label}: {kv.numel() * kv.element_size() / 1e6:.1f} MB, 256-token chunks\n")
        if kv.dtype == torch.bfloat16:
            with tempfile.TemporaryDirectory() as tmp:
                rows = io_table(kv, tokens, ident, Path(tmp), args.repeat)
            base = next(r[2] for r in rows if r[0].startswith("safetensors"))
            print("| format | write MB/s | read MB/s | read vs safetensors | file MB |")
            print("|---|---:|---:|---:|---:|")
            for name, w, r, size in rows:
                print(f"| {name} | {w:.0f} | {r:.0f} | {r / base:.2f}x | {size:.2f} |")
            print()
        rows = zstd_table(kv, args.repeat)
        print("| codec | ratio | encode MB/s | decode MB/s |")
        print("|---|---:|---:|---:|")
        for name, ratio, e, d in rows:
            print(f"| {name} | {ratio:.3f} | {e:.0f} | {d:.0f} |")
        print()


if __name__ == "__main__":
    main()
