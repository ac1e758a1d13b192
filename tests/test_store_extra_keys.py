"""Whose a chunk is (format-spec/store.md §3, "Extra keys"): a chunk stored for one namespace,
cache salt, LoRA adapter, multimodal input or prompt embedding is never served to a request
with other ones, on every backend; objects record their extra keys and readers check them; and
objects written under store version 1 are never served."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvtool.errors import ObjectRefused
from kvtool.store import open_store, upkeep
from kvtool.store import objects
from kvtool.store.names import ExtraKeys, MultimodalKey, chunk_chain, salt_digest

from fixtures import make_identity, make_kv, same_tensor

IDENTITY = make_identity()
CHUNK = 4


@pytest.fixture(params=["local", "memory", "redis", "tiered-local"])
def store(request, tmp_path):
    kind = request.param
    url = request.getfixturevalue("redis_url") if kind == "redis" else (
        "memory://" if kind == "memory" else str(tmp_path / "store"))
    s = open_store(url, memory_bytes=(1 << 20) if kind.startswith("tiered") else 0)
    yield s
    s.close()


def tokens(n: int = 12) -> list[int]:
    return list(range(100, 100 + n))


TENANTS = {
    "none": ExtraKeys(),
    "salt-a": ExtraKeys(cache_salt="tenant-a"),
    "salt-b": ExtraKeys(cache_salt="tenant-b"),
    "namespace": ExtraKeys(namespace="team-a"),
    "adapter": ExtraKeys(adapter="sql-lora"),
    "adapter-digest": ExtraKeys(adapter="sql-lora", adapter_digest="sha256:" + "ab" * 32),
    "image-1": ExtraKeys(multimodal=(MultimodalKey("img-1", 1, 2),)),
    "image-2": ExtraKeys(multimodal=(MultimodalKey("img-2", 1, 2),)),
}


@pytest.mark.parametrize("owner", sorted(TENANTS))
def test_chunks_are_served_to_their_owner_only(store, owner):
    t, kv = tokens(), make_kv(IDENTITY, 12)
    store.for_model(IDENTITY, CHUNK, TENANTS[owner]).put_sequence(t, kv)
    for other, keys in TENANTS.items():
        cache = store.for_model(IDENTITY, CHUNK, keys)
        hit = cache.get_prefix(t)
        if other == owner:
            assert cache.lookup(t) == 12 and hit.num_tokens == 12 and same_tensor(hit.kv(), kv[:, :, :12])
        else:
            assert cache.lookup(t) == 0 and hit.num_tokens == 0, f"{owner}'s chunks served to {other}"
    assert store.counters.refused == 0


def test_an_image_changes_only_the_chunks_it_overlaps():
    t = np.array(tokens())
    plain = chunk_chain(t, CHUNK)
    image = chunk_chain(t, CHUNK, ExtraKeys(multimodal=(MultimodalKey("img-1", 5, 2),)))
    assert plain[0].prefix_hash == image[0].prefix_hash  # tokens 0-3: before the image
    assert plain[1].prefix_hash != image[1].prefix_hash and image[1].extra == {"mm": [["img-1", 5, 2]]}
    assert plain[2].prefix_hash != image[2].prefix_hash and image[2].extra == {}  # after it: the chain differs


def test_prompt_embeddings_are_keyed_per_chunk():
    t = np.zeros(8, dtype=np.int64)  # embeddings requests carry placeholder tokens
    embeds = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    other = embeds.copy()
    other[5] += 1  # differs in chunk 1 only
    a = chunk_chain(t, CHUNK, ExtraKeys(prompt_embeds=embeds))
    b = chunk_chain(t, CHUNK, ExtraKeys(prompt_embeds=other))
    c = chunk_chain(t, CHUNK, ExtraKeys(prompt_embeds=torch.from_numpy(embeds)))  # a tensor keys the same
    assert a[0].prefix_hash == b[0].prefix_hash and a[1].prefix_hash != b[1].prefix_hash
    assert [x.prefix_hash for x in a] == [x.prefix_hash for x in c]
    assert a[0].prefix_hash != chunk_chain(t, CHUNK)[0].prefix_hash


def test_objects_record_the_salts_digest_never_the_salt():
    store = open_store("memory://")
    keys = ExtraKeys(namespace="team-a", cache_salt="s3cret-salt")
    cache = store.for_model(IDENTITY, CHUNK, keys)
    cache.put_sequence(tokens(), make_kv(IDENTITY, 12))
    for info in store.scan():
        data = store.backend.get(info.name)
        assert b"s3cret-salt" not in data
        obj = objects.check_chunk(data, info.name)
        assert obj.extra == {"namespace": "team-a", "cache_salt": salt_digest("s3cret-salt")}
        obj.reader.close()
    assert "s3cret" not in keys.describe() and "s3cret" not in repr(keys)


def test_a_chunk_moved_to_another_owners_name_is_refused(store):
    """An object copied under the name another tenant would look up (a hostile writer, or a bug)
    is refused there: its extra keys and prefix hash are not the ones asked for (checks 9, 10)."""
    t, kv = tokens(), make_kv(IDENTITY, 12)
    a = store.for_model(IDENTITY, CHUNK, TENANTS["salt-a"])
    b = store.for_model(IDENTITY, CHUNK, TENANTS["salt-b"])
    a.put_sequence(t, kv)
    for link_a, link_b in zip(a._chain(t), b._chain(t)):
        store.backend.put(b.name(link_b.prefix_hash), store.backend.get(a.name(link_a.prefix_hash)))
    assert b.lookup(t) == 12  # the names exist...
    hit = b.get_prefix(t)
    assert hit.num_tokens == 0 and store.counters.refused == 1  # ...but nothing is served
    assert "other extra keys" in hit.refused[0] or "does not belong" in hit.refused[0]


def _forge(data: bytes, mutate) -> bytes:
    """The object with its manifest's `store` key changed by `mutate` (the manifest re-encoded,
    every CRC recomputed: a well-formed container a writer could have written)."""
    from fixtures import rebuild

    return rebuild(bytes(data), lambda doc: mutate(doc["store"]))


@pytest.mark.parametrize("forgery", ["drop-extra", "other-salt", "empty-extra", "not-an-object", "version-1"])
def test_forged_extra_keys_are_refused(forgery):
    store = open_store("memory://")
    keys = ExtraKeys(cache_salt="tenant-a")
    cache = store.for_model(IDENTITY, CHUNK, keys)
    cache.put_sequence(tokens(), make_kv(IDENTITY, 12))
    name = cache.name(cache._chain(tokens())[1].prefix_hash)
    mutate = {
        "drop-extra": lambda s: s.pop("extra"),
        "other-salt": lambda s: s["extra"].update(cache_salt=salt_digest("tenant-b")),
        "empty-extra": lambda s: s.update(extra={}),
        "not-an-object": lambda s: s.update(extra=["cache_salt"]),
        "version-1": lambda s: s.update(version=1),
    }[forgery]
    forged = _forge(store.backend.get(name), mutate)
    store.backend.delete(name)
    store.backend.put(name, forged)
    with pytest.raises(ObjectRefused) as err:
        objects.check_chunk(store.backend.get(name), name)
    expected = {"version-1": "store version 1", "empty-extra": "store.extra", "not-an-object": "store.extra"}
    assert expected.get(forgery, "prefix hash does not match") in str(err.value)
    hit = cache.get_prefix(tokens())
    assert hit.num_tokens == CHUNK and store.counters.refused == 1  # chunk 0 only


def test_version_1_objects_are_never_served_and_fsck_reports_them(tmp_path):
    """A store written by kvtool before store version 2 opens as it is; its objects sit under
    version-1 model keys no lookup asks for, and fsck reports and removes each as version 1."""
    import hashlib

    store = open_store(tmp_path / "store")
    cache = store.for_model(IDENTITY, CHUNK)
    cache.put_sequence(tokens(), make_kv(IDENTITY, 12))
    # rewrite every object as version 1 wrote it: version 1, under the version-1 model key
    fingerprint = cache.model["fingerprint"]
    old_key = hashlib.sha256(b"kvtool-store/1\0" + fingerprint.encode() + b"\0").hexdigest()[:32]
    for info in list(store.scan()):
        data = _forge(store.backend.get(info.name), lambda s: s.update(version=1))
        store.backend.put(info.name.replace(cache.key, old_key), data)
        store.backend.delete(info.name)
    assert cache.lookup(tokens()) == 0 and cache.get_prefix(tokens()).num_tokens == 0
    report = upkeep.fsck(store, repair=False)
    assert report.checked == 3 and len(report.damaged) == 3
    assert all("store version 1" in d["reason"] for d in report.damaged)
    assert upkeep.fsck(store).removed == 3 and not list(store.scan())


def test_extra_keys_are_checked_on_input():
    for bad in ({"namespace": "x" * 1025}, {"cache_salt": "a\0b"}, {"adapter_digest": "abc"},
                {"multimodal": (MultimodalKey("", 0, 1),)}, {"multimodal": (MultimodalKey("i", -1, 1),)}):
        with pytest.raises(Exception) as err:
            ExtraKeys(**bad)
        assert type(err.value).__name__ == "UsageError"
    assert json.dumps(ExtraKeys(namespace="ü").for_chunk(0, 4), ensure_ascii=False) == '{"namespace": "ü"}'


def test_prompt_embeddings_need_a_row_per_token():
    with pytest.raises(Exception, match="one a token"):
        chunk_chain(np.zeros(8, dtype=np.int64), CHUNK, ExtraKeys(prompt_embeds=np.zeros((3, 2), np.float32)))
