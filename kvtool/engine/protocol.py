"""What kvtool's operations need of an engine, whichever runs the model: kvtool's own runner
(its adapter, `kvtool.ops.engines.KvtoolEngine`, sits beside the paged connector it gathers and
loads through) or Hugging Face transformers (`kvtool.integrations.hf.engine.HFEngine`).

An `Engine` is a loaded model and what it does for `capture` and `replay`:

- its identity: `name`, `identity` (what a file records and is checked against), `config`
  (`vocab_size`), `tokenizer`, `device`, `dtype`, `max_position_embeddings`, and what a capture's
  file records of the run (`run_metadata`);
- a capture: tokens prefilled chunk by chunk into its cache and each chunk's KV gathered out of it
  (`capture_steps`, a `CaptureSteps`);
- a replay: a fresh sequence in its cache (`new_sequence`, a `CachedSequence`) that a prefix
  loads into through `kvtool.load`, continued greedily or teacher-forced for a measure; the full
  recompute a measure compares with (`recompute`).

The operations hold one path per command over this interface (`kvtool.ops.capture`,
`kvtool.ops.replay`); the measure against a recompute is written once (`kvtool.ops.compare`).
Nothing here imports torch: the tensors are the engines'.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from ..identity import ModelIdentity

#: which logits a teacher-forced prefill returns: every position's [n, V], or the last one's [1, V]
ForcedLogits = Literal["all", "last"]


class Reference(NamedTuple):
    """A full recompute of a prompt, no cache: the logits [N, V] along its greedy continuation,
    the continuation (stopping at the model's end of sequence, included), its time to first token."""

    logits: "torch.Tensor"
    tokens: list[int]
    ttft_s: float


class CaptureSteps(Protocol):
    """A capture's two steps per chunk, whichever engine runs the model: `prefill` tokens [start,
    end) into its cache, then `gather` their KV out of it through the paged connector."""

    def prefill(self, token_ids: list[int], start: int, end: int, hidden: bool) -> "torch.Tensor | None":
        """Tokens [start, end) computed; their final hidden states [n, E] with `hidden`, else None."""

    def gather(self, start: int, end: int) -> "torch.Tensor":
        """Tokens [start, end)'s KV_BLOB [2, L, n, C], placed for the codec."""


class CachedSequence(ABC):
    """One sequence in an engine's KV cache, as a replay uses it: a prefix loaded into it, then
    prefilled (teacher-forced logits), continued greedily, or cut back and continued."""

    @abstractmethod
    def load(self, load: Callable[[Any, int], int], num_tokens: int) -> int:
        """Tokens [0, num_tokens) put into the cache by `load(destination, num_tokens)` (a
        `kvtool.load` destination over the cache's buffers). Returns how many tokens from 0 it
        loaded: the cache holds those."""

    @abstractmethod
    def prefill(self, tokens: list[int], start: int, logits: ForcedLogits, prefill_chunk: int) -> "torch.Tensor":
        """float32 logits of positions start .. len(tokens) - 1 (teacher-forced: each sees the given
        tokens before it), the cache holding tokens [0, start); after it, it holds all of them."""

    @abstractmethod
    def generate(self, tokens: list[int], start: int, max_new_tokens: int, first: "torch.Tensor | None",
                 prefill_chunk: int) -> tuple[list[int], float]:
        """Greedy decoding after `tokens`, the cache holding tokens [0, start): up to
        `max_new_tokens`, stopping at the model's end of sequence (included). `first` [1, V]: the
        first new token's logits when already known (tokens [start, n) then need no prefill).
        Returns (the new tokens, the seconds to the first one)."""

    @abstractmethod
    def continue_from(self, tokens: list[int], keep: int, max_new_tokens: int) -> list[int]:
        """The cache cut back to the first `keep` of `tokens` (its last token not yet in it), then
        up to `max_new_tokens` greedy tokens after `tokens` (each engine as its own decoding
        goes: kvtool's runner makes all of them, transformers' `generate` stops at the end of
        sequence)."""


class Engine(ABC):
    """A loaded model behind the interface of kvtool's operations (module docstring). The
    identity facts are the wrapped model's (`model`)."""

    #: the result's `engine`: "kvtool" (its paged runner) or "hf" (transformers)
    kind: str
    #: plain text gets the tokenizer's special tokens (a BOS, for many models): transformers'
    #: convention (`tokenizer(text)`); kvtool's engine takes the text as it is
    adds_special_tokens: bool
    #: a replay may start from a file's stored final hidden states (`logits_from_hidden`)
    starts_from_hidden_states: bool
    #: said in a replay's stages: how the reference runs, where the prefix loads
    recompute_label: str = ""
    cache_label: str = ""

    def __init__(self, model: Any):
        self.model = model

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def identity(self) -> "ModelIdentity":
        return self.model.identity

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def device(self) -> "torch.device":
        return self.model.device

    @property
    def dtype(self) -> "torch.dtype":
        return self.model.dtype

    @property
    def max_position_embeddings(self) -> int:
        return self.model.max_position_embeddings

    @abstractmethod
    def run_metadata(self, block_size: int) -> dict[str, str]:
        """What a file records of the engine that computed its KV (a capture at `block_size`)."""

    @abstractmethod
    def capture_block_size(self, block_size: int, num_tokens: int) -> int:
        """The block of the cache a capture of `num_tokens` at `block_size` really ran with."""

    @abstractmethod
    def capture_steps(self, num_tokens: int, *, kv_dtype: "torch.dtype", block_size: int, shuffle_seed: int | None,
                      prefill_chunk: int, blob_device: "torch.device", pinned: bool) -> CaptureSteps:
        """A cache for a capture of `num_tokens`, and how each chunk's KV leaves it: a KV_BLOB in
        `kv_dtype` on `blob_device` (in pinned memory with `pinned`), where the codec encodes it."""

    @abstractmethod
    def new_sequence(self, total: int, kv_dtype: "torch.dtype", block_size: int, seed: int) -> CachedSequence:
        """A fresh, empty sequence with room for `total` tokens, for a replay."""

    @abstractmethod
    def recompute(self, tokens: list[int], continue_tokens: int, kv_dtype: "torch.dtype", block_size: int,
                  prefill_chunk: int) -> Reference:
        """The full recompute of `tokens` and up to `continue_tokens` greedy tokens: a measure's reference."""

    def logits_from_hidden(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """float32 logits [n, V] from final hidden states [n, E] (`starts_from_hidden_states`)."""
        raise NotImplementedError(f"the {self.kind} engine does not start from stored hidden states")

    def warm_up(self, kv_dtype: "torch.dtype", codec_names: tuple[str, ...]) -> None:
        """Pay one-time costs (kernel builds, library handles) before anything is timed."""


__all__ = ["CachedSequence", "CaptureSteps", "Engine", "ForcedLogits", "Reference"]
