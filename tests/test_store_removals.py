"""Every removal removes what points to it (format-spec/store.md §4.6, §7): `store rm` (by name, by
model, by namespace), `fsck`, `gc`, eviction under a size cap, and a load that refuses an object or
finds it gone. After each, no block index entry names an object that is not stored, so a lookup
never promises tokens that cannot load. On every backend of the contract."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtool.ops import store as store_ops
from kvtool.store import open_store, upkeep
from kvtool.store.names import ExtraKeys, parse_name
from kvtool.store.pointers import dangling_entries

from fixtures import flip_byte, make_identity, make_kv
from test_store_contract import open_kind, store  # noqa: F401  (the contract's backends)

CHUNK, BLOCK = 16, 4
IDENTITY = make_identity(num_layers=2, num_kv_heads=2, head_dim=8)


def ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, n)]


def filled(store, keys: ExtraKeys = ExtraKeys(), seed: int = 0):  # noqa: F811
    """A 45-token sequence: 2 whole chunks (3 block entries each), a piece of 12 (2 entries)."""
    cache = store.for_model(IDENTITY, CHUNK, keys, BLOCK)
    tokens = ids(45, seed)
    cache.put_sequence(tokens, make_kv(IDENTITY, 45, seed=seed))
    return cache, tokens


def kinds(store) -> list[str]:  # noqa: F811
    return sorted(parse_name(i.name)[0] for i in store.backend.scan())


def url_of(store, request, tmp_path) -> str:  # noqa: F811
    """The URL the contract's fixture opened `store` with (its `url` hides a password)."""
    fixture = {"rediss": "rediss_url", "redis-cluster": "redis_cluster_url", "redis": "redis_url"}.get(store.kind)
    return request.getfixturevalue(fixture) if fixture else str(tmp_path / "store")


def test_rm_by_name_removes_the_entries_that_name_it(store, request, tmp_path):  # noqa: F811
    if store.kind.startswith("memory") or store.kind.startswith("tiered"):
        pytest.skip("`store rm` opens a store by URL: a memory store lives in its process")
    cache, tokens = filled(store)
    second = cache.chunk_names(tokens)[1]
    assert cache.lookup(tokens) == 44
    result = store_ops.rm(url_of(store, request, tmp_path), [second])
    assert result.removed == 1 + 3 and result.block_entries == 3  # the chunk, and its 3 entries
    assert dangling_entries(store.backend) == []
    assert cache.lookup(tokens) == 16  # the first chunk: nothing promised past the hole


def test_rm_of_a_namespace_removes_its_objects_and_their_entries(store, request, tmp_path):  # noqa: F811
    if store.kind.startswith("memory") or store.kind.startswith("tiered"):
        pytest.skip("`store rm` opens a store by URL: a memory store lives in its process")
    team, other = ExtraKeys(namespace="team-a"), ExtraKeys(namespace="team-b")
    cache_a, tokens = filled(store, team)
    cache_b, _ = filled(store, other)
    before = len(list(store.backend.scan()))
    result = store_ops.rm(url_of(store, request, tmp_path), namespace="team-a")
    assert result.removed == before // 2  # 2 chunks, a piece, 8 entries: all of team-a's
    assert cache_a.lookup(tokens) == 0 and cache_b.lookup(tokens) == 44  # team-b's untouched
    assert dangling_entries(store.backend) == []


