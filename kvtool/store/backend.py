"""What every backend of the chunk store does: named immutable objects (bytes), put once.

Backends know nothing of chunks: `kvtool.store.objects` names and checks the bytes, and the
store above decides. Every backend runs the same contract suite (tests/test_store_contract.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ObjectRefused, ObjectUnreadable

if TYPE_CHECKING:
    from ..format.reader import PreadFile

#: The bytes `probe_many` returns from an object's end: a container's trailer (container.md §2.2).
PROBE_TAIL = 32


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int  # bytes spent on it: the length (files, memory); Redis' MEMORY USAGE (a little more)
    last_used: float  # seconds since the epoch (the LRU clock); 0 where the backend cannot tell
    #: the namespace whose keys it was found among, where a backend keeps them apart (Redis: its
    #: key prefix); `backend.within(namespace)` reads and removes it. "" elsewhere.
    namespace: str = ""


class Backend(ABC):
    """Named objects. `put` is atomic and put-once: a reader sees the whole object or nothing,
    and a second put of a name already stored writes nothing (content addressing makes the two
    equal)."""

    url: str
    #: What callers may ask of a backend, declared (never told apart by comparing its methods):
    #: `open` gives an object as a file read in place (a folder's): a load opens each object on the
    #: worker that loads it, and never fetches a batch of bytes
    reads_in_place: bool = False
    #: `put_many` is one round trip (a network backend): puts go in batches, a refusal then alone
    writes_in_batches: bool = False
    #: checked objects kept between loads, while their names hold those very files (`file_state`:
    #: device, inode, size, time): a folder's own (`kept.KeptChecks`); None where nothing is kept
    kept = None

    @abstractmethod
    def get(self, name: str) -> bytes | memoryview | None:
        """The object's bytes, or None when it is not stored. Counts as a use (LRU). A backend
        that reads into a fresh buffer returns it as a writable memoryview the caller owns (a
        raw chunk then decodes without a copy); `bytes(...)` of it when bytes are needed."""

    def open(self, name: str) -> "bytes | memoryview | PreadFile | None":
        """The object for a load, or None when it is not stored; counts as a use (LRU). Its bytes
        (what `get` returns), or, from a backend with files, the object as an open file whose
        header, trailer and manifest are read with pread (the reader owns it) and whose raw
        payload the native scatter reads as it copies it (mapped behind a fault guard, or a
        window at a time), instead of reading it whole first. Every backend, tiers included,
        answers it: the fast path is never lost behind a memory tier."""
        return self.get(name)

    def file_state(self, name: str) -> tuple[tuple[int, int, int, int], int] | None:
        """Which file `name` holds now, for a backend that keeps checked files (`kept`); None elsewhere."""
        return None

    def within(self, namespace: str) -> "Backend":
        """The backend as requests of `namespace` see it. A chunk's name already holds its
        namespace (in its hash), so by default that is this backend; Redis also puts the namespace
        in the key, where its ACL key patterns can confine a tenant's user to its own chunks."""
        return self

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """`get` of each name; backends with a network batch them into one round trip."""
        return [self.get(n) for n in names]

    @abstractmethod
    def put(self, name: str, data: bytes, *, replace: bool = False) -> bool:
        """Store `data` under `name`; False when the name was already stored (nothing written).
        `replace=True` swaps the object atomically instead (the key/value buffer's `put`)."""

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        return [self.put(n, d) for n, d in items]

    def probe_many(self, names: Sequence[str]) -> list[tuple[int, bytes | None] | None]:
        """For each name, None when no object is stored there, else (its length, its last
        PROBE_TAIL bytes, or None where this user may not read them): what a lookup checks of a container (its size and trailer, store.md §7)
        without reading it. Not a use where the backend can tell (no LRU clock is touched on a
        folder or in memory). Backends answer it in one round trip; this default reads each."""
        found: list[tuple[int, bytes] | None] = []
        for name in names:
            try:
                data = self.get(name)
            except (ObjectRefused, ObjectUnreadable):
                data = None
            found.append(None if data is None else (len(data), bytes(data[-PROBE_TAIL:])))
        return found

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether `name` is stored (without reading it, and without counting as a use)."""

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        return [self.exists(n) for n in names]

    @abstractmethod
    def delete(self, name: str) -> bool:
        """Remove `name`; False when it was not stored."""

    @abstractmethod
    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every stored object whose name starts with `prefix`, in no particular order."""

    def children(self, prefix: str) -> set[str]:
        """The next name parts under `prefix` (which ends with "/"): e.g. the chunk sizes stored
        for a model under "chunks/<model key>/". From `scan` here; a folder lists one directory."""
        return {info.name[len(prefix):].split("/", 1)[0] for info in self.scan(prefix)}

    def evict(self, max_bytes: int) -> list[ObjectInfo]:
        """Remove least recently used objects until at most `max_bytes` are stored; the removed."""
        return self.evict_in_order(sorted(self.scan(), key=lambda o: o.last_used), max_bytes)

    def remove(self, names: Sequence[str]) -> tuple[list[str], list[str]]:
        """Delete `names` (of this view's namespace) and every block index entry that names one of
        them (store.md §4.6: a removal never leaves a pointer to nothing, which a lookup would
        promise): (the names removed, the entries removed with them)."""
        from .pointers import remove_with_entries

        return remove_with_entries(self, names)

    def evict_in_order(self, objects: list[ObjectInfo], max_bytes: int) -> list[ObjectInfo]:
        """Delete `objects` (oldest first) until the rest weigh at most `max_bytes`, then the block
        index entries naming what went; the removed (those entries included)."""
        from .pointers import entries_naming

        total = sum(o.size for o in objects)
        removed = []
        for info in objects:
            if total <= max_bytes:
                break
            if self.within(info.namespace).delete(info.name):
                removed.append(info)
            total -= info.size
        gone = {(info.namespace, info.name) for info in removed}
        by_namespace: dict[str, list[str]] = {}
        for namespace, name in gone:
            by_namespace.setdefault(namespace, []).append(name)
        for namespace, names in by_namespace.items():
            for entry_namespace, entries in entries_naming(self.within(namespace), names).items():
                view = self.within(entry_namespace)
                removed += [ObjectInfo(name, 0, 0.0, entry_namespace) for name in entries
                            if (entry_namespace, name) not in gone and view.delete(name)]
        return removed

    def sweep(self) -> int:
        """Remove what a killed writer left behind (temp files); how many. Nothing by default."""
        return 0

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
