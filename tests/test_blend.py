"""RoPE re-encoding of cached keys (issue 16, CacheBlend).

Against float64 ground truth for the default, linear and llama3 variants, and on the real
default model (layer 0 inside a longer prompt; every layer for the same text run at another
offset).
"""

from __future__ import annotations

import pytest
import torch

from kvtool.engine import PagedKVCache, Runner
from kvtool.engine.model import (
    ModelConfig,
    apply_rope,
    attention_mask,
    layer_forward,
    read_kv,
    rerotate_keys,
    rope_cos_sin,
    rope_inv_freq,
)

DOCS = [
    ("Alice lives in Paris. She works as a baker and her favourite colour is green. Every morning "
     "she bakes forty loaves of rye bread before the sun rises, and she sells them at the market.\n"),
    ("Bob lives in Tokyo. He is a software engineer who writes compilers in Rust, and his favourite "
     "colour is orange. On weekends he climbs mountains with his sister.\n"),
    ("Carol lives in Lima. She is a marine biologist who studies whales, and her favourite colour "
     "is purple. She has two cats named Pixel and Byte.\n"),
]


def _config(scaling: dict | None, theta: float = 10000.0, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=2 * head_dim,
                       intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=head_dim,
                       rms_norm_eps=1e-5, rope_theta=theta, rope_scaling=scaling,
                       max_position_embeddings=8192, tie_word_embeddings=True)


def _rope64(raw: torch.Tensor, inv_freq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """RoPE in float64 from the definition: pair (i, i + D/2) turned by pos * inv_freq[i]."""
    angles = pos.double()[:, None, None] * inv_freq.double()[None, None, :]  # [n, 1, D/2]
    x1, x2 = raw.double().chunk(2, dim=-1)
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)


ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rerotated_keys_equal_keys_rotated_at_the_new_positions(variant, device):
    inv_freq = rope_inv_freq(_config(ROPE_VARIANTS[variant])).to(device)
    if variant != "default":  # the scaling really changes the frequencies
        assert not torch.equal(inv_freq.cpu(), rope_inv_freq(_config(None)))
    g = torch.Generator().manual_seed(0)
    n, h, d = 300, 6, 64
    raw = (torch.randn(n, h, d, generator=g) * 3).to(device)
    old = torch.randint(0, 6000, (n,), generator=g).to(device)
    new = torch.randint(0, 8000, (n,), generator=g).to(device)  # moves both ways
    k_old = _rope64(raw, inv_freq, old).float()
    got = rerotate_keys(k_old, inv_freq, old, new)
    assert got.dtype == torch.float32 and got.device.type == device
    torch.testing.assert_close(got.double(), _rope64(raw, inv_freq, new), atol=5e-5, rtol=0)
    # No move is the identity, and moves compose: old -> mid -> new == old -> new.
    assert torch.equal(rerotate_keys(k_old, inv_freq, old, old), k_old)
    mid = torch.randint(0, 8000, (n,), generator=g).to(device)
    torch.testing.assert_close(rerotate_keys(rerotate_keys(k_old, inv_freq, old, mid), inv_freq, mid, new),
                               got, atol=5e-5, rtol=0)
    # A half-precision cache stays in its dtype, within its rounding.
    got16 = rerotate_keys(k_old.bfloat16(), inv_freq, old, new)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), got, atol=0.1, rtol=2 ** -7)


def test_rerotation_matches_the_engines_own_rope():
    """The engine's RoPE (float32 angles) at a new position, from the key at position 0."""
    inv_freq = rope_inv_freq(_config(None, theta=100000.0))
    raw = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(200, 250)
    at0 = apply_rope(raw, *rope_cos_sin(inv_freq, torch.zeros(50, dtype=torch.long), torch.float32))
    at_pos = apply_rope(raw, *rope_cos_sin(inv_freq, pos, torch.float32))
    torch.testing.assert_close(rerotate_keys(at0, inv_freq, torch.zeros_like(pos), pos), at_pos,
                               atol=1e-4, rtol=1e-5)


# --- the real default model ----------------------------------------------------------


