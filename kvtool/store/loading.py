"""Loading from the store: the longest run of stored, intact whole chunks of a prompt, from token 0,
through the one load path (`kvtool.load.load`).

Each chunk's object is opened on the worker that loads it (`Backend.open`: a folder's object as a
file, read in place), checked (store.md §5, checks 1-10: the name, the model, the position, the
tokens, the extra keys), and handed on as its `ChunkSource`: checks 11-12 (the payload's CRC-32C,
its decoding) run as it is copied or decoded into the destination. The run ends at the first
chunk missing or refused; a refused object is reported once, and is never loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..chunk_source import ChunkSource
from ..destination import Destination
from ..errors import (ChecksumMismatch, DecodeError, NonFiniteValues, NotCached, ObjectRefused, ObjectUnreadable,
                      ShapeMismatch)
from . import objects
from .names import ChunkLink

#: Chunks fetched per batch (one round trip to Redis): enough to hide latency, few enough
#: that a long prefix never sits in memory twice.
FETCH_BATCH = 8

if TYPE_CHECKING:
    import torch


class Gone(NotCached):
    """An object removed between the existence check and its read (a miss, not damage)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name  # the object that is not stored


_Gone = Gone


#: Failures of the stored bytes themselves (checks 11-13): the object is refused, a miss.
DAMAGE = (ObjectRefused, ChecksumMismatch, DecodeError, ShapeMismatch, NonFiniteValues)
#: Chunks smaller than this (their KV in bf16) load on one thread, fetched FETCH_BATCH at a time
#: from a backend without files (one round trip to Redis each batch): each costs more in Python
#: (open, checks) than in copying, and two threads only contend for the interpreter (bench_store:
#: 16-token chunks of the default model, 0.37 MB, loaded 1.7x slower on two threads, one GET each).
SMALL_CHUNK_BYTES = 1 << 20


#: A kept object used within this long is served without opening it while its name still holds
#: that very file (lstat: device, inode, size and time), from its kept mapping: 4 system calls
#: fewer an object (open, fstat, readlink, utime). Its use is then not recorded on the LRU clock
#: again (as relatime keeps a file's access time): a hot object's clock moves once a minute, by
#: its opening, through its descriptor. The same inode, size and time are the very file checked,
#: whatever path leads to it now: its bytes are checked again as they are copied, and nothing is
#: written through the path.
USE_RECORDED_NS = 60 * 10**9


def forget_checked() -> None:
    """Drop every kept check and mapping of every folder store open in this process (tests; a
    process that wants every object checked in full again). One store's: `backend.kept.forget()`."""
    from .kept import forget_all

    forget_all()


@dataclass
class PrefixHit:
    """What a load found: the longest run of stored whole chunks from token 0."""

    num_tokens: int
    chunks: list[Any]  # KV_BLOB tensors [2, L, S, C], one per chunk (`get_prefix`; empty for a destination's load)
    codecs: list[str]
    refused: list[str]  # a refused object ended the run early: why
    stored_bytes: int
    unreadable: list[str] = field(default_factory=list)  # an object that cannot be read here ended it: why
    healed: list[str] = field(default_factory=list)  # objects removed because this load refused them or found them gone

    def kv(self) -> "torch.Tensor":
        """The prefix as one KV_BLOB `[2, L, num_tokens, C]`."""
        import torch

        from ..errors import UsageError

        if not self.chunks:
            raise UsageError("no chunks to join: the prefix is empty or went into an engine's buffers")
        return torch.cat(self.chunks, dim=2)


