"""A small decoder for the Llama family and its relatives, on a paged KV cache.

One flat file of small functions (in the spirit of gpt-fast's model.py, our own
code): RMSNorm, RoPE (default / linear / llama3 scaling), grouped-query
attention through `scaled_dot_product_attention`, gated MLPs (SiLU or GELU-tanh),
tied or untied embeddings. Families differ only by fields of `ModelConfig` and
by which weights a layer has (`families.py` maps each Hugging Face config):
Llama (= SmolLM), Mistral and Qwen2 (q/k/v bias; sliding windows), Qwen3 (RMSNorm
of each q/k head before RoPE), Gemma 2 and 3 (scaled embeddings, norms after
attention and MLP, soft-capped attention and logits, sliding-window layers between
global ones, Gemma 3's own RoPE base for its sliding layers), Phi-3 (fused q/k/v
and gate/up, which is kvtool's own layout) and OLMo 2 (norms after attention and
MLP only, RMSNorm of the whole q/k projection).

Sliding-window layers attend to the last `sliding_window` positions only (the
mask says so), but the paged cache keeps every position's K/V in every layer:
what kvtool captures is the KV of every token of every layer.

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
    # A sliding layer's query at p sees keys p - sliding_window + 1 .. p.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # The per-family switches (families.py sets them; the defaults are Llama's).
    sliding_layers: tuple[int, ...] | None = None  # layers that slide; None: all, when sliding_window is set
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (no scaling there)
    qk_norm: Literal["head", "full"] | None = None  # RMSNorm of q and k before RoPE: per head (Qwen3,
    #                                                 Gemma 3) or over the whole projection (OLMo 2)
    activation: Literal["silu", "gelu_tanh"] = "silu"  # of the MLP's gate
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # scores' scale; None: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-0.5)
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap), before the mask
    final_softcap: float | None = None  # Gemma 2: the same on the logits

    def layer_window(self, layer: int) -> int | None:
        """The window of `layer`'s attention; None: it sees every earlier position."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window


@dataclass
class LayerWeights:
    attn_norm: Tensor | None  # [E]; None: the layer's input goes to q/k/v as it is (OLMo 2)
    wqkv: Tensor  # [(H + 2*Hkv) * D, E]  q, k, v projections stacked
    bqkv: Tensor | None  # [(H + 2*Hkv) * D] (Qwen2, Llama attention_bias)
    wo: Tensor  # [E, H*D]
    bo: Tensor | None  # [E]
    mlp_norm: Tensor | None  # [E]; None: the MLP reads the residual stream as it is (OLMo 2)
    w_gate_up: Tensor  # [2*F, E]  gate and up projections stacked
    w_down: Tensor  # [E, F]
    attn_post_norm: Tensor | None = None  # [E] on the attention's output before the residual (Gemma, OLMo 2)
    mlp_post_norm: Tensor | None = None  # [E] on the MLP's output before the residual (Gemma, OLMo 2)
    q_norm: Tensor | None = None  # [D] (qk_norm "head") or [H*D] ("full")
    k_norm: Tensor | None = None  # [D] or [Hkv*D]


@dataclass
class Weights:
    embed: Tensor  # [V, E]
    layers: list[LayerWeights]
    norm: Tensor  # [E]
    lm_head: Tensor  # [V, E]; the same tensor as `embed` when tied


