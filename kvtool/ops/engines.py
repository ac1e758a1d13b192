"""The engines the operations run, behind one interface (`kvtool.engine.protocol.Engine`):
kvtool's paged runner, adapted here (`KvtoolEngine`: its KV leaves and enters the paged buffers
through the paged connector, which the engine's row may not import), and Hugging Face
transformers (`kvtool.integrations.hf.engine.HFEngine`, imported only for `--engine hf`).

`open_engine` (a request's model) and `as_engine` (a model given to the Python API) are the one
place that tells the engines apart; capture and replay then run one path over the interface.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import codecs
from ..devices import synchronize
from ..engine import LoadedModel, PagedKVCache, Runner, load_model, logits_from_hidden
from ..engine.protocol import CachedSequence, Engine, ForcedLogits, Reference
from ..errors import ModelError, UsageError
from .engine_io import new_cache, paged_connector


# --- choosing the engine --------------------------------------------------------------------------


def open_engine(request) -> Engine:
    """The request's model in its engine (`request.engine`): kvtool's runner (`KvtoolEngine`), or
    transformers (`HFEngine`), loaded in the request's dtype on its device unless given loaded (a
    model given in its `Engine`, whichever, runs as it is)."""
    model = KvtoolEngine(request.model) if isinstance(request.model, LoadedModel) else request.model
    if request.engine == "hf":
        hf = _hf_engine()
        if isinstance(model, KvtoolEngine):
            raise UsageError("--engine hf runs a transformers model: give its folder or Hub id, or the model")
        if isinstance(model, (str, Path)) or model is None:
            return hf.load(model, dtype=request.torch_model_dtype, device=request.where)
        return as_engine(model)
    if isinstance(model, Engine):
        return model
    if not isinstance(model, (str, Path)) and model is not None:
        raise UsageError(f"a {type(model).__name__} runs with engine='hf' (kvtool's engine loads a folder)")
    return KvtoolEngine(load_model(model, dtype=request.torch_model_dtype, device=request.where))


def as_engine(model) -> Engine:
    """A model given to the Python API in its engine: kvtool's `LoadedModel` in its runner, any other
    (a transformers model or `HFModel`) in transformers; an `Engine` as it is."""
    if isinstance(model, Engine):
        return model
    if isinstance(model, LoadedModel):
        return KvtoolEngine(model)
    return _hf_engine().of(model)


def _hf_engine():
    """`HFEngine`, imported on first use (transformers is an extra: kvtool[model])."""
    try:
        from ..integrations.hf.engine import HFEngine
    except ImportError as err:
        raise ModelError(f"--engine hf needs transformers ({err}): pip install 'kvtool[model]'") from None
    return HFEngine


# --- kvtool's paged runner -------------------------------------------------------------------------


class KvtoolEngine(Engine):
    """kvtool's engine (`LoadedModel`, its `Runner`) behind the operations' interface: a capture
    prefills a shuffled paged cache and the paged connector gathers each chunk out of it; a replay
    loads into a fresh shuffled paged cache through the connector's destination."""

    kind = "kvtool"
    adds_special_tokens = False
    starts_from_hidden_states = True

    model: LoadedModel

    def run_metadata(self, block_size: int) -> dict[str, str]:
        return {"engine": "kvtool paged runner", "block_size": str(block_size)}

    def capture_block_size(self, block_size: int, num_tokens: int) -> int:
        return block_size

    def capture_steps(self, num_tokens: int, *, kv_dtype: torch.dtype, block_size: int, shuffle_seed: int | None,
                      prefill_chunk: int, blob_device: torch.device, pinned: bool) -> "PagedCapture":
        device = self.device
        cache = PagedKVCache.for_tokens(self.config, num_tokens, block_size=block_size, kv_dtype=kv_dtype,
                                        device=device, shuffle_seed=shuffle_seed)
        seq = cache.new_sequence(num_tokens)
        return PagedCapture(cache, Runner(self.model, cache), seq, seq.slot_mapping(num_tokens, device=device),
                            paged_connector(self.model), blob_device, pinned, kv_dtype, prefill_chunk)

    def new_sequence(self, total: int, kv_dtype: torch.dtype, block_size: int, seed: int) -> "KvtoolSequence":
        cache, seq = new_cache(self.model, total, kv_dtype, block_size, seed=seed)
        return KvtoolSequence(Runner(self.model, cache), seq, seq.slot_mapping(total, device=self.device))

    def recompute(self, tokens: list[int], continue_tokens: int, kv_dtype: torch.dtype, block_size: int,
                  prefill_chunk: int) -> Reference:
        return recompute(self.model, tokens, continue_tokens, kv_dtype, block_size, prefill_chunk)

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return logits_from_hidden(self.model.weights, hidden, self.config.final_softcap)

    def warm_up(self, kv_dtype: torch.dtype, codec_names: tuple[str, ...]) -> None:
        """On a GPU, pay the one-time costs (kernel builds and loads, library handles, lazy
        modules) before anything is timed: each codec warms itself up, the paged copy kernel
        loads, one tiny prefill runs. Nothing to do on the CPU."""
        from ..connectors.paged_copy import load_cuda_kernel

        key = (str(self.device), codec_names)
        if self.device.type != "cuda" or key in _warmed:
            return
        _warmed.add(key)
        load_cuda_kernel()
        for name in codec_names:
            codecs.get_codec(name).warm_up(self.device)
        cache, seq = new_cache(self.model, 2, kv_dtype, 16, seed=0)
        Runner(self.model, cache).prefill(seq, [0, 0], logits="last")
        synchronize(self.device)