def load_prefix(cache, token_ids, destination, *, max_tokens: int | None = None,
                from_token: int = 0) -> PrefixHit:
    """The longest run of stored, intact whole chunks of `token_ids` from token 0 into
    `destination` (a `kvtool.load.Destination`: an engine's buffers, `ConnectorTarget`; tensors,
    `get_prefix`). Tokens before `from_token` (which the engine holds already) are not written.
    Chunks past the first missing or refused one may have been written but are not in the hit."""
    from ..load import ChunkTask, load

    hit = PrefixHit(num_tokens=0, chunks=[], codecs=[], refused=[], stored_bytes=0)
    found = cache.find(token_ids, max_tokens, count_misses=True)
    chain, stored = found.chain, found.run
    block_refusal: list[str] = []  # the name to refuse when the block prefix's object fails (entry or object)
    seen: dict[int, tuple[str, int]] = {}  # chain index -> codec, stored bytes
    model = cache.model
    small = 2 * model["num_layers"] * cache.chunk_size * model["num_kv_heads"] * model["head_dim"] * 2 < SMALL_CHUNK_BYTES
    batched = small and not cache.backend.reads_in_place  # objects come as bytes: fetch a batch at once
    fetched: dict[int, Any] = {}
    kept = cache.backend.kept  # the folder backend's checked objects, kept between loads (store/kept.py)
    looked_at = cache.backend.file_state if kept is not None and not batched else None

    def fetch(index: int, name: str):
        if not batched:
            return cache.backend.open(name)
        if index not in fetched:  # (one thread: the batch is fetched in order)
            batch = chain[index:min(index + FETCH_BATCH, stored)]
            fetched.update(zip(range(index, index + len(batch)), cache.fetch([cache.name(l.prefix_hash) for l in batch])))
        data = fetched.pop(index)
        if isinstance(data, (ObjectRefused, ObjectUnreadable)):  # refused before it was read (its size)
            raise data
        return data

    def open_source(index: int, link: ChunkLink) -> ChunkSource:
        name = cache.name(link.prefix_hash)
        state = looked_at(name) if looked_at is not None else None
        if state is not None and time.time_ns() - state[1] < USE_RECORDED_NS:
            # a folder's object used within the minute, its name still holding a file kept mapped
            source = kept.mapped((state[0], name, cache.key, link.start))
            if source is not None:
                seen[index] = (source.codec, state[0][2])
                return source
        data = fetch(index, name)
        if data is None:
            raise _Gone(name)
        identity = getattr(data, "identity", None)  # an object opened as a file: which, as of when
        key = None if identity is None or kept is None else (identity, name, cache.key, link.start)
        if key is not None:
            source = kept.opened(data, key)
            if source is not None:
                seen[index] = (source.codec, identity[2])
                return source
        size = data.size if hasattr(data, "fd") else len(data)
        obj = objects.check_chunk(data, name, model=cache.key, chunk_size=cache.chunk_size,
                                  prefix_hash=link.prefix_hash, start=link.start, extra=link.extra,
                                  verify_payload=False)  # checked as it is copied or decoded
        seen[index] = (obj.codec, size)
        source = obj.source()
        return source if key is None else kept.keep(key, source, identity[3])

    def open_block() -> ChunkSource:
        block_refusal[:] = [found.via]
        try:
            obj, name, size = cache.open_block(found)
        except ObjectRefused as err:
            block_refusal[:] = [getattr(err, "name", found.via)]
            raise
        block_refusal[:] = [name]
        seen[stored] = (obj.codec, size)
        return obj.source()

    tasks, first_task = [], None
    for index, link in enumerate(chain[:stored]):
        end = link.start + cache.chunk_size
        if end <= from_token:
            hit.num_tokens = end  # the engine holds these; nothing to write
            continue
        first_task = index if first_task is None else first_task
        tasks.append(ChunkTask(max(link.start, from_token), end, lambda i=index, k=link: open_source(i, k),
                               origin=link.start))
    block = found.block
    if block is not None:
        end = block.start + block.tokens
        if end <= from_token:
            hit.num_tokens = max(hit.num_tokens, end)
        else:
            first_task = stored if first_task is None else first_task
            tasks.append(ChunkTask(max(block.start, from_token), end, open_block, origin=block.start))
    outcome = load(tasks, destination, threads=1 if small else None)
    first_task = first_task or 0
    if tasks:
        hit.num_tokens = max(hit.num_tokens, outcome.loaded_tokens)
    for index in range(first_task, first_task + outcome.chunks):
        codec, size = seen[index]
        hit.codecs.append(codec)
        hit.stored_bytes += size
    cache.store.counters.hits += outcome.chunks
    if outcome.error is not None:
        position = first_task + outcome.failed
        name = block_refusal[0] if position == stored and block_refusal else None
        hit.healed += cache.stopped_at(found, position, outcome.error, name=name, refused=hit.refused,
                                       unreadable=hit.unreadable)
    return hit


class TensorTarget(Destination):
    """A load's destination that keeps each chunk's KV as a tensor on `device` (`get_prefix`): a
    whole raw chunk is decoded straight onto `device` from its checked bytes (`takes_sources`)."""

    def __init__(self, device: "torch.device | str | None" = None):
        import torch

        self.device = torch.device("cpu" if device is None else device)
        self.parts: dict[int, "torch.Tensor"] = {}

    def scatter(self, kv: "torch.Tensor", start: int, end: int) -> None:
        self.parts[start] = kv.to(self.device, copy=True)  # (kv may view a load's reused buffer)

    def takes_sources(self) -> bool:
        return True

    def scatter_source(self, source: ChunkSource, start: int, end: int) -> None:
        self.parts[start] = source.decode(self.device)

    def chunks(self, num_tokens: int) -> list["torch.Tensor"]:
        return [self.parts[start] for start in sorted(self.parts) if start < num_tokens]


def get_prefix(cache, token_ids, *, device: "torch.device | str | None" = None,
               max_tokens: int | None = None) -> PrefixHit:
    """`load_prefix` into tensors: each chunk of the hit a KV_BLOB tensor on `device`."""
    target = TensorTarget(device)
    hit = load_prefix(cache, token_ids, target, max_tokens=max_tokens)
    hit.chunks = target.chunks(hit.num_tokens)
    return hit


__all__ = ["DAMAGE", "PrefixHit", "TensorTarget", "get_prefix", "load_prefix"]
