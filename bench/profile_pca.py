#!/usr/bin/env python3
"""One pca operation, repeated, for a profiler: the native coder (1 thread) encodes or decodes the
first 256-token chunk of the default model's real KV (bench_cachegen.real_kv, or --kv) at one step,
--repeat times, and prints its CPU time a chunk and the dense product's size. Run under `perf
record` to see where the time goes (RESULTS §36); `--step 1024` with `enc` is bench_pca's
`transform` row (every coefficient rounds to zero: the arithmetic alone).

    perf record -o pca.data python bench/profile_pca.py enc --calibration CAL --step 1024 --repeat 600
    perf report -i pca.data --sort sym
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_cachegen import CHUNK, real_kv  # noqa: E402
from bench_pca import load_calibration  # noqa: E402

from kvtool.codecs.pca import DEFAULT_SINKS, native  # noqa: E402
from kvtool.codecs.pca import calibration as calmod  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["enc", "dec"])
    ap.add_argument("--calibration")
    ap.add_argument("--step", type=float, default=0.8, help="the quantizer step (0.8: quality 97 per layer)")
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--kv", help="a torch.save'd [2, L, T, C] bf16 tensor to use instead of running the model")
    args = ap.parse_args(argv)
    cal = load_calibration(args.calibration)
    kv = torch.load(args.kv) if args.kv else real_kv(CHUNK)
    chunk = kv[:, :, :CHUNK].contiguous().view(torch.int16).numpy().view(np.uint16)
    payload = native.encode_chunk(chunk, "bfloat16", cal, args.step, DEFAULT_SINKS, 0, 16, threads=1)
    started = time.process_time()
    for _ in range(args.repeat):
        if args.mode == "enc":
            native.encode_chunk(chunk, "bfloat16", cal, args.step, DEFAULT_SINKS, 0, 16, threads=1)
        else:
            native.decode_chunk(payload, chunk.shape, "bfloat16", cal, args.step, 0, threads=1)
    seconds = (time.process_time() - started) / args.repeat
    _, L, T, C = chunk.shape
    width = cal.head_dim if calmod.axes(cal) == "head" else C
    macs = 2 * L * (T - DEFAULT_SINKS) * C * width
    print(f"{args.mode} at step {args.step} ({native.native_module().simd()}, axes per {calmod.axes(cal)}): "
          f"{seconds * 1e3:.2f} ms a chunk, {chunk.size * 2 / 1e6 / seconds:.0f} MB/s; "
          f"the product: {macs / 1e6:.0f} M multiply-adds a chunk")


if __name__ == "__main__":
    main()
