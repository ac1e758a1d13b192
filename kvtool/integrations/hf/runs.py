"""Running a transformers model for kvtool's operations: a capture's prefill, chunk by chunk, with
each chunk's KV gathered out of transformers' own cache; a replay's continuation with `generate`
(greedy), timed to its first token; the logits of a run teacher-forced along given tokens."""

from __future__ import annotations

import time

import torch

from ...errors import UnsupportedCache
from .caches import cache_argument, cached_tokens, filled_cache, gather
from .models import HFModel, check_window


class PromptPrefill:
    """One prompt run through the model in chunks, its KV in a transformers cache (as `generate`
    would make it) that the capture gathers each chunk out of through the paged connector: a
    capture's steps (`kvtool.engine.protocol.CaptureSteps`), `prefill`, then `gather`."""

    def __init__(self, model: HFModel, num_tokens: int, kv_dtype: torch.dtype, blob_device: torch.device,
                 pinned: bool):
        check_window(model, num_tokens)  # every token's KV stays in the cache
        self.model = model
        self.cache = filled_cache(model, [], [])
        self.kv_dtype, self.blob_device, self.pinned = kv_dtype, blob_device, pinned

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], start: int, end: int, hidden: bool) -> torch.Tensor | None:
        """Tokens [start, end) through the decoder (positions from the cache's length, `start`);
        their final hidden states [n, E] (after the final norm) with `hidden`, else None. The base
        model runs, not the LM head: a capture needs no logits."""
        ids = torch.tensor([token_ids[start:end]], dtype=torch.long, device=self.model.device)
        out = self.model.model.base_model(input_ids=ids, use_cache=True, **cache_argument(self.cache))
        held = cached_tokens(self.cache, self.model.identity)  # (refused in one line where it is not plain K/V)
        if held != end:
            raise UnsupportedCache(f"{self.model.identity.architecture}'s cache holds {held} tokens after a prefill "
                                   f"to {end}: not the KV of every token")
        return out.last_hidden_state[0] if hidden else None

    def gather(self, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end)'s KV_BLOB `[2, L, n, C]`, placed for the codec."""
        return gather(self.cache, self.model.identity, start, end, self.kv_dtype, self.blob_device, self.pinned)


class _FirstToken:
    """A `generate` streamer that notes when the first new token exists (its first `put` is the
    prompt, its second the first new token)."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, _value) -> None:
        self.puts += 1
        if self.puts == 2 and self.at is None:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def greedy(model: HFModel, token_ids: list[int], cache, max_new_tokens: int
           ) -> tuple[list[int], torch.Tensor, float]:
    """Greedy `generate` from the whole prompt `token_ids` and a cache of a prefix of it shorter
    than the prompt (None: no cache, a fresh run): the new tokens (stopping at the model's end of
    sequence, included), their float32 logits [N, V] and the seconds to the first one."""
    ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    first = _FirstToken()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.model.generate(ids, attention_mask=torch.ones_like(ids), **cache_argument(cache),
                                   max_new_tokens=max_new_tokens, do_sample=False, streamer=first,
                                   return_dict_in_generate=True, output_logits=True, **_GREEDY)
    new = out.sequences[0, len(token_ids):].tolist()
    return new, torch.cat(out.logits).float(), (first.at or time.perf_counter()) - started


#: generate's sampling settings neutralised: a model's generation_config may ask for sampling
_GREEDY = {"temperature": None, "top_p": None, "top_k": None}


@torch.inference_mode()
def forced_logits(model: HFModel, token_ids: list[int], cache, start: int) -> torch.Tensor:
    """float32 logits [n - start, V] of positions start .. n - 1 of `token_ids` run on a cache that
    holds tokens [0, start) (teacher-forced: each position sees the given tokens before it)."""
    ids = torch.tensor([token_ids[start:]], dtype=torch.long, device=model.device)
    return model.model(input_ids=ids, use_cache=True, **cache_argument(cache)).logits[0].float()


__all__ = ["PromptPrefill", "forced_logits", "greedy"]
