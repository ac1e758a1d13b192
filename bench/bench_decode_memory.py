"""Peak memory of the commands that decode a chunk (issue 46: at most 2x one chunk's decoded size,
format-spec/container.md §5 "Memory"): a zstd file of one chunk that decodes to MIB mebibytes
(bf16, mostly zeros, within the 1024x rule), written with the public writer, then each command in
its own process, its peak RSS read by /usr/bin/time -v. Baseline: `inspect` without decoding.

    python bench/bench_decode_memory.py [--mib 256] [--keep DIR]
    PYTHONPATH=OTHER_TREE python bench/bench_decode_memory.py      (another commit, side by side)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def make_file(path: Path, mib: int) -> int:
    """The file, and its chunk's decoded bytes."""
    import torch

    from kvtool.format import ContainerWriter, ModelIdentity

    layers, heads, dim = 32, 8, 128
    tokens = mib * 2**20 // (2 * layers * heads * dim * 2)
    identity = ModelIdentity(name="mem-probe", architecture="LlamaForCausalLM", num_layers=layers,
                             num_attention_heads=2 * heads, num_kv_heads=heads, head_dim=dim, hidden_size=2 * heads * dim,
                             intermediate_size=4 * heads * dim, vocab_size=1000, rms_norm_eps=1e-5,
                             tie_word_embeddings=True, rope={"rope_theta": 10000.0, "rope_scaling": None})
    kv = torch.zeros(2, layers, tokens, heads * dim, dtype=torch.bfloat16)
    noise = max(2**20 * mib // 1024 * 3 // 4, 4096)  # enough to keep the chunk within 1024x its stored size
    kv.view(-1)[:noise] = (torch.randn(noise, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    with ContainerWriter(path, identity, [i % 1000 for i in range(tokens)], kv_dtype="bfloat16", chunk_size=tokens) as w:
        w.write_chunk(kv, "zstd", None)
    return kv.numel() * 2


def peak_mb(argv: list[str], cwd: Path) -> int:
    """Peak RSS of `argv`, run in `cwd` (not the checkout: `python -m` puts its folder first, and
    PYTHONPATH then names the tree measured)."""
    done = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip().splitlines()[-1]}")
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the chunk's decoded size")
    parser.add_argument("--keep", type=Path, help="work folder (default: a temp folder, removed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        path = work / f"z{args.mib}.kvc"
        decoded = make_file(path, args.mib)
        kvtool = [sys.executable, "-m", "kvtool"]
        base = peak_mb([*kvtool, "inspect", str(path)], work)
        print(f"{path.name}: {os.path.getsize(path):,} bytes, one chunk of {decoded / 2**20:.0f} MiB decoded; "
              f"baseline (inspect, no decode) {base} MB")
        print("| command | peak RSS (MB) | growth / decoded size |\n|---|---:|---:|")
        for name, argv in (("inspect --stats", ["inspect", "--stats", str(path)]),
                           ("dump .safetensors", ["dump", str(path), "-o", str(work / "out.safetensors")]),
                           ("dump .npy", ["dump", str(path), "-o", str(work / "out.npy")]),
                           ("verify", ["verify", str(path)])):
            peak = peak_mb([*kvtool, *argv], work)
            print(f"| {name} | {peak:,} | {(peak - base) * 2**20 / decoded:.2f}x |")


if __name__ == "__main__":
    main()
