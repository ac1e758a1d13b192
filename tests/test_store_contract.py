"""The chunk store's contract, one suite run on every backend: a local folder, a real Redis
server, memory://, and a memory tier in front of the local folder and of Redis.

- the backends' own contract (kvtool/store/backend.py): put once, replace, get, exists,
  delete, scan by prefix, get_many's order, evict keeping the most recently used;
- the prefix API (ModelCache): exact tensors back, codecs, shared prefixes, dedup, partial
  last chunk, model identity and chunk size in the key;
- hostile objects: bad bytes written under a real chunk's name are never returned; the prefix
  stops before them and `counters.refused` grows;
- the local store: a restart in a new process keeps every object, `max_bytes` evicts the least
  recently used, a folder that is not a store is refused; an unreachable Redis is one line, fast. Redis Cluster's own (one
  round trip per node, scans over every primary) is in test_store_cluster.py.

Stress (processes, kill -9, a Redis restart) is in test_store_stress.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvtool.codecs.cachegen import cachegen_reference_roundtrip
from kvtool.errors import NotAStore, StoreUnavailable, UsageError
from kvtool.store import ChunkStore, open_store
from kvtool.store.objects import MAX_OBJECT_BYTES, check_chunk, chunk_name, model_key

from fixtures import (
    MAGIC,
    TRAILER_FMT,
    TRAILER_SIZE,
    flip_byte,
    make_identity,
    make_kv,
    rebuild,
    ref_prefix_hashes,
    same_tensor,
    split_file,
    write_kv_file,
)

CHUNK = 4
IDENTITY = make_identity(num_layers=2, num_kv_heads=2, head_dim=8)
# rediss: TLS only, an ACL user; redis-cluster: 3 masters with a replica each (redis+cluster://)
BACKENDS = ["local", "redis", "rediss", "redis-cluster", "memory", "tiered-local", "tiered-redis"]


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 50_000, n)]


def open_kind(kind: str, request, tmp_path, **kw) -> ChunkStore:
    if kind == "rediss":
        url = request.getfixturevalue("rediss_url")
    elif kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster_url")
    elif "redis" in kind:
        url = request.getfixturevalue("redis_url")
    elif "local" in kind:
        url = str(tmp_path / "store")
    else:
        url = "memory://"
    return open_store(url, memory_bytes=(1 << 20) if kind.startswith("tiered") else 0, **kw)


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    s = open_kind(request.param, request, tmp_path)
    s.kind = request.param
    yield s
    s.close()


def cache_of(store: ChunkStore, identity=IDENTITY, chunk_size: int = CHUNK):
    return store.for_model(identity, chunk_size)


def chunk_names(cache, tokens) -> list[str]:
    """The names of `tokens`' whole chunks, from the spec's hash chain (re-implemented in fixtures)."""
    whole = len(tokens) // cache.chunk_size * cache.chunk_size
    return [cache.name(h) for h in ref_prefix_hashes(tokens[:whole], cache.chunk_size)]


def assert_prefix(hit, kv: torch.Tensor, num_tokens: int) -> None:
    """`hit` holds exactly the first `num_tokens` tokens of `kv`, bit for bit."""
    assert hit.num_tokens == num_tokens
    assert len(hit.chunks) == num_tokens // CHUNK
    for i, chunk in enumerate(hit.chunks):
        assert same_tensor(chunk, kv[:, :, i * CHUNK:(i + 1) * CHUNK]), f"chunk {i} differs"


def name_for(i: int) -> str:
    """A well-formed chunk object name (the backends are given real-looking names)."""
    digest = hashlib.sha256(f"object {i}".encode()).hexdigest()
    return chunk_name("0" * 32, CHUNK, digest)


# --- the backends' contract ----------------------------------------------------------------


def test_put_is_put_once(store):
    b = store.backend
    name = name_for(1)
    assert b.put(name, b"first") is True
    assert b.put(name, b"first") is False
    assert b.put(name, b"other bytes") is False  # nothing written: the first stays
    assert b.get(name) == b"first"
    assert b.put_many([(name, b"again"), (name_for(2), b"second")]) == [False, True]
    assert b.get(name) == b"first" and b.get(name_for(2)) == b"second"


def test_replace_swaps_the_object(store):
    b = store.backend
    name = name_for(1)
    assert b.put(name, b"old") is True
    assert b.put(name, b"new and longer", replace=True) is True
    assert b.get(name) == b"new and longer"
    assert b.put(name, b"x", replace=True) is True
    assert b.get(name) == b"x"
    assert [sized(store, o.size) for o in b.scan() if o.name == name] == [1]


def test_get_exists_delete(store):
    b = store.backend
    a, missing = name_for(1), name_for(2)
    data = bytes(range(256)) * 4  # every byte value, zeros included
    assert b.get(missing) is None and b.exists(missing) is False
    assert b.put(a, data)
    assert b.get(a) == data and b.exists(a) is True
    assert b.exists_many([missing, a, missing]) == [False, True, False]
    assert b.exists_many([]) == [] and b.get_many([]) == []
    assert b.delete(a) is True
    assert b.delete(a) is False
    assert b.get(a) is None and b.exists(a) is False and b.exists_many([a]) == [False]
    assert b.put(a, b"after delete") is True  # a deleted name can be stored again
    assert b.get(a) == b"after delete"


def test_get_many_keeps_the_order(store):
    b = store.backend
    names = [name_for(i) for i in range(20)]
    for i, n in enumerate(names):
        if i % 3:
            b.put(n, f"object {i}".encode() * (i + 1))
    got = b.get_many(list(reversed(names)))
    for n, data in zip(reversed(names), got):
        i = names.index(n)
        assert data == (f"object {i}".encode() * (i + 1) if i % 3 else None)


def test_scan_by_prefix(store):
    b = store.backend
    objects = {chunk_name("a" * 32, 4, "aa" + "0" * 62): b"1",
               chunk_name("a" * 32, 4, "ab" + "1" * 62): b"22",
               chunk_name("a" * 32, 8, "aa" + "2" * 62): b"333",
               chunk_name("b" * 32, 4, "aa" + "3" * 62): b"4444",
               "entries/" + "a" * 32 + "/" + "5" * 64 + ".kvc": b"55555",
               "tensors/66/" + "6" * 64 + ".safetensors": b"666666"}
    for n, d in objects.items():
        assert b.put(n, d)

    def scanned(prefix=""):
        return {o.name: sized(store, o.size, len(objects[o.name])) for o in b.scan(prefix)}

    assert scanned() == {n: len(d) for n, d in objects.items()}
    assert scanned("chunks/") == {n: len(d) for n, d in objects.items() if n.startswith("chunks/")}
    assert set(scanned(f"chunks/{'a' * 32}/")) == {n for n in objects if n.startswith(f"chunks/{'a' * 32}/")}
    assert set(scanned(f"chunks/{'a' * 32}/4/")) == {n for n in objects if n.startswith(f"chunks/{'a' * 32}/4/")}
    assert set(scanned(f"chunks/{'a' * 32}/4/aa/")) == {chunk_name("a" * 32, 4, "aa" + "0" * 62)}
    assert set(scanned("entries")) == {"entries/" + "a" * 32 + "/" + "5" * 64 + ".kvc"}
    assert set(scanned("tensors/66/")) == {"tensors/66/" + "6" * 64 + ".safetensors"}
    assert scanned("chunks/c") == {} and scanned("nothing/") == {}


def sized(store: ChunkStore, size: int, length: int = 1) -> int:
    """A scanned size as the object's length: files and memory report the length; Redis reports
    the memory the server spends on the key (MEMORY USAGE, which unlike STRLEN does not count as
    a use), a little more than the length."""
    if "redis" in store.kind:
        assert length <= size <= length + 512, (size, length)
        return length
    return size


def _settle(store: ChunkStore) -> None:
    """Let the LRU clock move on: Redis counts idle time in whole seconds."""
    time.sleep(2.2 if "redis" in store.kind else 0.05)


def test_evict_keeps_the_most_recently_used(store):
    b = store.backend
    names = [name_for(i) for i in range(4)]
    for n in names:
        assert b.put(n, os.urandom(1000))
    _settle(store)
    assert b.get(names[2]) is not None  # the one use since: it must stay
    removed = b.evict(1500)
    assert {o.name for o in removed} == {names[0], names[1], names[3]}
    assert [n for n in names if b.exists(n)] == [names[2]]
    assert b.get_many(names) == [None, None, b.get(names[2]), None]
    assert sum(o.size for o in b.scan()) <= 1500


def test_evict_under_the_cap_removes_nothing(store):
    b = store.backend
    for i in range(3):
        b.put(name_for(i), b"x" * 100)
    total = sum(o.size for o in b.scan())  # 300, or what Redis spends on them
    assert b.evict(total) == []
    assert b.evict(10_000) == []
    assert all(b.exists(name_for(i)) for i in range(3))
    assert len(b.evict(0)) == 3 and list(b.scan()) == []


# --- the prefix API ------------------------------------------------------------------------


def test_put_sequence_then_exact_prefix(store):
    cache = cache_of(store)
    tokens, kv = prompt(16), make_kv(IDENTITY, 16)
    assert cache.lookup(tokens) == 0 and cache.get_prefix(tokens).num_tokens == 0
    result = cache.put_sequence(tokens, kv)
    assert (result.chunks, result.stored, result.present) == (4, 4, 0)
    assert result.stored_bytes == sum(sized(store, o.size, o.size if "redis" not in store.kind else
                                            len(store.backend.get(o.name))) for o in store.scan())
    assert cache.lookup(tokens) == 16 and cache.contains(tokens)
    hit = cache.get_prefix(tokens)
    assert_prefix(hit, kv, 16)
    assert hit.codecs == ["raw"] * 4 and hit.refused == []
    assert same_tensor(hit.kv(), kv)
    assert hit.stored_bytes == result.stored_bytes
    assert store.counters.refused == 0 and store.counters.hits == 4 and store.counters.stored == 4
    # a longer prompt with the same start: the stored prefix, then a miss
    longer = tokens + prompt(9, seed=1)
    assert cache.lookup(longer) == 16
    assert_prefix(cache.get_prefix(longer), kv, 16)
    assert_prefix(cache.get_prefix(tokens, max_tokens=11), kv, 8)
    assert_prefix(cache.get_prefix(torch.tensor(tokens), device="cpu"), kv, 16)


@pytest.mark.parametrize("codec", ["zstd", "cachegen"])
def test_codecs_decode(store, codec):
    cache = cache_of(store)
    tokens, kv = prompt(12, seed=2), make_kv(IDENTITY, 12, seed=2)
    assert cache.put_sequence(tokens, kv, codec=codec).stored == 3
    hit = cache.get_prefix(tokens)
    assert hit.num_tokens == 12 and hit.codecs == [codec] * 3
    for i, chunk in enumerate(hit.chunks):
        want = kv[:, :, i * CHUNK:(i + 1) * CHUNK]
        if codec == "cachegen":  # lossy: what decode(encode(kv)) must give
            want = cachegen_reference_roundtrip(want.contiguous())
        assert same_tensor(chunk, want), f"chunk {i}"


def test_shared_prefix_hits_only_shared_whole_chunks(store):
    cache = cache_of(store)
    a, kv = prompt(16, seed=3), make_kv(IDENTITY, 16, seed=3)
    cache.put_sequence(a, kv)
    b = a[:10] + prompt(10, seed=4)  # shares 2 whole chunks and half of the third
    assert cache.lookup(b) == 8
    assert_prefix(cache.get_prefix(b), kv, 8)
    assert cache.lookup(prompt(16, seed=5)) == 0
    # the third chunk's tokens again, after another second chunk: another prefix, a miss
    c = a[:4] + prompt(4, seed=6) + a[8:]
    assert cache.lookup(c) == 4
    assert_prefix(cache.get_prefix(c), kv, 4)
    assert cache.lookup(a[:7]) == 4 and cache.lookup(a[:3]) == 0 and cache.lookup([]) == 0
    assert not cache.contains(a[:3]) and not cache.contains(b) and cache.contains(a[:8])


def test_partial_last_chunk_is_not_stored(store):
    cache = cache_of(store)
    tokens, kv = prompt(18, seed=7), make_kv(IDENTITY, 18, seed=7)
    result = cache.put_sequence(tokens, kv)
    assert (result.chunks, result.stored) == (4, 4)
    assert len(store.scan("chunks/")) == 4
    assert cache.lookup(tokens) == 16
    assert_prefix(cache.get_prefix(tokens), kv, 16)
    assert cache.put_sequence(tokens[:3], kv[:, :, :3]).chunks == 0
    assert len(store.scan()) == 4


def test_second_put_stores_nothing(store):
    cache = cache_of(store)
    tokens, kv = prompt(16, seed=8), make_kv(IDENTITY, 16, seed=8)
    first = cache.put_sequence(tokens, kv)
    before = {o.name: store.backend.get(o.name) for o in store.scan()}
    second = cache.put_sequence(tokens, kv)
    assert (second.chunks, second.stored, second.present, second.stored_bytes) == (4, 0, 4, 0)
    assert store.counters.deduplicated == 4 and store.counters.stored == first.stored == 4
    assert {o.name: store.backend.get(o.name) for o in store.scan()} == before  # nothing rewritten
    # another engine's put of an extended prompt stores only the new chunks
    more, kv2 = tokens + prompt(8, seed=9), torch.cat([kv, make_kv(IDENTITY, 8, seed=9)], dim=2)
    third = cache.put_sequence(more, kv2, codec="zstd")
    assert (third.chunks, third.stored, third.present) == (6, 2, 4)
    assert len(store.scan()) == 6


def test_zstd_chunk_is_found_whatever_codec(store):
    cache = cache_of(store)
    tokens, kv = prompt(12, seed=10), make_kv(IDENTITY, 12, seed=10)
    cache.put_sequence(tokens, kv, codec="zstd")
    assert cache.lookup(tokens) == 12
    for codec in ("raw", "cachegen", "zstd"):
        assert cache.put_sequence(tokens, kv, codec=codec).stored == 0
    hit = cache.get_prefix(tokens)
    assert hit.codecs == ["zstd"] * 3
    assert_prefix(hit, kv, 12)


@pytest.mark.parametrize("other", ["config", "weights"])
def test_another_model_never_sees_the_chunks(store, other):
    tokens, kv = prompt(16, seed=11), make_kv(IDENTITY, 16, seed=11)
    cache_of(store).put_sequence(tokens, kv)
    if other == "config":  # same shapes, another fingerprint
        foreign = dataclasses.replace(IDENTITY, rope={"rope_theta": 500000.0, "rope_scaling": None})
        assert foreign.fingerprint() != IDENTITY.fingerprint()
    else:  # same config, other weights (a fine-tune)
        foreign = dataclasses.replace(IDENTITY, weights_digest="sha256:" + "ab" * 32)
        assert foreign.fingerprint() == IDENTITY.fingerprint()
    theirs = cache_of(store, foreign)
    assert theirs.key != cache_of(store).key
    assert theirs.lookup(tokens) == 0 and not theirs.contains(tokens)
    assert theirs.get_prefix(tokens).num_tokens == 0
    assert theirs.put_sequence(tokens, kv).stored == 4  # their own copy
    assert len(store.scan()) == 8
    assert theirs.delete(tokens) == 4 and cache_of(store).lookup(tokens) == 16
    # the name is a label: a renamed model is the same model
    renamed = cache_of(store, dataclasses.replace(IDENTITY, name="another label"))
    assert_prefix(renamed.get_prefix(tokens), kv, 16)
    assert store.counters.refused == 0


def test_chunk_size_is_part_of_the_key(store):
    tokens, kv = prompt(16, seed=12), make_kv(IDENTITY, 16, seed=12)
    cache_of(store).put_sequence(tokens, kv)
    eight = cache_of(store, chunk_size=8)
    assert eight.lookup(tokens) == 0 and eight.get_prefix(tokens).num_tokens == 0
    assert eight.put_sequence(tokens, kv).stored == 2
    assert {o.name.split("/")[2] for o in store.scan()} == {"4", "8"}
    assert len(store.scan(f"chunks/{model_key(IDENTITY)}/8/")) == 2
    hit = eight.get_prefix(tokens)
    assert hit.num_tokens == 16 and same_tensor(hit.kv(), kv)


def test_contains_and_delete(store):
    cache = cache_of(store)
    tokens, kv = prompt(12, seed=13), make_kv(IDENTITY, 12, seed=13)
    cache.put_sequence(tokens, kv)
    assert cache.contains(tokens)
    assert cache.delete(tokens[:8]) == 2
    assert cache.lookup(tokens) == 0 and not cache.contains(tokens)
    assert cache.get_prefix(tokens).num_tokens == 0
    assert cache.delete(tokens) == 1 and cache.delete(tokens) == 0
    assert store.scan() == []
    assert cache.put_sequence(tokens, kv).stored == 3


def test_put_encoded_copies_payloads(store):
    """`store put` of a container: payloads go in as they are, and decode to the same KV."""
    tokens, kv = prompt(12, seed=14), make_kv(IDENTITY, 12, seed=14)
    source = open_store("memory://").for_model(IDENTITY, CHUNK)
    source.put_sequence(tokens, kv, codec="zstd")
    payloads = []
    for name in chunk_names(source, tokens):
        obj = check_chunk(source.backend.get(name), name)
        payloads.append((bytes(obj.reader.chunk_payload(0)), obj.codec, obj.reader.chunks[0].codec_params))
    cache = cache_of(store)
    result = cache.put_encoded(tokens, payloads, "bfloat16")
    assert (result.chunks, result.stored) == (3, 3)
    hit = cache.get_prefix(tokens)
    assert hit.codecs == ["zstd"] * 3
    assert_prefix(hit, kv, 12)
    assert cache.put_encoded(tokens, payloads, "bfloat16").stored == 0


# --- hostile objects ---------------------------------------------------------------------

BAD_AT = 2  # the chunk replaced by bad bytes: chunks 0 and 1 are still returned


def _object_of(identity, tokens, kv, index, chunk_size=CHUNK, codec="raw") -> bytes:
    """The bytes a store writes for chunk `index` of `tokens` (another store, in memory)."""
    cache = open_store("memory://").for_model(identity, chunk_size)
    cache.put_sequence(tokens, kv, codec=codec)
    return cache.backend.get(chunk_names(cache, tokens)[index])


def _set_trailer(data: bytes, offset: int | None = None, length: int | None = None) -> bytes:
    trailer = list(struct.unpack(TRAILER_FMT, data[-TRAILER_SIZE:]))
    trailer[0] = trailer[0] if offset is None else offset
    trailer[1] = trailer[1] if length is None else length
    return data[:-TRAILER_SIZE] + struct.pack(TRAILER_FMT, *trailer)


def _chunk_field(key, value):
    def mutate(doc):
        doc["chunks"][0][key] = value
    return mutate


def _forged_position(ctx) -> bytes:
    """Chunk 1's object with its store key rewritten to claim chunk 2's place (valid CRC)."""
    hashes = ref_prefix_hashes(ctx.tokens, CHUNK)

    def mutate(doc):
        doc["store"].update(start=BAD_AT * CHUNK, parent_hash=hashes[BAD_AT - 1], prefix_hash=hashes[BAD_AT])
    return rebuild(ctx.good[1], mutate)


def _forged_fingerprint(ctx) -> bytes:
    """Another config's object claiming this model's fingerprint."""
    def mutate(doc):
        doc["model"]["fingerprint"] = IDENTITY.fingerprint()
    return rebuild(ctx.foreign, mutate)


def _plain_container(ctx) -> bytes:
    """A valid kvtool container of the same chunk, without the store's key."""
    path = ctx.tmp_path / "plain.kvc"
    write_kv_file(path, identity=IDENTITY, num_tokens=CHUNK, chunk_size=CHUNK,
                  token_ids=ctx.tokens[BAD_AT * CHUNK:(BAD_AT + 1) * CHUNK],
                  kv=ctx.kv[:, :, BAD_AT * CHUNK:(BAD_AT + 1) * CHUNK].contiguous())
    return path.read_bytes()


