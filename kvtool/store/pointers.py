"""What points at an object (store.md §4.6): a block index entry names the chunk or piece whose first
tokens it hashes. An entry whose object is gone would make a lookup promise tokens that cannot
load, so every removal (`rm`, `fsck`, `gc`, eviction, a load that refused the object) removes the
entries naming what it removed, and `fsck` removes entries left dangling by earlier versions or by
a server's own eviction (Redis' maxmemory)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from ..errors import ObjectRefused, ObjectUnreadable
from .names import parse_name

#: A store backend (`backend.Backend`; not imported: the backend imports this module).
Backend = Any

#: Entries read per round trip while looking for those that name removed objects.
READ_BATCH = 256


def entry_folder(name: str) -> str | None:
    """The folder of the block index entries that may name the chunk or piece `name`: entries
    name objects of their own model and chunk size only (§4.6). None for any other object."""
    parsed = parse_name(name)
    if parsed is None or parsed[0] not in ("chunk", "piece"):
        return None
    m = parsed[1]
    return f"chunks/{m.group(1)}/{m.group(2)}/blocks/"


def entry_target(data, name: str) -> str | None:
    """The object a block index entry names; None when its bytes are not an entry (fsck's to remove)."""
    from .objects import check_block_entry

    if data is None:
        return None
    try:
        return check_block_entry(data, name)[1]
    except ObjectRefused:
        return None


def _read(view: Backend, names: list[str]) -> list:
    """The bytes at each name (None: not there, or not an object a backend will read: a link, a
    folder, a Redis key of another type), one batch where the backend allows."""
    try:
        return view.get_many(names)
    except (ObjectRefused, ObjectUnreadable):
        pass
    found = []
    for name in names:
        try:
            found.append(view.get(name))
        except (ObjectRefused, ObjectUnreadable):
            found.append(None)
    return found


def entries_naming(backend: Backend, targets: Iterable[str]) -> dict[str, list[str]]:
    """The block index entries that name one of `targets`, by namespace: one scan of each entry
    folder concerned (a model at a chunk size), read in batches. `backend` sees what it lists:
    the store itself lists every namespace's entries (an entry names objects of its own namespace)."""
    by_folder: dict[str, set[str]] = defaultdict(set)
    for target in targets:
        folder = entry_folder(target)
        if folder is not None:
            by_folder[folder].add(target)
    found: dict[str, list[str]] = defaultdict(list)
    for folder, wanted in by_folder.items():
        by_namespace: dict[str, list[str]] = defaultdict(list)
        for info in backend.scan(folder):
            parsed = parse_name(info.name)
            if parsed is not None and parsed[0] == "block":
                by_namespace[info.namespace].append(info.name)
        for namespace, names in by_namespace.items():
            view = backend.within(namespace)
            for first in range(0, len(names), READ_BATCH):
                batch = names[first:first + READ_BATCH]
                for name, data in zip(batch, _read(view, batch)):
                    if entry_target(data, name) in wanted:
                        found[namespace].append(name)
    return dict(found)


def remove_with_entries(backend: Backend, names: Iterable[str]) -> tuple[list[str], list[str]]:
    """Delete `names` (of `backend`'s own namespace) and every block index entry naming one of them:
    (the names removed, the entries removed with them)."""
    removed = [name for name in names if backend.delete(name)]
    entries = []
    for namespace, found in entries_naming(backend, removed).items():
        view = backend.within(namespace)
        entries += [name for name in found if view.delete(name)]
    return removed, entries


def dangling_entries(backend: Backend, prefix: str = "chunks/") -> list[tuple[str, str, str]]:
    """(namespace, name, target) of each block index entry under `prefix` whose object (`target`)
    is not stored: what a removal by an earlier version, or by a Redis server's own eviction, left."""
    by_namespace: dict[str, list[str]] = defaultdict(list)
    for info in backend.scan(prefix):
        parsed = parse_name(info.name)
        if parsed is not None and parsed[0] == "block":
            by_namespace[info.namespace].append(info.name)
    dangling = []
    for namespace, names in by_namespace.items():
        view = backend.within(namespace)
        for first in range(0, len(names), READ_BATCH):
            batch = names[first:first + READ_BATCH]
            pairs = [(name, entry_target(data, name)) for name, data in zip(batch, _read(view, batch))]
            pairs = [(name, target) for name, target in pairs if target is not None]  # (not entries: fsck's own check)
            present = view.exists_many([target for _, target in pairs]) if pairs else []
            dangling += [(namespace, name, target) for (name, target), there in zip(pairs, present) if not there]
    return dangling


__all__ = ["dangling_entries", "entries_naming", "entry_folder", "entry_target", "remove_with_entries"]
