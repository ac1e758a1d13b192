"""Random damage to real store objects: every mutant is either refused with ObjectRefused or,
when the damage missed every checked byte (padding the reader skips), decodes to the original
KV. Nothing else: no other exception, no wrong chunk. The 29 named hostile objects are in
test_store_contract.py; this sweeps what no one thought to name."""

from __future__ import annotations

import random

import pytest
import torch

from kvtool.errors import ObjectRefused
from kvtool.store import objects
from kvtool.store.chunk_store import ModelCache, open_store

from fixtures import make_identity, make_kv

IDENTITY = make_identity()
TOKENS = list(range(500, 516))


def stored_objects(codec: str) -> tuple[ModelCache, list[tuple[str, bytes, torch.Tensor, int, str]]]:
    cache = open_store("memory://").for_model(IDENTITY, chunk_size=8)
    kv = make_kv(IDENTITY, 16)
    cache.put_sequence(TOKENS, kv, codec=codec)
    out = []
    for i, link in enumerate(cache._chain(TOKENS)):
        start, prefix = link.start, link.prefix_hash
        name = cache.name(prefix)
        out.append((name, bytes(cache.backend.get(name)), kv[:, :, start:start + 8], start, prefix))
    return cache, out


def mutants(data: bytes, rng: random.Random, count: int):
    for _ in range(count):
        b = bytearray(data)
        kind = rng.randrange(5)
        if kind == 0:  # one byte
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # a run of random bytes
            at = rng.randrange(len(b))
            b[at:at + rng.randrange(1, 64)] = rng.randbytes(rng.randrange(1, 64))
        elif kind == 2:  # truncated
            del b[rng.randrange(len(b)):]
        elif kind == 3:  # extended
            b += rng.randbytes(rng.randrange(1, 256))
        else:  # a range copied over another place of the object
            at, src, n = rng.randrange(len(b)), rng.randrange(len(b)), rng.randrange(1, 512)
            b[at:at + n] = b[src:src + n]
        yield bytes(b)


@pytest.mark.parametrize("codec", ["raw", "zstd", "cachegen"])
def test_damaged_objects_are_refused_or_intact(codec):
    _cache, stored = stored_objects(codec)
    rng = random.Random(f"store-fuzz-{codec}")
    refused = intact = 0
    for name, data, kv, start, prefix in stored:
        original = objects.check_chunk(data, name, model=objects.model_key(IDENTITY), chunk_size=8,
                                       prefix_hash=prefix, start=start).decode()
        assert codec == "cachegen" or torch.equal(original, kv)  # cachegen is lossy
        for mutant in mutants(data, rng, 1000):
            try:
                obj = objects.check_chunk(mutant, name, model=objects.model_key(IDENTITY), chunk_size=8,
                                          prefix_hash=prefix, start=start)
                got = obj.decode()
            except ObjectRefused:
                refused += 1
                continue
            # the damage missed every checked byte: the chunk is exactly the original
            assert torch.equal(got, original)
            intact += 1
    assert refused > 0.9 * (refused + intact)


def test_a_store_serving_damaged_objects_returns_only_intact_prefixes(tmp_path):
    """The same damage through the whole read path (a folder store): get_prefix stops at the
    first damaged chunk and what it returns equals what was stored."""
    rng = random.Random(7)
    store = open_store(tmp_path / "s")
    cache = store.for_model(IDENTITY, chunk_size=8)
    kv = make_kv(IDENTITY, 16)
    cache.put_sequence(TOKENS, kv, codec="zstd")
    names = cache.chunk_names(TOKENS)
    good = {n: bytes(store.backend.get(n)) for n in names}
    for _ in range(60):
        victim = rng.choice(names)
        mutant = next(mutants(good[victim], rng, 1))
        store.backend.put(victim, mutant, replace=True)
        hit = cache.get_prefix(TOKENS)
        if hit.num_tokens:
            assert torch.equal(hit.kv(), kv[:, :, :hit.num_tokens])
        for n in names:
            store.backend.put(n, good[n], replace=True)
    assert store.counters.refused > 30