def _payload_offset(data: bytes) -> int:
    return split_file(data).manifest["chunks"][0]["offset"]


def _tokens_offset(data: bytes) -> int:
    return split_file(data).manifest["sequence"]["tokens"]["offset"]


HOSTILE = {
    "flipped-payload-byte": lambda c: flip_byte(c.bad, _payload_offset(c.bad) + 37),
    "flipped-payload-high-bit": lambda c: flip_byte(c.bad, _payload_offset(c.bad), 0x80),
    "flipped-token-byte": lambda c: flip_byte(c.bad, _tokens_offset(c.bad) + 1),
    "flipped-header-byte": lambda c: flip_byte(c.bad, 12),
    "flipped-manifest-byte": lambda c: flip_byte(c.bad, split_file(c.bad).manifest_offset + 40),
    "flipped-trailer-byte": lambda c: flip_byte(c.bad, len(c.bad) - 1),
    "truncated-by-one": lambda c: c.bad[:-1],
    "truncated-half": lambda c: c.bad[:len(c.bad) // 2],
    "header-only": lambda c: c.bad[:64],
    "empty": lambda c: b"",
    "one-byte": lambda c: b"\x89",
    "appended-byte": lambda c: c.bad + b"\0",
    "another-model": lambda c: c.foreign,
    "another-model-forged-fingerprint": _forged_fingerprint,
    "other-weights": lambda c: c.fine_tune,
    "another-position": lambda c: c.good[1],
    "another-prefix-same-position": lambda c: c.other_prompt,
    "another-chunk-size": lambda c: c.other_size,
    "forged-position": _forged_position,
    "not-a-store-object": _plain_container,
    "random-garbage": lambda c: np.random.default_rng(1).bytes(len(c.bad)),
    "magic-then-garbage": lambda c: MAGIC + np.random.default_rng(2).bytes(len(c.bad) - len(MAGIC)),
    "huge-manifest-length": lambda c: _set_trailer(c.bad, length=1 << 62),
    "huge-manifest-offset": lambda c: _set_trailer(c.bad, offset=(1 << 63) - 8),
    "huge-chunk-length": lambda c: rebuild(c.bad, _chunk_field("length", 1 << 40)),
    "huge-chunk-offset": lambda c: rebuild(c.bad, _chunk_field("offset", 1 << 60)),
    "huge-chunk-shape": lambda c: rebuild(c.bad, _chunk_field("shape", [2, 2, 1 << 40, 16])),
    "huge-num-tokens": lambda c: rebuild(c.bad, lambda d: d["sequence"].update(num_tokens=1 << 40)),
    "huge-store-start": lambda c: rebuild(c.bad, lambda d: d["store"].update(start=1 << 62)),
}


@dataclasses.dataclass
class HostileContext:
    tmp_path: object
    tokens: list[int]
    kv: torch.Tensor
    good: list[bytes]
    foreign: bytes
    fine_tune: bytes
    other_prompt: bytes
    other_size: bytes

    @property
    def bad(self) -> bytes:
        return self.good[BAD_AT]


@pytest.fixture(scope="module")
def foreign_objects():
    """Valid objects that do not belong under chunk BAD_AT's name (written once)."""
    tokens, kv = prompt(16, seed=15), make_kv(IDENTITY, 16, seed=15)
    other_tokens = tokens[:BAD_AT * CHUNK] + prompt(8, seed=16)
    fine_tune = dataclasses.replace(IDENTITY, weights_digest="sha256:" + "cd" * 32)
    return {"foreign": _object_of(dataclasses.replace(IDENTITY, rms_norm_eps=1e-6), tokens, kv, BAD_AT),
            "fine_tune": _object_of(fine_tune, tokens, kv, BAD_AT),
            "other_prompt": _object_of(IDENTITY, other_tokens, make_kv(IDENTITY, 16, seed=16), BAD_AT),
            "other_size": _object_of(IDENTITY, tokens, kv, 2 * BAD_AT, chunk_size=CHUNK // 2)}


@pytest.mark.parametrize("variant", list(HOSTILE))
def test_hostile_object_is_never_returned(store, variant, tmp_path, foreign_objects):
    cache = cache_of(store)
    tokens, kv = prompt(16, seed=15), make_kv(IDENTITY, 16, seed=15)
    cache.put_sequence(tokens, kv)
    names = chunk_names(cache, tokens)
    ctx = HostileContext(tmp_path=tmp_path, tokens=tokens, kv=kv,
                         good=[bytes(store.backend.get(n)) for n in names], **foreign_objects)
    bad = HOSTILE[variant](ctx)
    assert bad != ctx.good[BAD_AT]
    assert store.backend.put(names[BAD_AT], bad, replace=True)
    assert store.backend.get(names[BAD_AT]) == bad

    hit = cache.get_prefix(tokens)
    assert_prefix(hit, kv, BAD_AT * CHUNK)
    assert len(hit.refused) == 1 and hit.refused[0]
    assert store.counters.refused == 1 and store.counters.hits == BAD_AT
    # healed at once (store.md §7): removed from every tier, so no lookup promises it again
    assert names[BAD_AT] in hit.healed and not store.backend.exists(names[BAD_AT])
    if store.kind.startswith("tiered"):
        assert not store.backend.tiers[0].exists(names[BAD_AT])  # never served from memory
    assert cache.lookup(tokens) == BAD_AT * CHUNK
    again = cache.get_prefix(tokens)  # a plain miss now: nothing refused, nothing past it read
    assert_prefix(again, kv, BAD_AT * CHUNK)
    assert again.refused == [] and store.counters.refused == 1 and store.counters.hits == 2 * BAD_AT
    assert cache.get_prefix(tokens[:BAD_AT * CHUNK + 3]).num_tokens == BAD_AT * CHUNK  # before it: no read
    cache.put_sequence(tokens, kv)  # the next writer stores it again, intact
    assert_prefix(cache.get_prefix(tokens), kv, 16)


@pytest.mark.parametrize("variant", ["flipped-payload-byte", "another-model", "random-garbage"])
def test_hostile_first_chunk_gives_nothing(store, variant, tmp_path):
    cache = cache_of(store)
    tokens, kv = prompt(12, seed=17), make_kv(IDENTITY, 12, seed=17)
    cache.put_sequence(tokens, kv)
    names = chunk_names(cache, tokens)
    first = store.backend.get(names[0])
    bad = {"flipped-payload-byte": flip_byte(first, _payload_offset(first) + 3),
           "another-model": _object_of(dataclasses.replace(IDENTITY, vocab_size=1001), tokens, kv, 0),
           "random-garbage": os.urandom(len(first))}[variant]
    store.backend.put(names[0], bad, replace=True)
    hit = cache.get_prefix(tokens)
    assert hit.num_tokens == 0 and hit.chunks == [] and len(hit.refused) == 1
    assert store.counters.refused == 1 and store.counters.hits == 0
    with pytest.raises(UsageError):
        hit.kv()  # nothing to join


def test_oversized_local_file_is_a_refusal(tmp_path):
    """A stored file larger than an object may be (a hostile size on disk) is refused without
    being read into memory, and the prefix stops before it."""
    store = open_store(tmp_path / "store")
    cache = cache_of(store)
    tokens, kv = prompt(12, seed=18), make_kv(IDENTITY, 12, seed=18)
    cache.put_sequence(tokens, kv)
    os.truncate(tmp_path / "store" / chunk_names(cache, tokens)[1], MAX_OBJECT_BYTES + 1)  # sparse
    hit = cache.get_prefix(tokens)
    assert_prefix(hit, kv, 4)
    assert store.counters.refused == 1 and len(hit.refused) == 1


# --- the local store ------------------------------------------------------------------

_REOPEN = r"""
import hashlib, json, sys, torch
from kvtool.identity import ModelIdentity
from kvtool.store import open_store
path, identity, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
store = open_store(path, create=False)
objects = {o.name: hashlib.sha256(store.backend.get(o.name)).hexdigest() for o in store.scan()}
cache = store.for_model(ModelIdentity.from_dict(identity), int(sys.argv[4]))
hits = []
for tokens in prompts:
    hit = cache.get_prefix(tokens)
    kv = hit.kv().contiguous().view(torch.int16).numpy().tobytes()
    hits.append([hit.num_tokens, hit.codecs, hashlib.sha256(kv).hexdigest()])
print(json.dumps({"objects": objects, "hits": hits, "refused": store.counters.refused,
                  "missing": [n for n in objects if not store.backend.exists(n)]}))
"""


def _kv_digest(hit) -> str:
    return hashlib.sha256(hit.kv().contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def test_local_store_survives_a_restart(tmp_path):
    path = tmp_path / "store"
    store = open_store(path)
    cache = cache_of(store)
    prompts = [prompt(16, seed=20), prompt(21, seed=21), prompt(12, seed=22)]
    prompts.append(prompts[0][:8] + prompt(8, seed=23))  # shares two chunks with the first
    for tokens, codec in zip(prompts, ["raw", "zstd", "cachegen", "raw"]):
        cache.put_sequence(tokens, make_kv(IDENTITY, len(tokens), seed=len(tokens)), codec=codec)
    before = {o.name: hashlib.sha256(store.backend.get(o.name)).hexdigest() for o in store.scan()}
    want = []
    for tokens in prompts:
        hit = cache.get_prefix(tokens)
        want.append([hit.num_tokens, hit.codecs, _kv_digest(hit)])
    assert len(before) == 4 + 5 + 3 + 2
    store.close()

    out = subprocess.run([sys.executable, "-c", _REOPEN, str(path), json.dumps(IDENTITY.to_dict()),
                          json.dumps(prompts), str(CHUNK)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["objects"] == before  # every object, byte for byte
    assert got["hits"] == want  # and the same tensors out of them
    assert got["refused"] == 0 and got["missing"] == []
    assert [h[0] for h in got["hits"]] == [16, 20, 12, 16]

    again = open_store(f"file://{path}")  # and here again, by URL
    assert {o.name for o in again.scan()} == set(before)
    assert again.backend.sweep() == 0


def test_local_max_bytes_evicts_the_least_recently_used(tmp_path):
    probe = open_store("memory://").for_model(IDENTITY, CHUNK)
    probe.put_sequence(prompt(4, seed=30), make_kv(IDENTITY, 4))
    size = max(o.size for o in probe.store.scan())
    cap = int(11.5 * size)
    store = open_store(tmp_path / "store", max_bytes=cap)
    cache = cache_of(store)
    (a, kva), (b, kvb), (c, kvc) = [(prompt(16, seed=s), make_kv(IDENTITY, 16, seed=s)) for s in (31, 32, 33)]
    cache.put_sequence(a, kva)
    cache.put_sequence(b, kvb)
    time.sleep(0.05)
    assert_prefix(cache.get_prefix(a), kva, 16)  # a is used again: b is now the oldest
    time.sleep(0.05)
    cache.put_sequence(c, kvc)  # 12 objects > 11.5: the least recently used go
    assert sum(o.size for o in store.scan()) <= cap
    assert cache.lookup(a) == 16 and cache.lookup(c) == 16
    left_of_b = sum(store.backend.exists(n) for n in chunk_names(cache, b))
    assert left_of_b < 4
    assert len(store.scan()) == 8 + left_of_b
    assert_prefix(cache.get_prefix(a), kva, 16)
    assert_prefix(cache.get_prefix(c), kvc, 16)
    # a reopened capped store counts what is there already
    reopened = open_store(tmp_path / "store", max_bytes=cap)
    cache2 = cache_of(reopened)
    cache2.put_sequence(prompt(16, seed=34), make_kv(IDENTITY, 16, seed=34))
    assert sum(o.size for o in reopened.scan()) <= cap


@pytest.mark.parametrize("what", ["other-files", "bad-marker", "foreign-marker", "a-file"])
def test_folder_that_is_not_a_store_is_refused(tmp_path, what):
    path = tmp_path / "folder"
    if what == "a-file":
        path.write_bytes(b"not a folder")
    else:
        path.mkdir()
        if what == "other-files":
            (path / "notes.txt").write_text("my notes")
        elif what == "bad-marker":
            (path / "kvtool-store.json").write_text("{not json")
        else:
            (path / "kvtool-store.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    before = sorted(p.name for p in path.iterdir()) if path.is_dir() else None
    with pytest.raises(NotAStore) as err:
        open_store(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    if before is not None:
        assert sorted(p.name for p in path.iterdir()) == before  # nothing written into it


def test_new_or_empty_folder_becomes_a_store(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "new" / "nested"):
        store = open_store(path)
        assert (path / "kvtool-store.json").is_file()
        cache_of(store).put_sequence(prompt(4), make_kv(IDENTITY, 4))
        assert len(open_store(path).scan()) == 1
    with pytest.raises(NotAStore):
        open_store(tmp_path / "absent", create=False)
    assert not (tmp_path / "absent").exists()


def test_folder_with_another_openers_marker_temp_is_new(tmp_path):
    """Two processes opening one new folder at once: the first one's marker temp file (written,
    not yet linked) must not make the second one call the folder 'not a store'."""
    path = tmp_path / "store"
    path.mkdir()
    (path / ".kvtool-store.json.abc123.tmp").write_bytes(b"")
    store = open_store(path)
    assert (path / "kvtool-store.json").is_file()
    cache_of(store).put_sequence(prompt(8), make_kv(IDENTITY, 8))
    assert cache_of(open_store(path)).lookup(prompt(8)) == 8


# --- Redis -----------------------------------------------------------------------------


def test_unreachable_redis_is_one_line_and_fast(redis_server):
    from redis_server import free_port

    from kvtool.store.redis_backend import RedisBackend

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        RedisBackend(url, retry_seconds=0.5)
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"took {elapsed:.1f} s"
    message = str(err.value)
    assert "\n" not in message and url in message and "cannot be reached" in message
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no chained traceback


def test_tier_copies_up_on_a_miss(request, tmp_path):
    """A chunk only the durable tier holds (another process wrote it) is served and copied up."""
    store = open_kind("tiered-local", request, tmp_path)
    other = open_store(tmp_path / "store")  # the same folder, without the memory tier
    tokens, kv = prompt(8, seed=40), make_kv(IDENTITY, 8, seed=40)
    cache_of(other).put_sequence(tokens, kv)
    memory = store.backend.tiers[0]
    names = chunk_names(cache_of(store), tokens)
    assert not any(memory.exists(n) for n in names)
    assert_prefix(cache_of(store).get_prefix(tokens), kv, 8)
    assert all(memory.exists(n) for n in names)
    # a chunk the durable tier lost is still served from memory, and still checked
    for n in names:
        other.backend.delete(n)
    assert_prefix(cache_of(store).get_prefix(tokens), kv, 8)
