"""Replay: load a KV file into a fresh paged buffer and continue from it.

The file's chunks are decoded and written into a newly allocated paged cache,
with a shuffled (non-contiguous) block assignment, through
`PagedMemConnectorV2.to_gpu` and the new sequence's slot mapping. The model then
computes only what the file does not hold. `compare` measures the cached run
against a full recompute of the same tokens:

- greedy: the recompute's greedy continuation is the reference; the cached run
  is teacher-forced along it, so "greedy tokens identical up to position i" is
  the first position whose top-1 differs (identical to running greedy decoding
  on the cache, up to that point);
- top-1 agreement, KL(reference || cached) per position, and the change in the
  negative log-likelihood of the reference tokens;
- time to first token: load + decode + the uncached remainder vs a full prefill.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .capture import paged_connector
from .devices import describe, synchronize
from .engine import LoadedModel, PagedKVCache, Runner, logits_from_hidden
from .errors import DataError, ModelMismatch, NonFiniteValues, PromptError, ShapeMismatch, UsageError
from .format import ContainerReader
from .format.hashing import prefix_hashes


# On a GPU, chunks decode this many at a time (one launch each group): enough to fill the
# device, few enough that the decoded group stays small next to the paged buffers.
LOAD_BATCH_CHUNKS = 32


@dataclass
class ReusePlan:
    tokens: list[int]  # the whole sequence to run (file prefix + anything new)
    reused: int  # tokens [0, reused) come from the file
    chunks: int  # how many of the file's chunks are (partly) loaded
    from_hidden: bool = False  # every token is reused; the first new token's logits come from the file's hidden states


def check_model(reader: ContainerReader, model: LoadedModel) -> None:
    """The file was made by this model: same fingerprint, and (since a fingerprint is only a
    claim) KV of this model's shape and token ids inside its vocabulary."""
    if reader.fingerprint != model.identity.fingerprint():
        raise ModelMismatch(
            f"{reader.path} was made by {reader.model.get('name')!r} ({reader.fingerprint[:19]}...), "
            f"not by the loaded model {model.name!r} ({model.identity.fingerprint()[:19]}...)")
    cfg, m = model.config, reader.manifest
    if (m.num_layers, m.hidden_kv) != (cfg.num_layers, cfg.num_kv_heads * cfg.head_dim):
        raise ModelMismatch(f"{reader.path} holds {m.num_layers} layers x {m.hidden_kv} KV channels, the model "
                            f"has {cfg.num_layers} x {cfg.num_kv_heads * cfg.head_dim} (its fingerprint is forged)")
    ids = reader.token_ids()
    if ids.size and int(ids.max()) >= cfg.vocab_size:
        raise ModelMismatch(f"{reader.path}: token id {int(ids.max())} is outside the model's vocabulary "
                            f"[0, {cfg.vocab_size})")


