"""Where a GPU load's time goes: torch.profiler (host and device) and cProfile (the host's Python)
over the loads that miss the GPU issue's goals, on the 8B geometry (32 layers x 8 KV heads x 128,
bf16, 256-token chunks).

    python scripts/gpu_profile_load.py [--out DIR] [--tokens 8192]

Profiled, each after two warm-up loads: a CacheGen file decoded on the GPU through `kvtool.load`
at --tokens, and a raw file through the staged loader at 2,048 tokens. For each it prints the
wall time of a load, the device's busy time (the sum of its kernels and copies), the top host
and device operations (torch.profiler), and the top Python functions by own time (cProfile); a
Chrome trace of each goes to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench_load import CHUNK, Paged, identity  # noqa: E402
from kvtool.format import ContainerReader, ContainerWriter  # noqa: E402
from kvtool.load import file_tasks, load, load_chunks_staged  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128


def write(path: Path, kv: torch.Tensor, codec: str, tokens: int) -> None:
    token_ids = [(7 * i + 3) % 32000 for i in range(tokens)]
    with ContainerWriter(path, identity("8B", LAYERS, HEADS, HEAD_DIM), token_ids, kv_dtype=torch.bfloat16,
                         chunk_size=CHUNK) as w:
        for s, e in w.chunk_ranges():
            w.write_chunk(kv[:, :, s:e], codec)


def profiled(label: str, fn, out: Path, nbytes: int) -> None:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / f"trace-{label}.json"))
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    print(f"\n=== {label}: {wall * 1e3:.1f} ms a load, {nbytes / wall / 1e9:.2f} GB/s of KV; "
          f"device busy {device_us / 1e3:.1f} ms ({device_us / 1e3 / (wall * 1e3):.0%} of the wall time)")
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    python = cProfile.Profile()
    python.enable()
    fn()
    torch.cuda.synchronize()
    python.disable()
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(18)
    print(f"--- {label}: Python, by own time (one load, profiled)")
    print("\n".join(text.getvalue().splitlines()[4:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=tempfile.mkdtemp())
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("gpu_profile_load: no CUDA device")
    print("device:", torch.cuda.get_device_name(0))
    tmp = Path(tempfile.mkdtemp())
    for codec, tokens in (("cachegen", args.tokens), ("raw", 2048)):
        gen = torch.Generator().manual_seed(tokens)
        kv = (torch.randn(2, LAYERS, tokens, HEADS * HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
        path = tmp / f"{codec}-{tokens}.kvc"
        write(path, kv, codec, tokens)
        paged = Paged(LAYERS, HEADS, HEAD_DIM, tokens, device="cuda")
        device = torch.device("cuda")

        def run(path=path, paged=paged, tokens=tokens, codec=codec):
            with ContainerReader(path) as reader:
                tasks = file_tasks(reader, tokens)
                outcome = load(tasks, paged.target) if codec == "cachegen" else \
                    load_chunks_staged(tasks, paged.target, device)
            assert outcome.error is None and outcome.loaded_tokens == tokens, outcome

        profiled(f"{codec}-{tokens}", run, out, kv.numel() * kv.element_size())
        del paged
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
