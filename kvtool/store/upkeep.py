"""Keeping a store: what it holds (`inventory`), a size cap (`gc`), and finding and removing
damaged or foreign objects (`fsck`). Every check is §5 of format-spec/store.md, from the
objects alone: no index is trusted, so any index can be rebuilt from what `fsck` passes."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..errors import (InputFileError, KvtoolError, ObjectRefused, ObjectUnreadable, StoreError, StoreUnavailable,
                      UsageError)
from ..format.reader import PreadFile
from . import objects
from .backend import ObjectInfo
from .chunk_store import ChunkStore
from .pointers import dangling_entries


@dataclass
class Inventory:
    objects: int
    bytes: int
    by_kind: dict[str, int]
    # model key -> {"chunks": n, "bytes": b, "chunk_sizes": [..]}
    models: dict[str, dict] = field(default_factory=dict)
    foreign: int = 0  # names that are not store objects


def printable(name: str) -> str:
    """A name as messages show it: the bytes of a name that is not UTF-8 (a Redis key, a file
    name) as \\x escapes, so that printing it never fails."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def describe(info: ObjectInfo) -> dict:
    """What an object's name says: kind, model key, chunk size, prefix hash."""
    parsed = objects.parse_name(info.name)
    row = {"name": printable(info.name), "bytes": info.size, "last_used": info.last_used, "kind": "foreign"}
    if info.namespace:
        row["namespace"] = printable(info.namespace)
    if parsed is None:
        return row
    kind, m = parsed
    row["kind"] = kind
    if kind in ("chunk", "piece", "block"):
        row.update(model=m.group(1), chunk_size=int(m.group(2)), prefix_hash=m.group(4))
    elif kind == "entry":
        row.update(model=m.group(1), key=m.group(2))
    elif kind == "calibration":
        row.update(digest=m.group(2))
    return row


#: the fewest characters of a short id (git's default abbreviation is 7; objects number far more)
SHORT_ID_MIN = 10


def object_stem(name: str) -> str:
    """The part of a name that tells an object apart: its last path component, without suffix
    (a chunk's prefix hash)."""
    return name.rsplit("/", 1)[-1].split(".", 1)[0]


def short_ids(names: list[str], minimum: int = SHORT_ID_MIN) -> dict[str, str]:
    """{name: the shortest start of its stem, at least `minimum` characters, that no other name's
    stem starts with} (as git abbreviates commits). Names whose stems are equal keep their whole
    name as id."""
    stems = sorted({object_stem(n) for n in names})
    need: dict[str, int] = {}
    for i, stem in enumerate(stems):
        common = max(_common_start(stem, stems[i - 1]) if i else 0,
                     _common_start(stem, stems[i + 1]) if i + 1 < len(stems) else 0)
        need[stem] = min(len(stem), max(minimum, common + 1))
    count = Counter(object_stem(n) for n in names)
    return {n: (n if count[object_stem(n)] > 1 else object_stem(n)[:need[object_stem(n)]]) for n in names}