def plan_reuse(reader: ContainerReader, new_tokens: list[int] | None = None,
               suffix_tokens: list[int] | None = None, use_hidden_states: bool = True) -> ReusePlan:
    """Which leading tokens of the run can come from the file.

    With `suffix_tokens`, the run is the file's own tokens plus the suffix, and
    every cached token is reused. With `new_tokens` (a new prompt), the longest
    run of whole chunks whose prefix hashes match is reused. At least one token
    is computed, since its logits start the continuation, unless the file stores
    the final hidden states and every token is reused: the last token's hidden
    state then gives those logits.
    """
    file_tokens = reader.token_ids().tolist()
    size = reader.manifest.chunk_size
    if new_tokens is None:
        tokens = file_tokens + list(suffix_tokens or [])
        reused = len(file_tokens)
    else:
        tokens = list(new_tokens)
        if not tokens:
            raise PromptError("the new prompt is empty")
        reused = 0
        for chunk, want in zip(reader.chunks, prefix_hashes(tokens, size)):
            if chunk.end - chunk.start != size or chunk.prefix_hash != want:
                break
            reused = chunk.end
        if reused == (len(reader.chunks) - 1) * size and tokens[:len(file_tokens)] == file_tokens:
            reused = len(file_tokens)  # the short last chunk matches too
    if use_hidden_states and reused == len(tokens) and "hidden_states" in reader.manifest.extras:
        return ReusePlan(tokens=tokens, reused=reused, chunks=-(-reused // size), from_hidden=True)
    reused = min(reused, len(tokens) - 1)
    return ReusePlan(tokens=tokens, reused=reused, chunks=-(-reused // size))


def load_prefix(reader: ContainerReader, model: LoadedModel, cache: PagedKVCache, seq, num_tokens: int,
                slot_mapping: torch.Tensor) -> float:
    """Decode the file's chunks covering [0, num_tokens) into the paged cache; returns seconds.

    Chunks decode where the cache is (CacheGen on the GPU when the cache is
    there; the other codecs on the CPU, then one copy) and go into the paged
    buffers through the connector's scatter."""
    t0 = time.perf_counter()
    connector = paged_connector(model)
    needed = [c.index for c in reader.chunks if c.start < num_tokens]
    group = LOAD_BATCH_CHUNKS if cache.device.type == "cuda" else 1
    for g in range(0, len(needed), group):
        batch = needed[g:g + group]
        for index, decoded in zip(batch, reader.read_chunks(batch, device=cache.device)):
            chunk = reader.chunks[index]
            end = min(chunk.end, num_tokens)
            kv = decoded[:, :, : end - chunk.start]  # [2, L, T, C]
            memory = connector.allocate(end - chunk.start, kv.dtype, cache.device)
            memory.tensor.copy_(kv)
            connector.to_gpu(memory, chunk.start, end, kvcaches=cache.kv_caches, slot_mapping=slot_mapping)
    seq.num_tokens = num_tokens
    synchronize(cache.device)
    return time.perf_counter() - t0


def _new_cache(model: LoadedModel, total: int, kv_dtype: torch.dtype, block_size: int, seed: int):
    cache = PagedKVCache.for_tokens(model.config, total, block_size=block_size, kv_dtype=kv_dtype,
                                    device=model.device, shuffle_seed=seed)
    seq = cache.new_sequence(total)
    return cache, seq


def replay(reader: ContainerReader, model: LoadedModel, plan: ReusePlan, *, continue_tokens: int = 32,
           compare: bool = False, block_size: int = 16) -> dict[str, Any]:
    check_model(reader, model)
    tokens = plan.tokens
    n = len(tokens)
    total = n + continue_tokens
    if total > model.max_position_embeddings:
        raise PromptError(f"{n} tokens plus {continue_tokens} to generate exceed the model's context of "
                          f"{model.max_position_embeddings}")
    if continue_tokens < 1:
        raise UsageError("--continue must be at least 1")
    kv_dtype = reader.kv_dtype
    prefill_chunk = reader.manifest.chunk_size
    result: dict[str, Any] = {"file": str(reader.path), "model": model.name, "num_tokens": n,
                              "reused_tokens": plan.reused, "computed_tokens": n - plan.reused,
                              "chunks_loaded": plan.chunks, "codecs": sorted({c.codec for c in reader.chunks}),
                              "continue": continue_tokens, "device": describe(model.device),
                              "model_dtype": str(model.dtype).removeprefix("torch."),
                              "first_token_from": "hidden_states" if plan.from_hidden else "prefill"}

    warm_up(model, reader)
    reference = None
    if compare:  # the full recompute, no cache: the reference
        cache, seq = _new_cache(model, total, kv_dtype, block_size, seed=2)
        runner = Runner(model, cache)
        synchronize(model.device)
        t0 = time.perf_counter()
        logits = runner.prefill(seq, tokens, prefill_chunk=prefill_chunk, logits="last")  # [1, V]
        synchronize(model.device)
        ttft_recompute = time.perf_counter() - t0
        ref_logits, greedy = [logits[0]], []
        for i in range(continue_tokens):
            greedy.append(int(ref_logits[-1].argmax()))
            if i + 1 < continue_tokens:
                ref_logits.append(runner.decode_step(seq, greedy[-1]))
        reference = (torch.stack(ref_logits), greedy)  # [N, V]
        result["ttft_recompute_s"] = ttft_recompute
        del cache

    cache, seq = _new_cache(model, total, kv_dtype, block_size, seed=1)
    slot_mapping = seq.slot_mapping(total, device=model.device)
    runner = Runner(model, cache)
    synchronize(model.device)
    t0 = time.perf_counter()
    load_s = load_prefix(reader, model, cache, seq, plan.reused, slot_mapping)
    hidden = None
    if plan.from_hidden:
        try:
            hidden = last_hidden_state(reader, model, n)  # [1, E]
        except DataError as err:  # the KV is intact: recompute the last token instead
            sys.stderr.write(f"kvtool: notice: the stored hidden states are unusable ({err}); "
                             f"the last token is recomputed\n")
            result.update(reused_tokens=n - 1, computed_tokens=1, first_token_from="prefill",
                          notice=f"hidden_states unusable: {err}")
    if hidden is not None:
        first = logits_from_hidden(model.weights, hidden)  # [1, V]
    elif plan.from_hidden:
        first = runner.prefill(seq, tokens[n - 1:], start_pos=n - 1, logits="last")  # rewrites its own slot
    else:
        first = runner.prefill(seq, tokens[plan.reused:], start_pos=plan.reused, prefill_chunk=prefill_chunk,
                               logits="last")  # [1, V]
    synchronize(model.device)
    ttft_cached = time.perf_counter() - t0
    result.update(load_s=load_s, ttft_cached_s=ttft_cached)
    if reference is None:
        generated = [int(first[0].argmax())]
        while len(generated) < continue_tokens:
            generated.append(int(runner.decode_step(seq, generated[-1]).argmax()))
        result["continuation_tokens"] = generated
        result["continuation"] = model.tokenizer.decode(generated)
        return result

    ref_logits, forced = reference
    rest = runner.prefill(seq, forced[:-1], start_pos=n, prefill_chunk=prefill_chunk, logits="all") \
        if continue_tokens > 1 else first[:0]
    cached_logits = torch.cat([first, rest])  # [N, V]
    result.update(continuation_tokens=forced, continuation=model.tokenizer.decode(forced),
                  speedup=result["ttft_recompute_s"] / max(ttft_cached, 1e-9),
                  **compare_logits(ref_logits, cached_logits, forced))
    return result


def last_hidden_state(reader: ContainerReader, model: LoadedModel, n: int) -> torch.Tensor:
    """The file's final hidden state of token n - 1, [1, E], on the model's device."""
    hidden = reader.read_extra("hidden_states")  # [num_tokens, E]
    if hidden.shape[1] != model.config.hidden_size:
        raise ShapeMismatch(f"hidden_states are {list(hidden.shape)}, the model's hidden size is "
                            f"{model.config.hidden_size}")
    last = hidden[n - 1:n]
    if not bool(torch.isfinite(last).all()):
        raise NonFiniteValues(f"hidden state of token {n - 1} is not finite")
    return last.to(model.device)


_warmed: set[tuple[str, bool]] = set()


def warm_up(model: LoadedModel, reader: ContainerReader) -> None:
    """On a GPU, pay the one-time costs (kernel builds and loads, library handles, lazy
    modules) before anything is timed; nothing to do on the CPU."""
    key = (str(model.device), any(c.codec == "cachegen" for c in reader.chunks))
    if model.device.type != "cuda" or key in _warmed:
        return
    _warmed.add(key)
    from . import cuda

    cuda.register(lazy=False)  # the paged copy kernel (or its one-line fallback notice)
    if any(c.codec == "cachegen" for c in reader.chunks):
        try:
            from .cuda import cachegen as gpu_cachegen

            gpu_cachegen.library()
        except cuda.CudaUnavailable as exc:
            cuda.notice("CacheGen coder", str(exc))
    cache, seq = _new_cache(model, 2, reader.kv_dtype, 16, seed=0)
    Runner(model, cache).prefill(seq, [0, 0], logits="last")
    synchronize(model.device)


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


def write_kv(model: LoadedModel, cache: PagedKVCache, seq, kv: torch.Tensor, slot_mapping: torch.Tensor,
             chunk_size: int = 256) -> None:
    """Write a whole-sequence KV_BLOB [2, L, T, C] into the paged cache, chunk by chunk."""
    connector = paged_connector(model)
    num_tokens = kv.shape[2]
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        memory = connector.allocate(end - start, cache.kv_dtype, cache.device)
        memory.tensor.copy_(kv[:, :, start:end])
        connector.to_gpu(memory, start, end, kvcaches=cache.kv_caches, slot_mapping=slot_mapping)
    seq.num_tokens = num_tokens


def teacher_forced_eval(model: LoadedModel, context: list[int], continuation: list[int], *,
                        kv: torch.Tensor | None = None, kv_dtype: torch.dtype = torch.bfloat16,
                        prefill_chunk: int = 256, block_size: int = 16) -> torch.Tensor:
    """Logits [N, V] predicting `continuation` after `context`.

    With `kv` (a KV_BLOB [2, L, T, C] of at least the context's first
    len(context) - 1 tokens, e.g. decoded from a lossy file), those tokens come
    from it; without, the whole context is prefilled (the reference)."""
    total = len(context) + len(continuation)
    cache, seq = _new_cache(model, total, kv_dtype, block_size, seed=3)
    runner = Runner(model, cache)
    start = 0
    if kv is not None:
        start = len(context) - 1
        write_kv(model, cache, seq, kv[:, :, :start], seq.slot_mapping(total, device=model.device), prefill_chunk)
    forced = context[start:] + continuation[:-1]
    logits = runner.prefill(seq, forced, start_pos=start, prefill_chunk=prefill_chunk, logits="all")
    return logits[-len(continuation):]
