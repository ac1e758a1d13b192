"""A small Llama-family decoder that runs on a paged KV cache.

One flat file of small functions (in the spirit of gpt-fast's model.py, our own
code): RMSNorm, RoPE (default / linear / llama3 scaling), grouped-query
attention through `scaled_dot_product_attention`, SwiGLU, tied or untied
embeddings; Llama, Mistral, Qwen2 (q/k/v bias) and SmolLM (= Llama).

The KV cache is changed in exactly one place, `write_kv`. Attention never sees
the freshly computed K/V directly: it reads every position back from the paged
buffer through the sequence's slot mapping (`read_kv`), so K/V are rounded to
the cache's dtype exactly as a real engine would see them.

Shapes use: n = tokens in this chunk, T = tokens in the context so far
(start_pos + n), H = query heads, Hkv = KV heads, D = head dim, E = hidden size,
F = FFN size, V = vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ModelError


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear" | "llama3", ...factors}.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


@dataclass
class LayerWeights:
    attn_norm: Tensor  # [E]
    wqkv: Tensor  # [(H + 2*Hkv) * D, E]  q, k, v projections stacked
    bqkv: Tensor | None  # [(H + 2*Hkv) * D] (Qwen2, Llama attention_bias)
    wo: Tensor  # [E, H*D]
    bo: Tensor | None  # [E]
    mlp_norm: Tensor  # [E]
    w_gate_up: Tensor  # [2*F, E]  gate and up projections stacked
    w_down: Tensor  # [E, F]


@dataclass
class Weights:
    embed: Tensor  # [V, E]
    layers: list[LayerWeights]
    norm: Tensor  # [E]
    lm_head: Tensor  # [V, E]; the same tensor as `embed` when tied


# --- building blocks -----------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32:  # one fused kernel; same math as below
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Half dtypes: normalise in float32, scale in the compute dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies [D/2] (float32) with the model's theta and scaling."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    scaling = config.rope_scaling
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":  # positions divided by `factor` == frequencies divided by it
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        missing = [key for key in ("factor", "original_max_position_embeddings") if key not in scaling]
        if missing:
            raise ModelError(f"llama3 rope scaling without {' and '.join(missing)} (segment.md §3: required)")
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        # Long wavelengths are slowed down by `factor`, short ones kept, and the band
        # between them interpolated smoothly in 1/wavelength.
        smooth = (old_ctx / wavelen - low) / (high - low)
        mixed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(between, mixed, out)
    raise ModelError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin, each [n, 1, D] (broadcast over heads), for `apply_rope`."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [n, D/2]
    cos = angles.cos().repeat(1, 2)  # [n, D]: (cos, cos)
    sin = angles.sin()
    sin = torch.cat([-sin, sin], dim=-1)  # [n, D]: (-sin, sin)
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE: pairs are (i, i + D/2). x: [n, h, D] -> [n, h, D].

    out = x * cos + (x2, x1) * (-sin, sin) = (x1 cos - x2 sin, x2 cos + x1 sin)
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # [n, h, D]: (x2, x1)
    return torch.addcmul(x * cos, swapped, sin)


def rerotate_keys(k: Tensor, inv_freq: Tensor, old_pos: Tensor, new_pos: Tensor) -> Tensor:
    """Re-encode keys k [n, h, D], RoPE'd at positions old_pos [n], to positions new_pos [n].

    RoPE turns each pair (i, i + D/2) by pos * inv_freq[i], and two turns of one pair add
    their angles: turning by (new - old) * inv_freq moves a key exactly (in exact arithmetic)
    for every variant `rope_inv_freq` builds, since linear and llama3 scaling only change
    inv_freq. The angles are formed in float64 from the integer delta, the turn is applied in
    float32, and the result has k's dtype. h may be anything (e.g. layers * KV heads): the
    turn depends on the position and the dim only. Any device.
    """
    delta = new_pos.to(torch.float64) - old_pos.to(torch.float64)  # [n]
    angles = delta[:, None] * inv_freq.to(torch.float64)[None, :]  # [n, D/2]
    cos = angles.cos().float().repeat(1, 2)[:, None, :]  # [n, 1, D]: (cos, cos)
    sin = angles.sin().float()
    sin = torch.cat([-sin, sin], dim=-1)[:, None, :]  # [n, 1, D]: (-sin, sin)
    return apply_rope(k.float(), cos, sin).to(k.dtype)  # [n, h, D]


def write_kv(kv_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """THE place the KV cache changes: store K/V of n tokens at their slots.

    kv_cache: [2, num_blocks, block_size, Hkv, D]; slots: [n]; k, v: [n, Hkv, D].
    Values are rounded to the cache's dtype here.
    """
    two, nb, bs, hkv, d = kv_cache.shape
    flat = kv_cache.view(two, nb * bs, hkv, d)  # [2, slots, Hkv, D]
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def read_kv(kv_cache: Tensor, slots: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Gather K/V of T tokens from the paged buffer: two [T, Hkv, D] tensors in `dtype`."""
    two, nb, bs, hkv, d = kv_cache.shape
    kv = kv_cache.view(two, nb * bs, hkv, d)[:, slots]  # [2, T, Hkv, D]
    kv = kv.to(dtype)
    return kv[0], kv[1]


