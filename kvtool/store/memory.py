"""The in-process memory tier: a bytes-capped LRU of objects, in front of a slower tier."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from .backend import PROBE_TAIL, Backend, ObjectInfo


class MemoryBackend(Backend):
    """Objects in this process's memory, least recently used dropped past `max_bytes`."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.url = f"memory://?max_bytes={max_bytes}"
        self.max_bytes = max_bytes
        self.bytes = 0
        self._objects: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> bytes | None:
        with self._lock:
            item = self._objects.get(name)
            if item is None:
                return None
            self._objects[name] = (item[0], time.time())
            self._objects.move_to_end(name)
            return item[0]

    def put(self, name: str, data: bytes, *, replace: bool = False) -> bool:
        data = bytes(data)
        if replace:
            self.delete(name)
        if len(data) > self.max_bytes:
            return False  # never cached: it would evict everything and still not fit
        evicted = []
        with self._lock:
            if name in self._objects:
                self._objects.move_to_end(name)
                return False
            self._objects[name] = (data, time.time())
            self.bytes += len(data)
            while self.bytes > self.max_bytes:
                gone, (old, _) = self._objects.popitem(last=False)
                self.bytes -= len(old)
                evicted.append(gone)
        if evicted:  # what named them goes too (store.md §4.6)
            from .pointers import entries_naming

            for entries in entries_naming(self, evicted).values():
                for entry in entries:
                    self.delete(entry)
        return True

    def exists(self, name: str) -> bool:
        return name in self._objects

    def probe_many(self, names: Sequence[str]) -> list[tuple[int, bytes] | None]:
        with self._lock:  # (not a use: the LRU order stays)
            items = [self._objects.get(name) for name in names]
        return [None if item is None else (len(item[0]), item[0][-PROBE_TAIL:]) for item in items]

    def delete(self, name: str) -> bool:
        with self._lock:
            item = self._objects.pop(name, None)
            if item is None:
                return False
            self.bytes -= len(item[0])
            return True

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._lock:
            items = [(n, len(d), t) for n, (d, t) in self._objects.items() if n.startswith(prefix)]
        for name, size, used in items:
            yield ObjectInfo(name, size, used)
