#!/usr/bin/env python3
"""Paired A/B of two or more builds of kvtool's pca coder (`kvtool/_pca_native*.so` files) in
one process: each round times every build in turn at the four quality points on the same real
KV of the default model, so a change's speed-up is read beside its own baseline under the same
host load. CPU time (1 thread), each build's fastest round after the first (warm-up).

    python setup.py build_ext --inplace && cp kvtool/_pca_native*.so /tmp/A.so   # before
    # ... change kernels/pca_*.c, build again ...
    cp kvtool/_pca_native*.so /tmp/B.so
    python bench/ab_pca_builds.py dec /tmp/A.so /tmp/B.so --calibration CAL [--rounds 10] [--kv real_kv.pt]

Each build must encode the same bytes (checked: the coder is bit-exact across builds and paths).
KVTOOL_PCA_SIMD=avx2 (or 0) narrows every build's path alike.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cachegen import CHUNK, real_kv  # noqa: E402
from bench_pca import load_calibration  # noqa: E402
from kvtool.codecs.pca import QUALITY_BY_AXES, native  # noqa: E402
from kvtool.codecs.pca import calibration as calmod  # noqa: E402


def load_build(path: str):
    spec = importlib.util.spec_from_file_location("kvtool._pca_native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["enc", "dec"])
    ap.add_argument("builds", nargs="+", help="two or more _pca_native*.so files")
    ap.add_argument("--calibration")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--kv", help="a torch.save'd [2, L, T, C] bf16 tensor to use instead of running the model")
    args = ap.parse_args(argv)
    if len(args.builds) < 2 or args.rounds < 2:
        sys.exit("give two or more builds and --rounds of at least 2")
    cal = load_calibration(args.calibration)
    kv = torch.load(args.kv)[:, :, :args.tokens] if args.kv else real_kv(args.tokens)
    chunks = [kv[:, :, t:t + CHUNK].contiguous().view(torch.int16).numpy().view(np.uint16)
              for t in range(0, kv.shape[2] - CHUNK + 1, CHUNK)]
    steps = [step for step, _ in QUALITY_BY_AXES[calmod.axes(cal)].values()]
    modules = [load_build(b) for b in args.builds]
    payloads, best = {}, [[float("inf")] * len(steps) for _ in modules]
    try:
        for r in range(args.rounds):
            for i, module in enumerate(modules):
                native.EXTENSION.module = lambda warn=True, m=module: m
                for si, step in enumerate(steps):
                    t0 = time.process_time()
                    for ci, c in enumerate(chunks):
                        if args.mode == "enc" or (si, ci) not in payloads:
                            p = native.encode_chunk(c, "bfloat16", cal, step, 4, ci * CHUNK, 16, threads=1)
                            if payloads.setdefault((si, ci), p) != p:
                                sys.exit(f"{args.builds[i]} encodes other bytes than {args.builds[0]}")
                        if args.mode == "dec":
                            native.decode_chunk(payloads[(si, ci)], c.shape, "bfloat16", cal, step, ci * CHUNK,
                                                threads=1)
                    if r > 0:
                        best[i][si] = min(best[i][si], time.process_time() - t0)
    finally:
        del native.EXTENSION.module  # the class's own loader again
    mb = sum(c.size for c in chunks) * 2 / 1e6
    print(f"{args.mode} MB/s per core at steps {steps} (path: {modules[0].simd()}), fastest of {args.rounds - 1} rounds")
    for path, b in zip(args.builds, best):
        ratio = " ".join(f"{best[0][k] / b[k]:.2f}x" for k in range(len(steps)))
        print(f"{os.path.basename(path):<28}" + " ".join(f"{mb / x:8.1f}" for x in b) + f"   vs first: {ratio}")


if __name__ == "__main__":
    main()
