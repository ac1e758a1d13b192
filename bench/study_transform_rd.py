#!/usr/bin/env python3
"""A design study for issue 29's new lossy codec: how far a per-model transform goes, before any
coder is written. Not a codec: its bits/value are an ESTIMATE (the empirical entropy of each
quantized component over each 256-token chunk: what an ideal adaptive entropy coder would spend,
with no tables or side information counted), and it says so in every row.

The transform (learned once per model on calibration text the benchmark never uses):
  - a metric per (layer, K or V, channel): for K the mean query energy of the query heads that
    read that KV head (the error of a key's channel moves the scores by q . dk), averaged over
    each RoPE pair (a rotation keeps a pair's energy); for V the energy of the o_proj columns
    that read it (the error of a value's channel moves the layer's output by W_o dv);
  - keys turned back to before RoPE (their positions are known), so one basis serves every
    position; a per-layer mean, then PCA of the metric-weighted channels (all KV heads of a
    layer together);
  - the coefficients quantized with one step `delta` everywhere (equal weighted distortion per
    component: the high-rate optimum; components smaller than the step become zeros, which an
    entropy coder nearly gets for free);
  - `--kscale`: the keys' metric multiplied (K against V);
  - `--sinks N`: the first N tokens of a sequence kept exact (attention sinks: every query puts
    much of its attention there, so their error reaches every position), counted at 16 bits.

Quality is measured exactly as bench_rd.py measures it (the same 20 windows of five kinds, 1024
context + 64 teacher-forced tokens, top-1 agreement with the exact cache's logits, its mean and
worst window).

    python bench/study_transform_rd.py --delta 0.04,0.16 --sinks 4 --kscale 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["KVTOOL_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_rd as rd  # noqa: E402
import kvtool.engine.model as engine_model  # noqa: E402
from kvtool.engine import load_model  # noqa: E402
from kvtool.ops.compare import compare_logits, teacher_forced_eval  # noqa: E402

CHUNK = 256


def benchmark_windows(model, calibration: bool) -> list[dict]:
    """bench_rd's 20 windows, or (calibration) one window of each source it never takes."""
    out = []
    for kind in rd.KINDS:
        if not calibration:
            out += rd.make_windows(model.tokenizer, 4, rd.SOURCES[kind], kind, 1024, 64, 512)
            continue
        for source in rd.SOURCES[kind][4:]:
            try:
                out += rd.make_windows(model.tokenizer, 1, [source], kind, 1024, 64, 512)
            except SystemExit:  # too short or missing here
                pass
    for w in out:
        w["kv"] = rd.capture_context(model, w["context"])  # [2, L, T, C] bf16
    return out


