"""How close a run from cached KV comes to a full recompute: next-token distributions
compared along a forced continuation (replay's `--compare`, a blend's, the RD benchmark).

`measure` is the one measure against a recompute, in any engine (`CachedSequence`): the cached
run teacher-forced along the reference's greedy continuation (`forced_along`), compared with it
position by position (`compare_logits`), then its own greedy continuation from where they part
(`own_continuation`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..engine import LoadedModel, Runner
from ..engine.protocol import CachedSequence
from .engine_io import new_cache, write_kv


def measure(reference_logits: torch.Tensor, forced: list[int], seq: CachedSequence, tokens: list[int],
            first: torch.Tensor, prefill_chunk: int) -> tuple[dict[str, Any], list[int]]:
    """The cached run (`seq`, holding `tokens`' KV but the last's, or all of it; `first` [1, V]
    the first new token's logits) teacher-forced along `forced`, the reference's greedy
    continuation, and compared with the reference's logits [N, V] position by position; then its
    own greedy continuation, which equals `forced` up to the first position whose top-1 differs.
    Returns (`compare_logits`' measures, the cached run's own continuation)."""
    cached_logits = forced_along(seq, tokens, first, forced, prefill_chunk)  # [N, V]
    compared = compare_logits(reference_logits, cached_logits, forced)
    own = own_continuation(seq, tokens, forced, cached_logits, compared["greedy_identical_tokens"])
    return compared, own


def forced_along(seq: CachedSequence, tokens: list[int], first: torch.Tensor, forced: list[int],
                 prefill_chunk: int) -> torch.Tensor:
    """Logits [N, V] of the cached run along `forced`: `first` (the prompt's last position's), then
    each forced token but the last fed after the prompt's `tokens`."""
    n = len(tokens)
    rest = seq.prefill(tokens + forced[:-1], n, "all", prefill_chunk) if len(forced) > 1 else first[:0]
    return torch.cat([first, rest])


def own_continuation(seq: CachedSequence, tokens: list[int], forced: list[int], cached_logits: torch.Tensor,
                     same: int) -> list[int]:
    """The cached run's own greedy continuation, after `forced_along`: the forced tokens up to the
    first position whose top-1 differs (`same`), then its own choice there, then its greedy decoding
    from that point (the cache cut back there: the teacher-forced tokens after it are forgotten)."""
    if same >= len(forced):
        return list(forced)
    own = forced[:same] + [int(cached_logits[same].argmax())]
    return own + seq.continue_from(tokens + own, len(tokens) + same, len(forced) - len(own))


def compare_logits(ref: torch.Tensor, got: torch.Tensor, forced: list[int]) -> dict[str, Any]:
    """Agreement of next-token distributions along the forced tokens. ref, got: [N, V].

    `greedy_identical_tokens` is the first position whose top-1 differs; when
    `forced` is the reference's own greedy continuation (as in `replay`), that is
    how many greedy tokens the cached run reproduces."""
    ref, got = ref.double().cpu(), got.double().cpu()
    ref_logp = F.log_softmax(ref, dim=-1)
    got_logp = F.log_softmax(got, dim=-1)
    kl = (ref_logp.exp() * (ref_logp - got_logp)).sum(dim=-1).clamp_min(0)  # [N]
    target = torch.tensor(forced)
    top1 = got.argmax(dim=-1) == ref.argmax(dim=-1)  # [N]; equals `forced` when it is ref's greedy path
    mismatch = (~top1).nonzero()
    ref_nll = -ref_logp[torch.arange(len(forced)), target].mean().item()
    got_nll = -got_logp[torch.arange(len(forced)), target].mean().item()
    return {"top1_agreement": top1.double().mean().item(),
            "greedy_identical_tokens": int(mismatch[0, 0]) if len(mismatch) else len(forced),
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "nll_reference": ref_nll, "nll_cached": got_nll, "delta_nll": got_nll - ref_nll,
            "max_abs_logit_diff": (ref - got).abs().max().item()}


def teacher_forced_eval(model: LoadedModel, context: list[int], continuation: list[int], *,
                        kv: torch.Tensor | None = None, kv_dtype: torch.dtype = torch.bfloat16,
                        prefill_chunk: int = 256, block_size: int = 16) -> torch.Tensor:
    """Logits [N, V] predicting `continuation` after `context`.

    With `kv` (a KV_BLOB [2, L, T, C] of at least the context's first
    len(context) - 1 tokens, e.g. decoded from a lossy file), those tokens come
    from it; without, the whole context is prefilled (the reference)."""
    total = len(context) + len(continuation)
    cache, seq = new_cache(model, total, kv_dtype, block_size, seed=3)
    runner = Runner(model, cache)
    start = 0
    if kv is not None:
        start = len(context) - 1
        write_kv(model, cache, seq, kv[:, :, :start], seq.slot_mapping(total, device=model.device), prefill_chunk)
    forced = context[start:] + continuation[:-1]
    logits = runner.prefill(seq, forced, start_pos=start, prefill_chunk=prefill_chunk, logits="all")
    return logits[-len(continuation):]
