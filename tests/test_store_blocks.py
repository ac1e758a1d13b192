"""Block prefixes (format-spec/store.md §3 "Block prefixes", §4.5-4.6, §7): a prompt loads every
block-aligned token a stored sequence shares with it, whatever the chunk size, on every backend
of the contract (a folder, a real Redis server, memory, tiers). Past its whole chunks a stored
sequence leaves a piece (its block-aligned tail) and block index entries (each block prefix of a
chunk or piece, naming it); a request of another namespace, salt or adapter finds none of them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvtool.store import open_store
from kvtool.store import upkeep
from kvtool.store.names import ExtraKeys, block_name, parse_name

from fixtures import make_identity, make_kv
from test_store_contract import open_kind, store  # noqa: F401  (the contract's backends)

CHUNK, BLOCK = 16, 4
IDENTITY = make_identity(num_layers=2, num_kv_heads=2, head_dim=8)


def ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, n)]


def shared(doc: list[int], tail: int, seed: int) -> list[int]:
    """The document, then `tail` tokens of its own (which differ from the document's next token)."""
    return doc + [50_001 + seed] + ids(tail - 1, seed + 100)


def cache(store, keys: ExtraKeys = ExtraKeys(), block: int | None = BLOCK):  # noqa: F811
    return store.for_model(IDENTITY, CHUNK, keys, block)


def test_tail_past_the_whole_chunks_is_found_and_exact(store):  # noqa: F811
    doc = ids(45)  # 2 whole chunks (32), then 13 tokens: 3 whole blocks (12) shared
    first, second = shared(doc, 9, 1), shared(doc, 7, 2)
    kv = make_kv(IDENTITY, len(first))
    put = cache(store).put_sequence(first, kv)
    assert (put.stored, put.pieces) == (3, 1)  # 54 tokens: 3 whole chunks, then 1 block (a piece)
    assert cache(store).lookup(second) == 44  # the whole chunks (32), then 3 blocks of the third chunk
    hit = cache(store).get_prefix(second)
    assert hit.num_tokens == 44 and not hit.refused
    assert torch.equal(hit.kv(), kv[:, :, :44])
    assert cache(store, block=None).lookup(second) == 32  # whole chunks only, as before


def test_piece_serves_a_prompt_that_shares_a_tail(store):  # noqa: F811
    doc = ids(45)
    kv = make_kv(IDENTITY, 45)
    put = cache(store).put_sequence(doc, kv)  # 2 whole chunks; 13 tokens past them: a piece of 12
    assert (put.stored, put.pieces) == (2, 1)
    assert put.block_entries == 2 * 3 + 2  # 3 per whole chunk, 2 shorter prefixes of the piece
    for shared_tokens, expected in ((45, 44), (42, 40), (35, 32), (33, 32)):
        prompt = doc[:shared_tokens] + [50_009] * 6
        assert cache(store).lookup(prompt) == expected
        hit = cache(store).get_prefix(prompt)
        assert hit.num_tokens == expected and torch.equal(hit.kv(), kv[:, :, :expected])
    assert cache(store).put_sequence(doc, kv).stored_bytes == 0  # all there: nothing written again


@pytest.mark.parametrize("codec", ["zstd", "cachegen"])
def test_pieces_in_every_codec(store, codec):  # noqa: F811
    doc = ids(45)
    kv = make_kv(IDENTITY, 45, dtype=torch.float16)
    cache(store).put_sequence(doc, kv, codec=codec)
    hit = cache(store).get_prefix(doc[:42] + [7])
    assert hit.num_tokens == 40 and hit.codecs == [codec] * 3
    got = hit.kv()
    assert got.shape == (2, 2, 40, 16)
    if codec == "zstd":
        assert torch.equal(got, kv[:, :, :40])
    else:  # lossy: close, and the part of a chunk is the same KV as the chunk's decode
        assert torch.equal(got[:, :, :32], cache(store).get_prefix(doc[:32]).kv())


@pytest.mark.parametrize("other", [ExtraKeys(namespace="team-b"), ExtraKeys(cache_salt="another tenant"),
                                   ExtraKeys(adapter="sql-lora", adapter_digest="sha256:" + "cd" * 32)],
                         ids=["namespace", "salt", "adapter"])
def test_other_keys_load_nothing_from_the_pieces(store, other):  # noqa: F811
    doc = ids(45)
    owner = ExtraKeys(namespace="team-a", cache_salt="s3cret")
    cache(store, owner).put_sequence(doc, make_kv(IDENTITY, 45))
    prompt = doc[:14] + [50_007] * 3  # only a block prefix of the first chunk is shared
    assert cache(store, owner).lookup(prompt) == 12
    assert cache(store, owner).get_prefix(prompt).num_tokens == 12
    for keys in (other, ExtraKeys()):
        assert cache(store, keys).lookup(doc) == 0
        assert cache(store, keys).lookup(prompt) == 0
        hit = cache(store, keys).get_prefix(prompt)
        assert hit.num_tokens == 0 and not hit.refused


def test_an_entry_that_names_another_object_is_refused_never_loaded(store):  # noqa: F811
    doc, other = ids(45), ids(45, seed=9)
    c = cache(store)
    c.put_sequence(doc, make_kv(IDENTITY, 45))
    c.put_sequence(other, make_kv(IDENTITY, 45, seed=1))
    prompt = doc[:8] + [50_003] * 4
    link = c.find(prompt)
    assert link.tokens == 8 and link.via.endswith(".kvi")
    target_of_other = c.name(c._chain(other)[0].prefix_hash)  # a whole, intact chunk of other tokens
    store.backend.delete(link.via)
    store.backend.put(link.via, json.dumps({"version": 2, "kind": "block", "tokens": 8,
                                            "target": target_of_other}).encode())
    hit = c.get_prefix(prompt)
    assert hit.num_tokens == 0 and len(hit.refused) == 1 and "tokens asked for" in hit.refused[0]
    assert store.counters.refused == 1


def test_fsck_keeps_pieces_and_entries_and_removes_stale_ones(store):  # noqa: F811
    doc = ids(45)
    c = cache(store)
    c.put_sequence(doc, make_kv(IDENTITY, 45))
    kinds = [parse_name(i.name)[0] for i in store.backend.scan()]
    assert sorted(set(kinds)) == ["block", "chunk", "piece"]
    report = upkeep.fsck(store)
    assert report.damaged == [] and report.intact == len(kinds)
    piece = next(i.name for i in store.backend.scan() if parse_name(i.name)[0] == "piece")
    store.backend.delete(piece)  # gone behind kvtool's back (an older version's rm): its two entries dangle
    report = upkeep.fsck(store)
    assert len(report.damaged) == 2 and all("stale" in d["reason"] for d in report.damaged)
    assert report.removed == 2 and c.lookup(doc) == 32


def test_a_lookup_never_promises_an_entry_whose_object_is_gone(store):  # noqa: F811
    doc = ids(45)
    c = cache(store)
    c.put_sequence(doc, make_kv(IDENTITY, 45))
    piece = next(i.name for i in store.backend.scan() if parse_name(i.name)[0] == "piece")
    store.backend.delete(piece)  # evicted by a server, or removed by an older version
    assert c.lookup(doc) == 32 and c.get_prefix(doc).num_tokens == 32  # promised what loads, no more
    assert upkeep.fsck(store).damaged == []  # the lookup removed the two entries that named it


def test_lookup_is_one_probe_when_whole_chunks_reach_the_last(store, monkeypatch):  # noqa: F811
    doc = ids(45)
    c = cache(store)
    c.put_sequence(doc, make_kv(IDENTITY, 45))
    calls = []
    real, probe = store.backend.exists_many, store.backend.probe_many  # (a lookup asks for lengths and trailers)
    monkeypatch.setattr(store.backend, "exists_many", lambda names: calls.append(len(names)) or real(names))
    monkeypatch.setattr(store.backend, "probe_many", lambda names: calls.append(len(names)) or probe(names))
    assert c.lookup(doc) == 44
    assert calls == [2 + 2 * 3]  # 2 chunk names, a piece and an entry name for each of 3 block prefixes
    calls.clear()
    assert c.lookup(doc[:20] + [50_001] * 20) == 20  # chunk 1 differs: a second probe at its position
    # two probes; the block prefix found is an entry, whose object is then probed alone (§7)
    assert len([n for n in calls if n > 1]) == 2 and len(calls) <= 3


def test_a_block_size_must_divide_the_chunk_size(tmp_path):
    from kvtool.errors import UsageError

    with pytest.raises(UsageError, match="divide"):
        open_store(tmp_path / "s").for_model(IDENTITY, CHUNK, block_size=5)


def test_block_entry_names_are_refused_outside_their_form():
    name = block_name("ab" * 16, 16, "cd" * 32)
    assert parse_name(name)[0] == "block"
    assert parse_name(name.replace("/cd/", "/ce/")) is None


@pytest.mark.parametrize("damage", [b"", b'{"version": 1, "ki'])
def test_an_entry_a_crash_emptied_or_cut_is_a_miss_and_fsck_removes_it(store, damage):  # noqa: F811
    """Entries are written without fsync on a folder (store.md §6.1): what a power failure can leave
    of one, nothing or a prefix of its bytes, is never trusted."""
    doc = ids(45)
    c = cache(store)
    c.put_sequence(doc, make_kv(IDENTITY, 45))
    prompt = doc[:8] + [50_003] * 4
    link = c.find(prompt)
    assert link.tokens == 8 and link.via.endswith(".kvi")
    store.backend.put(link.via, damage, replace=True)
    hit = c.get_prefix(prompt)
    assert hit.num_tokens == 0 and hit.healed == [link.via]  # refused, and removed at once (no fsck needed)
    assert not store.backend.exists(link.via) and upkeep.fsck(store).damaged == []
    assert c.get_prefix(doc).num_tokens == 44  # the rest is untouched
