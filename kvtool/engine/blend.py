"""Blended prefill (CacheBlend): a prompt made of separately cached text segments.

Each cached segment's KV was computed with the segment alone (positions from
`stored_start`, normally 0). Placed in a new prompt, its keys sit at the wrong
positions and none of its tokens has seen the text before it. The blended prefill:

1. writes every cached segment's KV into the sequence's paged cache at its new
   positions, keys re-rotated there (`rerotate_keys`);
2. runs layers 0..check_layer-1 for every token (a full prefill of those layers: their
   fresh K/V replace the cached ones);
3. at `check_layer`, computes fresh Q/K/V for every token and measures each cached
   token's *deviation* (`kv_deviation`): for K and for V, the L2 distance per KV head of
   fresh from cached (re-rotated) values, divided by that head's mean cached norm, squared
   and summed over heads and over K and V, in float32. (Rotations keep lengths, so K's
   distance is also the one before RoPE.) The `recompute_ratio` fraction of cached tokens
   with the largest deviation is chosen, round(ratio * candidates) tokens; uncached tokens
   (the question) and the prompt's last token are always chosen;
4. from `check_layer` on, runs the chosen tokens only: their fresh K/V overwrite the
   cached ones, and they attend causally over the blended K/V of the whole prompt.
   The other tokens keep their cached (re-rotated) K/V in those layers.

One exception, with no loss: a first segment cached from position 0 and placed at 0 is
a true prefix, exactly what a full prefill computes, so it is used as it is and
never recomputed (the blend then matches plain prefix reuse). The ratio counts the
cached tokens after it.

So ratio 1.0 is a full prefill (every token recomputed in every layer), and with
check_layer 1 ratio 0 is naive reuse (cached KV at new positions, only uncached tokens
computed): layer 0's K/V depend on nothing but the token and its position, so layer
0's fresh K/V of cached tokens equal their re-rotated cached K/V. With a deeper check
layer, layers below it are fully recomputed at every ratio.

Afterwards the paged cache holds the blended KV of the whole prompt and
`seq.num_tokens` is its length: `Runner.decode_step` continues from there.

The whole prompt runs in one chunk (activations of [n, E] and masks of [chosen, n] at most);
the rows run in a layer attend in up to four groups, each over the keys up to its last
position (`query_groups`). RoPE re-encoding is exact for the default, linear and llama3
variants the engine runs, in every family it runs (`families.py`, `Family.blend`): norms of
q/k (Qwen3, Gemma 3, OLMo 2) come before RoPE, so a cached key is still one turn from its new
position; each layer turns with its own table (Gemma 3's sliding layers have their own base) and
attends with its own window and soft-capping, in the blend as in `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import ModelMismatch, PromptError, RopeMismatch, ShapeMismatch, UsageError
from ..identity import ModelIdentity
from .loader import LoadedModel
from .model import (
    LayerWeights,
    ModelConfig,
    attention,
    attention_plan,
    embed,
    finish_layer,
    layer_inv_freq,
    logits_from_hidden,
    project_qkv,
    read_kv,
    rerotate_keys,
    rms_norm,
    rope_cos_sin,
    write_kv,
)
from .paged import PagedKVCache, Sequence
from .runner import Runner

DEFAULT_RECOMPUTE_RATIO = 0.15  # LMCache's defaults
DEFAULT_CHECK_LAYER = 1


@dataclass
class Segment:
    """One part of a blended prompt.

    tokens: its token ids. kv: its KV_BLOB [2, L, T, C] (C = KV heads * head dim, K at
    index 0), computed with the segment alone at positions stored_start..stored_start+T-1,
    any dtype and device; None for text without a cache (computed in every layer).
    identity: the model that computed kv, when known; it must be the runner's model, and a
    different RoPE setting is refused by name (RopeMismatch).
    """

    tokens: list[int]
    kv: Tensor | None = None
    stored_start: int = 0
    identity: ModelIdentity | None = None


@dataclass
class BlendResult:
    """What `blend_prefill` did. Positions index the whole prompt (all segments, then the question)."""

    logits: Tensor  # [V] float32, the prompt's last position
    tokens: list[int]  # the whole prompt
    cached: Tensor  # [n] bool (CPU): the token's KV came from a segment's cache
    prefix: int  # leading positions taken exactly (a first segment cached from 0), never recomputed
    recomputed: Tensor  # [k] long (CPU), sorted: positions run from the check layer on
    deviation: Tensor = field(repr=False)  # [n] float32 (CPU): check-layer KV deviation; NaN where not measured

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def recomputed_cached(self) -> int:
        """Cached tokens recomputed from the check layer on (the ratio's share)."""
        return int(self.cached[self.recomputed].sum())

    @property
    def recompute_fraction(self) -> float:
        """recomputed_cached over the cached tokens the ratio applies to (after the prefix)."""
        candidates = int(self.cached[self.prefix:].sum())
        return self.recomputed_cached / candidates if candidates else 0.0


# --- segments -----------------------------------------------------------------------


@torch.inference_mode()
def capture_segment(model: LoadedModel, tokens, kv_dtype: torch.dtype = torch.float32) -> Segment:
    """A Segment of `tokens` computed alone from position 0 (its own scratch cache)."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise PromptError("a segment needs at least one token")
    cfg = model.config
    cache = PagedKVCache.for_tokens(cfg, len(tokens), kv_dtype=kv_dtype, device=model.device)
    seq = cache.new_sequence(len(tokens))
    Runner(model, cache).prefill(seq, tokens, logits="none")
    slots = seq.slot_mapping(len(tokens), device=model.device)
    k, v = zip(*(read_kv(layer, slots, kv_dtype) for layer in cache.kv_caches))  # L x [T, Hkv, D]
    kv = torch.stack([torch.stack(k), torch.stack(v)])  # [2, L, T, Hkv, D]
    return Segment(tokens, kv.flatten(3), 0, model.identity)  # [2, L, T, C]


def check_segment(segment: Segment, model: LoadedModel, index: int, name: str | None = None) -> None:
    """Refuse a segment whose KV cannot be blended into this model's prompt: its identity (RoPE
    first, then the model, then the weights) and, when it holds KV, the KV's shape. `name` says
    which segment in messages (default "segment {index}")."""
    cfg, name = model.config, name or f"segment {index}"
    if not segment.tokens:
        raise PromptError(f"{name} has no tokens")
    if segment.identity is not None:
        mine = model.identity
        if segment.identity.rope != mine.rope:
            raise RopeMismatch(f"{name} was cached with RoPE {segment.identity.rope}, the model uses {mine.rope}")
        if segment.identity.fingerprint() != mine.fingerprint():
            raise ModelMismatch(f"{name} was cached by {segment.identity.name!r} "
                                f"({segment.identity.fingerprint()[:19]}...), not by the loaded model "
                                f"{mine.name!r} ({mine.fingerprint()[:19]}...)")
        theirs, ours = segment.identity.weights_digest, mine.weights_digest
        if theirs is not None and ours is not None and theirs != ours:
            raise ModelMismatch(f"{name} was cached with other weights than the loaded model's")
    if segment.kv is None:
        return
    shape = tuple(segment.kv.shape)
    channels = cfg.num_kv_heads * cfg.head_dim
    if len(shape) != 4 or shape[0] != 2 or (shape[1], shape[3]) != (cfg.num_layers, channels):
        raise ModelMismatch(f"{name}'s KV has shape {list(shape)}; the model needs "
                            f"[2, {cfg.num_layers}, T, {channels}]")
    if shape[2] != len(segment.tokens):
        raise ShapeMismatch(f"{name} holds KV of {shape[2]} tokens for {len(segment.tokens)} token ids")
    if segment.stored_start < 0:
        raise UsageError(f"{name}: stored_start must be >= 0, got {segment.stored_start}")


def place_segment(runner: Runner, segment: Segment, slots: Tensor, start: int) -> None:
    """Write a cached segment into the paged cache at positions start.., keys re-rotated there
    (each layer's keys with the frequencies that layer turned them by)."""
    cfg, device = runner.config, runner.inv_freq.device
    n = len(segment.tokens)
    kv = segment.kv.to(device)  # [2, L, T, C]
    k = kv[0].transpose(0, 1).reshape(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)  # [T, L, Hkv, D]
    if start != segment.stored_start:
        old = torch.arange(segment.stored_start, segment.stored_start + n, device=device)  # [T]
        new = old + (start - segment.stored_start)
        if runner.local_inv_freq is runner.inv_freq:  # one table: every layer's keys in one call
            k = rerotate_keys(k.reshape(n, -1, cfg.head_dim), runner.inv_freq, old, new).view_as(k)
        else:  # Gemma 3: the sliding layers' keys turn by their own table
            k = torch.stack([rerotate_keys(k[:, i], layer_inv_freq(cfg, i, runner.rope_tables), old, new)
                             for i in range(cfg.num_layers)], dim=1)  # [T, L, Hkv, D]
    v = kv[1].reshape(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)  # [L, T, Hkv, D]
    for layer, kv_cache in enumerate(runner.cache.kv_caches):
        write_kv(kv_cache, slots, k[:, layer], v[layer])


# --- the blended pass: one layer split at the point where tokens are chosen ----------


def kv_deviation(fresh_k: Tensor, fresh_v: Tensor, cached_k: Tensor, cached_v: Tensor, cached: Tensor) -> Tensor:
    """[n] float32: how far each token's fresh K and V ([n, Hkv, D] each) are from its cached ones.

    Per KV head, the L2 distance over dims divided by the head's mean norm of the cached values
    (over the `cached` rows, [n] bool), squared and summed over heads, for K plus for V. Without the
    per-head scale, the heads with the largest norms alone would choose; on the bench workload
    (bench/RESULTS.md §16) this chooses better than the plain L2 of K: mean KL at 15% recompute
    0.135 of naive reuse's against 0.165."""
    score = fresh_k.new_zeros(fresh_k.shape[0], dtype=torch.float32)  # [n]
    for fresh, old in ((fresh_k, cached_k), (fresh_v, cached_v)):
        old = old.float()
        dist = (fresh.float() - old).norm(dim=2)  # [n, Hkv]
        norms = old[cached].norm(dim=2)  # [c, Hkv]
        scale = norms.mean(0) if norms.shape[0] else norms.new_ones(old.shape[1])  # [Hkv]
        score += (dist / scale.clamp_min(1e-12)).square().sum(1)
    return score


def choose_tokens(deviation: Tensor, candidate: Tensor, forced: Tensor, ratio: float) -> Tensor:
    """Sorted indices [k]: every `forced` row, and the round(ratio * candidates) `candidate`
    rows of largest deviation (deviation, candidate, forced: [n])."""
    count = round(ratio * int(candidate.sum()))
    score = deviation.masked_fill(~candidate, float("-inf"))  # [n]
    top = torch.topk(score, count).indices if count else score.new_empty(0, dtype=torch.long)
    chosen = forced.clone()
    chosen[top] = True
    return chosen.nonzero().flatten()  # [k], ascending


# Rows run in a layer are cut into at most this many groups of at least this many rows; each
# group attends only the keys up to its last position. One explicit mask over every key would make
# SDPA compute all of them for every row (about twice the work of causal attention for rows spread
# over the prompt); on the bench workload (3k tokens, 15%) this takes attention from 2.4 s to 1.3 s.
MAX_QUERY_GROUPS = 4
MIN_GROUP_ROWS = 128

Group = tuple[int, int, int, "Tensor | None", bool]  # rows [a, b), keys [0, end), mask, causal


def query_groups(rows: Tensor, window: int | None, dtype: torch.dtype, square: bool) -> list[Group]:
    """How the rows (ascending positions [k]) attend in a layer with this sliding `window` (None:
    none): (a, b, end, mask, causal) per group of rows a..b-1, over keys 0..end-1 (end = the
    group's last position + 1)."""
    k, n = rows.shape[0], int(rows[-1]) + 1
    if square:  # positions 0..n-1: one causal pass
        return [(0, k, n, *attention_plan(rows, n, window, dtype, square=True))]
    count = max(1, min(MAX_QUERY_GROUPS, k // MIN_GROUP_ROWS))
    bounds = [round(i * k / count) for i in range(count + 1)]
    groups = []
    for a, b in zip(bounds, bounds[1:]):
        end = int(rows[b - 1]) + 1
        groups.append((a, b, end, *attention_plan(rows[a:b], end, window, dtype, square=False)))
    return groups


Plans = dict["int | None", tuple[Tensor, Tensor, list[Group]]]  # per window: cos, sin, groups


def layer_plans(runner: Runner, rows: Tensor, dtype: torch.dtype, square: bool) -> Plans:
    """What each kind of layer needs to run `rows`: RoPE's cos/sin [k, 1, D] (the layer's own
    table) and its query groups (its own window), once per window."""
    cfg, plans = runner.config, {}
    for layer in range(cfg.num_layers):
        window = cfg.layer_window(layer)
        if window not in plans:
            cos, sin = rope_cos_sin(layer_inv_freq(cfg, layer, runner.rope_tables), rows, dtype)
            plans[window] = (cos, sin, query_groups(rows, window, dtype, square))
    return plans


def attend_groups_mlp(x: Tensor, q: Tensor, w: LayerWeights, config: ModelConfig, kv_cache: Tensor,
                      slots: Tensor, groups: list[Group]) -> Tensor:
    """The second half of `layer_forward` for the rows of `groups`: attention, each group over the
    keys up to its last position, then the MLP. x [k, E] -> [k, E]."""
    parts = []
    for a, b, end, mask, causal in groups:
        k_all, v_all = read_kv(kv_cache, slots[:end], x.dtype)  # [end, Hkv, D] each
        parts.append(attention(q[a:b], k_all, v_all, mask, causal,
                               config.attn_scale, config.attn_softcap))  # [b - a, H*D]
    attn = parts[0] if len(parts) == 1 else torch.cat(parts)
    return finish_layer(x, attn, w, config)  # [k, E]


def blend_layer(x: Tensor, w: LayerWeights, config: ModelConfig, plan: tuple[Tensor, Tensor, list[Group]],
                kv_cache: Tensor, write_slots: Tensor, slots: Tensor) -> Tensor:
    """`layer_forward` for the rows of the plan's groups: their fresh K/V written at write_slots,
    then attention by groups and the MLP."""
    cos, sin, groups = plan
    q, k, v = project_qkv(x, w, config, cos, sin)
    write_kv(kv_cache, write_slots, k, v)
    return attend_groups_mlp(x, q, w, config, kv_cache, slots, groups)


@torch.inference_mode()
def blend_prefill(runner: Runner, seq: Sequence, segments: list[Segment], question_tokens=(),
                  recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
                  check_layer: int = DEFAULT_CHECK_LAYER) -> BlendResult:
    """Prefill `segments` then `question_tokens` (uncached) into the empty sequence `seq`, reusing
    the segments' cached KV with CacheBlend's selective recompute (see the module docstring).

    Returns the last position's logits and which positions were recomputed; the paged cache
    holds the blended KV of the whole prompt and `seq.num_tokens` is its length.
    """
    model, cfg = runner.model, runner.config
    if not 0.0 <= recompute_ratio <= 1.0:
        raise UsageError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
    if not 0 <= check_layer < cfg.num_layers:
        raise UsageError(f"check_layer must be in [0, {cfg.num_layers - 1}], got {check_layer}")
    if seq.num_tokens:
        raise UsageError("blend_prefill needs an empty sequence")
    parts = list(segments) + ([Segment([int(t) for t in question_tokens])] if len(question_tokens) else [])
    if not parts:
        raise PromptError("nothing to prefill: no segments and no question")
    for i, part in enumerate(parts):
        check_segment(part, model, i)
    tokens = [int(t) for part in parts for t in part.tokens]
    n = len(tokens)
    if n > cfg.max_position_embeddings:
        raise PromptError(f"{n} tokens exceed the model's context of {cfg.max_position_embeddings}")

    device = runner.inv_freq.device
    seq.reserve(n)
    slots = seq.slot_mapping(n, device=device)  # [n]
    cached = torch.zeros(n, dtype=torch.bool, device=device)  # [n]
    start = 0
    for part in parts:
        end = start + len(part.tokens)
        if part.kv is not None:
            place_segment(runner, part, slots[start:end], start)
            cached[start:end] = True
        start = end
    first = parts[0]
    exact = len(first.tokens) if first.kv is not None and first.stored_start == 0 else 0
    prefix = min(exact, n - 1)  # the last token always runs: its logits are the result

    weights, dtype = model.weights, model.weights.embed.dtype
    kv_caches = runner.cache.kv_caches
    rows = torch.arange(prefix, n, device=device)  # [m] positions run in layers < check_layer
    x = embed(weights, cfg, torch.tensor(tokens[prefix:], dtype=torch.long, device=device))  # [m, E]
    plans = layer_plans(runner, rows, dtype, square=prefix == 0)
    for layer in range(check_layer):
        x = blend_layer(x, weights.layers[layer], cfg, plans[cfg.layer_window(layer)], kv_caches[layer],
                        slots[rows], slots)

    # The check layer: fresh K of every row against the cached K still in the cache.
    w, kv_cache = weights.layers[check_layer], kv_caches[check_layer]
    cos, sin, _ = plans[cfg.layer_window(check_layer)]
    q, k, v = project_qkv(x, w, cfg, cos, sin)
    old_k, old_v = read_kv(kv_cache, slots[rows], torch.float32)  # [m, Hkv, D] each
    deviation = kv_deviation(k, v, old_k, old_v, cached[rows])  # [m]; meaningless where the row is uncached
    forced = ~cached[rows]
    forced[-1] = True
    keep = choose_tokens(deviation, cached[rows], forced, recompute_ratio)  # [k] indices into rows
    if keep.shape[0] != rows.shape[0]:
        rows, x, q, k, v = rows[keep], x[keep], q[keep], k[keep], v[keep]
        plans = layer_plans(runner, rows, dtype, square=False)
    write_kv(kv_cache, slots[rows], k, v)
    x = attend_groups_mlp(x, q, w, cfg, kv_cache, slots, plans[cfg.layer_window(check_layer)][2])
    for layer in range(check_layer + 1, cfg.num_layers):
        x = blend_layer(x, weights.layers[layer], cfg, plans[cfg.layer_window(layer)], kv_caches[layer],
                        slots[rows], slots)
    seq.num_tokens = n

    logits = logits_from_hidden(weights, rms_norm(x[-1:], weights.norm, cfg.rms_norm_eps), cfg.final_softcap)[0]
    dev = torch.full((n,), float("nan"))
    measured = cached.cpu().clone()
    measured[:prefix] = False
    dev[measured] = deviation.cpu()[measured[prefix:]]
    return BlendResult(logits, tokens, cached.cpu(), prefix, rows.cpu(), dev)