# --- building blocks -----------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim. A float32 `weight` with half-precision x (the loader keeps
    Gemma's and OLMo 2's norms in float32) scales before rounding, as those models do."""
    if x.dtype == torch.float32:  # one fused kernel; same math as below
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Half dtypes: normalise in float32, scale in the compute dtype (Llama) or in float32.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


def maybe_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """`rms_norm`, or x itself where the family has no norm there (weight None)."""
    return x if weight is None else rms_norm(x, weight, eps)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> Tensor:
    """Inverse frequencies [D/2] (float32) with the model's theta and scaling; `local`: of the
    sliding layers of a model whose sliding layers have their own base (Gemma 3: plain RoPE)."""
    d = config.head_dim
    theta = config.rope_local_theta if local and config.rope_local_theta is not None else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    scaling = None if local and config.rope_local_theta is not None else config.rope_scaling
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


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
              scale: float | None = None, softcap: float | None = None) -> Tensor:
    """q: [n, H, D]; k, v: [T, Hkv, D] -> [n, H*D]. `scale` of the scores (None: 1/sqrt(D));
    `softcap`: scores capped as cap * tanh(scores / cap) before the mask (written out: SDPA has
    no soft-capping)."""
    n, h, d = q.shape
    if softcap is not None:
        return softcapped_attention(q, k, v, mask, causal, scale, softcap)
    q = q.transpose(0, 1)[None]  # [1, H, n, D]  (4-D: CPU SDPA's fused kernel needs a batch dim)
    k = k.transpose(0, 1)[None]  # [1, Hkv, T, D]
    v = v.transpose(0, 1)[None]  # [1, Hkv, T, D]
    # grouped-query attention: each KV head serves H/Hkv query heads (enable_gqa)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[1] != h)  # [1, H, n, D]
    return out[0].transpose(0, 1).reshape(n, h * d)  # [n, H*D]


def softcapped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                         scale: float | None, softcap: float) -> Tensor:
    """`attention` with capped scores, in plain tensor ops; softmax in float32."""
    n, h, d = q.shape
    t, hkv = k.shape[0], k.shape[1]
    qg = q.view(n, hkv, h // hkv, d)  # [n, Hkv, G, D]: query head i uses KV head i // G
    scores = torch.einsum("nkgd,tkd->kgnt", qg, k) * (d ** -0.5 if scale is None else scale)  # [Hkv, G, n, T]
    scores = torch.tanh(scores / softcap) * softcap
    if causal and mask is None:  # the square causal case: query i is position i
        mask = attention_mask(torch.arange(n, device=q.device), torch.arange(t, device=q.device), None, q.dtype)
    if mask is not None:
        scores = scores + mask  # [n, T] broadcast
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    out = torch.einsum("kgnt,tkd->nkgd", probs, v)  # [n, Hkv, G, D]
    return out.reshape(n, h * d)  # [n, H*D]


def mlp(x: Tensor, w: LayerWeights, config: ModelConfig) -> Tensor:
    gate_up = F.linear(x, w.w_gate_up)  # [n, 2F]
    gate, up = gate_up.chunk(2, dim=-1)  # [n, F] each (strided views)
    # The activation makes a fresh contiguous [n, F]; multiplying into it in place saves a
    # large allocation (about 20% of the MLP's time on CPU).
    act = F.silu(gate) if config.activation == "silu" else F.gelu(gate, approximate="tanh")
    return F.linear(act.mul_(up), w.w_down)  # [n, E]


def project_qkv(x: Tensor, w: LayerWeights, config: ModelConfig, cos: Tensor,
                sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's input x [n, E] -> q [n, H, D] and k [n, Hkv, D] (normed where the family norms
    them, then RoPE'd) and v [n, Hkv, D]."""
    n, eps = x.shape[0], config.rms_norm_eps
    h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = F.linear(maybe_norm(x, w.attn_norm, eps), w.wqkv, w.bqkv)  # [n, (H+2Hkv)*D]
    qk, v = qkv.split([(h + hkv) * d, hkv * d], dim=-1)
    if config.qk_norm is not None:
        q, k = qk.split([h * d, hkv * d], dim=-1)
        if config.qk_norm == "head":  # each head's D values (Qwen3, Gemma 3)
            q, k = q.reshape(n, h, d), k.reshape(n, hkv, d)
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)  # "full": all H*D at once (OLMo 2)
        qk = torch.cat([q.reshape(n, h, d), k.reshape(n, hkv, d)], dim=1)  # [n, H+Hkv, D]
    qk = apply_rope(qk.reshape(n, h + hkv, d), cos, sin)  # [n, H+Hkv, D]: q and k in one go
    q, k = qk.split([h, hkv], dim=1)  # [n, H, D], [n, Hkv, D]
    return q, k, v.reshape(n, hkv, d)


def finish_layer(x: Tensor, attn: Tensor, w: LayerWeights, config: ModelConfig) -> Tensor:
    """The rest of a layer after attention (attn [n, H*D]): output projection, the residual adds
    and the MLP, each with the norms the family has. x [n, E] is updated in place and returned."""
    eps = config.rms_norm_eps
    # Residual adds in place: x is this forward pass's own activation buffer.
    x.add_(maybe_norm(F.linear(attn, w.wo, w.bo), w.attn_post_norm, eps))  # [n, E]
    out = mlp(maybe_norm(x, w.mlp_norm, eps), w, config)  # [n, E]
    return x.add_(maybe_norm(out, w.mlp_post_norm, eps))  # [n, E]


def layer_forward(x: Tensor, w: LayerWeights, config: ModelConfig, cos: Tensor, sin: Tensor,
                  kv_cache: Tensor, write_slots: Tensor, read_slots: Tensor,
                  mask: Tensor | None, causal: bool) -> Tensor:
    """One layer: cos/sin [n, 1, D] and (mask, causal) are this layer's (`layer_plan`)."""
    q, k, v = project_qkv(x, w, config, cos, sin)
    write_kv(kv_cache, write_slots, k, v)
    k_all, v_all = read_kv(kv_cache, read_slots, x.dtype)  # [T, Hkv, D] each
    attn = attention(q, k_all, v_all, mask, causal, config.attn_scale, config.attn_softcap)  # [n, H*D]
    return finish_layer(x, attn, w, config)


