"""Fitting a calibration object from samples (the math only; `kvtool.ops.calibrate` gathers the
samples from a model run).

For each part and layer: channels weighted by how far an error in them moves the model, centred,
and their principal axes (eigenvectors of the weighted covariance, the largest first). Coding
the coefficients with one quantizer step then spends bits where the model is sensitive and
drops components smaller than the step almost for free (format-spec/pca.md §2).
"""

from __future__ import annotations

import torch

from .calibration import Calibration, from_torch


def key_metric(query_energy: torch.Tensor, kscale: float) -> torch.Tensor:
    """Per key channel [L, Hkv*D]: the mean squared query that reads it ([L, Hkv, D], summed over
    the query heads of each KV head), averaged over each RoPE pair (a rotation moves energy
    between the pair's two channels, never out of it), times `kscale`."""
    layers, kv_heads, dim = query_energy.shape
    half = dim // 2
    pair = torch.cat([torch.arange(half, dim), torch.arange(0, half)])
    return (0.5 * (query_energy + query_energy[:, :, pair]) / dim).reshape(layers, kv_heads * dim) * kscale


def value_metric(wo: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Per value channel [L, Hkv*D]: the energy of the o_proj columns ([L, E, H*D]) that read it,
    summed over the query heads that share each KV head."""
    layers = wo.shape[0]
    group = wo.shape[2] // (num_kv_heads * head_dim)
    energy = wo.float().pow(2).sum(1)  # [L, H*D]
    return energy.view(layers, num_kv_heads, group, head_dim).sum(2).reshape(layers, num_kv_heads * head_dim)


class Moments:
    """Running first and second moments of [L, N, C] samples per layer (float64), so that any
    amount of calibration text takes the memory of one [L, C, C] matrix."""

    def __init__(self, layers: int, channels: int) -> None:
        self.count = 0
        self.sum = torch.zeros(layers, channels, dtype=torch.float64)
        self.outer = torch.zeros(layers, channels, channels, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        x = x.double()
        self.count += x.shape[1]
        self.sum += x.sum(1)
        self.outer += x.transpose(1, 2) @ x

    def mean_cov(self) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.sum / self.count
        return mean, self.outer / self.count - mean[:, :, None] * mean[:, None, :]


BASES = ("head", "layer")


def principal_axes(cov_z: torch.Tensor, head_dim: int, basis: str) -> torch.Tensor:
    """[L, C, C] columns = components of the weighted covariances [L, C, C], the largest variance
    first. basis 'layer': one set of axes over all channels of the layer; 'head': one per KV head,
    so the basis is block-diagonal (head h's D components are columns hD..hD+D-1 and read only its
    own channels). A coder multiplies only the blocks (kernels/pca_cpu.c): C/D times fewer
    multiply-adds, 3x on the default model and 8x on an 8-KV-head one, for the cross-head
    correlation the layer's axes would also take out (bench/RESULTS.md §34)."""
    if basis == "layer":
        return torch.linalg.eigh(cov_z)[1].flip(2)  # eigh: ascending
    if basis != "head":
        raise ValueError(f"basis must be one of {BASES}, got {basis!r}")
    layers, channels, _ = cov_z.shape
    axes = torch.zeros_like(cov_z)
    for h0 in range(0, channels, head_dim):
        block = slice(h0, h0 + head_dim)
        axes[:, block, block] = torch.linalg.eigh(cov_z[:, block, block])[1].flip(2)
    return axes


def fit(keys_before_rope: Moments, values: Moments, metric_k: torch.Tensor, metric_v: torch.Tensor,
        inv_freq: torch.Tensor, head_dim: int, model: str, basis: str = "layer") -> Calibration:
    """Moments of the keys (turned back to before RoPE) and values; metric_k, metric_v: [L, C] > 0;
    inv_freq: [L, D/2]. The weighted covariance is diag(w) Cov(x) diag(w) with w = sqrt(metric);
    its eigenvectors (`principal_axes`, per layer or per KV head) are the basis. Returns the
    calibration (no digest yet)."""
    means, weights, bases = [], [], []
    for moments, metric in ((keys_before_rope, metric_k), (values, metric_v)):
        mean, weight, cov_z = weighted_covariance(moments, metric)
        means.append(mean.float())
        weights.append(weight.float())
        bases.append(principal_axes(cov_z, head_dim, basis))
    return from_torch(torch.stack(means), torch.stack(weights), torch.stack(bases), inv_freq.float(), head_dim, model)


def weighted_covariance(moments: Moments, metric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean [L, C], weight w = sqrt(metric) [L, C], diag(w) Cov(x) diag(w) [L, C, C]), float64."""
    mean, cov = moments.mean_cov()
    weight = metric.double().clamp_min(1e-12).sqrt()
    return mean, weight, cov * weight[:, :, None] * weight[:, None, :]