def _common_start(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def resolve_names(given: list[str], infos: list[ObjectInfo]) -> list[ObjectInfo]:
    """The objects `given` names: each a whole name, or the start of one object's stem (a short id
    from `store ls`); a start that several objects share is refused, naming how many."""
    by_name = {o.name: o for o in infos}
    chosen: dict[str, ObjectInfo] = {}
    for name in given:
        if name in by_name:
            chosen[name] = by_name[name]
            continue
        matches = [o for o in infos if object_stem(o.name).startswith(name)] if len(name) >= 4 else []
        if len(matches) > 1:
            raise UsageError(f"{printable(name)} is the start of {len(matches)} objects' names: give more of it "
                             "(store ls --wide shows whole names)")
        if not matches:
            raise UsageError(f"no object {printable(name)} in the store (a name or id as store ls shows it)")
        chosen[matches[0].name] = matches[0]
    return list(chosen.values())


def model_names(store: ChunkStore, rows: list[dict]) -> dict[str, str]:
    """The model's name (as its objects' manifests record it) for each model key among `rows`
    (`describe`'s): one object's header and manifest read per key, not every object. A key whose
    object cannot be read or checked keeps no name (shown as the key)."""
    names: dict[str, str] = {}
    for row in rows:
        key = row.get("model")
        if not key or key in names or row["kind"] != "chunk":
            continue
        try:
            data = store.backend.within(row.get("namespace", "")).open(row["name"])
            if data is None:
                continue
            reader = objects.open_object(data, row["name"])
            try:
                name = reader.manifest.model.get("name")
            finally:
                reader.close()
        except KvtoolError:
            continue
        if isinstance(name, str) and name:
            names[key] = printable(name)
    return names


def in_namespace(store: ChunkStore, info: ObjectInfo, namespace: str) -> bool:
    """Whether an object belongs to `namespace`: found among its keys (Redis, §6.2), or a chunk or
    piece whose object records it (`store.extra.namespace`; a folder keeps every namespace's objects
    side by side). A block index entry goes with what it names (`Backend.remove`)."""
    if info.namespace:
        return info.namespace == namespace
    parsed = objects.parse_name(info.name)
    if parsed is None or parsed[0] not in ("chunk", "piece"):
        return False
    try:
        data = store.backend.open(info.name)
        if data is None:
            return False
        obj = objects.check_chunk(data, info.name, verify_payload=False, kind=parsed[0])
    except KvtoolError:  # damaged: not known to be the namespace's (fsck's)
        return False
    try:
        return obj.extra.get("namespace") == namespace
    finally:
        obj.reader.close()


def inventory(store: ChunkStore) -> Inventory:
    kinds: Counter = Counter()
    # per model: its objects of every kind ("chunks" counts the chunks alone, as its name says)
    models: dict[str, dict] = defaultdict(lambda: {"objects": 0, "chunks": 0, "by_kind": Counter(), "bytes": 0,
                                                   "chunk_sizes": set()})
    total = count = 0
    for info in store.backend.scan():
        row = describe(info)
        kinds[row["kind"]] += 1
        count += 1
        total += info.size
        if row["kind"] in ("chunk", "piece", "block"):
            entry = models[row["model"]]
            entry["objects"] += 1
            entry["chunks"] += row["kind"] == "chunk"
            entry["by_kind"][row["kind"]] += 1
            entry["bytes"] += info.size
            entry["chunk_sizes"].add(row["chunk_size"])
    return Inventory(objects=count, bytes=total, by_kind=dict(kinds), foreign=kinds.get("foreign", 0),
                     models={k: {**v, "by_kind": dict(v["by_kind"]), "chunk_sizes": sorted(v["chunk_sizes"])}
                             for k, v in models.items()})


@dataclass
class GcReport:
    removed: int
    removed_bytes: int
    temps_removed: int
    remaining_bytes: int


def gc(store: ChunkStore, max_bytes: int) -> GcReport:
    """Evict least recently used objects until at most `max_bytes` remain; sweep temp files."""
    temps = store.backend.sweep()
    removed = store.backend.evict(max_bytes)
    remaining = sum(o.size for o in store.backend.scan())
    return GcReport(removed=len(removed), removed_bytes=sum(o.size for o in removed), temps_removed=temps,
                    remaining_bytes=remaining)


class NamesDamage(ObjectRefused):
    """A block index entry that is itself intact but names a damaged object: it goes with that
    object, and is counted as a pointer removed, not as a second damaged object."""


@dataclass
class FsckReport:
    checked: int
    intact: int
    damaged: list[dict]  # {"name", "reason"}: each damaged, foreign or stale object once
    removed: int  # of those
    temps_removed: int
    entries_removed: int = 0  # intact block index entries removed because the object they named went


def check_block_entry(store: ChunkStore | None, name: str, data, namespace: str = "") -> None:
    """A block index entry (store.md §4.6) checks when it parses, and the object it names (read
    from `store`) is there and begins with the tokens its name hashes: the same parent, those
    tokens, their extra keys. One whose object is gone is stale (removed like a damaged one: it
    would only send lookups to a miss)."""
    if isinstance(data, PreadFile):
        data = _whole(data)
    tokens, target = objects.check_block_entry(data, name)
    if store is None:
        return
    kind = objects.parse_name(target)[0]
    held = store.backend.within(namespace).open(target)  # (an entry names objects of its own namespace)
    if held is None:
        raise ObjectRefused(f"{name}: stale: the object it names ({target}) is not stored")
    try:
        obj = objects.check_chunk(held, target, verify_payload=False, kind=kind)
    except ObjectRefused as err:  # the damage is the target's, reported once, as the target
        raise NamesDamage(str(err)) from None
    try:
        part = obj.tokens[:tokens]
        extra = objects.restrict_extra(obj.extra, obj.start, obj.start + tokens)
        if len(part) < tokens or objects.link_hash(bytes.fromhex(obj.parent_hash), part, extra).hex() != \
                objects.parse_name(name)[1].group(4):
            raise ObjectRefused(f"{name}: the object it names ({target}) does not begin with the tokens it hashes")
    finally:
        obj.reader.close()


def check_object(name: str, data, store: ChunkStore | None = None, namespace: str = "") -> None:
    """§5's checks of one object by its name alone (its bytes, or its open file: the header and
    manifest are checked before a payload is read, so memory stays within what they declare);
    raises ObjectRefused. `namespace`: found among that namespace's keys (Redis, §6.2), where only
    chunks, pieces and block entries of that namespace are ever written."""
    if data is None:
        raise ObjectRefused(f"{name}: vanished while being checked")
    parsed = objects.parse_name(name)
    if parsed is None:
        raise ObjectRefused(f"{name}: not a store object's name")
    kind = parsed[0]
    if namespace and kind not in ("chunk", "piece", "block"):
        raise ObjectRefused(f"{name}: a {kind} among namespace {printable(namespace)!r}'s keys (only chunks, pieces "
                            "and block entries are)")
    if kind == "block":
        return check_block_entry(store, name, data, namespace)
    if kind in ("chunk", "piece"):
        obj = objects.check_chunk(data, name, kind=kind)
        try:
            if namespace and obj.extra.get("namespace") != namespace:
                raise ObjectRefused(f"{name}: a chunk of another namespace than {printable(namespace)!r} "
                                    "among its keys")
            obj.decode()  # the payload decodes to the declared shape, every value finite
            if obj.reader.nonzero_padding():  # what `verify` refuses, fsck removes (never loaded: not KV)
                raise ObjectRefused(f"{name}: non-zero bytes in its padding (container.md §2.3)")
        except (ObjectRefused, ObjectUnreadable):  # (the latter: a pca chunk whose calibration is not here: kept)
            raise
        except KvtoolError as err:
            raise ObjectRefused(f"{name}: {err}") from None
        finally:
            obj.reader.close()
    elif kind == "entry":
        objects.check_entry(data, name).close()
    elif kind == "calibration":
        check_calibration(data if not isinstance(data, PreadFile) else _whole(data), name, parsed[1].group(2))
    else:
        objects.check_tensor(data if not isinstance(data, PreadFile) else _whole(data), name)


def check_calibration(data, name: str, digest: str) -> None:
    """A pca calibration object (store.md §4.7): its bytes hash to its name's digest and parse."""
    from .calibrations import check

    check(bytes(data), name, digest)


def _whole(source: PreadFile) -> bytes:
    try:
        return source.read(0, source.size)
    finally:
        source.close()


def fsck(store: ChunkStore, *, repair: bool = True) -> FsckReport:
    """Check every object; with `repair`, remove those that fail (and temp files of dead writers).
    One object that cannot be read or removed is reported, and the sweep goes on to the next; only
    a store that cannot be reached at all ends it."""
    temps = store.backend.sweep() if repair else 0
    damaged, doomed, checked, pointers = [], [], 0, 0
    for info in list(store.backend.scan()):
        checked += 1
        shown = printable(info.name)
        try:
            if objects.parse_name(info.name) is None:  # a foreign file: never read as an object
                raise ObjectRefused(f"{shown}: not a store object's name")
            check_object(info.name, store.backend.within(info.namespace).open(info.name), store, info.namespace)
        except StoreUnavailable:
            raise
        except NamesDamage:  # removed below with the object it names (if that is removed)
            pointers += 1
        except (ObjectUnreadable, InputFileError) as err:  # nothing known of its bytes: reported, kept
            damaged.append({"name": shown, "reason": f"{err}; left in place (it cannot be read here)", "kept": True})
        except (ObjectRefused, StoreError) as err:
            damaged.append({"name": shown, "reason": printable(str(err))})
            doomed.append((info, damaged[-1]))
    removed = sum(_remove(store, info, d) for info, d in doomed) if repair else 0
    entries_removed = 0
    if repair:  # the entries that named what went (or what an earlier version or a server's eviction removed)
        reported = {(info.namespace, info.name) for info, _ in doomed}
        went = {(info.namespace, info.name) for info, d in doomed if "not removed" not in d["reason"]}
        for namespace, name, target in dangling_entries(store.backend):
            if (namespace, name) in reported:
                continue
            if (namespace, target) in went:  # an intact pointer to what was just removed: counted apart
                entries_removed += int(store.backend.within(namespace).delete(name))
                continue
            row = {"name": printable(name), "reason": f"{printable(name)}: stale: the object it names is not stored"}
            damaged.append(row)
            removed += _remove(store, ObjectInfo(name, 0, 0.0, namespace), row)
    return FsckReport(checked=checked, intact=max(0, checked - len(damaged) - pointers),
                      damaged=damaged, removed=removed, temps_removed=temps, entries_removed=entries_removed)


def _remove(store: ChunkStore, info: ObjectInfo, damaged: dict) -> bool:
    """Remove one damaged entry; one that cannot be removed says why in its reason."""
    try:
        return store.backend.within(info.namespace).delete(info.name)
    except StoreUnavailable:
        raise
    except StoreError as err:
        damaged["reason"] += f"; not removed: {err}"
        return False
