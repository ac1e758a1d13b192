#!/usr/bin/env python3
"""Benchmark kvtool's CUDA kernels (needs a CUDA GPU; run via scripts/gpu_check.sh).

Paged gather/scatter (kernels/paged_copy.cu), per layout, Llama-3-8B-like KV
(32 layers, 8 KV heads x 128, bf16, block size 16, blocks assigned at random):
  kernel      the fused kernel: all layers, K and V, one launch
  torch-ref   the connector's torch path on the GPU (index_select/index_copy_
              per layer and K/V: "advanced indexing")
  d2d-copy    a device-to-device torch copy of the same bytes (the ceiling;
              goal: kernel >= 80% of it)
  pinned      the kernel reading/writing a pinned host blob in place, vs
  pcie-copy   a torch copy of the same bytes between device and pinned host
GB/s count the blob's bytes once (what moves between cache and blob).

CacheGen (kernels/cachegen_cuda.cu), Llama-8B-like 256-token chunks
([2, 32, 256, 1024] bf16, default bins), a batch of --chunks chunks:
  gpu decode  kernel time (payloads already on the GPU), GB/s of decoded bf16;
              goal >= 100 GB/s on an H100; also end to end (host payload
              parsing + upload + decode) and a single chunk
  gpu encode  end to end (launches + size readback + compaction + copy of the
              payload to the host), GB/s of input bf16
  cpu         kvtool's native CPU coder (all cores) and zstd-3 on the same chunks
  lmcache     LMCache 0.5.6's CUDA CacheGen (its quantizer, calculate_cdf,
              encode_fast_new, decode_fast_prefsum, do_dequantize) on the same
              chunks and bins, when its wheel imports here (put it and
              cachetools in .gpu_wheels/: scripts/gpu_check.sh installs them);
              else the reason it does not
Synthetic data (Gaussian with outlier channels; labelled SYNTHETIC); with --real FILE also the
whole chunks of a captured kvtool file (REAL), every decoder variant on both, and the variant a
decode that names none calibrates to.

    python bench/bench_cuda.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvtool.connectors import PagedLayout  # noqa: E402
from kvtool.connectors.paged_torch import torch_gather as _torch_gather, torch_scatter as _torch_scatter  # noqa: E402


def cuda_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over reps, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


GRAPHS = {"usable": False, "why": "--graphs not given"}  # and the first capture that fails turns them off


def graph_time(fn, reps: int = 20) -> float | None:
    """Median seconds of a CUDA-graph replay of fn(): device time without the host's launch
    overhead; None (the caller times with events) when graphs are off for this run.

    As torch documents it: warm-up on a side stream, then capture with errors counted for this
    thread only (another thread's CUDA call, e.g. a pinned-memory free, must not invalidate it).
    The first capture that fails turns graphs off for the rest of the run, once, with its reason:
    a failed capture can leave the context refusing every later one ("operation failed due to a
    previous error during capture"), which the last H100 run printed on every row."""
    if not GRAPHS["usable"]:
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            fn()
    except Exception as exc:  # noqa: BLE001 - report once, fall back
        GRAPHS.update(usable=False, why=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        print(f"   (CUDA-graph capture failed: {GRAPHS['why']}; event timing from here on)")
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None
    return cuda_time(g.replay, reps=reps)


def wall_time(fn, reps: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_caches(layout, L, NB, BS, H, D, dtype, dev):
    def one():
        if layout is PagedLayout.FLASH_ATTN:
            return torch.randn(2, NB, BS, H, D, device=dev, dtype=dtype)
        if layout is PagedLayout.FLASHINFER:
            return torch.randn(NB, 2, BS, H, D, device=dev, dtype=dtype)
        if layout is PagedLayout.VLLM:
            return torch.randn(NB, H, BS, 2 * D, device=dev, dtype=dtype)
        return (torch.randn(NB, BS, H, D, device=dev, dtype=dtype), torch.randn(NB, BS, H, D, device=dev, dtype=dtype))
    return [one() for _ in range(L)]


def bench_paged(args, results):
    from kvtool.connectors import paged_cuda as paged

    dev = torch.device("cuda")
    L, H, D, BS = args.layers, args.heads, args.head_dim, 16
    dt = torch.bfloat16
    print(f"\n== paged gather/scatter: {L} layers x {H} heads x {D}, bf16, block size {BS}, random blocks")
    print("kernel/torch columns: device time (" + ("CUDA-graph replays" if GRAPHS["usable"] else "CUDA events around each call") + "); 'e2e': the Python call timed with events,")
    print("host overhead included (dominates small sizes)")
    print(f"{'layout':<11}{'tokens':>7}{'MB':>8} | {'gather':>7}{'scatter':>8}{'g-e2e':>7}{'torch-g':>8}{'torch-s':>8}"
          f"{'d2d':>7}{'g/d2d':>7}{'s/d2d':>7} | {'pin-g':>6}{'pin-s':>6}{'d2h':>6}{'h2d':>6}   (GB/s)")
    for T in args.tokens:
        NB = max(4 * ((T + BS - 1) // BS), 64)
        blob_bytes = 2 * L * T * H * D * 2
        src = torch.empty(blob_bytes // 2, dtype=dt, device=dev).normal_()
        dst = torch.empty_like(src)
        t_d2d = graph_time(lambda: dst.copy_(src)) or cuda_time(lambda: dst.copy_(src))
        host = torch.empty(2, L, T, H * D, dtype=dt, pin_memory=True)
        dblob = torch.empty(2, L, T, H * D, dtype=dt, device=dev)
        t_d2h = cuda_time(lambda: host.copy_(dblob, non_blocking=True), reps=10)
        t_h2d = cuda_time(lambda: dblob.copy_(host, non_blocking=True), reps=10)
        del src, dst
        for layout in paged.LAYOUT_CODES:  # the kernel's layouts (vllm_cpu is a host layout)
            caches = make_caches(layout, L, NB, BS, H, D, dt, dev)
            slots = torch.randperm(NB * BS, device=dev)[:T]
            blob = torch.empty(2, L, T, H * D, dtype=dt, device=dev)

            def timed(fn, reps=20):
                return graph_time(fn, reps) or cuda_time(fn, reps)

            assert paged.gather(caches, layout, slots, blob)  # the kernel takes every case timed here
            t_g = timed(lambda: paged.gather(caches, layout, slots, blob))
            t_s = timed(lambda: paged.scatter(blob, caches, layout, slots))
            t_ge = cuda_time(lambda: paged.gather(caches, layout, slots, blob))
            t_tg = timed(lambda: _torch_gather(caches, layout, slots, blob), reps=10)
            t_ts = timed(lambda: _torch_scatter(blob, caches, layout, slots), reps=10)
            t_pg = timed(lambda: paged.gather(caches, layout, slots, host), reps=10)
            t_ps = timed(lambda: paged.scatter(host, caches, layout, slots), reps=10)
            gb = blob_bytes / 1e9
            row = dict(layout=layout.value, tokens=T, mb=blob_bytes / 1e6, gather=gb / t_g, scatter=gb / t_s,
                       gather_e2e=gb / t_ge, torch_gather=gb / t_tg, torch_scatter=gb / t_ts, d2d=gb / t_d2d,
                       gather_vs_d2d=t_d2d / t_g, scatter_vs_d2d=t_d2d / t_s, pinned_gather=gb / t_pg,
                       pinned_scatter=gb / t_ps, d2h=gb / t_d2h, h2d=gb / t_h2d, vec_bytes=paged.last_vec_bytes())
            results["paged"].append(row)
            print(f"{layout.value:<11}{T:>7}{row['mb']:>8.1f} | {row['gather']:>7.0f}{row['scatter']:>8.0f}"
                  f"{row['gather_e2e']:>7.0f}{row['torch_gather']:>8.0f}{row['torch_scatter']:>8.0f}{row['d2d']:>7.0f}"
                  f"{row['gather_vs_d2d']:>7.0%}{row['scatter_vs_d2d']:>7.0%} | {row['pinned_gather']:>6.1f}"
                  f"{row['pinned_scatter']:>6.1f}{row['d2h']:>6.1f}{row['h2d']:>6.1f}")
            del caches, blob
        del host, dblob
        torch.cuda.empty_cache()


def synthetic_chunk(L, T, C, seed, dev):
    g = torch.Generator(device=dev).manual_seed(seed)
    chan = torch.exp(torch.randn(2, L, 1, C, device=dev, generator=g) * 0.7)
    return (torch.randn(2, L, T, C, device=dev, generator=g) * chan).to(torch.bfloat16)


def bench_cachegen(args, results):
    from kvtool.codecs.cachegen import cachegen_decode, cachegen_encode
    from kvtool.codecs.cachegen.native import default_threads
    from kvtool.codecs.cachegen import gpu as gcg

    dev = torch.device("cuda")
    L, T, C, n = args.cg_layers, 256, args.cg_channels, args.chunks
    kvs = [synthetic_chunk(L, T, C, i, dev) for i in range(n)]
    raw = 2 * L * T * C * 2  # bytes per chunk (bf16)
    print(f"\n== CacheGen: {n} chunks of [2, {L}, {T}, {C}] bf16 (SYNTHETIC), default params; "
          f"{raw * n / 1e9:.2f} GB decoded")
    res = results["cachegen"]
    # GPU encode, end to end
    payloads, p = gcg.encode_chunks(kvs, None)
    t_enc = wall_time(lambda: gcg.encode_chunks(kvs, None), reps=3)
    size = sum(len(x) for x in payloads)
    res["ratio_vs_bf16"] = raw * n / size
    res["gpu_encode_e2e_GBps"] = raw * n / t_enc / 1e9
    # GPU decode: kernel only (payloads on the device), every variant and table placement, end to end
    reference = decode_variants(payloads, kvs, p, raw * n, res)
    res["decode_tables"] = gcg.plan_decode(payloads[:1], [kvs[0].shape], torch.bfloat16, p).tables  # what 'auto' picks
    plan1 = gcg.plan_decode(payloads[:1], [kvs[0].shape], torch.bfloat16, p)
    res["gpu_decode_kernel_1chunk_GBps"] = raw / cuda_time(plan1.run, reps=10, warmup=2) / 1e9
    plan1 = gcg.plan_decode(payloads[:1], [kvs[0].shape], torch.bfloat16, p, variant=gcg.VAR_GTAB | gcg.VAR_WINDOW)
    res["gpu_decode_kernel_1chunk_gtab+window_GBps"] = raw / cuda_time(plan1.run, reps=10, warmup=2) / 1e9
    res["gpu_decode_kernel_1chunk_gtab+window_same_output"] = torch.equal(
        plan1.check()[0].view(torch.int16), reference[0].view(torch.int16)) if reference else None
    t_e2e = wall_time(lambda: gcg.decode_chunks(payloads, [k.shape for k in kvs], torch.bfloat16, p), reps=3)
    res["gpu_decode_e2e_GBps"] = raw * n / t_e2e / 1e9
    # CPU baselines on a few chunks
    m = min(n, args.cpu_chunks)
    host = [k.cpu() for k in kvs[:m]]
    thr = default_threads()
    t0 = time.perf_counter()
    cpu_pl = [cachegen_encode(h, None, threads=thr)[0] for h in host]
    res["cpu_encode_GBps"] = raw * m / (time.perf_counter() - t0) / 1e9
    res["cpu_encode_identical"] = cpu_pl == payloads[:m]
    t0 = time.perf_counter()
    for pl, h in zip(cpu_pl, host):
        cachegen_decode(pl, h.shape, torch.bfloat16, p, threads=thr)
    res["cpu_decode_GBps"] = raw * m / (time.perf_counter() - t0) / 1e9
    res["cpu_threads"] = thr
    try:
        import zstandard

        cz, dz = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
        bufs = [h.view(torch.int16).numpy().tobytes() for h in host]
        t0 = time.perf_counter()
        comp = [cz.compress(b) for b in bufs]
        res["zstd3_compress_GBps"] = raw * m / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for c in comp:
            dz.decompress(c)
        res["zstd3_decompress_GBps"] = raw * m / (time.perf_counter() - t0) / 1e9
        res["zstd3_ratio"] = raw * m / sum(len(c) for c in comp)
    except ImportError:
        res["zstd3"] = "zstandard not installed"
    print(f"{'':<46}{'GB/s':>8}  same output as the first decoder")
    for k, v in res.items():
        if k.endswith("GBps"):
            same = res.get(k[:-5] + "_same_output")
            print(f"{k[:-5]:<46}{v:>8.2f}  {'' if same is None else same}")
    print(f"ratio vs bf16: cachegen {res['ratio_vs_bf16']:.2f}x"
          + (f", zstd-3 {res['zstd3_ratio']:.2f}x" if "zstd3_ratio" in res else "")
          + f"; GPU bytes == CPU bytes on {m} chunks: {res['cpu_encode_identical']}; decode tables: {res['decode_tables']}"
          + f"; CPU threads {thr}")
    if "lmcache" not in args.skip:
        from kvtool.codecs.cachegen import resolve_bins

        bench_lmcache(args, results, kvs, resolve_bins(p["bins"], L))


def decode_variants(payloads, kvs, p, nbytes, res, prefix="") -> list | None:
    """Kernel time of every decoder variant and table placement on these payloads (GB/s of
    decoded KV into res), whether each gives the first one's output, and which variant the
    calibration of a decode that names none picks here. Returns the first variant's output."""
    from kvtool.codecs.cachegen import gpu as gcg

    names = gcg.DECODE_VARIANTS
    runs = [(t, v) for t in ("smem", "global") for v in names if not v & gcg.VAR_GTAB]
    runs += [("smem", v) for v in names if v & gcg.VAR_GTAB]  # its tables are always in shared memory
    reference = None
    shapes = [k.shape for k in kvs]
    for tables, variant in runs:
        key = f"{prefix}gpu_decode_kernel_{tables}_{names[variant]}"
        try:
            plan = gcg.plan_decode(payloads, shapes, kvs[0].dtype, p, tables=tables, variant=variant)
        except Exception as exc:  # noqa: BLE001 - smem may not fit this geometry
            res[key] = str(exc)
            continue
        t = cuda_time(plan.run, reps=10, warmup=2)
        outs = plan.check()
        if reference is None:
            reference = [o.clone() for o in outs]
        res[key + "_same_output"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                        for a, b in zip(outs, reference))
        res[key + "_GBps"] = nbytes / t / 1e9
    saved, remembered = dict(gcg._chosen), gcg._saved_choices
    gcg._chosen.clear()
    gcg._saved_choices = dict  # calibrate here, whatever an earlier run chose
    try:
        res[f"{prefix}calibrated_variant"] = names[gcg.chosen_variant(payloads, shapes, kvs[0].dtype, p)]
    finally:
        gcg._chosen.update(saved)
        gcg._saved_choices = remembered
    return reference


def bench_real_kv(args, results):
    """The same decoder variants on real KV: the whole chunks of a captured kvtool file (--real)."""
    from kvtool.codecs.cachegen import gpu as gcg
    from kvtool.format import ContainerReader

    res = results["cachegen_real"] = {"file": args.real}
    with ContainerReader(args.real) as reader:
        whole = [c.index for c in reader.chunks if c.end - c.start == reader.chunk_size]
        kvs = [reader.read_chunk(i).cuda() for i in whole]
    if not kvs:
        res["skipped"] = "no whole chunk in the file"
        return
    nbytes = sum(k.numel() * k.element_size() for k in kvs)
    payloads, p = gcg.encode_chunks(kvs, None)
    res["ratio_vs_kv_dtype"] = nbytes / sum(len(x) for x in payloads)
    print(f"\n== CacheGen on REAL KV: {len(kvs)} chunks of {list(kvs[0].shape)} {kvs[0].dtype} from {args.real}; "
          f"{res['ratio_vs_kv_dtype']:.2f}x smaller")
    decode_variants(payloads, kvs, p, nbytes, res)
    for k, v in res.items():
        if k.endswith("GBps"):
            print(f"{k[:-5]:<46}{v:>8.2f}  {res.get(k[:-5] + '_same_output', '')}")
    print(f"calibration picks: {res['calibrated_variant']}")


# ---- LMCache's CUDA CacheGen, side by side ---------------------------------------------------

LMCACHE_PROBE_SECONDS = 120
_PROBE = """
import lmcache
from lmcache import device_ops
from lmcache.storage_backend.serde.cachegen_decoder import do_dequantize
from lmcache.storage_backend.serde.cachegen_encoder import encode_ntokens, torch_quant_vectorized
print(lmcache.torch_device_type)
"""


def lmcache_ops():
    """LMCache's CacheGen building blocks on its resolved device, or (None, why not).

    Its imports are tried first in a child process, bounded in time: on the last H100 run
    LMCache 0.5.6's CUDA ops did not load on that torch (an undefined symbol) and the section
    hung until the whole run was killed. A child that fails or takes longer than
    LMCACHE_PROBE_SECONDS is the reason the section is skipped."""
    import subprocess

    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                               timeout=LMCACHE_PROBE_SECONDS)
    except subprocess.TimeoutExpired:
        return None, f"importing LMCache took more than {LMCACHE_PROBE_SECONDS} s (a hang); skipped"
    if probe.returncode != 0:
        lines = (probe.stderr or probe.stdout).strip().splitlines()
        return None, f"LMCache does not import here: {lines[-1][:300] if lines else f'exit {probe.returncode}'}"
    try:
        import lmcache
        from lmcache import device_ops
        from lmcache.storage_backend.serde.cachegen_decoder import do_dequantize
        from lmcache.storage_backend.serde.cachegen_encoder import encode_ntokens, torch_quant_vectorized
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to report
        return None, f"{type(exc).__name__}: {exc}"
    return (lmcache.torch_device_type, device_ops, torch_quant_vectorized, encode_ntokens, do_dequantize), ""


def lmcache_coder(ops, key_bins, value_bins, device):
    """encode(kv [2, L, T, C], T <= 256) -> state; decode(state, shape, dtype) -> [2, L, T, C].
    The calls and buffers of LMCache's CacheGenSerializer/Deserializer GPU path, without
    its pickling (so its timings are kernels and tensor ops only)."""
    _, device_ops, quant, encode_ntokens, dequant = ops
    kb = torch.tensor(key_bins, device=device)
    vb = torch.tensor(value_bins, device=device)
    both = torch.cat((kb, vb))

    def encode(kv):
        _, L, T, C = kv.shape
        k, max_k = quant(kb, kv[0])  # [L, T, C] int8 (offset by +M), [L, T, 1]
        v, max_v = quant(vb, kv[1])
        cdf = torch.cat([device_ops.calculate_cdf(k, int(kb.max())), device_ops.calculate_cdf(v, int(vb.max()))])
        buf = torch.zeros((2 * L, C, 256), dtype=torch.uint8, device=kv.device)
        lens = torch.zeros((2 * L, C), dtype=torch.int32, device=kv.device)
        stream = encode_ntokens(cdf, torch.cat((k, v)).reshape(2 * L, T, C), buf, lens)
        return stream, lens, cdf, torch.cat((max_k, max_v))

    def decode(state, shape, dtype):
        stream, lens, cdf, maxes = state
        _, L, T, C = shape
        sym = torch.empty((2 * L, T, C), dtype=torch.uint8, device=stream.device)
        device_ops.decode_fast_prefsum(cdf, stream, lens.flatten().cumsum(0).reshape(lens.shape), sym)
        return dequant(sym.float(), both, maxes).to(dtype).view(shape)

    def stored_bytes(state):
        stream, lens, cdf, maxes = state
        return stream.numel() + cdf.numel() * cdf.element_size() + maxes.numel() * 2  # maxes as the KV dtype

    return encode, decode, stored_bytes


def bench_lmcache(args, results, kvs, bins):
    res = results["lmcache_cuda"] = {}
    ops, why = lmcache_ops()
    if ops is None or ops[0] != "cuda":
        res["unavailable"] = why or f"LMCache resolved its device as {ops[0]!r}, not cuda"
        print(f"\n== LMCache CUDA CacheGen: not run ({res['unavailable']})")
        return
    L = kvs[0].shape[1]
    encode, decode, stored = lmcache_coder(ops, bins[:L], bins[L:], kvs[0].device)
    raw = kvs[0].numel() * 2 * len(kvs)
    states = [encode(kv) for kv in kvs]
    res["encode_GBps"] = raw / cuda_time(lambda: [encode(kv) for kv in kvs], reps=3, warmup=1) / 1e9
    res["decode_GBps"] = raw / cuda_time(lambda: [decode(st, kv.shape, kv.dtype) for st, kv in zip(states, kvs)],
                                         reps=3, warmup=1) / 1e9
    res["ratio_vs_bf16"] = raw / sum(stored(st) for st in states)
    out = decode(states[0], kvs[0].shape, kvs[0].dtype).float()
    ref = kvs[0].float()
    res["max_rel_error"] = float(((out - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1).clamp_min(1e-30)).max())
    print(f"\n== LMCache 0.5.6 CUDA CacheGen, same {len(kvs)} chunks and bins: encode {res['encode_GBps']:.2f} GB/s, "
          f"decode {res['decode_GBps']:.2f} GB/s, {res['ratio_vs_bf16']:.2f}x vs bf16 "
          f"(max error {res['max_rel_error']:.3f} of the token's max)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048, 8000])
    ap.add_argument("--cg-layers", type=int, default=32)
    ap.add_argument("--cg-channels", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--cpu-chunks", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    ap.add_argument("--graphs", action="store_true",
                    help="time kernels by CUDA-graph replays (on the H100 and H200 runs of 2026-11 a capture "
                         "failed and left torch's CUDA generator unusable: off by default, CUDA events instead)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["paged", "cachegen", "lmcache"])
    ap.add_argument("--real", help="a kvtool file of captured KV: time the decoders on its chunks too")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.graphs:
        GRAPHS.update(usable=True, why="")
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device; nothing to measure")
        return 0
    if args.quick:
        args.tokens, args.chunks = [2048], 8
    from kvtool import cuda_build as kc

    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; {kc.backend_status(build=True)}")
    results = {"device": torch.cuda.get_device_name(0), "paged": [], "cachegen": {}}
    if "paged" not in args.skip:
        bench_paged(args, results)
    if "cachegen" not in args.skip:
        bench_cachegen(args, results)
        if args.real:
            bench_real_kv(args, results)
    results["timing"] = "CUDA graphs" if GRAPHS["usable"] else f"CUDA events (graphs off: {GRAPHS['why'] or 'not used'})"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