def query_energy(model, windows) -> torch.Tensor:
    """Mean q^2 per (layer, KV head, dim), summed over the query heads of each KV head [L, Hkv, D]."""
    cfg = model.config
    layers, heads, kv_heads, dim = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    energy, seen, calls = torch.zeros(layers, kv_heads, dim, dtype=torch.float64), [0], [0]
    real = engine_model.attention

    def spy(q, *args, **kwargs):
        layer = calls[0] % layers
        energy[layer] += q.float().pow(2).view(q.shape[0], kv_heads, heads // kv_heads, dim).sum((0, 2)).double()
        seen[0] += q.shape[0] if layer == 0 else 0
        calls[0] += 1
        return real(q, *args, **kwargs)

    engine_model.attention = spy
    try:
        for w in windows:
            calls[0] = 0
            rd.capture_context(model, w["context"])
    finally:
        engine_model.attention = real
    return (energy / seen[0]).float()


class Transform:
    def __init__(self, model, calibration, kscale: float):
        cfg = model.config
        self.layers, self.kv_heads, self.dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self.channels = self.kv_heads * self.dim
        self.inv_freq = engine_model.rope_inv_freq(cfg)
        q = query_energy(model, calibration)
        half = self.dim // 2
        pair = torch.cat([torch.arange(half, self.dim), torch.arange(0, half)])
        metric_k = (0.5 * (q + q[:, :, pair]) / self.dim).reshape(self.layers, self.channels) * kscale
        wo = torch.stack([lw.wo.float() for lw in model.weights.layers])  # [L, E, H*D]
        group = cfg.num_heads // self.kv_heads
        metric_v = wo.pow(2).sum(1).view(self.layers, self.kv_heads, group, self.dim).sum(2).reshape(self.layers, -1)
        self.parts = []
        for part, metric in ((0, metric_k), (1, metric_v)):
            weight = metric.sqrt()  # [L, C]
            x = torch.cat([self.before_rope(w["kv"][part].float(), part) for w in calibration], 1)  # [L, N, C]
            mean = x.mean(1, keepdim=True)
            z = (x - mean) * weight[:, None, :]
            basis = []
            for layer in range(self.layers):
                _, vectors = torch.linalg.eigh((z[layer].T @ z[layer] / z.shape[1]).double())
                basis.append(vectors.float().flip(1))  # [C, C], the largest first
            self.parts.append((mean, weight, torch.stack(basis)))

    def rope(self, x: torch.Tensor, sign: int) -> torch.Tensor:
        layers, tokens, _ = x.shape
        cos, sin = engine_model.rope_cos_sin(self.inv_freq, torch.arange(tokens), torch.float32)
        xt = x.view(layers, tokens, self.kv_heads, self.dim).permute(1, 0, 2, 3).reshape(tokens, -1, self.dim)
        y = engine_model.apply_rope(xt, cos, sin * sign)
        return y.view(tokens, layers, self.kv_heads, self.dim).permute(1, 0, 2, 3).reshape(layers, tokens, -1)

    def before_rope(self, x, part):
        return self.rope(x, -1) if part == 0 else x

    def __call__(self, kv: torch.Tensor, delta: float, sinks: int) -> tuple[torch.Tensor, float]:
        out, bits = [], 0.0
        for part, (mean, weight, basis) in enumerate(self.parts):
            x = self.before_rope(kv[part].float(), part)
            q = torch.round(torch.einsum("ltc,lcd->ltd", (x - mean) * weight[:, None, :], basis) / delta)
            for start in range(0, q.shape[1], CHUNK):
                bits += entropy_bits(q[:, start:start + CHUNK].permute(0, 2, 1).reshape(-1, min(CHUNK, q.shape[1] - start)))
            x_hat = torch.einsum("ltd,lcd->ltc", q * delta, basis) / weight[:, None, :] + mean
            out.append(self.rope(x_hat, 1) if part == 0 else x_hat)
        kv_hat = torch.stack(out).to(kv.dtype)
        kv_hat[:, :, :sinks] = kv[:, :, :sinks]
        return kv_hat, bits + sinks * kv.shape[0] * kv.shape[1] * kv.shape[3] * 16


def entropy_bits(rows: torch.Tensor) -> float:
    """Sum over rows of len(row) x the empirical entropy of the row's integers."""
    shifted = (rows - rows.min(1, keepdim=True).values).long()
    counts = torch.zeros(rows.shape[0], int(shifted.max()) + 1).scatter_add_(
        1, shifted, torch.ones_like(shifted, dtype=torch.float32))
    p = counts / rows.shape[1]
    return float(-(counts * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delta", default="0.04,0.16", help="comma-separated quantizer steps")
    ap.add_argument("--kscale", type=float, default=1.0, help="keys' metric multiplied by this")
    ap.add_argument("--sinks", type=int, default=0, help="first tokens kept exact")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = load_model(None)
    transform = Transform(model, benchmark_windows(model, calibration=True), args.kscale)
    windows = benchmark_windows(model, calibration=False)
    for w in windows:
        w["ref"] = teacher_forced_eval(model, w["context"], w["continuation"], kv=w["kv"], kv_dtype=torch.bfloat16,
                                       prefill_chunk=CHUNK)
    print("| delta | kscale | sinks | est. b/v | top-1 mean | worst window | mean KL |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for delta in [float(d) for d in args.delta.split(",")]:
        tops, kls, bits = [], [], 0.0
        for w in windows:
            kv_hat, b = transform(w["kv"], delta, args.sinks)
            got = teacher_forced_eval(model, w["context"], w["continuation"], kv=kv_hat, kv_dtype=torch.bfloat16,
                                      prefill_chunk=CHUNK)
            cmp = compare_logits(w["ref"], got, w["continuation"])
            tops.append(cmp["top1_agreement"])
            kls.append(cmp["kl_mean"])
            bits += b / w["kv"].numel()
        print(f"| {delta} | {args.kscale} | {args.sinks} | {bits / len(windows):.3f} | {100 * sum(tops) / len(tops):.1f}% "
              f"| {100 * min(tops):.1f}% | {sum(kls) / len(kls):.2e} |", flush=True)
    print(f"({len(windows)} windows; {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
