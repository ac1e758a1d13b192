"""Prefill throughput: kvtool's paged runner vs transformers, same model, same threads.

    python bench/bench_prefill.py [--model DIR] [--lengths 256 1024] [--repeats 5]

Both compute logits for every position (transformers' default) and fill a KV
cache (ours: the paged buffer with shuffled blocks). Runs alternate between the
two engines so background load hits both alike; the table shows the best and the
median of `--repeats` timed runs after one warm-up each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvtool.dtypes import dtype_from_name  # noqa: E402
from kvtool.engine import PagedKVCache, Runner, default_model_path, load_model  # noqa: E402
from kvtool.engine.model import DEFAULT_PREFILL_CHUNK  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help="kvtool prefill_chunk")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="float32", help="kvtool KV cache dtype")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    path = Path(args.model) if args.model else default_model_path()
    ours = load_model(path, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kv_dtype = dtype_from_name(args.kv_dtype)
    gen = torch.Generator().manual_seed(0)

    def run_ours(ids: list[int]) -> float:
        cache = PagedKVCache.for_tokens(ours.config, len(ids), block_size=args.block_size,
                                        kv_dtype=kv_dtype, shuffle_seed=0)
        seq = cache.new_sequence()
        t0 = time.perf_counter()
        Runner(ours, cache).prefill(seq, ids, prefill_chunk=args.chunk, logits="all")
        return time.perf_counter() - t0

    def run_hf(ids: list[int]) -> float:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf(x, use_cache=True)
        return time.perf_counter() - t0

    print(f"model: {ours.name} ({ours.config.architecture}, fp32 weights), "
          f"torch {torch.__version__}, threads: {torch.get_num_threads()}, "
          f"kvtool: chunk {args.chunk}, block {args.block_size}, kv {args.kv_dtype}, "
          f"transformers: attn {hf.config._attn_implementation}")
    print(f"{'tokens':>7} | {'kvtool best':>11} {'median':>8} | {'transformers best':>17} "
          f"{'median':>8} | {'ratio (best)':>12}")
    print(f"{'':>7} | {'tok/s':>11} {'tok/s':>8} | {'tok/s':>17} {'tok/s':>8} | "
          f"{'kvtool/hf':>12}")
    for n in args.lengths:
        ids = torch.randint(100, ours.config.vocab_size, (n,), generator=gen).tolist()
        run_ours(ids), run_hf(ids)  # warm-up
        t_ours, t_hf = [], []
        for _ in range(args.repeats):
            t_ours.append(run_ours(ids))
            t_hf.append(run_hf(ids))
        best_o, best_h = n / min(t_ours), n / min(t_hf)
        med_o, med_h = n / statistics.median(t_ours), n / statistics.median(t_hf)
        print(f"{n:>7} | {best_o:>11.0f} {med_o:>8.0f} | {best_h:>17.0f} {med_h:>8.0f} | "
              f"{best_o / best_h:>11.2f}x", flush=True)


if __name__ == "__main__":
    main()
