"""`kvtool store ...`: the chunk store's operations (format-spec/store.md).

put (containers' whole chunks, copied as encoded), get (the longest cached prefix of a prompt
as a container), ls, stats, gc, fsck, rm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import NotCached, StoreDamaged
from ..format import ContainerReader
from ..store import ChunkStore, open_store, upkeep
from ..store.containers import ingest, prefix_container  # noqa: F401  (public here too)
from .file_requests import (StoreFsckRequest, StoreGcRequest, StoreGetRequest, StoreListRequest, StorePutRequest,
                            StoreRmRequest, StoreStatsRequest)
from .inputs import parse_size  # noqa: F401  (public here too)
from .result import Result



def connect(url: str, *, memory_bytes: int | str | None = None, max_bytes: int | str | None = None,
            create: bool = True) -> ChunkStore:
    return open_store(url, memory_bytes=parse_size(memory_bytes, "--memory") or 0,
                      max_bytes=parse_size(max_bytes), create=create)


# --- put ---------------------------------------------------------------------------------


@dataclass
class IngestedFile:
    file: str
    model: str
    chunk_size: int
    chunks: int  # whole chunks in the file
    stored: int
    present: int
    stored_bytes: int


@dataclass
class StorePutResult(Result):
    store: str
    files: list[IngestedFile]

    @property
    def totals(self) -> dict[str, int]:
        return {k: sum(getattr(f, k) for f in self.files) for k in ("chunks", "stored", "present", "stored_bytes")}

    def to_dict(self, json_safe: bool = True) -> dict[str, Any]:
        return {**super().to_dict(json_safe), "totals": self.totals}


def put(files: list[str | Path] | StorePutRequest, store: str | None = None, **options: Any) -> StorePutResult:
    """`kvtool store put FILE... --store URL [--namespace NAME]`: a `StorePutRequest`, or its fields."""
    request = files if isinstance(files, StorePutRequest) else StorePutRequest(files, store, **options)
    files, store, keys = request.files, request.store, request.extra_keys
    for path in files:  # each file opened (header, manifest, trailer) before the store is: a file that is
        with ContainerReader(path):  # not a kvtool file leaves no new, empty store behind
            pass
    rows = []
    with connect(store) as s:
        for path in files:
            with ContainerReader(path) as reader:
                r = ingest(reader, s, keys)
                rows.append(IngestedFile(file=str(path), model=str(reader.model.get("name")),
                                         chunk_size=reader.manifest.chunk_size, chunks=r.chunks, stored=r.stored,
                                         present=r.present, stored_bytes=r.stored_bytes))
        return StorePutResult(store=s.url, files=rows)


# --- get ---------------------------------------------------------------------------------


@dataclass
class StoreGetResult(Result):
    store: str
    output: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    chunks: int
    codecs: list[str]
    file_bytes: int
    refused: list[str] = field(default_factory=list)
    reencoded: int = 0  # chunks re-encoded into the asked codec (`codec`); the rest copied as stored


def get(store: str | StoreGetRequest, output: str | Path | None = None, **options: Any) -> StoreGetResult:
    """`kvtool store get --prompt-file F --store URL -o OUT` (a `StoreGetRequest`, or its fields):
    the longest cached prefix of the prompt, as a container (at `chunk_size`, or the stored chunk size that covers the most), of
    the chunks stored under `namespace` (none: those stored without one). With `codec`, every
    chunk ends in that codec (its default parameters; pca's: quality 97 with the model's registered
    calibration): a chunk stored so is copied as it is, the
    others are decoded and encoded again (a store keeps one object per chunk, in the codec it was
    first put in). With `block_size`, the prefix goes on past the whole chunks to the longest
    block-aligned run of tokens a stored sequence shares (store.md §7; at a chunk size it does
    not divide, whole chunks only). With `sglang_page_size`, the pages SGLang's kvtool backend
    saved for the prompt instead (store.md §4.8; written by `sglang_tp` ranks)."""
    from ..engine import load_model
    from .capture import read_tokens

    request = store if isinstance(store, StoreGetRequest) else StoreGetRequest(store, output, **options)
    if request.sglang_page_size is not None:
        return _get_sglang_pages(request)
    store, output, codec, chunk_size, namespace = (request.store, request.output, request.codec,
                                                   request.chunk_size, request.namespace)
    keys, block_size = request.extra_keys, request.block_size
    with connect(store, create=False) as s:
        loaded = load_model(request.model)
        params = request.params_for(loaded.identity.fingerprint())  # (pca: the model's calibration)
        ids = read_tokens(loaded, request.prompt, request.prompt_file, request.tokens_file, request.chat)
        refused: list[str] = []
        target = output if codec is None else _beside(output)
        try:
            n, codecs_used, _writer = prefix_container(s, loaded.identity, ids, chunk_size, target, refused, keys,
                                                   block_size=block_size)
            if n == 0:
                why = f" ({refused[0]})" if refused else ""
                sizes = [chunk_size] if chunk_size is not None else s.chunk_sizes(loaded.identity)
                at = f"at chunk size {', '.join(map(str, sizes))}" if sizes else "at any chunk size"
                where = f" in namespace {namespace!r}" if namespace else ""
                raise NotCached(f"{s.url}: no whole chunk of this prompt's {len(ids)} tokens is stored{where} "
                                f"for {loaded.name} {at}{why}")
            reencoded = 0
            if codec is not None:
                from .compress import compress_file

                with ContainerReader(target) as reader:
                    # (no re-laying: a prompt waits, and a decode and encode is ~30x faster: bench/RESULTS.md §46)
                    done = compress_file(reader, output, codec, params, relay=False)
                reencoded, codecs_used = done.num_chunks - done.chunks_copied, [codec] * done.num_chunks
        finally:
            if target != output and os.path.exists(target):
                os.unlink(target)
        return StoreGetResult(store=s.url, output=str(output), model=loaded.name, prompt_tokens=len(ids),
                              cached_tokens=n, chunks=len(codecs_used), codecs=sorted(set(codecs_used)),
                              file_bytes=os.path.getsize(output), refused=refused, reencoded=reencoded)


def _get_sglang_pages(request: StoreGetRequest) -> StoreGetResult:
    """`store get --sglang-page-size`: the prompt's leading pages SGLang saved, as a raw container."""
    from ..engine import load_model
    from ..store.sglang_pages import pages_container
    from .capture import read_tokens

    page_size, namespace, output = request.sglang_page_size, request.namespace, request.output
    with connect(request.store, create=False) as s:
        loaded = load_model(request.model)
        ids = read_tokens(loaded, request.prompt, request.prompt_file, request.tokens_file, request.chat)
        n, refused = pages_container(s.backend, loaded.identity, ids, page_size, output, namespace=namespace or "",
                                     tp_size=request.sglang_tp)
        if n == 0:
            why = f" ({refused[0]})" if refused else ""
            where = f" in namespace {namespace!r}" if namespace else ""
            raise NotCached(f"{s.url}: no SGLang page of this prompt's {len(ids)} tokens is stored{where} for "
                            f"{loaded.name} at page size {page_size}{why}")
        chunk = page_size * max(1, 256 // page_size)
        return StoreGetResult(store=s.url, output=str(output), model=loaded.name, prompt_tokens=len(ids),
                              cached_tokens=n, chunks=-(-n // chunk), codecs=["raw"],
                              file_bytes=os.path.getsize(output), refused=refused, reencoded=0)


def _beside(output: str | Path) -> str:
    """A scratch path in the output's folder (the prefix as stored, before it is re-encoded)."""
    folder, name = os.path.split(os.path.abspath(output))
    return os.path.join(folder, f".{name}.{os.getpid()}.stored")


# --- upkeep ------------------------------------------------------------------------------


@dataclass
class StoreListing(Result):
    store: str
    objects: list[dict[str, Any]]


def ls(store: str | StoreListRequest, **options: Any) -> StoreListing:
    """`kvtool store ls`: the stored objects, most recently used first (a `StoreListRequest`, or its fields)."""
    request = store if isinstance(store, StoreListRequest) else StoreListRequest(store, **options)
    store, kind, model, limit = request.store, request.kind, request.model, request.limit
    with connect(store, create=False) as s:
        infos = list(s.backend.scan())
        ids = upkeep.short_ids([o.name for o in infos])  # each distinct among every object of the store
        rows = [upkeep.describe(o) | {"id": upkeep.printable(ids[o.name])} for o in infos]
        rows = [r for r in rows if (kind is None or r["kind"] == kind)
                and (model is None or r.get("model", "").startswith(model))]
        rows.sort(key=lambda r: -r["last_used"])
        rows = rows[:limit] if limit else rows
        names = upkeep.model_names(s, rows)
        for row in rows:
            if row.get("model") in names:
                row["model_name"] = names[row["model"]]
        return StoreListing(store=s.url, objects=rows)


@dataclass
class StoreStats(Result):
    store: str
    objects: int
    bytes: int
    by_kind: dict[str, int]
    models: dict[str, dict]
    foreign: int


def stats(store: str | StoreStatsRequest) -> StoreStats:
    """`kvtool store stats`: how many objects and bytes, per kind and per model."""
    store = store.store if isinstance(store, StoreStatsRequest) else store
    with connect(store, create=False) as s:
        inv = upkeep.inventory(s)
        return StoreStats(store=s.url, objects=inv.objects, bytes=inv.bytes, by_kind=inv.by_kind,
                          models=inv.models, foreign=inv.foreign)


@dataclass
class StoreGcResult(Result):
    store: str
    max_bytes: int
    removed: int
    removed_bytes: int
    temps_removed: int
    remaining_bytes: int


def gc(store: str | StoreGcRequest, max_bytes: int | str | None = None) -> StoreGcResult:
    """`kvtool store gc --max-bytes 10G`: evict least recently used objects down to the cap (a
    `StoreGcRequest`, or its fields)."""
    request = store if isinstance(store, StoreGcRequest) else StoreGcRequest(store, max_bytes)
    store, cap = request.store, request.cap
    with connect(store, create=False) as s:
        r = upkeep.gc(s, cap)
        return StoreGcResult(store=s.url, max_bytes=cap, removed=r.removed, removed_bytes=r.removed_bytes,
                             temps_removed=r.temps_removed, remaining_bytes=r.remaining_bytes)


@dataclass
class StoreFsckResult(Result):
    store: str
    repair: bool
    checked: int
    intact: int
    damaged: list[dict]
    removed: int
    temps_removed: int
    entries_removed: int = 0  # intact block index entries removed with the damaged objects they named

    @property
    def ok(self) -> bool:  # damage found and left in place fails; damage removed is repaired
        return not self.damaged or (self.repair and self.removed == len(self.damaged))


def fsck(store: str | StoreFsckRequest, **options: Any) -> StoreFsckResult:
    """`kvtool store fsck`: check every object (§5); remove the damaged and foreign ones (a
    `StoreFsckRequest`, or its fields)."""
    request = store if isinstance(store, StoreFsckRequest) else StoreFsckRequest(store, **options)
    store, repair = request.store, request.repair
    with connect(store, create=False) as s:
        r = upkeep.fsck(s, repair=repair)
        result = StoreFsckResult(store=s.url, repair=repair, checked=r.checked, intact=r.intact, damaged=r.damaged,
                                 removed=r.removed, temps_removed=r.temps_removed, entries_removed=r.entries_removed)
    if not result.ok:
        n = len(result.damaged)
        raise StoreDamaged(f"{result.store}: {n} damaged, foreign or unreadable object{'' if n == 1 else 's'} "
                           f"({result.removed} removed)", report=result)
    return result


@dataclass
class StoreRmResult(Result):
    store: str
    removed: int  # objects removed, the block index entries that named them included
    removed_bytes: int
    block_entries: int = 0  # of `removed`: entries removed because what they named went


def rm(store: str | StoreRmRequest, names: list[str] | None = None, **options: Any) -> StoreRmResult:
    """`kvtool store rm NAME... | --model KEY | --namespace NAME | --all`: the objects, and the block
    index entries that name them (store.md §4.6), on every backend (a `StoreRmRequest`, or its fields)."""
    request = store if isinstance(store, StoreRmRequest) else StoreRmRequest(store, names, **options)
    store, names, model, namespace = request.store, request.names, request.model, request.namespace
    with connect(store, create=False) as s:
        infos = list(s.backend.scan())
        if names:  # whole names or short ids (store ls); nothing is removed when one names nothing
            targets = upkeep.resolve_names(names, infos)
        elif model:
            targets = [o for o in infos if upkeep.describe(o).get("model", "").startswith(model)]
        elif namespace:
            targets = [o for o in infos if upkeep.in_namespace(s, o, namespace)]
        else:
            targets = infos
        by_namespace: dict[str, list] = {}
        for info in targets:
            by_namespace.setdefault(info.namespace, []).append(info)
        removed, entries, removed_bytes = 0, 0, 0
        for namespace, infos in by_namespace.items():  # each with the block index entries naming it (store.md §4.6)
            sizes = {o.name: o.size for o in infos}
            gone, pointers = s.backend.within(namespace).remove([o.name for o in infos])
            removed += len(gone) + len(set(pointers) - set(sizes))
            entries += len(set(pointers) - set(sizes))
            removed_bytes += sum(sizes[name] for name in gone)
        return StoreRmResult(store=s.url, removed=removed, removed_bytes=removed_bytes, block_entries=entries)


__all__ = ["StoreFsckResult", "StoreGcResult", "StoreGetResult", "StoreListing", "StorePutResult",
           "StoreRmResult", "StoreStats", "connect", "fsck", "gc", "get", "ingest", "ls", "parse_size",
           "prefix_container", "put", "rm", "stats"]
