#!/usr/bin/env python3
"""Speed of kvtool's pca coder (native, 1 thread) at its four quality points, next to kvtool's
CacheGen (native, 1 thread), in the same run on the same 256-token chunks of real KV of the
default model (bench_cachegen.real_kv; --source synthetic for its stand-in).

MB/s are MB of bf16 KV per CPU-second of the process (per core), each the sum over chunks of
the best of --repeat runs (bench_cachegen.per_item_best), the fastest of --rounds rounds of
CacheGen then pca, through the codecs' Python entry
points (cachegen_encode/decode, pca native.encode_chunk/decode_chunk: what PcaCodec calls),
so Python's share and pca's RoPE tables are counted. The goal (issue 29): pca's decode and encode
per core at least CacheGen's. The row `transform` is pca's encoder at the largest step (2^10), where
every coefficient rounds to zero: the RoPE turn, the weights and the product alone, no coding; its
speed is a ceiling on pca's encode with that calibration (no dec figure: nothing to decode).

The calibration object: --calibration FILE, else the only *.kvcal in $KVTOOL_CALIBRATION_PATH.

    KVTOOL_CALIBRATION_PATH=/tmp/pca/cli/cal python bench/bench_pca.py [--tokens 1024] [--repeat 5] [--rounds 3]

--relay adds what `compress` does to move a pca chunk between bitstream versions at the default
point (97): its coefficients re-laid (kvtool/codecs/pca/relay.py, the numpy reference) beside a
decode and an encode (the native coder: what `store get --codec` does), each way, with how many of
the chunk's values each leaves different from the source's decode.

KVTOOL_PCA_SIMD=avx2 measures the AVX2 paths on a CPU with AVX-512 (native.native_module().simd()
names the path in the first line).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_cachegen import CHUNK, per_item_best, real_kv, synthetic_kv  # noqa: E402

from kvtool.codecs.cachegen import cachegen_decode, cachegen_encode, cachegen_params  # noqa: E402
from kvtool.codecs.pca import QUALITY_BY_AXES, native  # noqa: E402
from kvtool.codecs.pca import calibration as calmod  # noqa: E402


def load_calibration(path: str | None) -> calmod.Calibration:
    if path is None:
        found = [f for d in os.environ.get("KVTOOL_CALIBRATION_PATH", "").split(os.pathsep) if d
                 for f in glob.glob(os.path.join(d, "*" + calmod.SUFFIX))]
        if len(found) != 1:
            sys.exit(f"give --calibration FILE (found {len(found)} objects in $KVTOOL_CALIBRATION_PATH)")
        path = found[0]
    with open(path, "rb") as f:
        return calmod.from_bytes(f.read())


STEP_MAX = 2.0 ** 10  # format-spec/pca.md §2
TRANSFORM = "transform"


def measure(cal, chunks, repeat, v2=False) -> dict:
    """{method: (payload bytes, encode CPU s, decode CPU s, relative RMSE or None)} for CacheGen and
    the four pca points, each the sum over chunks of the best of `repeat` runs."""
    rows = {}
    params = cachegen_params("default")
    enc, _, ce = per_item_best(lambda pc: cachegen_encode(pc[1], params, threads=1), chunks, repeat)
    _, _, cd = per_item_best(lambda e: cachegen_decode(e[0][0], e[1][1].shape, e[1][1].dtype, e[0][1], threads=1),
                             list(zip(enc, chunks)), repeat)
    rows["cachegen"] = (sum(len(p) for p, _ in enc), ce, cd, None)
    for quality, (step, _) in QUALITY_BY_AXES[calmod.axes(cal)].items():
        raws = [(t, c.view(torch.int16).numpy().view(np.uint16)) for t, c in chunks]
        enc, _, ce = per_item_best(
            lambda tr: native.encode_chunk(tr[1], "bfloat16", cal, step, 4, tr[0], 16, threads=1), raws, repeat)
        dec, _, cd = per_item_best(
            lambda pt: native.decode_chunk(pt[0], pt[1][1].shape, "bfloat16", cal, step, pt[1][0], threads=1),
            list(zip(enc, raws)), repeat)
        got = np.concatenate([(d.astype(np.uint32) << 16).view(np.float32) for d in dec], 2)
        want = np.concatenate([c.float().numpy() for _, c in chunks], 2)
        rel = float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))
        rows[f"pca-{quality}"] = (sum(len(p) for p in enc), ce, cd, rel)
        if v2:  # bitstream version 2 (format-spec/pca.md §11), its native coder, after version 1 on the same chunks
            enc2, _, ce2 = per_item_best(
                lambda tr: native.encode_chunk_v2(tr[1], "bfloat16", cal, step, 4, tr[0], threads=1), raws, repeat)
            dec2, _, cd2 = per_item_best(
                lambda pt: native.decode_chunk_v2(pt[0], pt[1][1].shape, "bfloat16", cal, step, pt[1][0], threads=1),
                list(zip(enc2, raws)), repeat)
            got2 = np.concatenate([(d.astype(np.uint32) << 16).view(np.float32) for d in dec2], 2)
            rel2 = float(np.sqrt(((got2 - want) ** 2).mean() / (want ** 2).mean()))
            rows[f"pca2-{quality}"] = (sum(len(p) for p in enc2), ce2, cd2, rel2)
    # The transform alone: at the largest step every coefficient rounds to zero, so the encoder
    # turns, weights and multiplies every token, then has nothing to choose or code. Its time is a
    # ceiling on pca's encode speed with this calibration on this core (RESULTS §36).
    raws = [(t, c.view(torch.int16).numpy().view(np.uint16)) for t, c in chunks]
    enc, _, ce = per_item_best(
        lambda tr: native.encode_chunk(tr[1], "bfloat16", cal, STEP_MAX, 4, tr[0], 16, threads=1), raws, repeat)
    rows[TRANSFORM] = (sum(len(p) for p in enc), ce, float("nan"), None)
    return rows


def tables_per_row(cal, chunks, quality: str) -> str:
    """How many of the 32 frequency tables a row's components use (distinct side-byte tables):
    version 2's units each read their own, so these are the decoder's tables in use at once
    (bench/pca_lanes.c measures what their number costs)."""
    step = QUALITY_BY_AXES[calmod.axes(cal)][quality][0]
    counts = []
    for t, c in chunks:
        raw = c.view(torch.int16).numpy().view(np.uint16)
        payload = native.encode_chunk_v2(raw, "bfloat16", cal, step, 4, t, threads=1)
        _, L, _, C = raw.shape
        side = np.frombuffer(payload, np.uint8, count=2 * L * C, offset=24).reshape(2 * L, C)  # pca.md §11.2
        counts += [len(set((row[row != 0xFF] & 31).tolist())) for row in side]
    return f"tables a row uses: mean {np.mean(counts):.1f}, at most {max(counts)}"


def measure_relay(cal, chunks, repeat) -> None:
    """Version 1 -> 2 and 2 -> 1 at the default point: re-laid (the reference) against decoded and
    encoded (native), seconds per chunk and values changed, printed side by side."""
    from kvtool.codecs.pca import DEFAULT_QUALITY, params_for
    from kvtool.codecs.pca.relay import relay

    step = QUALITY_BY_AXES[calmod.axes(cal)][DEFAULT_QUALITY][0]
    raws = [(t, c.view(torch.int16).numpy().view(np.uint16)) for t, c in chunks]
    shape = raws[0][1].shape
    v1 = [native.encode_chunk(r, "bfloat16", cal, step, 4, t, 16, threads=1) for t, r in raws]
    v2 = [native.encode_chunk_v2(r, "bfloat16", cal, step, 4, t, threads=1) for t, r in raws]
    dec = {1: lambda p, t: native.decode_chunk(p, shape, "bfloat16", cal, step, t, threads=1),
           2: lambda p, t: native.decode_chunk_v2(p, shape, "bfloat16", cal, step, t, threads=1)}
    enc = {1: lambda x, t: native.encode_chunk(x, "bfloat16", cal, step, 4, t, 16, threads=1),
           2: lambda x, t: native.encode_chunk_v2(x, "bfloat16", cal, step, 4, t, threads=1)}
    print(f"\nbetween bitstream versions at quality {DEFAULT_QUALITY}, {len(chunks)} chunks, per chunk "
          f"(best of {repeat}; values: of {raws[0][1].size * len(raws):,}, those differing from the source's decode)")
    print(f"{'way':<8}{'re-laid s':>11}{'values':>8}{'decoded+encoded s':>19}{'values':>8}{'ratio':>8}")
    for a, b, source in ((1, 2, v1), (2, 1, v2)):
        pa = {n: params_for(cal.digest, DEFAULT_QUALITY, version=n) for n in (1, 2)}
        items = list(zip(source, (t for t, _ in raws)))
        relaid, _, t_relay = per_item_best(
            lambda it: relay(it[0], shape, "bfloat16", dict(pa[a], position=it[1]), dict(pa[b], position=it[1])),
            items, repeat)
        again, _, t_again = per_item_best(lambda it: enc[b](dec[a](it[0], it[1]), it[1]), items, repeat)
        want = [dec[a](p, t) for p, t in items]
        changed = [sum(int((dec[b](p, t) != w).sum()) for p, (_, t), w in zip(out, items, want))
                   for out in (relaid, again)]
        n = len(items)
        print(f"v{a} -> v{b}{t_relay / n:>11.3f}{changed[0]:>8}{t_again / n:>19.4f}{changed[1]:>8}"
              f"{t_relay / t_again:>7.0f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=["real", "synthetic"], default="real")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3,
                    help="CacheGen then pca, this many times; each method's fastest round is reported "
                         "(both see the host's slow and fast spells)")
    ap.add_argument("--calibration")
    ap.add_argument("--kv", help="a torch.save'd [2, L, T, C] bf16 tensor to use instead of running the model")
    ap.add_argument("--v2", action="store_true",
                    help="also pca bitstream version 2 (rows pca2-*, its native coder, format-spec/pca.md §11)")
    ap.add_argument("--relay", action="store_true",
                    help="also the move between bitstream versions: re-laid against decoded and encoded")
    args = ap.parse_args(argv)

    cal = load_calibration(args.calibration)
    if args.kv:
        kv = torch.load(args.kv)[:, :, :args.tokens].contiguous()
    else:
        kv = real_kv(args.tokens) if args.source == "real" else synthetic_kv(tokens=args.tokens)
    _, L, T, C = kv.shape
    chunks = [(t, kv[:, :, t:t + CHUNK].contiguous()) for t in range(0, T - CHUNK + 1, CHUNK)]
    mb = sum(c.numel() for _, c in chunks) * 2 / 1e6
    print(f"{args.source} KV: {len(chunks)} chunks of [2, {L}, {CHUNK}, {C}] bf16 = {mb:.1f} MB; "
          f"pca native: {native.native_available()} ({native.native_module().simd()}); load: {os.getloadavg()}")

    rows = {}
    for _ in range(args.rounds):  # CacheGen and pca in turn, each method's fastest round kept
        for name, row in measure(cal, chunks, args.repeat, args.v2).items():
            rows[name] = row if name not in rows else (row[0], min(rows[name][1], row[1]),
                                                       min(rows[name][2], row[2]), row[3])
    nvals = sum(c.numel() for _, c in chunks)
    print(f"\n{'method':<10}{'bits/val':>9}{'enc MB/s/core':>15}{'dec MB/s/core':>15}{'relRMSE':>9}")
    for name, (size, ce, cd, rel) in rows.items():
        dec = "-" if cd != cd else f"{mb / cd:.1f}"  # the transform row decodes nothing (NaN)
        print(f"{name:<10}{size * 8 / nvals:>9.3f}{mb / ce:>15.1f}{dec:>15}"
              f"{'' if rel is None else f'{rel:.4f}':>9}")
    cg = rows["cachegen"]
    points = [r for k, r in rows.items() if k.startswith("pca-")]
    for quality in (q for q in QUALITY_BY_AXES[calmod.axes(cal)] if f"pca2-{q}" in rows):
        one, two = rows[f"pca-{quality}"], rows[f"pca2-{quality}"]
        print(f"pca2-{quality} / pca-{quality}: bits {two[0] / one[0]:.4f}x, encode speed {one[1] / two[1]:.3f}x, "
              f"decode speed {one[2] / two[2]:.3f}x; {tables_per_row(cal, chunks, quality)}")
    worst_enc = min(cg[1] / r[1] for r in points)
    worst_dec = min(cg[2] / r[2] for r in points)
    print(f"\npca / cachegen per core, worst quality point: encode {worst_enc:.2f}x, decode {worst_dec:.2f}x "
          f"(goal, issue 29: >= 1.00x both)")
    print(f"pca's transform alone (step 2^10, nothing left to code) / cachegen's whole encode: "
          f"{cg[1] / rows[TRANSFORM][1]:.2f}x (a ceiling on pca's encode on this core with this calibration)")
    if args.relay:
        measure_relay(cal, chunks, max(1, args.repeat // 2))


if __name__ == "__main__":
    main()
