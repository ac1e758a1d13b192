"""Tiers: a fast backend in front of a slower one, write-through; a lookup walks them in order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .backend import Backend, ObjectInfo


class TieredBackend(Backend):
    """`tiers[0]` is the fastest (the memory tier), `tiers[-1]` the durable one. Puts go to
    every tier; a get that misses a tier and hits a lower one copies the object up."""

    reads_in_place = True  # (the durable tier's open, behind the memory tier's bytes)
    writes_in_batches = True

    def __init__(self, tiers: Sequence[Backend]):
        self.tiers = list(tiers)
        self.kept = self.tiers[-1].kept  # (a load opens the durable tier's files)
        self.url = " + ".join(t.url for t in self.tiers)

    @property
    def durable(self) -> Backend:
        return self.tiers[-1]

    def within(self, namespace: str) -> Backend:
        """The same upper tiers (names differ by namespace anyway) over the durable tier's view."""
        durable = self.durable.within(namespace)
        if durable is self.durable:
            return self
        views = self.__dict__.setdefault("_views", {})
        if namespace not in views:
            views[namespace] = TieredBackend([*self.tiers[:-1], durable])
        return views[namespace]

    def get(self, name: str) -> bytes | None:
        for i, tier in enumerate(self.tiers):
            data = tier.get(name)
            if data is not None:
                for upper in self.tiers[:i]:
                    upper.put(name, data)
                return data
        return None

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        found: list[bytes | None] = [None] * len(names)
        missing = list(range(len(names)))
        for i, tier in enumerate(self.tiers):
            if not missing:
                break
            got = tier.get_many([names[j] for j in missing])
            still = []
            for j, data in zip(missing, got):
                if data is None:
                    still.append(j)
                else:
                    found[j] = data
                    for upper in self.tiers[:i]:
                        upper.put(names[j], data)
            missing = still
        return found

    def open(self, name: str):
        """An upper tier's copy when it has one (a load copies it in one pass from memory). Else
        the durable tier's `open`: an object an upper tier can hold is read from it whole and
        copied up (promotion, as `get`: the next load comes from memory); one too large for every
        upper tier stays a file, read in place as it is copied."""
        uppers = self.tiers[:-1]
        for tier in uppers:
            data = tier.get(name)
            if data is not None:
                return data
        source = self.durable.open(name)
        size = getattr(source, "size", None)  # a file: promoted only where it fits
        if source is None or (size is not None and size > max(getattr(t, "max_bytes", 0) for t in uppers)):
            return source
        if size is not None:
            try:
                data = source.read(0, size)
            finally:
                source.close()
        else:
            data = source
        for tier in uppers:
            tier.put(name, bytes(data))
        return data

    def put(self, name: str, data: bytes, *, replace: bool = False) -> bool:
        created = self.durable.put(name, data, replace=replace)
        if created:  # else the durable tier holds another writer's object: never cache ours over it
            for tier in self.tiers[:-1]:
                tier.put(name, data, replace=replace)
        return created

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        created = self.durable.put_many(items)
        kept = [item for item, c in zip(items, created) if c]
        for tier in self.tiers[:-1]:
            tier.put_many(kept)
        return created

    def exists(self, name: str) -> bool:
        return any(t.exists(name) for t in self.tiers)

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        found = [False] * len(names)
        for tier in self.tiers:
            missing = [j for j, f in enumerate(found) if not f]
            if not missing:
                break
            for j, hit in zip(missing, tier.exists_many([names[j] for j in missing])):
                found[j] = hit
        return found

    def probe_many(self, names: Sequence[str]) -> list[tuple[int, bytes] | None]:
        found: list[tuple[int, bytes] | None] = [None] * len(names)
        for tier in self.tiers:
            missing = [j for j, f in enumerate(found) if f is None]
            if not missing:
                break
            for j, probe in zip(missing, tier.probe_many([names[j] for j in missing])):
                found[j] = probe
        return found

    def delete(self, name: str) -> bool:
        return any([t.delete(name) for t in self.tiers])  # a list: every tier forgets it

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.durable.scan(prefix)

    def children(self, prefix: str) -> set[str]:
        return self.durable.children(prefix)

    def evict(self, max_bytes: int) -> list[ObjectInfo]:
        """The durable tier's least recently used objects go, from every tier. A use is its
        latest in any tier: a get served by the memory tier never reaches the durable one."""
        used: dict[str, float] = {}
        for tier in self.tiers[:-1]:
            for info in tier.scan():
                used[info.name] = max(used.get(info.name, 0.0), info.last_used)
        objects = sorted(self.durable.scan(), key=lambda o: max(o.last_used, used.get(o.name, 0.0)))
        return self.evict_in_order(objects, max_bytes)  # self.delete: every tier forgets each

    def sweep(self) -> int:
        return sum(t.sweep() for t in self.tiers)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
