"""kvtool.engine.blend and RoPE re-encoding (issue 16, CacheBlend).

RoPE re-encoding against float64 ground truth for the default, linear and llama3 variants,
and on the real default model (layer 0 inside a longer prompt; every layer for the same
text run at another offset). The blended prefill on the real model: ratio 1.0 is a full
prefill, ratio 0 is naive reuse built here without the blend code, a first segment at
position 0 is plain prefix reuse bit for bit, selective recompute at 15% is closer to the
full prefill than naive reuse, and foreign segments are refused by name.

Segments as files (format-spec/segment.md): the `segment` key written and checked, a file turned
into an engine Segment (keys stored at other positions moved from there), the delimiter
retriever over files and the chunk store, and `kvtool.ops.blend.blend_replay`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtool.engine import PagedKVCache, Runner
from kvtool.engine.blend import BlendResult, Segment, blend_prefill, capture_segment
from kvtool.engine.model import (
    ModelConfig,
    apply_rope,
    attention_mask,
    layer_forward,
    read_kv,
    rerotate_keys,
    rope_cos_sin,
    rope_inv_freq,
    write_kv,
)
from kvtool.errors import (
    ManifestInvalid,
    MissingField,
    ModelMismatch,
    PromptError,
    RopeMismatch,
    ShapeMismatch,
    UnsupportedVersion,
    UsageError,
)
from kvtool.format import ContainerReader, ContainerWriter
from kvtool.format.segment import SegmentInfo, segment_extension
from kvtool.identity import ModelIdentity
from kvtool.ops.blend import blend_replay, retrieve, segment_from_file, split_prompt
from kvtool.ops.capture import capture
from kvtool.store import open_store

from fixtures import make_identity, rebuild, write_kv_file

SCHEMA = Path(__file__).resolve().parents[1] / "format-spec" / "manifest.schema.json"

DOCS = [
    ("Alice lives in Paris. She works as a baker and her favourite colour is green. Every morning "
     "she bakes forty loaves of rye bread before the sun rises, and she sells them at the market.\n"),
    ("Bob lives in Tokyo. He is a software engineer who writes compilers in Rust, and his favourite "
     "colour is orange. On weekends he climbs mountains with his sister.\n"),
    ("Carol lives in Lima. She is a marine biologist who studies whales, and her favourite colour "
     "is purple. She has two cats named Pixel and Byte.\n"),
]
QUESTION = "\nQuestion: What is Bob's favourite colour, and where does Carol live?\nAnswer:"
ANSWER_STEPS = 12  # teacher-forced positions compared after the prompt


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


# --- the blended prefill -------------------------------------------------------------


def _full_prefill(model, tokens, extra: int = ANSWER_STEPS, seed: int = 1):
    cache = PagedKVCache.for_tokens(model.config, len(tokens) + extra, block_size=16, shuffle_seed=seed)
    seq = cache.new_sequence()
    runner = Runner(model, cache)
    logits = runner.prefill(seq, tokens, logits="last")[0]
    return runner, seq, logits


def _blend(model, segments, question, ratio, check_layer=1, extra: int = ANSWER_STEPS, seed: int = 2):
    n = sum(len(s.tokens) for s in segments) + len(question)
    cache = PagedKVCache.for_tokens(model.config, n + extra, block_size=16, shuffle_seed=seed)
    seq = cache.new_sequence()
    runner = Runner(model, cache)
    result = blend_prefill(runner, seq, segments, question, recompute_ratio=ratio, check_layer=check_layer)
    return runner, seq, result


def _teacher_forced(runner, seq, first_logits, answer) -> torch.Tensor:
    """Logits [len(answer), V]: the prompt's last position, then each answer token but the last fed."""
    out = [first_logits]
    for token in answer[:-1]:
        out.append(runner.decode_step(seq, token))
    return torch.stack(out)


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over positions of KL(ref || got), in nats."""
    return F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean").item()


@pytest.fixture(scope="module")
def rag(default_model, captured):
    """Three documents as segments, the question, the full prefill's greedy answer, its
    teacher-forced logits [ANSWER_STEPS, V] and its KV."""
    segments = [capture_segment(default_model, tokens) for tokens, _ in captured[0]]
    question = default_model.tokenizer.encode(QUESTION)
    prompt = [t for s in segments for t in s.tokens] + question
    runner, seq, logits = _full_prefill(default_model, prompt)
    answer, step = [], logits
    for _ in range(ANSWER_STEPS):
        answer.append(int(step.argmax()))
        step = runner.decode_step(seq, answer[-1])
    full_kv = _segment_kv(runner.cache, seq, 0, len(prompt))
    ref = _teacher_forced(*_full_prefill(default_model, prompt), answer)
    return segments, question, prompt, answer, ref, full_kv


@pytest.mark.model
def test_capture_segment_is_the_segment_prefilled_alone(default_model, captured):
    tokens, kv = captured[0][0]
    seg = capture_segment(default_model, tokens)
    assert seg.tokens == tokens and seg.stored_start == 0 and seg.identity == default_model.identity
    assert seg.kv.shape == kv.shape and seg.kv.dtype == torch.float32
    assert torch.equal(seg.kv, kv)
    assert capture_segment(default_model, tokens, kv_dtype=torch.bfloat16).kv.dtype == torch.bfloat16


@pytest.mark.model
@pytest.mark.parametrize("check_layer", [1, 3])
def test_ratio_one_is_a_full_prefill(default_model, rag, check_layer):
    segments, question, prompt, answer, ref, full_kv = rag
    runner, seq, result = _blend(default_model, segments, question, 1.0, check_layer)
    assert isinstance(result, BlendResult) and result.tokens == prompt and seq.num_tokens == len(prompt)
    assert result.prefix == len(segments[0].tokens)  # the first segment is exact: never recomputed
    assert result.recomputed.tolist() == list(range(result.prefix, len(prompt)))
    assert result.recompute_fraction == 1.0
    torch.testing.assert_close(result.logits, ref[0], atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(_segment_kv(runner.cache, seq, 0, len(prompt)), full_kv, atol=2e-3, rtol=1e-4)
    got = _teacher_forced(runner, seq, result.logits, answer)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert _kl(ref, got) < 1e-6


@pytest.mark.model
def test_ratio_one_with_uncached_text_between_segments_is_a_full_prefill(default_model, rag):
    segments, question, _, _, ref, _ = rag
    middle = Segment(segments[1].tokens)  # no cache: computed in every layer
    _, _, result = _blend(default_model, [segments[0], middle, segments[2]], question, 1.0)
    torch.testing.assert_close(result.logits, ref[0], atol=2e-3, rtol=1e-4)
    assert result.cached.tolist() == [s.kv is not None for s in (segments[0], middle, segments[2])
                                      for _ in s.tokens] + [False] * len(question)


@pytest.mark.model
def test_ratio_zero_is_naive_reuse(default_model, rag):
    """Naive reuse built without the blend code: each segment's KV written at its new positions
    with re-rotated keys, then the question prefilled after it."""
    segments, question, prompt, answer, ref, _ = rag
    cfg = default_model.config
    inv_freq = rope_inv_freq(cfg)
    n_ctx = len(prompt) - len(question)
    cache = PagedKVCache.for_tokens(cfg, len(prompt) + ANSWER_STEPS, block_size=16, shuffle_seed=7)
    seq = cache.new_sequence(n_ctx)
    start = 0
    for seg in segments:
        t = len(seg.tokens)
        slots = seq.slot_mapping(start + t, start)
        pos = torch.arange(t)
        for layer, kv_cache in enumerate(cache.kv_caches):
            k = seg.kv[0, layer].view(t, cfg.num_kv_heads, cfg.head_dim)
            v = seg.kv[1, layer].view(t, cfg.num_kv_heads, cfg.head_dim)
            write_kv(kv_cache, slots, rerotate_keys(k, inv_freq, pos, pos + start), v)
        start += t
    seq.num_tokens = n_ctx
    naive_runner = Runner(default_model, cache)
    naive_logits = naive_runner.prefill(seq, question, start_pos=n_ctx, logits="last")[0]
    naive = _teacher_forced(naive_runner, seq, naive_logits, answer)

    runner, bseq, result = _blend(default_model, segments, question, 0.0)
    assert result.recomputed.tolist() == list(range(n_ctx, len(prompt)))  # the question only
    assert result.recomputed_cached == 0
    torch.testing.assert_close(result.logits, naive_logits, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(_segment_kv(runner.cache, bseq, 0, len(prompt)),
                               _segment_kv(cache, seq, 0, len(prompt)), atol=2e-3, rtol=1e-4)
    got = _teacher_forced(runner, bseq, result.logits, answer)
    assert torch.equal(got.argmax(-1), naive.argmax(-1))
    assert _kl(naive, got) < 1e-6
    assert _kl(ref, naive) > 1e-2  # naive reuse really is different from the full prefill


@pytest.mark.model
@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0])
def test_one_segment_at_position_zero_is_plain_prefix_reuse(default_model, rag, ratio):
    segments, question, _, _, _, _ = rag
    seg = segments[0]
    cfg, t = default_model.config, len(seg.tokens)
    # Plain prefix reuse: the segment's KV copied in as it is, then the question after it.
    cache = PagedKVCache.for_tokens(cfg, t + len(question) + 4, block_size=16, shuffle_seed=2)
    seq = cache.new_sequence(t)
    slots = seq.slot_mapping(t)
    for layer, kv_cache in enumerate(cache.kv_caches):
        write_kv(kv_cache, slots, seg.kv[0, layer].view(t, cfg.num_kv_heads, cfg.head_dim),
                 seg.kv[1, layer].view(t, cfg.num_kv_heads, cfg.head_dim))
    seq.num_tokens = t
    plain = Runner(default_model, cache)
    want = plain.prefill(seq, question, start_pos=t, logits="last")[0]

    runner, bseq, result = _blend(default_model, [seg], question, ratio, extra=4)
    assert result.prefix == t and result.recomputed.tolist() == list(range(t, t + len(question)))
    assert torch.equal(result.logits, want)
    n = t + len(question)
    assert torch.equal(_segment_kv(runner.cache, bseq, 0, n), _segment_kv(cache, seq, 0, n))
    for token in (int(want.argmax()), 42, 7):  # decoding goes on identically
        assert torch.equal(runner.decode_step(bseq, token), plain.decode_step(seq, token))


@pytest.mark.model
def test_selective_recompute_is_closer_to_the_full_prefill_than_naive_reuse(default_model, rag):
    segments, question, _, answer, ref, _ = rag
    kls = {}
    for ratio in (0.0, 0.15, 1.0):
        runner, seq, result = _blend(default_model, segments, question, ratio)
        kls[ratio] = _kl(ref, _teacher_forced(runner, seq, result.logits, answer))
        cached_after_prefix = sum(len(s.tokens) for s in segments[1:])
        assert result.recomputed_cached == round(ratio * cached_after_prefix)
        measured = result.deviation[result.cached & ~torch.isnan(result.deviation)]
        assert measured.numel() == cached_after_prefix and (measured >= 0).all()
    print(f"teacher-forced KL over {ANSWER_STEPS} positions vs full prefill: "
          + ", ".join(f"ratio {r}: {v:.4g}" for r, v in kls.items()))
    assert kls[1.0] < 1e-6
    assert kls[0.15] < kls[0.0]


def test_query_groups_attend_only_the_keys_up_to_their_last_row():
    import kvtool.engine.blend as blend_module

    rows = torch.cat([torch.arange(100, 400), torch.arange(700, 912)])  # 512 rows
    groups = blend_module.query_groups(rows, None, torch.float32, square=False)
    assert [(a, b, end) for a, b, end, _, _ in groups] == [(0, 128, 228), (128, 256, 356), (256, 384, 784),
                                                            (384, 512, 912)]
    for a, b, end, mask, causal in groups:
        assert not causal and mask.shape == (b - a, end)
        assert torch.equal(mask == 0, rows[a:b, None] >= torch.arange(end)[None, :])
    assert len(blend_module.query_groups(rows[:200], None, torch.float32, square=False)) == 1
    (a, b, end, mask, causal), = blend_module.query_groups(torch.arange(300), None, torch.float32, square=True)
    assert (a, b, end, mask, causal) == (0, 300, 300, None, True)


@pytest.mark.model
@pytest.mark.parametrize("ratio", [0.3, 1.0])
def test_rows_attending_in_groups_equal_one_pass_over_every_key(default_model, rag, monkeypatch, ratio):
    import kvtool.engine.blend as blend_module

    segments, question, _, _, ref, _ = rag
    monkeypatch.setattr(blend_module, "MIN_GROUP_ROWS", 10 ** 9)  # one group: every row over every key
    _, _, one = _blend(default_model, segments, question, ratio)
    monkeypatch.setattr(blend_module, "MIN_GROUP_ROWS", 8)  # four groups on this small prompt
    assert len(blend_module.query_groups(one.recomputed, None, torch.float32, False)) == 4
    _, _, four = _blend(default_model, segments, question, ratio)
    assert torch.equal(one.recomputed, four.recomputed)
    torch.testing.assert_close(four.logits, one.logits, atol=1e-3, rtol=1e-4)
    if ratio == 1.0:
        torch.testing.assert_close(four.logits, ref[0], atol=2e-3, rtol=1e-4)


@pytest.mark.model
def test_the_recompute_picks_the_tokens_whose_keys_deviate_most(default_model, rag):
    segments, question, _, _, _, _ = rag
    _, _, result = _blend(default_model, segments, question, 0.15)
    dev = result.deviation
    chosen = torch.zeros(len(dev), dtype=torch.bool)
    chosen[result.recomputed] = True
    measured = ~torch.isnan(dev)
    assert dev[chosen & measured].min() >= dev[~chosen & measured].max()


@pytest.mark.model
def test_foreign_segments_and_bad_arguments_are_refused_by_name(default_model, rag):
    segments, question, _, _, _, _ = rag
    seg = segments[1]
    mine = default_model.identity
    other_rope = ModelIdentity.from_dict({**mine.to_dict(), "rope": {"rope_theta": 10000.0, "rope_scaling": None}})
    scaled = ModelIdentity.from_dict({**mine.to_dict(), "rope": {
        "rope_theta": mine.rope["rope_theta"], "rope_scaling": {"rope_type": "linear", "factor": 2.0}}})
    other_model = ModelIdentity.from_dict({**mine.to_dict(), "num_layers": 24})
    other_weights = ModelIdentity.from_dict({**mine.to_dict(), "weights_digest": "sha256:" + "0" * 64})
    cases = [
        ([Segment(seg.tokens, seg.kv, identity=other_rope)], RopeMismatch, "RoPE"),
        ([Segment(seg.tokens, seg.kv, identity=scaled)], RopeMismatch, "RoPE"),
        ([Segment(seg.tokens, seg.kv, identity=other_model)], ModelMismatch, "not by the loaded model"),
        ([Segment(seg.tokens, seg.kv[:, :20])], ModelMismatch, "shape"),
        ([Segment(seg.tokens[:-1], seg.kv)], ShapeMismatch, "token ids"),
        ([Segment([], None)], PromptError, "no tokens"),
    ]
    if mine.weights_digest is not None:
        cases.append(([Segment(seg.tokens, seg.kv, identity=other_weights)], ModelMismatch, "other weights"))
    for segs, error, words in cases:
        with pytest.raises(error, match=words):
            _blend(default_model, segs, question, 0.15)
    assert issubclass(RopeMismatch, ModelMismatch)
    for kwargs, words in (({"ratio": 1.5}, "recompute_ratio"), ({"ratio": -0.1}, "recompute_ratio"),
                          ({"ratio": 0.1, "check_layer": 30}, "check_layer"),
                          ({"ratio": 0.1, "check_layer": -1}, "check_layer")):
        with pytest.raises(UsageError, match=words):
            _blend(default_model, [seg], question, **kwargs)
    with pytest.raises(PromptError, match="nothing to prefill"):
        _blend(default_model, [], [], 0.15)


@pytest.mark.model
def test_blend_without_a_question_recomputes_the_last_token(default_model, rag):
    segments = rag[0]
    runner, seq, result = _blend(default_model, segments[1:], [], 0.0)
    n = result.num_tokens
    assert result.prefix == len(segments[1].tokens)  # exact: cached from 0, placed at 0
    assert result.recomputed.tolist() == [n - 1] and seq.num_tokens == n
    assert torch.isfinite(result.logits).all() and math.isfinite(runner.decode_step(seq, 5).sum().item())


@pytest.mark.model
def test_a_segment_stored_at_other_positions_is_moved_from_there(default_model, rag):
    """stored_start says where the segment's keys were rotated: the same keys stored at 500.. blend
    as the ones stored at 0.."""
    segments, question, _, _, _, _ = rag
    cfg, b = default_model.config, segments[1]
    t = len(b.tokens)
    pos = torch.arange(t)
    k = b.kv[0].transpose(0, 1).reshape(t, -1, cfg.head_dim)  # [T, L*Hkv, D]
    k500 = rerotate_keys(k, rope_inv_freq(cfg), pos, pos + 500).view(t, cfg.num_layers, -1).transpose(0, 1)
    b500 = Segment(b.tokens, torch.stack([k500, b.kv[1]]), stored_start=500, identity=b.identity)
    _, _, want = _blend(default_model, segments, question, 0.15)
    _, _, got = _blend(default_model, [segments[0], b500, segments[2]], question, 0.15)
    assert torch.equal(got.recomputed, want.recomputed)
    torch.testing.assert_close(got.logits, want.logits, atol=2e-3, rtol=1e-4)


@pytest.mark.model
def test_bf16_segments_blend_into_a_bf16_cache(default_model, rag):
    segments, question, prompt, _, _, _ = rag
    segs16 = [capture_segment(default_model, s.tokens, kv_dtype=torch.bfloat16) for s in segments]
    cfg = default_model.config
    cache = PagedKVCache.for_tokens(cfg, len(prompt), block_size=16, kv_dtype=torch.bfloat16, shuffle_seed=9)
    seq = cache.new_sequence()
    want = Runner(default_model, cache).prefill(seq, prompt, logits="last")[0]
    cache = PagedKVCache.for_tokens(cfg, len(prompt), block_size=16, kv_dtype=torch.bfloat16, shuffle_seed=9)
    seq = cache.new_sequence()
    result = blend_prefill(Runner(default_model, cache), seq, segs16, question, recompute_ratio=1.0)
    assert cache.kv_caches[0].dtype == torch.bfloat16
    assert int(result.logits.argmax()) == int(want.argmax())
    assert _kl(want[None], result.logits[None]) < 1e-3


# --- segments as files (format-spec/segment.md) --------------------------------------------------


def _segment_file(path, stored_start: int = 0):
    identity = make_identity()
    f = write_kv_file(path, identity=identity, num_tokens=6, chunk_size=4)
    with ContainerReader(f.path) as r:
        kv, tokens = r.read_range(0, 6), r.token_ids().tolist()
    with ContainerWriter(path, identity, tokens, chunk_size=4, alignment=64,
                         extensions=segment_extension(stored_start)) as w:
        for s, e in w.chunk_ranges():
            w.write_chunk(kv[:, :, s:e])
    return Path(path)


def test_the_segment_key_is_written_and_read_back(tmp_path):
    plain = write_kv_file(tmp_path / "plain.kvc").path
    with ContainerReader(plain) as r:
        assert r.segment is None
    for start in (0, 500):
        path = _segment_file(tmp_path / f"seg{start}.kvc", start)
        with ContainerReader(path) as r:
            assert r.segment == SegmentInfo(stored_start=start, version=1)
            assert r.manifest.extensions["segment"] == {"version": 1, "stored_start": start}


def test_the_segment_key_validates_against_the_json_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from fixtures import split_file

    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    doc = split_file(_segment_file(tmp_path / "s.kvc", 7)).manifest
    validator.validate(doc)
    doc["segment"]["color"] = "red"
    assert not validator.is_valid(doc)


@pytest.mark.parametrize("value,error,words", [
    ([], ManifestInvalid, "must be an object"),
    ({"version": 1}, MissingField, "stored_start"),
    ({"stored_start": 0}, MissingField, "version"),
    ({"version": 1, "stored_start": 0, "moved": True}, ManifestInvalid, "undefined key 'moved'"),
    ({"version": True, "stored_start": 0}, ManifestInvalid, "version"),
    ({"version": 0, "stored_start": 0}, ManifestInvalid, "version"),
    ({"version": 2, "stored_start": 0}, UnsupportedVersion, "segment version 2"),
    ({"version": 1, "stored_start": -1}, ManifestInvalid, "stored_start"),
    ({"version": 1, "stored_start": 1.0}, ManifestInvalid, "stored_start"),
    ({"version": 1, "stored_start": 2 ** 24 - 5}, ManifestInvalid, "stored_start"),  # past 2^24 with 6 tokens
])
def test_a_bad_segment_key_is_refused_by_name_when_the_file_is_used_as_a_segment(tmp_path, value, error, words):
    good = _segment_file(tmp_path / "s.kvc")
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(rebuild(good, lambda doc: doc.__setitem__("segment", value)))
    with ContainerReader(bad) as r:  # a reader that does not use segments ignores the key
        assert r.read_range(0, 6).shape[2] == 6
        with pytest.raises(error, match=words) as info:
            r.segment
    assert str(bad) in str(info.value)
    with pytest.raises(ManifestInvalid):
        segment_extension(-3)


def test_the_store_refuses_a_segment_stored_at_other_positions(tmp_path):
    from kvtool.store.containers import ingest

    with open_store(str(tmp_path / "store")) as store:
        with ContainerReader(_segment_file(tmp_path / "at0.kvc", 0)) as r:
            assert ingest(r, store).stored == 1  # a segment at 0 is a prefix cache of its tokens
        with ContainerReader(_segment_file(tmp_path / "at5.kvc", 5)) as r:
            with pytest.raises(UsageError, match="rotated for positions from 5.*not a prefix cache"):
                ingest(r, store)


def test_replay_refuses_a_segment_stored_at_other_positions_as_a_prefix(tmp_path, default_model):
    from kvtool.errors import NotAPrefixCache
    from kvtool.ops.replay import check_model

    with ContainerReader(_segment_file(tmp_path / "at5.kvc", 5)) as r:
        with pytest.raises(NotAPrefixCache, match="rotated for positions from 5.*replay --blend"):
            check_model(r, default_model)


def test_split_prompt_at_the_delimiter():
    assert split_prompt("A # # B # # Q") == (["A", "B"], "Q")
    assert split_prompt(" # # A # #  # # B # # ") == (["A", "B"], "")
    assert split_prompt("A||Q", "||") == (["A"], "Q")
    with pytest.raises(UsageError, match="no delimiter"):
        split_prompt("just a question")
    with pytest.raises(UsageError, match="empty"):
        split_prompt("A # # Q", "")


@pytest.fixture(scope="module")
def segment_files(default_model, captured, tmp_path_factory):
    """DOCS[0..2] captured by `capture(segment=True)` into fp32 files, 16-token chunks."""
    folder = tmp_path_factory.mktemp("segments")
    paths = []
    for i, (tokens, _) in enumerate(captured[0]):
        path = folder / f"doc{i}.kvc"
        result = capture(default_model, tokens, path, chunk_size=16, kv_dtype=torch.float32, segment=True)
        assert result.segment == {"version": 1, "stored_start": 0}
        paths.append(path)
    return paths


@pytest.mark.model
def test_a_segment_file_is_the_segment_captured_alone(default_model, rag, segment_files):
    segments = rag[0]
    for path, want in zip(segment_files, segments):
        got = segment_from_file(path, default_model)
        assert got.tokens == want.tokens and got.stored_start == 0
        assert got.identity == default_model.identity
        assert got.kv.dtype == torch.float32  # capture prefills 16-token chunks: float rounding differs
        torch.testing.assert_close(got.kv, want.kv, atol=2e-4, rtol=1e-4)


@pytest.mark.model
def test_a_segment_file_stored_at_other_positions_blends_as_the_one_stored_at_zero(default_model, rag, tmp_path):
    """The writer records stored_start, the reader gives it to the engine, which moves the keys from there."""
    segments, question = rag[0], rag[1]
    cfg, b = default_model.config, segments[1]
    t = len(b.tokens)
    pos = torch.arange(t)
    k = b.kv[0].transpose(0, 1).reshape(t, -1, cfg.head_dim)
    k700 = rerotate_keys(k, rope_inv_freq(cfg), pos, pos + 700).view(t, cfg.num_layers, -1).transpose(0, 1)
    path = tmp_path / "b700.kvc"
    with ContainerWriter(path, default_model.identity, b.tokens, kv_dtype=torch.float32, chunk_size=16,
                         extensions=segment_extension(700)) as w:
        kv = torch.stack([k700, b.kv[1]])
        for s, e in w.chunk_ranges():
            w.write_chunk(kv[:, :, s:e])
    moved = segment_from_file(path, default_model)
    assert moved.stored_start == 700
    _, _, want = _blend(default_model, segments, question, 0.15)
    _, _, got = _blend(default_model, [segments[0], moved, segments[2]], question, 0.15)
    assert torch.equal(got.recomputed, want.recomputed)
    torch.testing.assert_close(got.logits, want.logits, atol=2e-3, rtol=1e-4)


@pytest.mark.model
def test_a_foreign_segment_file_is_refused_rope_first(default_model, segment_files, tmp_path):
    model_doc = {**default_model.identity.to_dict(), "rope": {"rope_theta": 10000.0, "rope_scaling": None}}
    with ContainerReader(segment_files[0]) as r:
        kv, tokens = r.read_range(0, r.num_tokens), r.token_ids().tolist()
    other_rope = tmp_path / "rope.kvc"
    with ContainerWriter(other_rope, ModelIdentity.from_dict(model_doc), tokens, kv_dtype=torch.float32,
                         extensions=segment_extension(0)) as w:
        w.write_chunk(kv)
    with pytest.raises(RopeMismatch, match=f"{other_rope}.*RoPE"):
        segment_from_file(other_rope, default_model)
    other_model = tmp_path / "layers.kvc"
    tiny = ModelIdentity.from_dict({**make_identity().to_dict(), "rope": default_model.identity.rope})
    with ContainerWriter(other_model, tiny, tokens[:3], extensions=segment_extension(0)) as w:
        w.write_chunk(torch.zeros(2, 2, 3, 16, dtype=torch.bfloat16))
    with pytest.raises(ModelMismatch, match="not by the loaded model"):
        segment_from_file(other_model, default_model)


@pytest.mark.model
def test_the_retriever_finds_segments_in_files_and_the_store(default_model, captured, segment_files, tmp_path):
    tok = default_model.tokenizer
    pieces = DOCS[:3]
    parts = retrieve(default_model, pieces, [str(segment_files[2]), str(segment_files[0])])
    assert [p.report.source for p in parts] == [str(segment_files[0]), "text", str(segment_files[2])]
    assert [[t for s in p.segments for t in s.tokens] for p in parts] == [tok.encode(d) for d in pieces]
    assert parts[1].segments[0].kv is None and parts[0].report.marked_segment
    with pytest.raises(UsageError, match="not those of any segment"):
        retrieve(default_model, pieces[:1], [str(segment_files[1])])

    store = tmp_path / "store"
    capture(default_model, tok.encode(DOCS[1]), None, chunk_size=16, kv_dtype=torch.float32, store=str(store),
            segment=True)
    parts = retrieve(default_model, pieces, [], str(store))
    n1 = len(tok.encode(DOCS[1]))
    whole = n1 // 16 * 16
    with open_store(str(store)) as chunk_store:
        url = chunk_store.url
    assert [(p.report.source, p.report.tokens, p.report.cached_tokens) for p in parts] == [
        ("text", len(tok.encode(DOCS[0])), 0), (url, n1, whole), ("text", len(tok.encode(DOCS[2])), 0)]
    cached, tail = parts[1].segments  # the whole chunks, then the tail (computed)
    assert len(cached.tokens) == whole and tail.kv is None and len(tail.tokens) == n1 - whole > 0
    torch.testing.assert_close(cached.kv, segment_from_file(segment_files[1]).kv[:, :, :whole])


@pytest.mark.model
def test_blend_replay_of_files_measures_against_the_full_prefill_and_naive_reuse(default_model, segment_files,
                                                                                 rag, tmp_path):
    question_file = tmp_path / "q.txt"
    question_file.write_text(QUESTION)
    files = [str(p) for p in segment_files]
    full = blend_replay(files, default_model, prompt_file=question_file, recompute_ratio=1.0, continue_tokens=6,
                        compare=True)
    eos = set(default_model.config.eos_token_ids)
    want = rag[3][:6]
    want = want[:next((i + 1 for i, t in enumerate(want) if t in eos), len(want))]  # it stops at the end of sequence
    assert full.ok and full.num_tokens == len(rag[2]) and full.continuation_tokens == want
    assert full.blend["top1_agreement"] == 1.0 and full.blend["kl_mean"] < 1e-6
    assert full.naive["kl_mean"] > 1e-3 and full.recompute_fraction == 1.0
    assert [s.source for s in full.segments] == files and full.prefix_tokens == len(rag[0][0].tokens)
    naive = blend_replay(files, default_model, prompt=QUESTION, recompute_ratio=0.0, continue_tokens=6,
                         compare=True)
    assert naive.blend["kl_mean"] == pytest.approx(naive.naive["kl_mean"], abs=1e-6)
    assert naive.recomputed_cached == 0 and naive.computed_tokens == len(rag[1])
    # the same prompt, delimited: the same tokens and the same blend
    delimited = " # # ".join(DOCS[:3]) + " # # " + QUESTION
    split = blend_replay(files, default_model, prompt=delimited, delimiter=" # # ", continue_tokens=6)
    plain = blend_replay(files, default_model, prompt=QUESTION, continue_tokens=6)
    assert split.continuation_tokens == plain.continuation_tokens and split.num_tokens == plain.num_tokens
    assert split.recomputed_cached == plain.recomputed_cached == round(0.15 * sum(len(s.tokens) for s in rag[0][1:]))
    with pytest.raises(UsageError, match="check-layer"):
        blend_replay(files, default_model, prompt=QUESTION, check_layer=30)
    with pytest.raises(UsageError, match="recompute-ratio"):
        blend_replay(files, default_model, prompt=QUESTION, recompute_ratio=2.0)
