"""CPU throughput of the paged connectors vs a plain contiguous copy of the same bytes.

    python bench/bench_connectors.py [--layers 30 --heads 3 --head-dim 64 --tokens 256 2048 --block-size 16]

For each layout: gather (from_gpu: paged buffers -> KV_BLOB memory object) and
scatter (to_gpu: memory object -> a fresh paged buffer), through the whole
connector (checks included), with a shuffled block table over a pool twice the
needed size. The baseline is `dst.copy_(src)` of one contiguous tensor of the
same number of bytes; "ratio" = the median over rounds of the baseline's time
over the connector's in the same round (GB/s: from best times). The row
"copy x2L" copies the same bytes as 2*num_layers contiguous per-layer tensors
(a connector's loop and cache footprint without the indexing). Ratios, not
absolute numbers, are what carry over between machines. Each timing is the
best of `--rounds` runs, all candidates taking turns (robust to other
processes on a shared machine); torch
runs on `--threads` threads (default 1, the steadiest ratio).
"""

from __future__ import annotations

import argparse
import os
import math
import random
import statistics
import time

# torch's OpenMP threads sleep when idle instead of spinning: a candidate timed right after a
# torch copy would otherwise share the cores with its spinning threads (measured: the file load
# 1.5x slower right after the copy than alone). The copy itself is no slower so.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from kvtool.connectors import NestedTupleConnector, PagedMemConnectorV2

LAYOUTS = ["flash_attn", "flashinfer", "vllm", "kv_tuple", "vllm_cpu"]


def time_rounds(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Each function's time in each of `rounds` rounds, running them in turn, so that load from
    other processes hits every candidate alike. Each round takes them in a new order (seeded): a
    candidate run right after a similar one finds the caches and page tables as it left them,
    and measured ~7% faster than after another."""
    for fn in fns.values():
        fn()  # warm up
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def time_round_robin(fns: dict, rounds: int) -> dict:
    """Best time of each function over `rounds` rounds of `time_rounds`."""
    return {k: min(v) for k, v in time_rounds(fns, rounds).items()}


def paired_ratio(baseline: list[float], candidate: list[float]) -> float:
    """The median over rounds of baseline / candidate time, each round's pair taken together: a
    host whose memory speed changes between minutes (measured 23 vs 39 GB/s for the same copy)
    then moves both sides of each ratio alike, where best-of times may come from different
    phases."""
    return statistics.median(b / c for b, c in zip(baseline, candidate))


def make_layer(layout, NB, BS, H, D, dtype):
    if layout == "flash_attn":
        return torch.randn(2, NB, BS, H, D).to(dtype)
    if layout == "flashinfer":
        return torch.randn(NB, 2, BS, H, D).to(dtype)
    if layout in ("vllm", "vllm_cpu"):  # vllm_cpu: the same tensor, K pages transposed inside it
        return torch.randn(NB, H, BS, 2 * D).to(dtype)
    return (torch.randn(NB, BS, H, D).to(dtype), torch.randn(NB, BS, H, D).to(dtype))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["KVTOOL_THREADS"] = str(args.threads)  # the native copy uses as many threads as torch
    L, H, D, BS = args.layers, args.heads, args.head_dim, args.block_size
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {L} layers, {H} KV heads, "
        f"head_dim {D}, {args.dtype}, block_size {BS}"
    )
    print(f"{'tokens':>6} {'layout':<12} {'MB':>7} {'gather GB/s':>12} {'ratio':>6} {'scatter GB/s':>13} {'ratio':>6}")
    for T in args.tokens:
        need = math.ceil(T / BS)
        NB = 2 * need
        table = torch.randperm(NB, generator=gen)[:need]
        t = torch.arange(T)
        slots = table[t // BS] * BS + t % BS
        nbytes = 2 * L * T * H * D * torch.empty((), dtype=dtype).element_size()
        src = torch.randn(2, L, T, H * D).to(dtype)
        dst = torch.empty_like(src)
        # the same bytes as 2*L contiguous [T, H*D] copies from separate tensors
        # (a connector's per-layer loop and cache footprint, without indexing)
        parts = [torch.randn(T, H * D).to(dtype) for _ in range(2 * L)]
        outs = [o for kv in dst.unbind(0) for o in kv.unbind(0)]

        def per_layer():
            for o, p in zip(outs, parts):
                o.copy_(p)

        rows = {"torch copy": (lambda: dst.copy_(src),) * 2, "copy x2L": (per_layer,) * 2}
        for layout in LAYOUTS:
            bufs = [make_layer(layout, NB, BS, H, D, dtype) for _ in range(L)]
            conn = PagedMemConnectorV2(H * D, L, layout=layout)
            mo = conn.allocate(T, dtype)
            rows[layout] = (
                lambda c=conn, m=mo, b=bufs: c.from_gpu(m, 0, T, kvcaches=b, slot_mapping=slots),
                lambda c=conn, m=mo, b=bufs: c.to_gpu(m, 0, T, kvcaches=b, slot_mapping=slots),
            )
        nested = tuple((torch.randn(T, H, D).to(dtype), torch.randn(T, H, D).to(dtype)) for _ in range(L))
        nconn = NestedTupleConnector(H * D, L)
        nmo = nconn.allocate(T, dtype)
        rows["nested"] = (
            lambda: nconn.from_gpu(nmo, 0, T, kvcaches=nested),
            lambda: nconn.to_gpu(nmo, 0, T, kvcaches=nested),
        )
        fns = {(name, i): f[i] for name, f in rows.items() for i in (0, 1) if not (f[0] is f[1] and i)}
        times = time_rounds(fns, args.rounds)
        copy = times[("torch copy", 0)]
        for name, f in rows.items():
            gather, scatter = times[(name, 0)], times[(name, 0) if f[0] is f[1] else (name, 1)]
            g, s = nbytes / min(gather) / 1e9, nbytes / min(scatter) / 1e9
            print(f"{T:>6} {name:<12} {nbytes / 1e6:>7.2f} {g:>12.2f} {paired_ratio(copy, gather):>6.2f} "
                  f"{s:>13.2f} {paired_ratio(copy, scatter):>6.2f}")

if __name__ == "__main__":
    main()