def test_fsck_removes_a_damaged_chunk_with_its_entries_counted_once(store):  # noqa: F811
    cache, tokens = filled(store)
    names = cache.chunk_names(tokens)
    for name in names:  # both whole chunks damaged: 2 files, each reported once
        data = bytes(cache.backend.get(name))
        cache.backend.put(name, flip_byte(data, len(data) * 2 // 3), replace=True)
    report = upkeep.fsck(store)
    assert sorted(d["name"] for d in report.damaged) == sorted(names)
    assert report.removed == 2 and report.entries_removed == 6  # 3 entries named each
    assert report.intact == report.checked - 2 - 6  # the entries named damage: neither damaged nor intact
    assert dangling_entries(store.backend) == []
    assert kinds(store) == ["block", "block", "piece"]  # the piece and its own 2 entries
    assert cache.lookup(tokens) == 0


def test_gc_removes_the_entries_of_what_it_evicts(store):  # noqa: F811
    cache, tokens = filled(store)
    cache_2, tokens_2 = filled(store, seed=1)
    total = sum(i.size for i in store.backend.scan())
    upkeep.gc(store, total // 3)
    assert dangling_entries(store.backend) == []
    for c, t in ((cache, tokens), (cache_2, tokens_2)):
        found = c.lookup(t)
        assert c.get_prefix(t).num_tokens == found  # promised is what loads


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_eviction_under_a_cap_removes_the_entries_of_what_it_evicts(tmp_path, kind):
    """A folder store capped by `max_bytes` (evicting as it writes), and a memory store (its LRU)."""
    one = open_store("memory://").for_model(IDENTITY, CHUNK, block_size=BLOCK)
    one.put_sequence(ids(45), make_kv(IDENTITY, 45))
    size = sum(i.size for i in one.store.backend.scan())
    url = str(tmp_path / "store") if kind == "local" else "memory://"
    store = open_store(url, max_bytes=int(size * 2.5))  # noqa: F811
    for seed in range(6):
        cache = store.for_model(IDENTITY, CHUNK, block_size=BLOCK)
        cache.put_sequence(ids(45, seed), make_kv(IDENTITY, 45, seed=seed))
        assert dangling_entries(store.backend) == []
    assert sum(i.size for i in store.backend.scan()) <= size * 2.5


def test_a_load_that_refuses_a_chunk_removes_it_and_its_entries(store):  # noqa: F811
    cache, tokens = filled(store)
    second = cache.chunk_names(tokens)[1]
    data = bytes(cache.backend.get(second))
    cache.backend.put(second, flip_byte(data, len(data) * 2 // 3), replace=True)
    hit = cache.get_prefix(tokens)
    assert hit.num_tokens == 16 and len(hit.refused) == 1
    assert second in hit.healed and len(hit.healed) == 4  # the chunk and its 3 entries
    assert dangling_entries(store.backend) == [] and cache.lookup(tokens) == 16
    cache.put_sequence(tokens, make_kv(IDENTITY, 45))  # the next writer stores it again
    assert cache.lookup(tokens) == 44 and cache.get_prefix(tokens).num_tokens == 44


def test_a_load_that_finds_a_chunk_gone_removes_its_entries(store):  # noqa: F811
    """Removed between the lookup and the load (by another process, or a server's eviction)."""
    cache, tokens = filled(store)
    second = cache.chunk_names(tokens)[1]
    found = cache.find(tokens)
    assert found.run == 2
    store.backend.delete(second)  # behind the store's back: its entries dangle
    prompt = tokens[:16] + tokens[16:24] + [50_001] * 4  # 8 tokens into the second chunk: its entry
    assert cache.get_prefix(prompt).num_tokens == 16  # the entry named a missing object: removed
    assert cache.get_prefix(tokens).num_tokens == 16
    assert dangling_entries(store.backend) == []


def test_fsck_removes_entries_an_older_version_left_dangling(store):  # noqa: F811
    cache, tokens = filled(store)
    store.backend.delete(cache.chunk_names(tokens)[0])  # as `store rm` did before: entries left behind
    assert len(dangling_entries(store.backend)) == 3
    report = upkeep.fsck(store)
    assert len(report.damaged) == 3 and all("stale" in d["reason"] for d in report.damaged)
    assert report.removed == 3 and dangling_entries(store.backend) == []


def test_rm_cli_says_what_went(tmp_path, capsys):
    from kvtool.cli.app import run

    store = open_store(tmp_path / "store")  # noqa: F811
    cache, tokens = filled(store)
    name = cache.chunk_names(tokens)[0]
    assert run(["store", "rm", name, "--store", str(tmp_path / "store")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (rich wraps at the terminal's width)
    assert "removed 4 objects" in out and "3 of them block index entries" in out
    assert not os.path.exists(tmp_path / "store" / name)


@pytest.mark.parametrize("damage", ["cut", "grown"])
def test_a_lookup_never_promises_a_chunk_cut_short_or_grown(store, damage):  # noqa: F811
    """The lookup an engine's scheduler makes (store.md §7) reads each whole chunk's length and
    trailer in its one batch: a chunk cut short, or with bytes appended, is not promised (and is
    removed with its entries), so the engine's load never meets it."""
    cache, tokens = filled(store)
    second = cache.chunk_names(tokens)[1]
    data = bytes(cache.backend.get(second))
    cache.backend.put(second, data[:len(data) - 40] if damage == "cut" else data + b"\0" * 8, replace=True)
    assert cache.lookup(tokens) == 16 + 0  # the first chunk; nothing past the bad one
    assert not cache.backend.exists(second) and dangling_entries(store.backend) == []
    assert store.counters.refused == 1
