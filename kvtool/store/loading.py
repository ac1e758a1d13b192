"""Loading from the store: the longest run of stored, intact whole chunks of a prompt, from token 0,
through the one load path (`kvtool.load.load`).

Each chunk's object is opened on the worker that loads it (`Backend.open`: a folder's object as a
file, read in place), checked (store.md §5, checks 1-10: the name, the model, the position, the
tokens, the extra keys), and handed on as its `ChunkSource`: checks 11-12 (the payload's CRC-32C,
its decoding) run as it is copied or decoded into the destination. The run ends at the first
chunk missing or refused; a refused object is reported once, and is never loaded.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict
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


#: Chunk objects in files whose checks 1-10 passed on an earlier opening in this process, by the
#: file they lie in (its device, inode, size and modification time) and what was asked of it: a
#: hot prefix's objects are opened by every load, and those checks (header, manifest, tokens,
#: names) cost ~90 us an object, as long as copying 1.5 MB of its KV. Such an object opened again
#: skips them; its payload is still checked as it is copied (CRC-32C and values, checks 11-13,
#: against the checked manifest's CRC), so what reaches a model is exactly the bytes checked.
#: Only files last modified KEPT_AFTER_NS ago or more are kept (as git's index treats "racily
#: clean" files): a file's time moves in clock ticks, so a change made within the tick of an
#: earlier one could leave its size and time as they were; after that, any write moves them.
#:
#: A kept object's file stays mapped (read-only, shared), up to KEPT_MAPPED_BYTES in all: read
#: through a mapping made for one load, a 5.9 MB object costs its page faults and its unmapping
#: every time (the default model's 2,048-token prefix loaded at 0.60-0.72x a plain copy of the
#: same bytes); through a kept one, the pages are mapped already. The mapping is only read
#: behind the fault guard, and only while the file at the object's name is still that file,
#: of that size and time (a folder's object is looked at, lstat, on every load; the same inode,
#: size and time mean the very file checked, whatever path now leads to it): an object
#: replaced, removed or written since is opened afresh and checked in full. A removed object's disk space
#: comes back when its mapping is dropped (the least recently used first, or `forget_checked`).
_kept: "OrderedDict[tuple, tuple[ChunkSource, memoryview | None]]" = OrderedDict()
_kept_lock = threading.Lock()
_kept_mapped = 0  # bytes of the kept mappings
KEPT_OBJECTS = 4096
KEPT_AFTER_NS = 2_000_000_000
KEPT_MAPPED_BYTES = 2 << 30


def _kept_source(data, key: tuple) -> ChunkSource | None:
    """The kept description of the object open in `data` (a `PreadFile`) under `key`: read from
    its kept mapping (`data` closed), or as a source that owns `data`'s descriptor; None when it
    is not kept."""
    with _kept_lock:
        entry = _kept.get(key)
        if entry is None:
            return None
        _kept.move_to_end(key)
    template, view = entry
    if view is not None:
        data.close()
        return template.mapped_as(view)
    fd, data.fd = data.fd, -1  # (the new source owns the descriptor now)
    return template.reopened(fd)


#: A kept object used within this long is served without opening it while its name still holds
#: that very file (lstat: device, inode, size and time), from its kept mapping: 4 system calls
#: fewer an object (open, fstat, readlink, utime). Its use is then not recorded on the LRU clock
#: again (as relatime keeps a file's access time): a hot object's clock moves once a minute, by
#: its opening, through its descriptor. The same inode, size and time are the very file checked,
#: whatever path leads to it now: its bytes are checked again as they are copied, and nothing is
#: written through the path.
USE_RECORDED_NS = 60 * 10**9


def _looks_at_files(backend) -> bool:
    """A folder store whose objects are opened as LocalBackend opens them (not a subclass's own way)."""
    from .local import LocalBackend

    return isinstance(backend, LocalBackend) and type(backend).open is LocalBackend.open \
        and type(backend)._open_file is LocalBackend._open_file


def _kept_in_mapping(key: tuple) -> ChunkSource | None:
    """The object kept under `key` as a source read from its kept mapping, or None when it is not
    kept, or kept without a mapping."""
    with _kept_lock:
        entry = _kept.get(key)
        if entry is None or entry[1] is None:
            return None
        _kept.move_to_end(key)
    return entry[0].mapped_as(entry[1])


def _keep(key: tuple, source: ChunkSource, mtime_ns: int) -> ChunkSource:
    """`source` (a checked object's payload in its open file) kept for the next opening of the
    same file, mapped when that can be done; the source to load from now."""
    global _kept_mapped
    if time.time_ns() - mtime_ns < KEPT_AFTER_NS or not source.in_file:
        return source
    view = _mapping(source)
    with _kept_lock:
        old = _kept.pop(key, None)
        _kept_mapped -= 0 if old is None or old[1] is None else old[1].nbytes
        _kept[key] = (source, view)
        _kept_mapped += 0 if view is None else view.nbytes
        while len(_kept) > KEPT_OBJECTS or (_kept_mapped > KEPT_MAPPED_BYTES and len(_kept) > 1):
            _, (_, dropped) = _kept.popitem(last=False)
            _kept_mapped -= 0 if dropped is None else dropped.nbytes
    if view is None:
        return source
    fd, source.fd = source.fd, -1  # (the kept template holds no descriptor: each opening brings its own)
    os.close(fd)
    return source.mapped_as(view)


def _mapping(source: ChunkSource) -> memoryview | None:
    """The payload of `source` (in its open file) as a read-only shared mapping of the file, or
    None where it cannot be mapped (the load reads it from the file then)."""
    if source.length == 0 or source.length > KEPT_MAPPED_BYTES:
        return None
    try:
        whole = mmap.mmap(source.fd, source.offset + source.length, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    except (OSError, ValueError, OverflowError):
        return None
    return memoryview(whole)[source.offset:source.offset + source.length]  # (the view keeps the mapping)


def forget_checked() -> None:
    """Drop every kept check and mapping (tests; a process that wants every object checked in
    full again)."""
    global _kept_mapped
    with _kept_lock:
        _kept.clear()
        _kept_mapped = 0


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

    from .backend import Backend

    hit = PrefixHit(num_tokens=0, chunks=[], codecs=[], refused=[], stored_bytes=0)
    found = cache.find(token_ids, max_tokens, count_misses=True)
    chain, stored = found.chain, found.run
    block_refusal: list[str] = []  # the name to refuse when the block prefix's object fails (entry or object)
    seen: dict[int, tuple[str, int]] = {}  # chain index -> codec, stored bytes
    model = cache.model
    small = 2 * model["num_layers"] * cache.chunk_size * model["num_kv_heads"] * model["head_dim"] * 2 < SMALL_CHUNK_BYTES
    batched = small and type(cache.backend).open is Backend.open  # objects come as bytes: fetch a batch at once
    fetched: dict[int, Any] = {}
    looked_at = cache.backend.file_state if _looks_at_files(cache.backend) and not batched else None

    def fetch(index: int, name: str):
        if not batched:
            return cache.backend.open(name)
        if index not in fetched:  # (one thread: the batch is fetched in order)
            batch = chain[index:min(index + FETCH_BATCH, stored)]
            fetched.update(zip(range(index, index + len(batch)), cache._fetch([cache.name(l.prefix_hash) for l in batch])))
        data = fetched.pop(index)
        if isinstance(data, (ObjectRefused, ObjectUnreadable)):  # refused before it was read (its size)
            raise data
        return data

    def open_source(index: int, link: ChunkLink) -> ChunkSource:
        name = cache.name(link.prefix_hash)
        state = looked_at(name) if looked_at is not None else None
        if state is not None and time.time_ns() - state[1] < USE_RECORDED_NS:
            # a folder's object used within the minute, its name still holding a file kept mapped
            source = _kept_in_mapping((state[0], name, cache.key, link.start))
            if source is not None:
                seen[index] = (source.codec, state[0][2])
                return source
        data = fetch(index, name)
        if data is None:
            raise _Gone(name)
        identity = getattr(data, "identity", None)  # an object opened as a file: which, as of when
        key = None if identity is None else (identity, name, cache.key, link.start)
        if key is not None:
            source = _kept_source(data, key)
            if source is not None:
                seen[index] = (source.codec, identity[2])
                return source
        size = data.size if hasattr(data, "fd") else len(data)
        obj = objects.check_chunk(data, name, model=cache.key, chunk_size=cache.chunk_size,
                                  prefix_hash=link.prefix_hash, start=link.start, extra=link.extra,
                                  verify_payload=False)  # checked as it is copied or decoded
        seen[index] = (obj.codec, size)
        source = obj.source()
        return source if key is None else _keep(key, source, identity[3])

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
    error = outcome.error
    if error is not None and objects.needs_what_is_not_here(error):  # (a pca chunk whose calibration is not here)
        error = ObjectUnreadable(str(error))
    if isinstance(error, ObjectUnreadable):
        hit.unreadable.append(str(error))
    if error is not None and first_task + outcome.failed == stored:  # the block prefix's object
        if isinstance(error, DAMAGE):
            name = block_refusal[0] if block_refusal else found.via
            refusal = error if isinstance(error, ObjectRefused) else ObjectRefused(f"{name}: {error}")
            hit.healed += cache.heal_block(found, name, refusal)
            hit.refused.append(str(refusal))
        elif isinstance(error, ObjectUnreadable):
            cache.store.unreadable(error)
        elif isinstance(error, _Gone):  # the entry names an object that went: the entry goes too
            hit.healed += cache.heal_block(found, error.name, error)
        else:
            raise error
        cache.store.counters.misses += 1
    elif isinstance(error, DAMAGE):
        failed = chain[first_task + outcome.failed]
        name = cache.name(failed.prefix_hash)
        refusal = error if isinstance(error, ObjectRefused) else ObjectRefused(
            str(error) if str(error).startswith(name) else f"{name}: {error}")
        hit.healed += cache._refused(name, refusal, chain, failed.start, hit.refused, found.ids)
    elif isinstance(error, _Gone):  # removed since the existence check: no entry may promise it still
        cache.store.counters.misses += len(chain) - outcome.loaded_tokens // cache.chunk_size
        failed = chain[first_task + outcome.failed]
        hit.healed += cache.forget_gone(error.name, chain, failed.start // cache.chunk_size, found.ids)
    elif isinstance(error, ObjectUnreadable):  # not readable here: a miss, said; nothing removed
        cache.store.unreadable(error)
        cache.store.counters.misses += len(chain) - outcome.loaded_tokens // cache.chunk_size
    elif error is not None:  # e.g. the store became unreachable: not a miss to hide
        raise error
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
