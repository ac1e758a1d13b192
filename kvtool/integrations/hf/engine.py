"""A transformers model behind the interface of kvtool's operations (`kvtool.engine.protocol.Engine`):
what `capture --engine hf` and `replay --engine hf` run.

A capture prefills transformers' own cache chunk by chunk (`runs.PromptPrefill`: the paged connector
gathers each chunk out of it, one block of every token). A replay's prefix loads into a transformers
cache (`caches.load_cache`: the contiguous cache as one block of a paged buffer) holding at most all
but the prompt's last token, transformers' convention; `generate` (greedy) continues from it, and a
measure runs the model teacher-forced on it (`runs.forced_logits`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...engine.protocol import CachedSequence, CaptureSteps, Engine, ForcedLogits, Reference
from .caches import filled_cache, load_cache
from .models import HFModel, load_hf_model
from .runs import PromptPrefill, forced_logits, greedy


class HFEngine(Engine):
    """An `HFModel` as the operations run it: its cache is one block of every token, plain text gets
    the tokenizer's special tokens, the first new token is always computed."""

    kind = "hf"
    adds_special_tokens = True
    starts_from_hidden_states = False
    recompute_label = " with transformers"
    cache_label = " into a transformers cache"

    model: HFModel

    @classmethod
    def load(cls, path: str | Path | None, *, dtype: torch.dtype, device: torch.device | str) -> "HFEngine":
        """A model folder (or a Hub id in the local cache; None: kvtool's default model) loaded by transformers."""
        return cls(load_hf_model(path, dtype=dtype, device=device))

    @classmethod
    def of(cls, model, tokenizer=None) -> "HFEngine":
        """A loaded transformers model (or `HFModel`) in this engine (`HFModel.of`)."""
        return model if isinstance(model, HFEngine) else cls(HFModel.of(model, tokenizer))

    def run_metadata(self, block_size: int) -> dict[str, str]:
        return self.model.engine_metadata()

    def capture_block_size(self, block_size: int, num_tokens: int) -> int:
        return num_tokens  # transformers' cache is one block of every token

    def capture_steps(self, num_tokens: int, *, kv_dtype: torch.dtype, block_size: int, shuffle_seed: int | None,
                      prefill_chunk: int, blob_device: torch.device, pinned: bool) -> CaptureSteps:
        return PromptPrefill(self.model, num_tokens, kv_dtype, blob_device, pinned)

    def new_sequence(self, total: int, kv_dtype: torch.dtype, block_size: int, seed: int) -> "HFSequence":
        return HFSequence(self.model)

    def recompute(self, tokens: list[int], continue_tokens: int, kv_dtype: torch.dtype, block_size: int,
                  prefill_chunk: int) -> Reference:
        """A fresh greedy `generate` of the whole prompt."""
        generated, logits, ttft = greedy(self.model, tokens, None, continue_tokens)
        return Reference(logits, generated, ttft)


class HFSequence(CachedSequence):
    """A transformers cache (`DynamicCache`, as `generate` makes it for the model), empty until a
    prefix loads into it."""

    def __init__(self, model: HFModel):
        self.model = model
        self.cache = filled_cache(model, [], [])

    def load(self, load: Callable[[Any, int], int], num_tokens: int) -> int:
        self.cache = load_cache(self.model, num_tokens, load)
        return self.cache.get_seq_length()

    def prefill(self, tokens: list[int], start: int, logits: ForcedLogits, prefill_chunk: int) -> torch.Tensor:
        out = forced_logits(self.model, tokens, self.cache, start)  # [n - start, V]
        return out[-1:] if logits == "last" else out

    def generate(self, tokens: list[int], start: int, max_new_tokens: int, first: torch.Tensor | None,
                 prefill_chunk: int) -> tuple[list[int], float]:
        """Greedy `generate` from the cache (which must hold tokens [0, start)), timed to its first token."""
        if first is not None:  # (starts_from_hidden_states is False: a replay never hands it one)
            raise NotImplementedError("transformers' generate computes the first token itself")
        generated, _, first_s = greedy(self.model, tokens, self.cache, max_new_tokens)
        return generated, first_s

    def continue_from(self, tokens: list[int], keep: int, max_new_tokens: int) -> list[int]:
        if max_new_tokens <= 0:
            return []
        surplus = self.cache.get_seq_length() - keep  # (transformers' crop takes how many to drop)
        if surplus:
            self.cache.crop(-surplus)
        return greedy(self.model, tokens, self.cache, max_new_tokens)[0]


__all__ = ["HFEngine", "HFSequence"]
