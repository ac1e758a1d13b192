"""kvtool files in and out of Hugging Face transformers (`kvtool.hf`).

    cache, input_ids = kvtool.hf.to_cache("notes.kvc", model)            # a file (or a store, a dump)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
    out = kvtool.hf.generate(model, "notes.kvc", max_new_tokens=20)      # the same, in one call
    kvtool.hf.from_cache(cache, token_ids, "out.kvc", model)             # a transformers cache to a file

transformers' convention for a cached prompt: `generate` takes the whole prompt as `input_ids` and a
cache one token shorter, and computes the last token's logits from it (a cache that already holds
every token runs, wrongly, with no warning). `to_cache` follows it by default (`leave_last_token`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import DynamicCache

from ...chunk_source import ChunkSource
from ...devices import describe
from ...dtypes import canonical_name
from ...errors import ModelMismatch, NotAPrefixCache, UsageError
from ...format import ContainerReader, ContainerWriter
from ...format.made_by import check_made_by, check_vocabulary
from ...load import ChunkTask, file_tasks, load
from ...store.chunk_store import ChunkStore, open_store
from ...store.names import ExtraKeys
from .caches import cache_argument, cached_tokens, gather, load_cache
from .latent import is_latent_model, latent_from_cache, latent_to_cache
from .models import HFModel

#: how a refusal of other weights tells a Python caller to load the file anyway
OTHER_WEIGHTS_HINT = "allow_other_weights=True to load it anyway"
_STORE_URL = re.compile(r"(redis|rediss|unix|file|memory)://", re.I)


class CachedPrompt(NamedTuple):
    """What `to_cache` gives: `cache, input_ids = kvtool.hf.to_cache(...)`, then
    `model.generate(input_ids, past_key_values=cache, ...)` (`cache=cache` from transformers 5.24)."""

    cache: DynamicCache  # the KV of input_ids[:, :cache.get_seq_length()], positions from 0
    input_ids: torch.Tensor  # [1, T] int64 on the model's device: the whole prompt


@dataclass(frozen=True)
class SavedCache:
    """What `from_cache` wrote."""

    path: str
    num_tokens: int
    num_chunks: int
    codec: str
    kv_dtype: str
    fingerprint: str
    file_bytes: int


def to_cache(source: Any, model, *, prompt_ids=None, leave_last_token: bool = True,
             allow_other_weights: bool = False, chunk_size: int | None = None,
             namespace: str | None = None) -> CachedPrompt:
    """A transformers cache of a cached prompt, ready for `model.generate`, with the prompt's ids.

    `source`: a kvtool file (a path or an open `ContainerReader`); a chunk store (a folder, a
    `redis://` URL or an open `ChunkStore`: the longest stored prefix of `prompt_ids`, at
    `chunk_size` (None: the stored size covering most) under `namespace`); or a safetensors dump
    (`kvtool dump`, every layer, tokens from position 0).

    `prompt_ids` (a list or a `[T]` / `[1, T]` tensor) is the prompt to continue: by default the
    file's own tokens; a longer or other prompt reuses the KV of the tokens it shares with the
    file from the first one. `leave_last_token` (True: transformers' convention) leaves the
    prompt's last token out of the cache for `generate` to compute from `input_ids`; False puts
    every shared token in, for a caller that continues with more tokens than the cache holds.

    The cache is made as transformers makes one for `model` (its layers' kinds), in the model's
    dtype on its device. Refused in one line: a file of another model or (unless
    `allow_other_weights`) other weights, a segment or dump that does not start at position 0,
    a model whose cache is not plain K/V per layer.

    A multi-head latent attention model (DeepSeek, Kimi) takes an mla_latent file (container.md
    3.2: vLLM's latent, a file `from_cache` wrote): its cache is made of the latent itself, as
    transformers keeps it (`latent.py`)."""
    if not isinstance(model, HFModel) and is_latent_model(model):
        return _latent_to_cache(source, model, prompt_ids, leave_last_token, allow_other_weights,
                                chunk_size, namespace)
    hf = HFModel.of(model)
    prompt = _ids(prompt_ids, "prompt_ids") if prompt_ids is not None else None
    if isinstance(source, ChunkStore) or (isinstance(source, (str, os.PathLike)) and _is_store(source)):
        cache, tokens = _from_store(source, hf, prompt, leave_last_token, chunk_size, namespace)
    elif chunk_size is not None or namespace is not None:
        raise UsageError("chunk_size and namespace apply to a chunk store")
    elif isinstance(source, ContainerReader):
        cache, tokens = _from_file(source, hf, prompt, leave_last_token, allow_other_weights)
    elif str(source).lower().endswith(".safetensors"):
        cache, tokens = _from_dump(Path(source), hf, prompt, leave_last_token, allow_other_weights)
    else:
        with ContainerReader(source) as reader:
            cache, tokens = _from_file(reader, hf, prompt, leave_last_token, allow_other_weights)
    return CachedPrompt(cache, torch.tensor([tokens], dtype=torch.long, device=hf.device))


def generate(model, source: Any, *, prompt_ids=None, allow_other_weights: bool = False,
             chunk_size: int | None = None, namespace: str | None = None, **generate_kwargs):
    """`model.generate` continuing a cached prompt, in one call: `to_cache(source, model, ...)`
    (the prompt's last token left to `generate`), then `model.generate(input_ids,
    past_key_values=cache, **generate_kwargs)` (`cache=` where transformers takes it, 5.24 on). Returns what `generate` returns (by default the
    prompt's ids and the new ones, `[1, T + new]`)."""
    hf = model if isinstance(model, HFModel) or is_latent_model(model) else HFModel.of(model)
    cache, input_ids = to_cache(source, hf, prompt_ids=prompt_ids, allow_other_weights=allow_other_weights,
                                chunk_size=chunk_size, namespace=namespace)
    generate_kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
    return (hf.model if isinstance(hf, HFModel) else hf).generate(input_ids, **cache_argument(cache), **generate_kwargs)


def from_cache(cache, token_ids, path: str | os.PathLike, model, *, codec: str = "raw",
               params: dict[str, Any] | None = None, kv_dtype: torch.dtype | str | None = None,
               chunk_size: int = 256, metadata: dict[str, str] | None = None) -> SavedCache:
    """A transformers cache (`DynamicCache`, one sequence) and its tokens' ids written as a kvtool
    file at `path` through kvtool's writer, with the model's identity (its fingerprint, config
    digest and weights digest): what `kvtool capture --engine hf` writes.

    `token_ids` are the ids of the cached tokens, or those and one more (what `generate` returns:
    its last token is not in the cache yet; it is left out). `kv_dtype` (default: the cache's
    dtype, bf16 for one kvtool does not store) and `codec` (raw, zstd, cachegen; `params` its
    options) as in `kvtool.capture`; `metadata` is recorded beside the run's (e.g. how the prompt
    was made). A multi-head latent attention model's cache holds its latent: written as an
    mla_latent file (raw or zstd)."""
    if not isinstance(model, HFModel) and is_latent_model(model):
        done = latent_from_cache(cache, _ids(token_ids, "token_ids"), path, model, codec=codec,
                                 kv_dtype=canonical_name(kv_dtype) if isinstance(kv_dtype, str) else kv_dtype,
                                 chunk_size=chunk_size, metadata=metadata)
        with ContainerReader(done["path"]) as reader:
            return SavedCache(path=done["path"], num_tokens=done["num_tokens"], num_chunks=done["num_chunks"],
                              codec=codec, kv_dtype=reader.manifest.kv_dtype, fingerprint=done["fingerprint"],
                              file_bytes=reader.file_size)
    hf = HFModel.of(model)
    held = cached_tokens(cache, hf.identity)
    ids = _ids(token_ids, "token_ids")
    if len(ids) == held + 1:  # generate's sequences: the newest token's KV is not computed yet
        ids = ids[:held]
    elif len(ids) != held:
        raise UsageError(f"the cache holds {held} tokens and token_ids has {len(ids)}: give the ids of the cached "
                         f"tokens (or those and the one generate made last)")
    check_vocabulary(ids, hf.identity.vocab_size)
    stored = cache.layers[0].keys.dtype
    if kv_dtype is None:
        kv_dtype = stored if stored in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16
    elif isinstance(kv_dtype, str):  # bf16, fp16, fp32 or the long names, as `kvtool capture --dtype` takes them
        kv_dtype = canonical_name(kv_dtype)
    run = {**hf.engine_metadata(), "device": describe(torch.device(cache.layers[0].keys.device)),
           "model_dtype": str(hf.dtype).removeprefix("torch."), **(metadata or {})}
    with ContainerWriter(path, hf.identity, ids, kv_dtype=kv_dtype, chunk_size=chunk_size, metadata=run) as writer:
        for start, end in writer.chunk_ranges():
            writer.write_chunk(gather(cache, hf.identity, start, end, writer.kv_dtype), codec, params)
    return SavedCache(path=str(writer.path), num_tokens=len(ids), num_chunks=len(writer.chunks), codec=codec,
                      kv_dtype=writer.kv_dtype_name, fingerprint=hf.identity.fingerprint(),
                      file_bytes=Path(writer.path).stat().st_size)


# --- the sources --------------------------------------------------------------------------------


def _latent_to_cache(source, model, prompt_ids, leave_last: bool, allow_other_weights: bool, chunk_size,
                     namespace) -> CachedPrompt:
    """An mla_latent file as a latent attention model's cache (stores and dumps: not yet)."""
    if chunk_size is not None or namespace is not None or isinstance(source, ChunkStore) or (
            isinstance(source, (str, os.PathLike)) and (_is_store(source) or str(source).lower().endswith(".safetensors"))):
        raise UsageError(f"{type(model).__name__} uses multi-head latent attention: its cache comes from an "
                         f"mla_latent file (a store or a dump: export the prefix to a file first)")
    prompt = _ids(prompt_ids, "prompt_ids") if prompt_ids is not None else None
    if isinstance(source, ContainerReader):
        cache, tokens = latent_to_cache(source, model, prompt, leave_last, allow_other_weights)
    else:
        with ContainerReader(source) as reader:
            cache, tokens = latent_to_cache(reader, model, prompt, leave_last, allow_other_weights)
    return CachedPrompt(cache, torch.tensor([tokens], dtype=torch.long, device=next(model.parameters()).device))


def _from_file(reader: ContainerReader, hf: HFModel, prompt: list[int] | None, leave_last: bool,
               allow_other_weights: bool) -> tuple[DynamicCache, list[int]]:
    """A file's KV of the tokens `prompt` shares with it (the file's own tokens by default)."""
    check_made_by(reader, hf.identity, allow_other_weights=allow_other_weights, other_weights_hint=OTHER_WEIGHTS_HINT)
    stored = reader.token_ids().tolist()
    tokens = stored if prompt is None else prompt
    check_vocabulary(tokens, hf.identity.vocab_size)

    def load_file(target, num_tokens: int) -> int:
        outcome = load(file_tasks(reader, num_tokens), target)
        if outcome.error is not None:  # a damaged chunk: refused, named
            raise outcome.error
        return num_tokens

    return load_cache(hf, _cached(_shared(stored, tokens), len(tokens), leave_last), load_file), tokens


def _from_store(source, hf: HFModel, prompt: list[int] | None, leave_last: bool, chunk_size: int | None,
                namespace: str | None) -> tuple[DynamicCache, list[int]]:
    """The store's longest stored prefix of `prompt` (whole chunks, each checked as it loads)."""
    if prompt is None:
        raise UsageError("a chunk store holds many prompts: give prompt_ids, the prompt to look up")
    check_vocabulary(prompt, hf.identity.vocab_size)
    chunk_store = source if isinstance(source, ChunkStore) else open_store(source, create=False)
    try:
        cache = chunk_store.best_cache(hf.identity, prompt, chunk_size, ExtraKeys(namespace=namespace or ""))
        wanted = _cached(cache.lookup(prompt), len(prompt), leave_last)
        loaded = load_cache(hf, wanted, lambda target, n: cache.load_prefix(prompt, target, max_tokens=n).num_tokens)
    finally:
        if chunk_store is not source:
            chunk_store.close()
    return loaded, prompt


def _from_dump(path: Path, hf: HFModel, prompt: list[int] | None, leave_last: bool,
               allow_other_weights: bool) -> tuple[DynamicCache, list[int]]:
    """A safetensors dump (`kvtool dump`): every layer's K and V `[T, kv_heads, head_dim]` of
    tokens from position 0, of this model."""
    from safetensors import SafetensorError, safe_open

    identity = hf.identity
    try:
        with safe_open(str(path), framework="pt") as dump:
            meta, names = dump.metadata() or {}, set(dump.keys())
            missing = [i for i in range(identity.num_layers) if f"layers.{i}.key" not in names]
            if missing or not {"token_ids", "positions"} <= names:
                raise UsageError(f"{path}: a dump without {'layer ' + str(missing[0]) if missing else 'token ids'}: "
                                 f"a cache needs every layer of every token (dump without --layers)")
            positions = dump.get_tensor("positions")
            if positions.numel() == 0 or not torch.equal(positions, torch.arange(positions.numel())):
                first = int(positions[0]) if positions.numel() else 0
                raise NotAPrefixCache(f"{path}: a dump of tokens from position {first} (or with gaps); a transformers "
                                      f"cache holds positions from 0 on: dump the chunks from the first on")
            stored = dump.get_tensor("token_ids").tolist()
            keys = [dump.get_tensor(f"layers.{i}.key") for i in range(identity.num_layers)]
            values = [dump.get_tensor(f"layers.{i}.value") for i in range(identity.num_layers)]
    except (SafetensorError, OSError) as err:
        raise UsageError(f"{path}: not a safetensors dump ({err})") from None
    if meta.get("fingerprint") != identity.fingerprint():
        raise ModelMismatch(f"{path} was dumped from {meta.get('model')!r} ({str(meta.get('fingerprint'))[:19]}...), "
                            f"not from the model {identity.name!r} ({identity.fingerprint()[:19]}...)")
    recorded = meta.get("weights_digest")
    if recorded and identity.weights_digest and recorded != identity.weights_digest and not allow_other_weights:
        raise ModelMismatch(f"{path} was computed with other weights than the model's ({OTHER_WEIGHTS_HINT})")
    tokens = stored if prompt is None else prompt
    check_vocabulary(tokens, identity.vocab_size)
    wanted = _cached(_shared(stored, tokens), len(tokens), leave_last)

    def load_dump(target, num_tokens: int) -> int:  # [T, H, D] per layer -> one KV_BLOB [2, L, n, H*D]
        blob = torch.stack([torch.stack([k[:num_tokens] for k in keys]), torch.stack([v[:num_tokens] for v in values])])
        blob = blob.reshape(2, identity.num_layers, num_tokens, -1)
        # through the load path as a chunk of its own: its values checked finite as a file's are
        # (a dump has no CRC to check; `kvtool dump` copies a file's values as they are)
        outcome = load([ChunkTask(0, num_tokens, lambda: ChunkSource.from_tensor(blob, what=str(path)))], target)
        if outcome.error is not None:
            raise outcome.error
        return num_tokens

    return load_cache(hf, wanted, load_dump), tokens


def _is_store(source: str | os.PathLike) -> bool:
    """A store's URL, or a folder (a store's): not a file."""
    text = os.fspath(source)
    return bool(_STORE_URL.match(text)) or Path(text).expanduser().is_dir()


def _ids(ids, what: str) -> list[int]:
    """Token ids of one sequence: a list, or a `[T]` / `[1, T]` tensor."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise UsageError(f"{what} holds a batch of {ids.shape[0]} sequences; a kvtool file holds one")
        if ids.dim() not in (1, 2):
            raise UsageError(f"{what} must be [T] or [1, T], got {list(ids.shape)}")
        ids = ids.reshape(-1).tolist()
    ids = list(ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UsageError(f"{what} must be integer token ids")
    if not ids:
        raise UsageError(f"{what} is empty")
    return ids


def _shared(stored: list[int], tokens: list[int]) -> int:
    """How many leading tokens two sequences share (the KV of those is the same)."""
    n = 0
    for a, b in zip(stored, tokens):
        if a != b:
            break
        n += 1
    return n


def _cached(shared: int, total: int, leave_last: bool) -> int:
    """How many tokens go into the cache: the shared ones, all but the prompt's last with
    `leave_last` (transformers' convention: generate computes it from input_ids)."""
    return min(shared, total - 1) if leave_last else shared


__all__ = ["CachedPrompt", "OTHER_WEIGHTS_HINT", "SavedCache", "from_cache", "generate", "to_cache"]