LogitsMode = Literal["all", "last", "none", "hidden"]
# Chunks bound activation memory. On CPU the first chunk uses SDPA's fast causal
# path and later ones need an explicit mask, so prompts up to this size run in one.
DEFAULT_PREFILL_CHUNK = 2048


def rope_tables(config: ModelConfig, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """(global, local) inverse frequencies [D/2] on `device`: the sliding layers' own where the
    model has them (Gemma 3), else the same tensor twice."""
    inv_freq = rope_inv_freq(config).to(device)
    if config.rope_local_theta is None:
        return inv_freq, inv_freq
    return inv_freq, rope_inv_freq(config, local=True).to(device)


def layer_inv_freq(config: ModelConfig, layer: int, tables: tuple[Tensor, Tensor]) -> Tensor:
    """The inverse frequencies `layer`'s keys are turned with (`rope_tables`)."""
    return tables[1] if config.layer_window(layer) is not None else tables[0]


def attention_plan(q_pos: Tensor, num_keys: int, window: int | None, dtype: torch.dtype,
                   square: bool) -> tuple[Tensor | None, bool]:
    """(mask, causal) for queries at q_pos (ascending, the last at num_keys - 1) over keys
    0..num_keys-1; `square`: the queries are exactly positions 0..num_keys-1."""
    if window is not None and window >= num_keys:
        window = None  # the window covers everything: plain causal
    if q_pos.shape[0] == 1 and window is None:
        return None, False  # one query, the last position: it sees every key
    if square and window is None:
        return None, True  # SDPA's own causal path
    return attention_mask(q_pos, torch.arange(num_keys, device=q_pos.device), window, dtype), False


def forward(weights: Weights, config: ModelConfig, inv_freqs: tuple[Tensor, Tensor], tokens: Tensor,
            start_pos: int, kv_caches: list[Tensor], write_slots: Tensor, read_slots: Tensor,
            logits: LogitsMode = "all") -> Tensor | None:
    """Run n tokens at positions start_pos..start_pos+n-1 through every layer.

    inv_freqs: `rope_tables(config)`. tokens: [n]; write_slots: [n] (slots of these tokens);
    read_slots: [T] (slots of positions 0..T-1, T = start_pos + n). Returns float32 logits
    [n, V] ("all"), [1, V] ("last"), None, or ("hidden") the final hidden states [n, E], after
    the final norm: what lm_head reads (`logits_from_hidden`).
    """
    n = tokens.shape[0]
    dtype = weights.embed.dtype
    device = weights.embed.device
    positions = torch.arange(start_pos, start_pos + n, device=device)  # [n]
    t = start_pos + n
    plans: dict[int | None, tuple] = {}  # per window: (cos, sin, mask, causal), shared by its layers
    x = embed(weights, config, tokens)  # [n, E]; a fresh copy, so layers may update it in place
    for layer, (w, kv_cache) in enumerate(zip(weights.layers, kv_caches)):
        window = config.layer_window(layer)
        if window not in plans:
            cos, sin = rope_cos_sin(layer_inv_freq(config, layer, inv_freqs), positions, dtype)  # [n, 1, D]
            plans[window] = (cos, sin, *attention_plan(positions, t, window, dtype, square=start_pos == 0))
        cos, sin, mask, causal = plans[window]
        x = layer_forward(x, w, config, cos, sin, kv_cache, write_slots, read_slots, mask, causal)
    if logits == "none":
        return None
    if logits == "last":
        x = x[-1:]  # [1, E]
    x = rms_norm(x, weights.norm, config.rms_norm_eps)
    if logits == "hidden":
        return x  # [n, E]
    return logits_from_hidden(weights, x, config.final_softcap)  # [n or 1, V]


def embed(weights: Weights, config: ModelConfig, tokens: Tensor) -> Tensor:
    """Embeddings [n, E] of tokens [n] (a gathered copy), scaled where the family scales them."""
    x = weights.embed[tokens]  # [n, E]
    if config.embed_scale is not None:  # Gemma: the scale rounded to the weights' dtype first
        x.mul_(torch.tensor(config.embed_scale, dtype=x.dtype, device=x.device))
    return x


def logits_from_hidden(weights: Weights, hidden: Tensor, softcap: float | None = None) -> Tensor:
    """float32 logits [n, V] from final hidden states [n, E] (after the final norm); `softcap`:
    the model's final soft-capping (`ModelConfig.final_softcap`, Gemma 2)."""
    logits = F.linear(hidden.to(weights.lm_head.dtype), weights.lm_head)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.float()
