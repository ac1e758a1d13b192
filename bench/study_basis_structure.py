#!/usr/bin/env python3
"""A design study for issue 29's speed goal: can a basis with structure (fewer multiply-adds per
value than one dense C x C basis per layer) keep the bits of the dense one?

Every basis here is an ordinary version-1 calibration object (format-spec/pca.md §3): the same
means, weights and row gains, only the axes differ. Each is measured by kvtool's own pca coder
(exact bits/value of real payloads, nothing estimated) on the same real KV as bench_pca
(bench_cachegen.real_kv: the default model, 1,024 tokens, 256-token chunks) at the four named
steps of a per-layer calibration (`QUALITY_BY_AXES["layer"]`). The same step gives about the same
error in the weighted space whatever the orthonormal axes (the quantizer's error per component is
set by the step), so bits at a step compare the bases' rates at one quality.

The bases (MAC/value: multiply-adds per coded value of the product, each direction):
  - `layer`: principal axes of each layer's C channels (the default; C).
  - `head`: principal axes per KV head, zero outside the D x D blocks (D).
  - `hybrid-R`: per KV head, its R largest axes are mixed across heads by the principal axes of
    those H*R dimensions (columns dense over all C channels); its other D - R axes stay within the
    head (H*R*C + H*(D-R)*D over C).
  - `givens-J`: axes per KV head, then J plane rotations of two components each, every one the
    rotation that takes out the largest correlation left (a truncated Jacobi eigenvalue
    method: D + 4J/C, each rotation four multiply-adds on two values).
  - `pairs`: heads taken two at a time (blocks of 2D channels, the last block what is left).
  - `swapped` (`--swapped`, ~8 minutes): blocks of D channels, not bound to heads: from the heads'
    blocks, channels swapped between blocks while a high-rate estimate of the rate falls (one pass).

    python bench/study_basis_structure.py [--hybrid 16,32] [--givens 1536,3072] [--swapped]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_cachegen import CHUNK, real_kv  # noqa: E402

from kvtool.codecs.pca import QUALITY_BY_AXES, native  # noqa: E402
from kvtool.codecs.pca.calibration import from_bytes, from_torch  # noqa: E402
from kvtool.codecs.pca.fit import principal_axes, weighted_covariance  # noqa: E402


def descending_axes(cov: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigh(cov)[1].flip(-1)


def blocks_basis(cov_z: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """[L, C, C]: principal axes within each channel group (columns in group order)."""
    layers, C, _ = cov_z.shape
    basis, col = torch.zeros_like(cov_z), 0
    for g in groups:
        idx = torch.tensor(g)
        basis[:, idx[:, None], torch.arange(col, col + len(g))[None, :]] = descending_axes(cov_z[:, idx][:, :, idx])
        col += len(g)
    return basis


def hybrid_basis(cov_z: torch.Tensor, head_dim: int, top: int) -> torch.Tensor:
    """[L, C, C]: each head's `top` largest axes mixed across heads (dense columns first), then
    each head's other axes, within the head."""
    layers, C, _ = cov_z.shape
    heads = C // head_dim
    out = torch.zeros_like(cov_z)
    for layer in range(layers):
        lead = torch.zeros(C, heads * top, dtype=cov_z.dtype)
        tails = []
        for h in range(heads):
            block = slice(h * head_dim, (h + 1) * head_dim)
            axes = descending_axes(cov_z[layer, block, block])
            lead[block, h * top:(h + 1) * top] = axes[:, :top]
            tail = torch.zeros(C, head_dim - top, dtype=cov_z.dtype)
            tail[block] = axes[:, top:]
            tails.append(tail)
        mix = descending_axes(lead.T @ cov_z[layer] @ lead)
        out[layer] = torch.cat([lead @ mix] + tails, 1)
    return out


def givens_basis(cov_z: torch.Tensor, head_dim: int, rotations: int) -> torch.Tensor:
    """[L, C, C]: axes per KV head, then `rotations` plane rotations in the components' space,
    each zeroing the largest correlation left between two components; columns by variance."""
    heads = principal_axes(cov_z, head_dim, "head")
    within = (heads.transpose(1, 2) @ cov_z @ heads).numpy()  # [L, C, C]: the components' covariance
    bases = []
    for layer in range(cov_z.shape[0]):
        s, b = within[layer].copy(), heads[layer].numpy().copy()
        for _ in range(rotations):
            sd = np.sqrt(np.maximum(np.diag(s), 1e-30))
            corr = np.abs(s) / np.outer(sd, sd)
            np.fill_diagonal(corr, 0.0)
            i, j = np.unravel_index(np.argmax(corr), corr.shape)
            if corr[i, j] < 1e-6:
                break
            theta = 0.5 * np.arctan2(2 * s[i, j], s[i, i] - s[j, j])
            g = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
            b[:, [i, j]] = b[:, [i, j]] @ g
            s[:, [i, j]] = s[:, [i, j]] @ g
            s[[i, j], :] = g.T @ s[[i, j], :]
        bases.append(torch.from_numpy(b[:, np.argsort(-np.diag(s))]))
    return torch.stack(bases)


