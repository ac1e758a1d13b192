"""The content-addressed chunk store (format-spec/store.md): many sequences' chunks, keyed by
(model, chunk size, chained prefix hash), deduplicated by prefix, checked on every read.

>>> store = open_store("~/.cache/kvtool/store")            # or "redis://host:6379/0"
>>> cache = store.for_model(identity, chunk_size=256)
>>> cache.put_sequence(token_ids, kv)                       # kv: KV_BLOB [2, L, T, C]
>>> cache.lookup(token_ids)                                 # tokens covered by stored whole chunks
>>> hit = cache.get_prefix(token_ids)                       # hit.kv(): [2, L, hit.num_tokens, C]
"""

from __future__ import annotations

import array
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import KvtoolError, NotCached, ObjectRefused, ObjectUnreadable, StoreAccessDenied, UsageError
from ..identity import ModelIdentity
from ..notices import notice
from . import loading, objects
from .calibrations import CalibrationShelf, pca_digests
from .loading import FETCH_BATCH, PrefixHit
from .names import BLOCK_SUFFIX, NO_EXTRA_KEYS, BlockLink, ChunkLink, ExtraKeys, block_links, chunk_chain
from ..format import layout
from ..format.hashing import ZERO_HASH
from ..format.manifest import layout_of_model
from .backend import Backend, ObjectInfo
from .local import LocalBackend
from .memory import MemoryBackend
from .tiers import TieredBackend
from .urls import parse_store_url

if TYPE_CHECKING:
    import torch


def open_store(url: str | os.PathLike, *, memory_bytes: int = 0, max_bytes: int | None = None,
               create: bool = True) -> "ChunkStore":
    """A store from a URL: a folder path, `file://PATH`, `redis://host:port/db` (`rediss://`: TLS),
    `redis+cluster://host:port,host:port/0` (a Redis Cluster; `rediss+cluster://`), or `memory://`.
    `memory_bytes` > 0 puts an in-process LRU memory tier of that size in front (write-through);
    `max_bytes` caps a local store (least recently used objects are evicted past it). The URL is
    parsed whole first (`urls.py`): anything it does not understand is one line, never a folder."""
    parsed = parse_store_url(url)
    if parsed.kind in ("redis", "cluster"):
        from .redis_backend import RedisBackend
        from .redis_cluster import RedisClusterBackend

        if max_bytes is not None:
            raise UsageError("a Redis store is capped by the server: set its maxmemory and "
                             "maxmemory-policy allkeys-lru (format-spec/store.md §6)")
        backend: Backend = (RedisClusterBackend if parsed.kind == "cluster" else RedisBackend)(parsed)
    elif parsed.kind == "memory":
        backend = MemoryBackend(max_bytes or parsed.max_bytes or (1 << 30))
    else:
        backend = LocalBackend(parsed.path, max_bytes=max_bytes, create=create)
    if memory_bytes > 0:
        backend = TieredBackend([MemoryBackend(memory_bytes), backend])
    return ChunkStore(backend)


@dataclass
class StoreCounters:
    """What this process saw of the store (reads check every object)."""

    hits: int = 0  # chunks returned
    misses: int = 0  # chunks asked for and not stored
    refused: int = 0  # chunks stored but refused by a check (§5): they count as misses too
    stored: int = 0  # chunks written
    deduplicated: int = 0  # chunks already stored, not written again
    refusals: list[str] = field(default_factory=list)  # the first few refusals, one line each
    healed: int = 0  # objects removed because a load refused them or found them gone (and entries naming them)


@dataclass
class PutResult:
    chunks: int  # whole chunks of the sequence
    stored: int  # written now
    present: int  # already stored (deduplicated)
    stored_bytes: int  # bytes written now (block index entries and the piece included)
    pieces: int = 0  # a piece (the block-aligned tokens past the last whole chunk) written now
    block_entries: int = 0  # block index entries written now


@dataclass
class Found:
    """What one existence probe found of a prompt (store.md §7): its whole chunks (the chain, to
    the limit), how many lead it stored, and the longest stored block prefix after them."""

    chain: list[ChunkLink]
    run: int  # leading chain links stored
    block: BlockLink | None = None  # the block prefix of position `run` to load after them
    via: str = ""  # the name found for it: its piece, or a block index entry naming its object
    chunk_size: int = 256
    ids: Any = None  # the prompt's token ids (int64)

    @property
    def tokens(self) -> int:
        return self.run * self.chunk_size + (self.block.tokens if self.block is not None else 0)