def attention_mask(q_pos: Tensor, k_pos: Tensor, sliding_window: int | None,
                   dtype: torch.dtype) -> Tensor:
    """Additive [n, T] mask: 0 where query i may attend to key j, -inf elsewhere.

    (An additive float mask is cheaper for CPU SDPA than a boolean one, which it
    would convert in every layer.)
    """
    allowed = k_pos[None, :] <= q_pos[:, None]  # [n, T]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device).masked_fill_(~allowed, float("-inf"))


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """q: [n, H, D]; k, v: [T, Hkv, D] -> [n, H*D]."""
    n, h, d = q.shape
    q = q.transpose(0, 1)[None]  # [1, H, n, D]  (4-D: CPU SDPA's fused kernel needs a batch dim)
    k = k.transpose(0, 1)[None]  # [1, Hkv, T, D]
    v = v.transpose(0, 1)[None]  # [1, Hkv, T, D]
    # grouped-query attention: each KV head serves H/Hkv query heads (enable_gqa)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                         enable_gqa=k.shape[1] != h)  # [1, H, n, D]
    return out[0].transpose(0, 1).reshape(n, h * d)  # [n, H*D]


def mlp(x: Tensor, w: LayerWeights) -> Tensor:
    gate_up = F.linear(x, w.w_gate_up)  # [n, 2F]
    gate, up = gate_up.chunk(2, dim=-1)  # [n, F] each (strided views)
    # silu() makes a fresh contiguous [n, F]; multiplying into it in place saves a
    # large allocation (about 20% of the MLP's time on CPU).
    return F.linear(F.silu(gate).mul_(up), w.w_down)  # [n, E]


def layer_forward(x: Tensor, w: LayerWeights, config: ModelConfig, cos: Tensor, sin: Tensor,
                  kv_cache: Tensor, write_slots: Tensor, read_slots: Tensor,
                  mask: Tensor | None, causal: bool) -> Tensor:
    n = x.shape[0]
    h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = F.linear(rms_norm(x, w.attn_norm, config.rms_norm_eps), w.wqkv, w.bqkv)  # [n, (H+2Hkv)*D]
    qk, v = qkv.split([(h + hkv) * d, hkv * d], dim=-1)
    qk = apply_rope(qk.view(n, h + hkv, d), cos, sin)  # [n, H+Hkv, D]: q and k in one go
    q, k = qk.split([h, hkv], dim=1)  # [n, H, D], [n, Hkv, D]
    v = v.view(n, hkv, d)  # [n, Hkv, D]
    write_kv(kv_cache, write_slots, k, v)
    k_all, v_all = read_kv(kv_cache, read_slots, x.dtype)  # [T, Hkv, D] each
    attn = attention(q, k_all, v_all, mask, causal)  # [n, H*D]
    # Residual adds in place: x is this forward pass's own activation buffer.
    x.add_(F.linear(attn, w.wo, w.bo))  # [n, E]
    return x.add_(mlp(rms_norm(x, w.mlp_norm, config.rms_norm_eps), w))  # [n, E]


LogitsMode = Literal["all", "last", "none", "hidden"]
# Chunks bound activation memory. On CPU the first chunk uses SDPA's fast causal
# path and later ones need an explicit mask, so prompts up to this size run in one.
DEFAULT_PREFILL_CHUNK = 2048


def forward(weights: Weights, config: ModelConfig, inv_freq: Tensor, tokens: Tensor,
            start_pos: int, kv_caches: list[Tensor], write_slots: Tensor, read_slots: Tensor,
            logits: LogitsMode = "all") -> Tensor | None:
    """Run n tokens at positions start_pos..start_pos+n-1 through every layer.

    tokens: [n]; write_slots: [n] (slots of these tokens); read_slots: [T] (slots of
    positions 0..T-1, T = start_pos + n). Returns float32 logits [n, V] ("all"),
    [1, V] ("last"), None, or ("hidden") the final hidden states [n, E], after the
    final norm: what lm_head reads (`logits_from_hidden`).
    """
    n = tokens.shape[0]
    dtype = weights.embed.dtype
    device = weights.embed.device
    positions = torch.arange(start_pos, start_pos + n, device=device)  # [n]
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)  # [n, 1, D] each
    t = start_pos + n
    window = config.sliding_window if config.sliding_window and config.sliding_window < t else None
    if n == 1 and window is None:
        mask, causal = None, False  # one query sees every cached key
    elif start_pos == 0 and window is None:
        mask, causal = None, True  # square causal: let SDPA build it
    else:
        mask = attention_mask(positions, torch.arange(t, device=device), window, dtype)
        causal = False
    x = weights.embed[tokens]  # [n, E]; a gathered copy, so layers may update it in place
    for w, kv_cache in zip(weights.layers, kv_caches):
        x = layer_forward(x, w, config, cos, sin, kv_cache, write_slots, read_slots, mask, causal)
    if logits == "none":
        return None
    if logits == "last":
        x = x[-1:]  # [1, E]
    x = rms_norm(x, weights.norm, config.rms_norm_eps)
    if logits == "hidden":
        return x  # [n, E]
    return logits_from_hidden(weights, x)  # [n or 1, V]


def logits_from_hidden(weights: Weights, hidden: Tensor) -> Tensor:
    """float32 logits [n, V] from final hidden states [n, E] (after the final norm)."""
    return F.linear(hidden.to(weights.lm_head.dtype), weights.lm_head).float()