def _segment_kv(cache: PagedKVCache, seq, start: int, end: int) -> torch.Tensor:
    """KV_BLOB [2, L, end - start, C] of positions start..end-1 of `seq`."""
    slots = seq.slot_mapping(end, start)
    k, v = zip(*(read_kv(layer, slots, torch.float32) for layer in cache.kv_caches))
    return torch.stack([torch.stack(k), torch.stack(v)]).flatten(3)


def _capture(model, tokens) -> torch.Tensor:
    """KV_BLOB [2, L, T, C] of `tokens` prefilled alone from position 0 (float32)."""
    cache = PagedKVCache.for_tokens(model.config, len(tokens), block_size=16, shuffle_seed=5)
    seq = cache.new_sequence()
    Runner(model, cache).prefill(seq, tokens, logits="none")
    return _segment_kv(cache, seq, 0, len(tokens))


@pytest.fixture(scope="module")
def captured(default_model):
    """Each document's tokens and KV captured alone, and the KV of all of them in one prompt."""
    tok = default_model.tokenizer
    docs = [tok.encode(d) for d in DOCS]
    whole = [t for d in docs for t in d]
    return [(d, _capture(default_model, d)) for d in docs], _capture(default_model, whole)


@pytest.mark.model
def test_layer0_keys_rerotated_equal_the_keys_inside_a_longer_prompt(default_model, captured):
    """Layer 0's K depends only on the token and its position."""
    docs, full_kv = captured
    (a, _), (b, b_kv) = docs[0], docs[1]
    start, end = len(a), len(a) + len(b)
    cfg = default_model.config
    inv_freq = rope_inv_freq(cfg)
    k0 = b_kv[0, 0].view(-1, cfg.num_kv_heads, cfg.head_dim)  # layer 0 K, captured at 0..T-1
    pos = torch.arange(len(b))
    moved = rerotate_keys(k0, inv_freq, pos, pos + start)
    placed = full_kv[0, 0, start:end].view(-1, cfg.num_kv_heads, cfg.head_dim)
    assert (moved - k0).abs().max() > 1.0  # the move matters
    torch.testing.assert_close(moved, placed, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(b_kv[1, 0], full_kv[1, 0, start:end], atol=1e-5, rtol=1e-5)  # V: no RoPE


@pytest.mark.model
def test_every_layers_keys_rerotated_equal_the_same_text_run_at_the_new_offset(default_model, captured):
    """RoPE attention sees only relative positions: the same text with nothing before it, run at
    positions s.., has the same hidden states, so its K at every layer is the K captured at 0..
    turned by s."""
    tokens, kv = captured[0][2]
    cfg, w = default_model.config, default_model.weights
    n, s = len(tokens), 1000
    inv_freq = rope_inv_freq(cfg)
    cache = PagedKVCache.for_tokens(cfg, n, block_size=16, shuffle_seed=3)
    slots = cache.new_sequence(n).slot_mapping(n)
    pos = torch.arange(s, s + n)
    cos, sin = rope_cos_sin(inv_freq, pos, w.embed.dtype)
    mask = attention_mask(pos, pos, None, w.embed.dtype)  # causal over its own keys only
    x = w.embed[torch.tensor(tokens)]
    with torch.inference_mode():
        for lw, kv_cache in zip(w.layers, cache.kv_caches):
            x = layer_forward(x, lw, cfg, cos, sin, kv_cache, slots, slots, mask, False)
    for layer in range(cfg.num_layers):
        k_at_s, v_at_s = read_kv(cache.kv_caches[layer], slots, torch.float32)
        k0 = kv[0, layer].view(n, cfg.num_kv_heads, cfg.head_dim)
        moved = rerotate_keys(k0, inv_freq, pos - s, pos)
        rel = ((moved - k_at_s).norm() / k_at_s.norm()).item()
        assert rel < 1e-4, f"layer {layer}: relative error {rel:.3g}"
        vrel = ((kv[1, layer].view_as(v_at_s) - v_at_s).norm() / v_at_s.norm()).item()
        assert vrel < 1e-4, f"V of layer {layer}: relative error {vrel:.3g}"
