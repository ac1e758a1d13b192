"""Checked chunk objects kept between loads, per folder store (the folder backend owns them:
`LocalBackend.kept`; a tiered store's are its durable folder's).

Chunk objects in files whose checks 1-10 passed on an earlier opening in this process, by the
file they lie in (its device, inode, size and modification time) and what was asked of it: a
hot prefix's objects are opened by every load, and those checks (header, manifest, tokens,
names) cost ~90 us an object, as long as copying 1.5 MB of its KV. Such an object opened again
skips them; its payload is still checked as it is copied (CRC-32C and values, checks 11-13,
against the checked manifest's CRC), so what reaches a model is exactly the bytes checked.
Only files last modified KEPT_AFTER_NS ago or more are kept (as git's index treats "racily
clean" files): a file's time moves in clock ticks, so a change made within the tick of an
earlier one could leave its size and time as they were; after that, any write moves them.

A kept object's file stays mapped (read-only, shared), up to KEPT_MAPPED_BYTES in all: read
through a mapping made for one load, a 5.9 MB object costs its page faults and its unmapping
every time (the default model's 2,048-token prefix loaded at 0.60-0.72x a plain copy of the
same bytes); through a kept one, the pages are mapped already. The mapping is only read
behind the fault guard, and only while the file at the object's name is still that file,
of that size and time (a folder's object is looked at, lstat, on every load; the same inode,
size and time mean the very file checked, whatever path now leads to it): an object
replaced, removed or written since is opened afresh and checked in full. A removed object's disk space
comes back when its mapping is dropped (the least recently used first, or `forget`).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict

from ..chunk_source import ChunkSource

KEPT_OBJECTS = 4096
KEPT_AFTER_NS = 2_000_000_000
KEPT_MAPPED_BYTES = 2 << 30

_every: "weakref.WeakSet[KeptChecks]" = weakref.WeakSet()


class KeptChecks:
    """One folder store's kept objects: (file identity, name, model key, start) -> (the checked
    object's source, its payload's kept mapping or None), least recently used dropped first."""

    def __init__(self, max_objects: int = KEPT_OBJECTS, max_mapped_bytes: int = KEPT_MAPPED_BYTES,
                 after_ns: int = KEPT_AFTER_NS):
        self.max_objects = max_objects
        self.max_mapped_bytes = max_mapped_bytes
        self.after_ns = after_ns
        self.mapped_bytes = 0  # bytes of the kept mappings
        self._kept: "OrderedDict[tuple, tuple[ChunkSource, memoryview | None]]" = OrderedDict()
        self._lock = threading.Lock()
        _every.add(self)

    def __len__(self) -> int:
        return len(self._kept)

    def views(self) -> list[memoryview]:
        with self._lock:
            return [view for _, view in self._kept.values() if view is not None]

    def opened(self, data, key: tuple) -> ChunkSource | None:
        """The kept description of the object open in `data` (a `PreadFile`) under `key`: read from
        its kept mapping (`data` closed), or as a source that owns `data`'s descriptor; None when it
        is not kept."""
        with self._lock:
            entry = self._kept.get(key)
            if entry is None:
                return None
            self._kept.move_to_end(key)
        template, view = entry
        if view is not None:
            data.close()
            return template.mapped_as(view)
        fd, data.fd = data.fd, -1  # (the new source owns the descriptor now)
        return template.reopened(fd)

    def mapped(self, key: tuple) -> ChunkSource | None:
        """The object kept under `key` as a source read from its kept mapping, or None when it is
        not kept, or kept without a mapping."""
        with self._lock:
            entry = self._kept.get(key)
            if entry is None or entry[1] is None:
                return None
            self._kept.move_to_end(key)
        return entry[0].mapped_as(entry[1])

    def keep(self, key: tuple, source: ChunkSource, mtime_ns: int) -> ChunkSource:
        """`source` (a checked object's payload in its open file) kept for the next opening of the
        same file, mapped when that can be done; the source to load from now."""
        if time.time_ns() - mtime_ns < self.after_ns or not source.in_file:
            return source
        view = self._mapping(source)
        with self._lock:
            old = self._kept.pop(key, None)
            self.mapped_bytes -= 0 if old is None or old[1] is None else old[1].nbytes
            self._kept[key] = (source, view)
            self.mapped_bytes += 0 if view is None else view.nbytes
            while len(self._kept) > self.max_objects or (self.mapped_bytes > self.max_mapped_bytes
                                                          and len(self._kept) > 1):
                _, (_, dropped) = self._kept.popitem(last=False)
                self.mapped_bytes -= 0 if dropped is None else dropped.nbytes
        if view is None:
            return source
        fd, source.fd = source.fd, -1  # (the kept template holds no descriptor: each opening brings its own)
        os.close(fd)
        return source.mapped_as(view)

    def _mapping(self, source: ChunkSource) -> memoryview | None:
        """The payload of `source` (in its open file) as a read-only shared mapping of the file, or
        None where it cannot be mapped (the load reads it from the file then)."""
        if source.length == 0 or source.length > self.max_mapped_bytes:
            return None
        try:
            whole = mmap.mmap(source.fd, source.offset + source.length, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        except (OSError, ValueError, OverflowError):
            return None
        return memoryview(whole)[source.offset:source.offset + source.length]  # (the view keeps the mapping)

    def forget(self) -> None:
        """Drop every kept check and mapping (a removed object's disk space comes back)."""
        with self._lock:
            self._kept.clear()
            self.mapped_bytes = 0


def forget_all() -> None:
    """`forget` of every folder store's kept objects in this process."""
    for kept in list(_every):
        kept.forget()


__all__ = ["KeptChecks", "forget_all"]
