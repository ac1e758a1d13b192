#!/usr/bin/env python3
"""pca bitstream version 2 against version 1 on the same real KV (format-spec/pca.md §11): bits per
value at each quality point for several unit sizes, the decode units per chunk, and the paired
CPU time of the coders (version 1 native, version 2's reference), one chunk at a time in turn.

The KV: .kvc files holding the default model's KV with the raw codec (any capture), or a
torch.save'd {name: [2, L, T, C] bf16} (bench_rd --save-kv); every whole 256-token chunk of it
at its position. The calibration: --calibration FILE (the default model's, `kvtool calibrate`).

    python bench/study_pca_v2.py --calibration CAL.kvcal --kv a.kvc b.kvc [--units 512,768,1024]

`--rope-check` alone compares §11.5's RoPE tables with libm's; `--synthetic-8b` alone codes one
random 8B-shaped chunk (its units; native against the reference). Also prints the units an 8B-shaped
chunk (32 layers, 8 KV heads of 128, 256 tokens) would have at
the live share of components measured here (units depend on how many components are coded).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvtool.codecs.pca import QUALITY_BY_AXES, native  # noqa: E402
from kvtool.codecs.pca import calibration as calmod  # noqa: E402
from kvtool.codecs.pca import reference2 as v2  # noqa: E402

CHUNK = 256
SINKS = 4


def chunks_of(paths: list[str]) -> list[tuple[str, int, np.ndarray]]:
    """(source, position, raw bf16 bits [2, L, 256, C]) of every whole chunk."""
    out = []
    for path in paths:
        if path.endswith(".kvc"):
            from kvtool.format import ContainerReader

            r = ContainerReader(path)
            kv = np.concatenate([r.read_chunk_array(i) for i in range(len(r.chunks))], 2)
            sources = {os.path.basename(path): kv.view(np.uint16)}
        else:
            import torch

            sources = {k: v.contiguous().view(torch.int16).numpy().view(np.uint16) for k, v in torch.load(path).items()}
        for name, kv in sources.items():
            for t in range(0, kv.shape[2] - CHUNK + 1, CHUNK):
                out.append((name, t, np.ascontiguousarray(kv[:, :, t:t + CHUNK])))
    return out


def rope_agreement(positions: int = 1 << 17) -> None:
    """How often §11.5's float32 RoPE tables differ from version 1's (libm's cos/sin), positions
    0..positions-1, the usual RoPE bases and head sizes."""
    for base in (1e4, 1e5, 5e5):
        for D in (64, 128):
            exponent = np.arange(0, D, 2, dtype=np.float32) / np.float32(D)
            inv = (1.0 / (np.float32(base) ** exponent)).astype(np.float32)
            a = np.arange(positions, dtype=np.float64)[:, None] * inv.astype(np.float64)[None, :]
            s2, c2 = v2.sincos(a)
            diff = int((s2.astype(np.float32) != np.sin(a).astype(np.float32)).sum()
                       + (c2.astype(np.float32) != np.cos(a).astype(np.float32)).sum())
            print(f"RoPE base {base:g}, head_dim {D}: {diff} of {2 * a.size} float32 table entries differ from libm's")


def synthetic_8b() -> None:
    """An 8B-shaped chunk (32 layers, 8 KV heads of 128, 256 tokens after a sequence's first) of
    random KV over a random orthonormal calibration (every component coded): its units, and the
    native coder against the reference on it."""
    rng = np.random.default_rng(8)
    L, H, D, T = 32, 8, 128, 256
    C = H * D
    basis = np.empty((2, L, C, C), np.int16)
    for p in range(2):
        for layer in range(L):
            q, _ = np.linalg.qr(rng.standard_normal((C, C)))
            basis[p, layer] = np.rint(q * calmod.BASIS_ONE).clip(-32767, 32767)
    inv_freq = np.tile((1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32), (L, 1))
    cal = calmod.Calibration(mean=np.zeros((2, L, C), np.float32), weight=np.ones((2, L, C), np.float32),
                             basis=basis, inv_freq=inv_freq, head_dim=D, model="synthetic-8b")
    x = (rng.standard_normal((2, L, T, C)) * 2).astype(np.float32)
    raw = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: any bf16 input will do
    t0 = time.perf_counter()
    payload = native.encode_chunk_v2(raw, "bfloat16", cal, 0.8, 4, 256)
    t1 = time.perf_counter()
    out = native.decode_chunk_v2(payload, raw.shape, "bfloat16", cal, 0.8, 256)
    t2 = time.perf_counter()
    lay = v2.parse(payload, raw.shape, "bfloat16")
    same = out.tobytes() == v2.decode_chunk(payload, raw.shape, "bfloat16", cal, 0.8, 256).tobytes()
    print(f"8B-shaped chunk [2, {L}, {T}, {C}] at step 0.8, U={lay.unit}: {len(lay.spans)} units, "
          f"{(lay.side != v2.ALL_ZERO).mean():.3f} of the components coded, {len(payload) * 8 / raw.size:.3f} b/v; "
          f"native encode {t1 - t0:.2f} s, decode {t2 - t1:.2f} s (wall, 1 call); native decode == reference: {same}")


def timed(fn):
    t0 = time.process_time()
    r = fn()
    return r, time.process_time() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration")
    ap.add_argument("--kv", nargs="+")
    ap.add_argument("--units", default="512,768,1024")
    ap.add_argument("--rope-check", action="store_true", help="only compare the RoPE tables of §11.5 with libm's")
    ap.add_argument("--synthetic-8b", action="store_true",
                    help="only code one random 8B-shaped chunk: its units, native against the reference")
    args = ap.parse_args(argv)
    if args.rope_check:
        return rope_agreement()
    if args.synthetic_8b:
        return synthetic_8b()
    if not (args.calibration and args.kv):
        ap.error("--calibration and --kv are required (but with --rope-check)")
    with open(args.calibration, "rb") as f:
        cal = calmod.from_bytes(f.read())
    chunks = chunks_of(args.kv)
    units = [int(u) for u in args.units.split(",")]
    _, L, _, C = chunks[0][2].shape
    values = sum(c.size for _, _, c in chunks)
    print(f"{len(chunks)} chunks of [2, {L}, {CHUNK}, {C}] bf16 from {', '.join(sorted({s for s, _, _ in chunks}))}; "
          f"calibration {cal.digest[:16]}... ({calmod.axes(cal)}); pca native: {native.native_available()}; "
          f"load {os.getloadavg()}")
    print("\nversion 2's bits as a ratio to version 1's (all chunks' bytes together)")
    print(f"{'quality':<8}{'step':>6}{'v1 b/v':>9}" + "".join(f"{f'v2 U={u}':>13}" for u in units)
          + f"{'live':>7}" + "".join(f"{f'units U={u}':>13}" for u in units) + f"{f'8B units@{v2.DEFAULT_UNIT}':>14}")
    timing, sames = {}, []
    for quality, (step, _) in QUALITY_BY_AXES[calmod.axes(cal)].items():
        b1 = 0
        b2 = {u: 0 for u in units}
        n_units = {u: 0 for u in units}
        live = coded = same = 0
        t1e = t1d = t2e = t2d = 0.0
        for _, pos, raw in chunks:  # v1 and v2 in turn, chunk by chunk (paired on this shared host)
            p1, te = timed(lambda: native.encode_chunk(raw, "bfloat16", cal, step, SINKS, pos, 16, threads=1))
            out1, td = timed(lambda: native.decode_chunk(p1, raw.shape, "bfloat16", cal, step, pos, threads=1))
            b1 += len(p1)
            t1e, t1d = t1e + te, t1d + td
            for u in units:
                p2, te = timed(lambda: v2.encode_chunk(raw, "bfloat16", cal, step, SINKS, pos, u))
                b2[u] += len(p2)
                lay = v2.parse(p2, raw.shape, "bfloat16")
                n_units[u] += len(lay.spans)
                if u == v2.DEFAULT_UNIT:
                    out2, td = timed(lambda: v2.decode_chunk(p2, raw.shape, "bfloat16", cal, step, pos))
                    same += out2.tobytes() == out1.tobytes() == native.decode_chunk_v2(
                        p2, raw.shape, "bfloat16", cal, step, pos, threads=1).tobytes()
                    t2e, t2d = t2e + te, t2d + td
                    live += int((lay.side != v2.ALL_ZERO).sum())
                    coded += lay.side.size
        share = live / coded
        # an 8B-shaped chunk after the first: 64 rows of 1024 components, 256 coded tokens
        est_8b = 64 * math.ceil(share * 1024 * 256 / v2.DEFAULT_UNIT)
        print(f"{quality:<8}{step:>6g}{b1 * 8 / values:>9.4f}"
              + "".join(f"{b2[u] / b1:>12.4f}x" for u in units)
              + f"{share:>7.3f}" + "".join(f"{n_units[u] / len(chunks):>13.0f}" for u in units) + f"{est_8b:>14}")
        timing[quality] = (t1e, t1d, t2e, t2d)
        sames.append(f"{quality}: {same} of {len(chunks)}")
    print("chunks whose values version 2 decodes (reference and native) equal to version 1's, byte for byte: "
          + ", ".join(sames))
    mb = values * 2 / 1e6
    print(f"\nCPU seconds (process time) over the {len(chunks)} chunks, 1 thread, v1 native vs v2 reference "
          f"(U={v2.DEFAULT_UNIT}), "
          f"in turn:")
    print(f"{'quality':<8}{'v1 enc MB/s':>12}{'v1 dec MB/s':>12}{'v2 enc MB/s':>12}{'v2 dec MB/s':>12}"
          f"{'v2/v1 enc':>10}{'v2/v1 dec':>10}")
    for quality, (t1e, t1d, t2e, t2d) in timing.items():
        print(f"{quality:<8}{mb / t1e:>12.1f}{mb / t1d:>12.1f}{mb / t2e:>12.1f}{mb / t2d:>12.1f}"
              f"{t1e / t2e:>10.3f}{t1d / t2d:>10.3f}")


if __name__ == "__main__":
    main()