class ChunkStore:
    """A backend (one, or tiers) plus the object rules; `for_model` gives the prefix API."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.url = backend.url
        self.counters = StoreCounters()
        self.calibrations = CalibrationShelf(backend)  # pca's calibration objects (store.md §4.7)

    def for_model(self, model: ModelIdentity | dict[str, Any], chunk_size: int = 256,
                  extra_keys: ExtraKeys = NO_EXTRA_KEYS, block_size: int | None = None) -> "ModelCache":
        """The prefix API for one model at one chunk size, for requests of these extra keys
        (namespace, cache salt, adapter...: store.md §3): it never sees another's chunks. With a
        `block_size` (the engine's, dividing the chunk size), prefixes match to that many tokens:
        block-aligned tokens past the last whole chunk are stored and found too."""
        return ModelCache(self, model, chunk_size, extra_keys, block_size)

    def chunk_sizes(self, model: ModelIdentity | dict[str, Any], extra_keys: ExtraKeys = NO_EXTRA_KEYS) -> list[int]:
        """The chunk sizes this store holds chunks of `model` at (in `extra_keys`' namespace)."""
        cache = ModelCache(self, model, 1, extra_keys)
        return sorted(int(c) for c in cache.backend.children(f"chunks/{cache.key}/") if c.isdigit())

    def best_cache(self, model: ModelIdentity | dict[str, Any], token_ids,
                   chunk_size: int | None = None, extra_keys: ExtraKeys = NO_EXTRA_KEYS,
                   block_size: int | None = None) -> "ModelCache":
        """The model's cache at `chunk_size`, or (None) at the stored chunk size that covers the
        most of `token_ids` (256 when nothing is stored); block prefixes at `block_size` count
        (a chunk size it does not divide is used at whole chunks)."""
        def at(size: int) -> "ModelCache":
            block = block_size if block_size is not None and size % block_size == 0 else None
            return self.for_model(model, size, extra_keys, block)

        if chunk_size is not None:
            return at(chunk_size)
        caches = [at(s) for s in self.chunk_sizes(model, extra_keys)] or [at(256)]
        return max(caches, key=lambda c: (c.lookup(token_ids), -c.chunk_size))

    def count_refusal(self, err: Exception) -> None:
        self.counters.refused += 1
        if len(self.counters.refusals) < 16:
            self.counters.refusals.append(str(err))

    def refuse(self, name: str, err: ObjectRefused) -> None:
        """Something that is not an object holds a name a put needed (a folder): a miss, reported
        once; `fsck` removes it. (An object refused at a load is healed: `ModelCache.heal`.)"""
        self.count_refusal(err)
        notice(f"store: refused a damaged or foreign object ({err}); `kvtool store fsck` removes it")
        for tier in getattr(self.backend, "tiers", [])[:-1]:  # never serve it from memory again
            tier.delete(name)

    def unreadable(self, err: ObjectUnreadable) -> None:
        """A stored object could not be read here: a miss, said once; nothing is removed."""
        notice(f"store: skipped an object that cannot be read here ({err}); counted as a miss", key="store unreadable")

    def scan(self, prefix: str = "") -> list[ObjectInfo]:
        return list(self.backend.scan(prefix))

    def close(self) -> None:
        self.calibrations.close()
        self.backend.close()

    def __enter__(self) -> "ChunkStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ModelCache:
    """The chunks of one model at one chunk size: the prefix API engines use."""

    def __init__(self, store: ChunkStore, model: ModelIdentity | dict[str, Any], chunk_size: int,
                 extra_keys: ExtraKeys = NO_EXTRA_KEYS, block_size: int | None = None):
        if not isinstance(chunk_size, int) or not 1 <= chunk_size <= 65536:
            raise UsageError(f"chunk size must be in [1, 65536], got {chunk_size}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1 or chunk_size % block_size):
            raise UsageError(f"block size must divide the chunk size {chunk_size}, got {block_size}")
        #: the engine's block: prefixes match to a multiple of it (the chunk size: whole chunks only)
        self.block_size = block_size or chunk_size
        self.store = store
        self.extra_keys = extra_keys
        if isinstance(model, ModelIdentity):
            model = {**model.to_dict(), "fingerprint": model.fingerprint()}
        self.model = dict(model)
        self.key = objects.model_key(self.model)
        # K and V planes, or an MLA model's one latent (its identity names the layout kind, and
        # with it every name here: container.md 3.2)
        self.planes = layout.LAYOUT_PLANES[layout_of_model(self.model)[0]]
        self.chunk_size = chunk_size
        #: the store as this namespace sees it (Redis: the namespace's key prefix, store.md §6.2)
        self.backend: Backend = store.backend.within(extra_keys.namespace)

    def _chain(self, token_ids, limit: int | None = None) -> list[ChunkLink]:
        """The link (start, parent, prefix hash, extra keys) of each whole chunk of `token_ids`
        (up to `limit` tokens), under this cache's extra keys."""
        return chunk_chain(_as_token_array(token_ids), self.chunk_size, self.extra_keys, limit)

    def name(self, prefix_hash: str) -> str:
        return objects.chunk_name(self.key, self.chunk_size, prefix_hash)

    def chunk_names(self, token_ids, limit: int | None = None) -> list[str]:
        """The store names of the whole chunks of `token_ids` (up to `limit` tokens), in order."""
        return [self.name(link.prefix_hash) for link in self._chain(token_ids, limit)]

    # --- reads -----------------------------------------------------------------------

    def lookup(self, token_ids) -> int:
        """How many leading tokens the store covers: whole chunks, then the longest stored block
        prefix after them (a multiple of the block size). Existence only, one probe (two when the
        whole chunks stop before the prompt's last): `get_prefix` checks each object and may
        return fewer."""
        return self.find(token_ids, check_trailers=True).tokens

    def find(self, token_ids, limit: int | None = None, count_misses: bool = False,
             check_trailers: bool = False) -> Found:
        """The existence probe of a prompt (up to `limit` tokens): its whole chunks' names and the
        block prefixes after its last whole chunk (pieces and block index entries) in one batch;
        when the stored chunks stop earlier, a second batch for the block prefixes there. With
        `check_trailers` (a lookup that promises tokens to an engine, which loads them later), each
        whole chunk's length and trailer come with it, in the same batch (`Backend.probe_many`),
        and one that is cut short or grown is not promised: it is healed here. A load checks every
        byte anyway, and asks without."""
        tokens = _as_token_array(token_ids)
        chain = chunk_chain(tokens, self.chunk_size, self.extra_keys, limit)
        blocks = self._blocks_at(tokens, chain, len(chain), limit)
        names = [self.name(link.prefix_hash) for link in chain]
        candidates = self._block_names(blocks)
        exists, run = self._probe(names, candidates, tokens, chain, check_trailers)
        if run < len(chain):
            if count_misses:
                self.store.counters.misses += len(chain) - run
            blocks = self._blocks_at(tokens, chain, run, limit)
            candidates = self._block_names(blocks)
            exists = [False] * len(chain) + (self.backend.exists_many(candidates) if candidates else [])
        found = Found(chain, run, chunk_size=self.chunk_size, ids=tokens)
        for j in range(len(blocks) - 1, -1, -1):  # the longest: a piece itself, else an entry naming an object
            piece, entry = exists[len(chain) + 2 * j], exists[len(chain) + 2 * j + 1]
            if piece or (entry and self._entry_leads_somewhere(candidates[2 * j + 1])):
                found.block, found.via = blocks[j], candidates[2 * j + (0 if piece else 1)]
                break
        return found

    def _probe(self, names: list[str], candidates: list[str], tokens: np.ndarray, chain: list[ChunkLink],
               check_trailers: bool) -> tuple[list[bool], int]:
        """(whether each of `names + candidates` is stored, the leading run of `names` stored and,
        with `check_trailers`, whole by its length and trailer): one batch."""
        if not names and not candidates:
            return [], 0
        probes = None
        if check_trailers:
            try:
                probes = self.backend.probe_many(names + candidates)
            except StoreAccessDenied:  # a tenant's user whose ACL predates STRLEN/GETRANGE: existence alone
                probes = None
        exists = [p is not None for p in probes] if probes is not None else self.backend.exists_many(names + candidates)
        run = next((i for i, f in enumerate(exists[:len(names)]) if not f), len(names))
        for i in range(run if probes is not None else 0):  # cut short or grown: never promised, healed here
            why = _trailer_fault(probes[i])
            if why is not None:
                self.heal(names[i], ObjectRefused(f"{names[i]}: {why}"), chain, i, tokens)
                return exists, i
        return exists, run

    def _entry_leads_somewhere(self, entry: str) -> bool:
        """Whether the object a block index entry names is stored (the entry read, its target
        probed: two round trips, only for the block prefix a lookup would promise). An entry whose
        object is gone is removed here, as `fsck` would (store.md §4.6): the lookup never promises
        tokens that cannot load. One that cannot be read as an entry is promised, and its load
        refuses it (and removes it)."""
        from .pointers import entry_target

        try:
            data = self.backend.get(entry)
        except (ObjectRefused, ObjectUnreadable):
            return True
        if data is None:
            return False
        target = entry_target(data, entry)
        if target is None or self.backend.exists(target):
            return True
        self._remove([entry], "the object it names is not stored")
        return False

    def _blocks_at(self, tokens: np.ndarray, chain: list[ChunkLink], i: int, limit: int | None) -> list[BlockLink]:
        """The block prefixes of chunk position `i` (after `i` whole chunks of `chain`)."""
        parent = bytes.fromhex(chain[i - 1].prefix_hash) if i else ZERO_HASH
        return block_links(tokens, i * self.chunk_size, parent, self.chunk_size, self.block_size, self.extra_keys,
                           limit)

    def _block_names(self, blocks: list[BlockLink]) -> list[str]:
        """Each block prefix's piece name, then its block index entry's name."""
        return [name for b in blocks for name in (objects.piece_name(self.key, self.chunk_size, b.prefix_hash),
                                                  objects.block_name(self.key, self.chunk_size, b.prefix_hash))]

    def open_block(self, found: Found, *, verify_payload: bool = False, opener=None) -> tuple[objects.ChunkObject, str, int]:
        """The object that serves `found.block` (its piece, or the chunk or piece its block index
        entry names), checked (§5 1-10, and that it begins with these tokens after this parent,
        for these extra keys): (object, its name, stored bytes). ObjectRefused carries `.name`,
        the name to refuse: the entry when it names an object that does not serve it."""
        block, via = found.block, found.via
        name, kind = via, "piece"
        if via.endswith(BLOCK_SUFFIX):
            data = self.backend.get(via)
            if data is None:
                raise loading.Gone(via)
            try:
                count, name = objects.check_block_entry(data, via)
            except ObjectRefused as err:
                raise _named(err, via) from None
            if count != block.tokens:
                raise _named(ObjectRefused(f"{via}: names {count} tokens where its name hashes {block.tokens}"), via)
            kind = objects.parse_name(name)[0]
        data = (opener or self.backend.open)(name)
        if data is None:
            raise loading.Gone(name)
        size = data.size if hasattr(data, "fd") else len(data)
        try:
            obj = objects.check_chunk(data, name, model=self.key, chunk_size=self.chunk_size, start=block.start,
                                      verify_payload=verify_payload, kind=kind)
        except ObjectRefused as err:
            raise _named(err, name) from None
        try:
            objects.check_serves(obj, name, block.parent.hex(), found.ids[block.start:block.start + block.tokens],
                                 block.extra)
        except ObjectRefused as err:
            obj.reader.close()
            raise _named(err, via) from None
        return obj, name, size

    def _exists(self, chain: list[ChunkLink]) -> list[bool]:
        """The existence probe, for reads and puts alike: a stat each, or one pipelined round trip;
        not a use (no LRU clock is touched)."""
        return self.backend.exists_many([self.name(link.prefix_hash) for link in chain]) if chain else []

    def _stored_run(self, chain: list[ChunkLink], count_misses: bool = False) -> int:
        """How many links from the first are stored (`_exists`). Nothing past a miss is read;
        `count_misses` counts the rest as misses."""
        found = self._exists(chain)
        stored = next((i for i, f in enumerate(found) if not f), len(found))
        if count_misses and stored < len(chain):
            self.store.counters.misses += len(chain) - stored
        return stored

    def contains(self, token_ids) -> bool:
        """Whether every whole chunk of `token_ids` is stored (and there is at least one)."""
        chain = self._chain(token_ids)
        return bool(chain) and self._stored_run(chain) == len(chain)

    def checked_objects(self, token_ids, max_tokens: int | None = None,
                        refused: list[str] | None = None) -> Iterator[tuple[int, int, objects.ChunkObject, int]]:
        """(start, end, checked object, stored bytes) of each stored whole chunk from token 0, in
        order, until the first chunk that is missing or refused (its reason goes to `refused`),
        then of the longest stored block prefix after them (an object serving its first `end -
        start` tokens: a piece, or a longer chunk or piece). The objects are not decoded: `store
        get` copies their payloads as they are (or a part of a longer one, decoded)."""
        found = self.find(token_ids, max_tokens, count_misses=True)
        served = 0
        for item in self._checked_chunks(found, refused):
            served += 1
            yield item
        if found.block is None or served < found.run:  # (nothing past a chunk missing or refused)
            return
        try:
            obj, _name, size = self.open_block(found, verify_payload=True)
            obj.check_values()
        except (ObjectRefused, ObjectUnreadable, loading.Gone) as err:
            self.stopped_at(found, found.run, err, name=getattr(err, "name", found.via), refused=refused)
            return
        self.store.counters.hits += 1
        yield found.block.start, found.block.start + found.block.tokens, obj, size

    def _checked_chunks(self, found: Found, refused: list[str] | None) -> Iterator[tuple[int, int, objects.ChunkObject, int]]:
        chain, whole = found.chain[:found.run], found.chain
        for first in range(0, len(chain), FETCH_BATCH):
            batch = chain[first:first + FETCH_BATCH]
            names = [self.name(link.prefix_hash) for link in batch]
            for link, name, data in zip(batch, names, self.fetch(names)):
                start, position = link.start, link.start // self.chunk_size
                if data is None or isinstance(data, (ObjectRefused, ObjectUnreadable)):  # (refused by its size)
                    self.stopped_at(found, position, data if data is not None else loading.Gone(name), refused=refused)
                    return
                obj = None
                try:
                    obj = objects.check_chunk(data, name, model=self.key, chunk_size=self.chunk_size,
                                              prefix_hash=link.prefix_hash, start=start, extra=link.extra)
                    obj.check_values()  # what is copied out as it is must be what a load would take
                except (ObjectRefused, ObjectUnreadable) as err:
                    if obj is not None:
                        obj.reader.close()
                    self.stopped_at(found, position, err, refused=refused)
                    return
                self.store.counters.hits += 1
                yield start, start + self.chunk_size, obj, data.size if hasattr(data, "fd") else len(data)

    def fetch(self, names: list[str]) -> list:
        """The objects (None: not stored), one batch: bytes from a backend that batches reads, or
        each opened as a file from a folder (its header checked before anything else is read:
        a huge file at a name is never read whole). An object the backend refuses (a hostile
        size, a link) is its ObjectRefused, one it cannot read its ObjectUnreadable, in its place."""
        if self.backend.reads_in_place:
            return [self._fetch_one(name, self.backend.open) for name in names]
        try:
            return self.backend.get_many(names)
        except (ObjectRefused, ObjectUnreadable):
            return [self._fetch_one(name, self.backend.get) for name in names]

    @staticmethod
    def _fetch_one(name: str, read):
        try:
            return read(name)
        except (ObjectRefused, ObjectUnreadable) as err:
            return err

    def stopped_at(self, found: Found, position: int, error: BaseException, *, name: str | None = None,
                   refused: list[str] | None = None, unreadable: list[str] | None = None) -> list[str]:
        """The one place a read that stops early is sorted (store.md §5), at chain `position` of
        `found` (`found.run`: the block prefix's object, `name` the one to refuse there): stored bytes
        that fail a check are refused (`refused` gets why), counted and healed; an object that cannot
        be read here (a pca chunk whose calibration is not here, a file we may not read) is a miss,
        said once (`unreadable` gets why; without it, `refused` does) and kept; one gone since the
        lookup is a miss, and what named it goes; anything else (the store went away) is raised, not
        a miss to hide. Returns the names healed."""
        if objects.needs_what_is_not_here(error):
            error = ObjectUnreadable(str(error))
        at_block = position >= found.run and found.block is not None
        self.store.counters.misses += 1 if at_block else len(found.chain) - position
        if isinstance(error, ObjectUnreadable):
            if unreadable is not None:
                unreadable.append(str(error))
                self.store.unreadable(error)
            elif refused is not None:  # the caller says why the prefix stops here
                refused.append(str(error))
            else:
                self.store.unreadable(error)
            return []
        if isinstance(error, loading.Gone):  # no entry may promise it still
            if at_block:
                return self.heal_block(found, error.name, error)
            return self.forget_gone(error.name, found.chain, position, found.ids)
        if not isinstance(error, loading.DAMAGE):
            raise error
        if at_block:
            name = name or found.via
            refusal = error if isinstance(error, ObjectRefused) else ObjectRefused(f"{name}: {error}")
            if refused is not None:
                refused.append(str(refusal))
            return self.heal_block(found, name, refusal)
        name = self.name(found.chain[position].prefix_hash)
        refusal = error if isinstance(error, ObjectRefused) else ObjectRefused(
            str(error) if str(error).startswith(name) else f"{name}: {error}")
        if refused is not None:
            refused.append(str(refusal))
        return self.heal(name, refusal, found.chain, position, found.ids)

    def heal(self, name: str, err: Exception, chain: list[ChunkLink], position: int,
             tokens: np.ndarray | None) -> list[str]:
        """An object refused at a load (damaged, foreign) is removed at once, as `fsck` would,
        with this prompt's block index entries at its chain position that name it: the next lookup
        no longer promises it, so the next request computes those tokens and stores them again
        (no wait for `fsck`). Said once per object; the names removed (none where the store does not
        let this user remove them: then `fsck` does)."""
        self.store.count_refusal(err)
        removed = self._remove([name], str(err))
        if tokens is not None and objects.parse_name(name) is not None \
                and objects.parse_name(name)[0] in ("chunk", "piece") and position <= len(chain):
            removed += self._remove(self._entries_naming(name, tokens, chain, position), f"it named {name}, removed")
        return removed

    def heal_block(self, found: Found, name: str, err: Exception) -> list[str]:
        """The object serving `found.block` refused (`name`: the entry, or the object it names, or
        the piece) or gone: removed as `heal` removes a chunk, with the entry that led to it."""
        gone = isinstance(err, NotCached)
        removed = []
        if not gone:
            self.store.count_refusal(err)
            removed += self._remove([name], str(err))
        pointers = [found.via] if found.via.endswith(BLOCK_SUFFIX) and found.via != name else []
        if name != found.via and objects.parse_name(name) is not None:
            pointers += [e for e in self._entries_naming(name, found.ids, found.chain, found.run) if e not in pointers]
        why = f"it named {name}, which is not stored" if gone else f"it named {name}, removed"
        return removed + self._remove(pointers, why)

    def forget_gone(self, name: str, chain: list[ChunkLink], position: int, tokens: np.ndarray | None) -> list[str]:
        """A whole chunk found by the lookup and gone at its load (removed or evicted meanwhile):
        this prompt's block index entries that name it go, so no lookup promises it again."""
        if tokens is None:
            return []
        return self._remove(self._entries_naming(name, tokens, chain, position), f"it named {name}, which is not stored")

    def _entries_naming(self, name: str, tokens: np.ndarray, chain: list[ChunkLink], position: int) -> list[str]:
        """This prompt's block index entries at chain `position` that name `name`: at this cache's
        block size and at 16 tokens (GPU engines' block) where it divides the chunk size. Entries of
        other sizes or prompts are removed when a lookup meets them (`_entry_leads_somewhere`)."""
        sizes = {self.block_size} | ({16} if self.chunk_size % 16 == 0 else set())
        links: dict[str, BlockLink] = {}
        for size in sorted(sizes):
            if size >= self.chunk_size:
                continue
            parent = bytes.fromhex(chain[position - 1].prefix_hash) if position else ZERO_HASH
            for link in block_links(tokens, position * self.chunk_size, parent, self.chunk_size, size,
                                    self.extra_keys):
                links[link.prefix_hash] = link
        names = [objects.block_name(self.key, self.chunk_size, h) for h in links]
        if not names:
            return []
        from .pointers import _read, entry_target

        return [entry for entry, data in zip(names, _read(self.backend, names)) if entry_target(data, entry) == name]

    def _remove(self, names: list[str], why: str) -> list[str]:
        """Remove `names` from every tier of this cache's namespace; one line per object removed."""
        removed = []
        for name in names:
            try:
                if self.backend.delete(name):
                    removed.append(name)
            except KvtoolError as err:  # (a tenant's user that may only read: fsck removes it)
                notice(f"store: could not remove {name} ({err}); `kvtool store fsck` removes it", key=f"heal {name}")
                continue
        for name in removed:
            reason = why[len(name) + 2:] if why.startswith(f"{name}: ") else why
            notice(f"store: removed {name} ({reason}): the next request computes and stores its tokens again",
                   key=f"healed {next(_HEALS)}")  # (every one said: a name healed again is another event)
        self.store.counters.healed += len(removed)
        return removed

    def kv_dtype(self, token_ids) -> "torch.dtype | None":
        """The KV dtype of the stored first chunk of `token_ids` (None: not stored, or refused):
        what an engine's buffers for its prefix are made of."""
        chain = self._chain(token_ids, self.chunk_size)
        if not chain:
            return None
        name = self.name(chain[0].prefix_hash)
        try:
            data = self.backend.open(name)
            if data is None:
                return None
            obj = objects.check_chunk(data, name, model=self.key, chunk_size=self.chunk_size,
                                      prefix_hash=chain[0].prefix_hash, start=0, extra=chain[0].extra,
                                      verify_payload=False)
        except ObjectRefused:
            return None  # the load refuses it again, and reports it
        try:
            return obj.reader.kv_dtype
        finally:
            obj.reader.close()

    def load_prefix(self, token_ids, destination, *, max_tokens: int | None = None,
                    from_token: int = 0) -> PrefixHit:
        """The longest run of stored, intact whole chunks from token 0 into `destination` (a
        `kvtool.load.Destination`, e.g. `ConnectorTarget(connector, kvcaches=..., slot_mapping=...)`)
        through the one load path: each object opened, checked and copied or decoded on the worker
        that loads it (store/loading.py). A damaged or foreign object ends the run: never loaded."""
        return loading.load_prefix(self, token_ids, destination, max_tokens=max_tokens, from_token=from_token)

    def get_prefix(self, token_ids, *, device: "torch.device | str | None" = None,
                   max_tokens: int | None = None) -> PrefixHit:
        """`load_prefix` into tensors: `hit.chunks` are KV_BLOB tensors `[2, L, S, C]` on `device`."""
        return loading.get_prefix(self, token_ids, device=device, max_tokens=max_tokens)

    # --- writes ----------------------------------------------------------------------

    def put_sequence(self, token_ids, kv: "torch.Tensor", codec: str = "raw",
                     params: dict[str, Any] | None = None, *, start: int = 0) -> PutResult:
        """Store the whole chunks of a sequence's KV_BLOB `kv` `[2, L, T, C]` (T >= the tokens
        given). Chunks already stored, by any codec, are not encoded again. At a block size, each
        whole chunk also gets its block index entries, and the tokens past the last whole chunk,
        to the last whole block, are stored as a piece (store.md §7); without one, a last partial
        chunk is not stored. With `start` (a
        multiple of the chunk size), `kv` holds tokens `[start, ...)` and only the chunks from
        there are stored (an engine saving what a step completed)."""
        from ..dtypes import dtype_name

        if start % self.chunk_size:
            raise UsageError(f"start {start} is not a multiple of the chunk size {self.chunk_size}")
        tokens = _as_token_array(token_ids)
        whole = chunk_chain(tokens, self.chunk_size, self.extra_keys)
        chain = [link for link in whole if link.start >= start]
        if kv.dim() != 4 or kv.shape[0] != self.planes or kv.shape[2] < len(chain) * self.chunk_size:
            raise UsageError(f"kv must be a KV_BLOB [{self.planes}, L, T, C] covering the tokens, got {list(kv.shape)}")
        kv_dtype = dtype_name(kv.dtype)

        def encode(i: int, link, tokens_of_chunk, piece_of: int | None = None) -> bytes:
            first, end = link.start, link.start + len(tokens_of_chunk)
            return objects.encode_chunk(self.model, kv_dtype, link.parent, first, tokens_of_chunk,
                                        kv=kv[:, :, first - start:end - start], codec=codec, params=params,
                                        extra=link.extra, piece_of=piece_of)

        self.store.calibrations.publish(pca_digests([(codec, params)]))  # before the chunks that name it
        result = self._store(chain, tokens, encode)
        if self.block_size < self.chunk_size:
            self._store_blocks(tokens, whole, chain, start, start + kv.shape[2], encode, result)
        return result

    def _store_blocks(self, tokens: np.ndarray, whole: list[ChunkLink], chain: list[ChunkLink], start: int,
                      kv_end: int, encode, result: PutResult) -> None:
        """Block prefixes (store.md §7): a block index entry for each block prefix of each whole
        chunk stored here, naming it; and the tokens past the last whole chunk, to the last whole
        block, as a piece with an entry for each of its shorter block prefixes. A piece whose
        tokens an object holds already (an entry at its own prefix) is not written. One probe."""
        entries: list[tuple[BlockLink, str]] = []  # (block prefix, the object it names)
        for link in chain:
            target = self.name(link.prefix_hash)
            entries += [(b, target) for b in self._blocks_at(tokens, whole, link.start // self.chunk_size, None)]
        tail = self._blocks_at(tokens, whole, len(whole), None) if len(whole) * self.chunk_size >= start else []
        while tail and tail[-1].start + tail[-1].tokens > kv_end:  # (what kv holds only)
            tail.pop()
        piece = tail[-1] if tail else None
        names = [objects.block_name(self.key, self.chunk_size, b.prefix_hash) for b, _ in entries]
        if piece is not None:
            piece_name = objects.piece_name(self.key, self.chunk_size, piece.prefix_hash)
            tail_entries = [(b, piece_name) for b in tail[:-1]]
            names += [objects.block_name(self.key, self.chunk_size, b.prefix_hash) for b, _ in tail_entries]
            names += [piece_name, objects.block_name(self.key, self.chunk_size, piece.prefix_hash)]
        found = self.backend.exists_many(names) if names else []
        items = [(name, objects.encode_block_entry(b.tokens, target))
                 for (b, target), name, present in zip(entries, names, found) if not present]
        if piece is not None and not any(found[-2:]):  # no object holds these tokens yet
            items += [(name, objects.encode_block_entry(b.tokens, target))
                      for (b, target), name, present in zip(tail_entries, names[len(entries):], found[len(entries):])
                      if not present]
            data = encode(0, piece, tokens[piece.start:piece.start + piece.tokens], piece_of=self.chunk_size)
            items.insert(0, (piece_name, data))  # (before the entries that name it)
        for first in range(0, len(items), FETCH_BATCH):
            batch = items[first:first + FETCH_BATCH]
            for (name, data), created in zip(batch, self._put_all(batch)):
                if created:
                    result.stored_bytes += len(data)
                    if name.endswith(BLOCK_SUFFIX):
                        result.block_entries += 1
                    else:
                        result.pieces += 1

    def put_encoded(self, token_ids, payloads: Sequence[tuple[Any, str, dict[str, Any]]],
                    kv_dtype: str) -> PutResult:
        """Store already-encoded whole chunks as they are (`store put` of a container):
        `payloads[i]` is chunk i's (payload, codec name, codec params)."""
        chain = self._chain(token_ids)[:len(payloads)]

        def encode(i: int, link: ChunkLink, tokens_of_chunk) -> bytes:
            payload, codec, params = payloads[i]
            return objects.encode_chunk(self.model, kv_dtype, link.parent, link.start, tokens_of_chunk,
                                        payload=payload, codec=codec, params=params, extra=link.extra)

        tokens = _as_token_array(token_ids)
        self.store.calibrations.publish(pca_digests((codec, params) for _, codec, params in payloads[:len(chain)]))
        result = self._store(chain, tokens, encode)
        if self.block_size < self.chunk_size:  # each whole chunk's block index entries (no piece: no KV past them)
            self._store_blocks(tokens, self._chain(tokens), chain, 0, len(chain) * self.chunk_size, encode, result)
        return result

    def _store(self, chain: list[ChunkLink], tokens: np.ndarray, encode) -> PutResult:
        """The one put: the links not stored yet (one existence probe) encoded (`encode(i, link,
        tokens of the chunk)`) and put, put-once, in batches of FETCH_BATCH; the rest deduplicated."""
        present = self._exists(chain)
        result = PutResult(chunks=len(chain), stored=0, present=0, stored_bytes=0)
        items: list[tuple[str, bytes]] = []
        for i, (link, stored) in enumerate(zip(chain, present)):
            if stored:
                result.present += 1
                self.store.counters.deduplicated += 1
                continue
            data = encode(i, link, tokens[link.start:link.start + self.chunk_size])
            items.append((self.name(link.prefix_hash), data))
            if len(items) >= FETCH_BATCH:
                self._put(items, result)
        self._put(items, result)
        return result

    def _put(self, items: list[tuple[str, bytes]], result: PutResult) -> None:
        if not self.backend.writes_in_batches:  # one at a time anyway: each refusal alone
            outcomes = [self._put_one(name, data) for name, data in items]
        else:
            try:
                outcomes = self.backend.put_many(items)
            except ObjectRefused:  # something that is not an object holds a name (a folder)
                outcomes = [self._put_one(name, data) for name, data in items]
        for (_name, data), created in zip(items, outcomes):
            if created is None:  # not stored, not present: said once; fsck removes what is in the way
                continue
            if created:
                result.stored += 1
                result.stored_bytes += len(data)
                self.store.counters.stored += 1
            else:  # another process stored it between our check and our write
                result.present += 1
                self.store.counters.deduplicated += 1
        items.clear()

    def _put_all(self, items: list[tuple[str, bytes]]) -> list[bool | None]:
        """Put a batch (one round trip where the backend batches), each refusal alone."""
        if not self.backend.writes_in_batches:
            return [self._put_one(name, data) for name, data in items]
        try:
            return self.backend.put_many(items)
        except ObjectRefused:
            return [self._put_one(name, data) for name, data in items]

    def _put_one(self, name: str, data: bytes) -> bool | None:
        try:
            return self.backend.put(name, data)
        except ObjectRefused as err:
            self.store.refuse(name, err)
            return None

    def delete(self, token_ids) -> int:
        """Remove the stored whole chunks of `token_ids` (and, at a block size, their block index
        entries and the piece past them); how many objects were removed."""
        tokens = _as_token_array(token_ids)
        chain = self._chain(tokens)
        names = [self.name(link.prefix_hash) for link in chain]
        for i in range(len(chain) + 1):
            names += self._block_names(self._blocks_at(tokens, chain, i, None))
        return sum(self.backend.delete(name) for name in names)


def _trailer_fault(probe: tuple[int, bytes]) -> str | None:
    """Why an object's length and last bytes (`Backend.probe_many`) are not a container's
    (container.md §2.2: a trailer whose manifest ends where it begins), or None: the check a
    lookup makes before promising a chunk, without reading it."""
    from ..errors import KvtoolError
    from ..format.layout import TRAILER_SIZE, Trailer

    size, tail = probe
    if tail is None:  # (there, but not readable by this user: its load says so)
        return None
    try:
        Trailer.unpack(bytes(tail[-TRAILER_SIZE:]).rjust(TRAILER_SIZE, b"\0"), size)
    except KvtoolError as err:
        return str(err)
    return None


def _named(err: ObjectRefused, name: str) -> ObjectRefused:
    """`err`, saying which object to refuse for it (`err.name`)."""
    err.name = name
    return err


def _as_token_array(token_ids) -> np.ndarray:
    """A request's token ids as int64, each checked to be in [0, 2^32). A list (what vLLM and
    callers hand over) goes through array('I'), which checks the range as it converts: 3x
    faster than numpy's conversion of a list (0.3 ms for 8,192 ids, a tenth of loading them)."""
    if isinstance(token_ids, (list, tuple)) and _U32.itemsize == 4:
        try:
            return np.frombuffer(array.array("I", token_ids), dtype=np.uint32).astype(np.int64)
        except (TypeError, ValueError, OverflowError):
            raise UsageError("token ids must be integers in [0, 2^32)") from None
    try:
        if hasattr(token_ids, "detach"):  # a torch tensor
            token_ids = token_ids.detach().cpu().numpy()
        tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise UsageError("token ids must be integers in [0, 2^32)") from None
    if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
        raise UsageError("token ids must be integers in [0, 2^32)")
    return tokens


_U32 = array.array("I")
_HEALS = itertools.count()


__all__ = ["ChunkStore", "ModelCache", "PrefixHit", "PutResult", "StoreCounters", "open_store"]