_warmed: set[tuple[str, tuple[str, ...]]] = set()


@dataclass(frozen=True)
class PagedCapture:
    """The paged cache a capture prefills, and how each chunk's KV leaves it (`CaptureSteps`)."""

    cache: PagedKVCache
    runner: Runner
    seq: Any  # the sequence being captured
    slot_mapping: torch.Tensor  # [n], the whole sequence's slots
    connector: Any  # the paged connector: from_gpu gathers a chunk
    blob_device: torch.device  # where a chunk's KV_BLOB goes: where the codec encodes it
    pinned: bool  # a host KV_BLOB in pinned memory (a GPU model's chunk bound for a CPU codec)
    kv_dtype: torch.dtype
    prefill_chunk: int

    def prefill(self, token_ids: list[int], start: int, end: int, hidden: bool) -> torch.Tensor | None:
        return self.runner.prefill(self.seq, token_ids[start:end], start_pos=start, prefill_chunk=self.prefill_chunk,
                                   logits="hidden" if hidden else "none")  # [n, E] or None

    def gather(self, start: int, end: int) -> torch.Tensor:
        memory = self.connector.allocate(end - start, self.kv_dtype, self.blob_device, pin_memory=self.pinned)
        self.connector.from_gpu(memory, start, end, kvcaches=self.cache.kv_caches, slot_mapping=self.slot_mapping)
        return memory.tensor


class KvtoolSequence(CachedSequence):
    """A sequence in a paged cache of kvtool's runner: loaded through the paged connector's
    destination (slots checked on the host: no device sync per chunk), run by the runner."""

    def __init__(self, runner: Runner, seq, slot_mapping: torch.Tensor | None = None):
        self.runner, self.seq = runner, seq
        self.slot_mapping = slot_mapping  # [total], the slots reserved: where a load puts tokens (`load`)

    def load(self, load: Callable[[Any, int], int], num_tokens: int) -> int:
        target = paged_connector(self.runner.model).target(kvcaches=self.runner.cache.kv_caches,
                                                           slot_mapping=self.slot_mapping.cpu())
        loaded = load(target, num_tokens) if num_tokens else 0
        self.seq.num_tokens = loaded
        return loaded

    def prefill(self, tokens: list[int], start: int, logits: ForcedLogits, prefill_chunk: int) -> torch.Tensor:
        return self.runner.prefill(self.seq, tokens[start:], start_pos=start, prefill_chunk=prefill_chunk,
                                   logits=logits)

    def generate(self, tokens: list[int], start: int, max_new_tokens: int, first: torch.Tensor | None,
                 prefill_chunk: int) -> tuple[list[int], float]:
        started = time.perf_counter()
        if first is None:
            first = self.prefill(tokens, start, "last", prefill_chunk)
            synchronize(self.runner.model.device)
        first_s = time.perf_counter() - started
        return greedy(self.runner, self.seq, first, max_new_tokens), first_s

    def continue_from(self, tokens: list[int], keep: int, max_new_tokens: int) -> list[int]:
        self.seq.num_tokens = keep  # forget what follows: its slots are written over
        new = [tokens[-1]]
        while len(new) <= max_new_tokens:
            new.append(int(self.runner.decode_step(self.seq, new[-1]).argmax()))
        return new[1:]


def greedy(runner: Runner, seq, first: torch.Tensor, continue_tokens: int) -> list[int]:
    """Up to `continue_tokens` tokens of greedy decoding, the first from the logits `first` [1, V];
    it stops at the model's end of sequence (included), as `Runner.generate` does."""
    stop = set(runner.config.eos_token_ids)
    generated = [int(first[0].argmax())]
    while len(generated) < continue_tokens and generated[-1] not in stop:
        generated.append(int(runner.decode_step(seq, generated[-1]).argmax()))
    return generated


def recompute(model: LoadedModel, tokens: list[int], continue_tokens: int, kv_dtype: torch.dtype,
              block_size: int, prefill_chunk: int) -> Reference:
    """The full recompute, no cache: logits [N, V] along its greedy continuation, the
    continuation, and its time to first token."""
    cache, seq = new_cache(model, len(tokens) + continue_tokens, kv_dtype, block_size, seed=2)
    runner = Runner(model, cache)
    synchronize(model.device)
    t0 = time.perf_counter()
    logits = runner.prefill(seq, tokens, prefill_chunk=prefill_chunk, logits="last")  # [1, V]
    synchronize(model.device)
    ttft = time.perf_counter() - t0
    ref_logits, generated, stop = [logits[0]], [], set(model.config.eos_token_ids)
    for i in range(continue_tokens):  # up to continue_tokens, stopping at the end of sequence (kept)
        generated.append(int(ref_logits[-1].argmax()))
        if generated[-1] in stop:
            break
        if i + 1 < continue_tokens:
            ref_logits.append(runner.decode_step(seq, generated[-1]))
    return Reference(torch.stack(ref_logits), generated, ttft)


__all__ = ["KvtoolEngine", "KvtoolSequence", "PagedCapture", "as_engine", "greedy", "open_engine", "recompute"]