def rate_estimate(cov: np.ndarray, groups: list[list[int]], step: float) -> float:
    """High-rate bits of the components above the step, axes learned within each group."""
    bits = 0.0
    for g in groups:
        lam = np.linalg.eigvalsh(cov[np.ix_(g, g)])
        bits += 0.5 * np.log2(np.maximum(lam / (step * step / 12), 1.0)).sum()
    return bits


def swapped_groups(cov: np.ndarray, groups: list[list[int]], step: float) -> list[list[int]]:
    """One pass of pairwise channel swaps between groups, each the best swap for that channel
    when it lowers `rate_estimate`."""
    groups = [list(g) for g in groups]
    for a in range(len(groups)):
        for b in range(a + 1, len(groups)):
            for i in range(len(groups[a])):
                base = rate_estimate(cov, [groups[a], groups[b]], step)
                changes = []
                for j in range(len(groups[b])):
                    ga, gb = groups[a][:], groups[b][:]
                    ga[i], gb[j] = gb[j], ga[i]
                    changes.append((rate_estimate(cov, [ga, gb], step) - base, j))
                best, best_j = min(changes)
                if best < -1e-6:
                    groups[a][i], groups[b][best_j] = groups[b][best_j], groups[a][i]
    return groups


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hybrid", default="16,32", help="R values for the hybrid bases")
    ap.add_argument("--givens", default="1536,3072", help="J values for the givens bases")
    ap.add_argument("--swapped", action="store_true", help="also the swapped blocks (slow)")
    args = ap.parse_args(argv)

    from kvtool.engine import load_model
    from kvtool.ops.calibrate import (calibration_sequences, default_texts, gain_windows, gather, row_gains,
                                      row_sensitivity, with_gains)
    from kvtool.codecs.pca.fit import fit

    started = time.perf_counter()
    model = load_model(None)
    cfg = model.config
    D, C = cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sequences = calibration_sequences(model, default_texts())
    samples = gather(model, sequences)
    parts = [weighted_covariance(samples.keys, samples.metric_k), weighted_covariance(samples.values, samples.metric_v)]
    layer_cal = fit(samples.keys, samples.values, samples.metric_k, samples.metric_v, samples.inv_freq, D,
                    model.identity.fingerprint(), "layer")
    gains = row_gains(row_sensitivity(model, layer_cal, gain_windows(sequences)))  # one set for every basis
    print(f"samples and gains: {len(sequences)} sequences, {time.perf_counter() - started:.0f} s", flush=True)

    heads = [list(range(h * D, (h + 1) * D)) for h in range(C // D)]
    pairs = [sum(heads[i:i + 2], []) for i in range(0, len(heads), 2)]
    bases = {  # name: (multiply-adds per value, [L, C, C] covariances -> [L, C, C] axes)
        "layer": (C, lambda cz: principal_axes(cz, D, "layer")),
        "head": (D, lambda cz: principal_axes(cz, D, "head")),
    }
    for top in (int(r) for r in args.hybrid.split(",") if r):
        bases[f"hybrid-{top}"] = ((len(heads) * top * C + len(heads) * (D - top) * D) / C,
                                  lambda cz, top=top: hybrid_basis(cz, D, top))
    for rotations in (int(j) for j in args.givens.split(",") if j):
        bases[f"givens-{rotations}"] = (D + 4 * rotations / C,
                                        lambda cz, rotations=rotations: givens_basis(cz, D, rotations))
    bases["pairs"] = (sum(len(g) ** 2 for g in pairs) / C, lambda cz: blocks_basis(cz, pairs))
    if args.swapped:
        step = QUALITY_BY_AXES["layer"]["97"][0]
        bases["swapped"] = (D, lambda cz: torch.stack([
            blocks_basis(cz[layer:layer + 1], swapped_groups(cz[layer].numpy(), heads, step))[0]
            for layer in range(cz.shape[0])]))

    kv = real_kv(4 * CHUNK)
    raw = kv.view(torch.int16).numpy().view(np.uint16)
    steps = {q: s for q, (s, _) in QUALITY_BY_AXES["layer"].items()}
    coder = native.coder()
    print(f"\n{'basis':<11}{'MAC/value':>10}" + "".join(f"{'b/v @' + str(s) + ' (' + q + ')':>17}"
                                                   for q, s in steps.items()) + f"{'vs layer @97':>14}")
    reference = None
    for name, (macs, make) in bases.items():
        axes = torch.stack([make(cz) for _, _, cz in parts])
        cal = from_torch(torch.stack([m.float() for m, _, _ in parts]), torch.stack([w.float() for _, w, _ in parts]),
                         axes, samples.inv_freq.float(), D, model.identity.fingerprint())
        cal = from_bytes(with_gains(cal, gains).to_bytes())  # named by its digest, as a reader finds it
        bpv = []
        for step in steps.values():
            size = sum(len(coder.encode_chunk(np.ascontiguousarray(raw[:, :, t:t + CHUNK]), "bfloat16", cal, step, 4, t))
                       for t in range(0, raw.shape[2], CHUNK))
            bpv.append(size * 8 / raw.size)
        reference = reference or bpv
        print(f"{name:<11}{macs:>10.0f}" + "".join(f"{b:>17.3f}" for b in bpv) + f"{bpv[1] / reference[1]:>13.3f}x",
              flush=True)


if __name__ == "__main__":
    main()
