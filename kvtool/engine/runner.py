"""`Runner`: prefill and greedy decode of one loaded model on one paged KV cache.

It joins the parts below it: the model's arithmetic (`model.py`), the weights and
tokenizer (`loader.py`) and the paged cache (`paged.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import PromptError, UsageError
from .loader import LoadedModel
from .model import DEFAULT_PREFILL_CHUNK, LogitsMode, forward, rope_tables
from .paged import PagedKVCache, Sequence


class Runner:
    """Prefill and greedy decode of one model on one paged KV cache."""

    def __init__(self, model: LoadedModel, cache: PagedKVCache):
        cfg = model.config
        if (cache.config.num_layers, cache.config.num_kv_heads, cache.config.head_dim) != (
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise UsageError("the KV cache was built for a different model shape")
        self.model = model
        self.config = cfg
        self.cache = cache
        # RoPE's inverse frequencies: the global layers', and the sliding layers' (the same tensor
        # unless the model gives them their own base, Gemma 3).
        self.inv_freq, self.local_inv_freq = rope_tables(cfg, model.weights.embed.device)

    @property
    def rope_tables(self) -> tuple[Tensor, Tensor]:
        return self.inv_freq, self.local_inv_freq

    @torch.inference_mode()
    def prefill(self, seq: Sequence, tokens, start_pos: int = 0,
                prefill_chunk: int = DEFAULT_PREFILL_CHUNK, logits: LogitsMode = "all") -> Tensor | None:
        """Compute tokens at positions start_pos.. and store their K/V in `seq`'s blocks.

        Positions 0..start_pos-1 must already be in the cache (an earlier prefill, or a
        connector that wrote them at `seq.slot_mapping(start_pos)`). Runs in chunks of
        `prefill_chunk` tokens. Returns float32 logits for every computed position
        ([n, V]), for the last one only ([1, V]), None, or the final hidden states of
        every computed position ([n, E], "hidden"), as `logits` says.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.inv_freq.device).reshape(-1)
        n = tokens.shape[0]
        if n == 0:
            raise PromptError("nothing to prefill: empty token list")
        if start_pos < 0:
            raise UsageError(f"start_pos must be >= 0, got {start_pos}")
        if prefill_chunk <= 0:
            raise UsageError(f"prefill_chunk must be positive, got {prefill_chunk}")
        end = start_pos + n
        if end > self.config.max_position_embeddings:
            raise PromptError(f"{end} tokens exceed the model's context of "
                              f"{self.config.max_position_embeddings}")
        seq.reserve(end)
        device = self.inv_freq.device
        all_slots = seq.slot_mapping(end, device=device)  # [end]
        outs = []
        for lo in range(0, n, prefill_chunk):
            hi = min(lo + prefill_chunk, n)
            p0, p1 = start_pos + lo, start_pos + hi
            mode: LogitsMode = logits if logits != "last" else ("last" if hi == n else "none")
            out = forward(self.model.weights, self.config, self.rope_tables, tokens[lo:hi], p0,
                          self.cache.kv_caches, all_slots[p0:p1], all_slots[:p1], mode)
            seq.num_tokens = p1
            if out is not None:
                outs.append(out)
        if logits == "none":
            return None
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # [n or 1, V]

    @torch.inference_mode()
    def decode_step(self, seq: Sequence, token: int) -> Tensor:
        """Append one token at position seq.num_tokens; returns its logits [V]."""
        return self.prefill(seq, [token], start_pos=seq.num_tokens, logits="last")[0]

    @torch.inference_mode()
    def generate(self, seq: Sequence, prompt_tokens, max_new_tokens: int,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 stop_tokens: tuple[int, ...] | None = None, start_pos: int = 0) -> list[int]:
        """Greedy decoding: prefill the prompt (from start_pos) then pick argmax tokens.

        Stops after `max_new_tokens` or at a stop token (default: the model's EOS
        ids; pass `()` to never stop early). Returns the new tokens, stop included.
        """
        stop = set(self.config.eos_token_ids if stop_tokens is None else stop_tokens)
        logits = self.prefill(seq, prompt_tokens, start_pos=start_pos,
                              prefill_chunk=prefill_chunk, logits="last")[0]  # [V]
        new: list[int] = []
        while len(new) < max_new_tokens:
            token = int(logits.argmax())
            new.append(token)
            if token in stop or len(new) == max_new_tokens:
                break
            logits = self.decode_step(seq, token)
        return new
