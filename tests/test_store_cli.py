"""The chunk store's user-facing parts: vLLM's lookup/store buffer API over it (seed 003),
`kvtool store put|get|ls|stats|gc|fsck|rm`, `capture --store` and `replay --store`.
The backends' own contract and the stress runs are in test_store_contract.py / test_store_stress.py."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.cli.app import run
from kvtool.errors import UsageError
from kvtool.format import ContainerReader
from kvtool.store import open_store
from kvtool.store.buffers import (KVLookupBufferBase, KVStoreBufferBase, StoreKeyValueBuffer,
                                  StoreLookupBuffer)

from fixtures import make_identity, write_kv_file


@pytest.fixture(params=["local", "redis"])
def store_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("redis_url")


def call(capsys, *args):
    capsys.readouterr()
    code = run([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- the seed's API ------------------------------------------------------------------


def test_the_seed_base_classes_are_abstract():
    for cls in (KVLookupBufferBase, KVStoreBufferBase):
        with pytest.raises(TypeError):
            cls()
    assert {"insert", "drop_select", "close"} <= set(KVLookupBufferBase.__abstractmethods__)
    assert {"put", "get", "close"} <= set(KVStoreBufferBase.__abstractmethods__)


def test_lookup_buffer_insert_then_drop_select(store_url):
    identity = make_identity()
    store = open_store(store_url)
    buffer = StoreLookupBuffer(store, identity, chunk_size=4, owns_store=True)
    tokens = torch.arange(10, 20)
    roi = torch.ones(10, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    key = torch.randn(2, 10, 2, 8, generator=g)  # [layers, tokens, kv heads, head dim], vLLM's stack
    value = torch.randn(2, 10, 2, 8, generator=g)
    hidden = torch.randn(10, identity.hidden_size, generator=g)
    buffer.insert(tokens, roi, key, value, hidden)
    # the whole chunks of the roi prefix also went into the prefix store: others reuse them
    assert store.for_model(identity, 4).lookup(tokens.tolist() + [1, 2, 3]) == 8

    assert buffer.drop_select(torch.arange(11, 21), roi) == [None] * 5  # other tokens: a miss
    got = buffer.drop_select(tokens, roi)
    assert torch.equal(got[0], tokens) and torch.equal(got[1], roi)
    assert torch.equal(got[2], key) and torch.equal(got[3], value) and torch.equal(got[4], hidden)
    assert buffer.drop_select(tokens, roi) == [None] * 5  # selected means removed
    buffer.close()


def test_lookup_buffer_drop_select_none_takes_any_entry_once(store_url):
    identity = make_identity()
    store = open_store(store_url)
    buffer = StoreLookupBuffer(store, identity, chunk_size=4)
    inserted = set()
    for i in range(3):
        tokens = torch.arange(i * 100, i * 100 + 6)
        kv = torch.full((2, 6, 16), float(i))
        buffer.insert(tokens, torch.ones(6, dtype=torch.bool), kv, kv, None)
        inserted.add(tuple(tokens.tolist()))
    taken = set()
    for _ in range(3):
        tokens, roi, key, value, hidden = buffer.drop_select(None, None)
        assert hidden is None and key.shape == (2, 6, 16)
        assert torch.all(key == key.flatten()[0])  # an entry's own KV, not a mix
        taken.add(tuple(tokens.tolist()))
    assert taken == inserted
    assert buffer.drop_select(None, None) == [None] * 5
    # another model's buffer over the same store sees none of them
    buffer.insert(torch.arange(6), torch.ones(6, dtype=torch.bool), kv, kv, None)
    other = StoreLookupBuffer(store, make_identity(num_layers=3), chunk_size=4)
    assert other.drop_select(None, None) == [None] * 5
    store.close()


def test_lookup_buffer_a_partial_roi_stores_only_its_leading_whole_chunks(tmp_path):
    identity = make_identity()
    store = open_store(tmp_path / "s")
    buffer = StoreLookupBuffer(store, identity, chunk_size=4)
    tokens = torch.arange(12)
    roi = torch.tensor([True] * 6 + [False] * 6)
    kv = torch.randn(2, 12, 16)
    buffer.insert(tokens, roi, kv, kv, None)
    assert store.for_model(identity, 4).lookup(tokens) == 4  # tokens 4-7 are not all of interest
    assert buffer.drop_select(tokens, torch.ones(12, dtype=torch.bool)) == [None] * 5  # roi is part of the key
    got = buffer.drop_select(tokens, roi)
    assert torch.equal(got[1], roi) and torch.equal(got[2], kv)


def test_lookup_buffer_rejects_wrong_shapes(tmp_path):
    buffer = StoreLookupBuffer(open_store(tmp_path / "s"), make_identity(), chunk_size=4)
    tokens, roi = torch.arange(5), torch.ones(5, dtype=torch.bool)
    with pytest.raises(UsageError, match="key must be"):
        buffer.insert(tokens, roi, torch.zeros(2, 4, 16), torch.zeros(2, 5, 16), None)
    with pytest.raises(UsageError, match="roi must be"):
        buffer.insert(tokens, torch.ones(4, dtype=torch.bool), torch.zeros(2, 5, 16), torch.zeros(2, 5, 16), None)
    with pytest.raises(UsageError, match="both"):
        buffer.drop_select(tokens, None)


def test_key_value_buffer_put_get_replace_delete(store_url):
    store = open_store(store_url)
    buffer = StoreKeyValueBuffer(store, owns_store=True)
    assert buffer.get("layer0/key") is None
    first = torch.randn(3, 4).to(torch.bfloat16)
    buffer.put("layer0/key", first)
    assert torch.equal(buffer.get("layer0/key"), first)
    second = torch.arange(6, dtype=torch.int32)
    buffer.put("layer0/key", second)  # put replaces
    assert torch.equal(buffer.get("layer0/key"), second)
    buffer.put("layer0/key", None)  # a None value deletes
    assert buffer.get("layer0/key") is None
    # a damaged tensor object is never returned
    buffer.put("k", first)
    from kvtool.store.objects import tensor_name

    name = tensor_name("k")
    data = bytearray(store.backend.get(name))
    data[-1] ^= 0x40
    store.backend.put(name, bytes(data), replace=True)
    assert buffer.get("k") is None and store.counters.refused == 1
    buffer.close()


# --- the commands --------------------------------------------------------------------


def test_store_put_ls_stats_rm_json(tmp_path, capsys, store_url):
    identity = make_identity()
    a = write_kv_file(tmp_path / "a.kvc", identity=identity, num_tokens=18, chunk_size=4, codec="zstd")
    b = write_kv_file(tmp_path / "b.kvc", identity=identity, num_tokens=10, chunk_size=4,
                      token_ids=a.token_ids[:8] + [7, 7], kv=a.kv[:, :, :10])
    code, out, _ = call(capsys, "store", "put", a.path, b.path, "--store", store_url, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["ok"] and [f["chunks"] for f in doc["files"]] == [4, 2]
    assert [f["stored"] for f in doc["files"]] == [4, 0] and doc["files"][1]["present"] == 2  # shared prefix
    code, out, _ = call(capsys, "store", "ls", "--store", store_url, "--json")
    rows = json.loads(out)["objects"]
    assert len(rows) == 4 and {r["kind"] for r in rows} == {"chunk"} and {r["chunk_size"] for r in rows} == {4}
    code, out, _ = call(capsys, "store", "stats", "--store", store_url, "--json")
    stats = json.loads(out)
    assert stats["objects"] == 4 and stats["by_kind"] == {"chunk": 4} and len(stats["models"]) == 1
    code, out, _ = call(capsys, "store", "stats", "--store", store_url)
    assert code == 0 and "4 chunks" in out
    code, out, _ = call(capsys, "store", "rm", rows[0]["name"], "--store", store_url, "--json")
    assert code == 0 and json.loads(out)["removed"] == 1
    code, out, _ = call(capsys, "store", "rm", "--all", "--store", store_url, "--json")
    assert json.loads(out)["removed"] == 3


def test_store_fsck_finds_and_removes_damage(tmp_path, capsys):
    identity = make_identity()
    f = write_kv_file(tmp_path / "a.kvc", identity=identity, num_tokens=16, chunk_size=4)
    url = str(tmp_path / "store")
    assert call(capsys, "store", "put", f.path, "--store", url)[0] == 0
    store = open_store(url)
    names = sorted(o.name for o in store.backend.scan())
    path = tmp_path / "store" / names[1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    (tmp_path / "store" / "chunks" / "stray.txt").write_text("not an object")
    code, out, _ = call(capsys, "store", "fsck", "--store", url, "--no-repair", "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["checked"] == 5 and len(report["damaged"]) == 2
    assert {d["name"] for d in report["damaged"]} == {names[1], "chunks/stray.txt"}
    code, out, _ = call(capsys, "store", "fsck", "--store", url)
    assert code == 0 and "2 damaged, removed 2" in out
    assert not path.exists()
    # the store still serves the intact chunks before the removed one, and nothing refused
    cache = store.for_model(identity, 4)
    hit = cache.get_prefix(f.token_ids)
    assert hit.num_tokens == cache.lookup(f.token_ids) < 16 and not hit.refused
    if hit.num_tokens:  # the removed chunk may have been the first: then nothing is served
        assert torch.equal(hit.kv(), f.kv[:, :, :hit.num_tokens])


def test_store_gc_caps_the_store(tmp_path, capsys):
    identity = make_identity()
    f = write_kv_file(tmp_path / "a.kvc", identity=identity, num_tokens=40, chunk_size=4)
    url = str(tmp_path / "store")
    call(capsys, "store", "put", f.path, "--store", url)
    sizes = [o.size for o in open_store(url).backend.scan()]
    code, out, _ = call(capsys, "store", "gc", "--store", url, "--max-bytes", str(sum(sizes) // 2), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["removed"] >= len(sizes) // 2 and doc["remaining_bytes"] <= sum(sizes) // 2
    code, _, err = call(capsys, "store", "gc", "--store", url, "--max-bytes", "lots")
    assert code == 2 and "not a size" in err


@pytest.mark.parametrize("url, message", [
    ("ftp://host/x", "a store is a folder"),
    ("redis://127.0.0.1:1/0", "cannot be reached"),
])
def test_store_errors_are_one_line(tmp_path, capsys, url, message):
    code, out, err = call(capsys, "store", "stats", "--store", url)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err + out


def test_a_folder_with_other_files_is_not_a_store(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = call(capsys, "store", "put", write_kv_file(tmp_path / "a.kvc").path, "--store", tmp_path)
    assert code == 2 and "not a kvtool store" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.kvc", "notes.txt"]  # nothing written there


def test_store_put_refuses_a_forged_fingerprint(tmp_path, capsys):
    from fixtures import rebuild

    f = write_kv_file(tmp_path / "a.kvc", num_tokens=8, chunk_size=4)
    forged = rebuild(f.path, lambda doc: doc["model"].__setitem__("rms_norm_eps", 0.5) or doc)
    bad = tmp_path / "forged.kvc"
    bad.write_bytes(forged)
    code, _, err = call(capsys, "store", "put", bad, "--store", tmp_path / "s")
    assert code != 0 and "fingerprint" in err


# --- with the default model ----------------------------------------------------------


@pytest.mark.model
def test_capture_store_get_and_replay_store(tmp_path, capsys, default_model, store_url):
    prompt = ("The chunk store keeps the KV cache of many prompts, one object per chunk, so that a prompt "
              "which shares a prefix with one seen before loads those chunks instead of computing them. ") * 6
    code, out, err = call(capsys, "capture", "--prompt", prompt, "--store", store_url, "--chunk-size", "32",
                          "--codec", "zstd", "--json")
    assert code == 0, err
    doc = json.loads(out)
    whole = doc["num_tokens"] // 32
    assert doc["output"] is None and doc["store"]["stored"] == whole and whole >= 3

    longer = prompt + "What does the store do with damaged objects?"
    # the whole chunks, then the captured tokens past them to the engine's 16-token block (a piece)
    cached = doc["num_tokens"] // 16 * 16
    assert cached > whole * 32
    out_file = tmp_path / "prefix.kvc"
    code, out, err = call(capsys, "store", "get", "--store", store_url, "--prompt", longer,
                          "-o", out_file, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["cached_tokens"] == cached and got["codecs"] == ["zstd"]
    with ContainerReader(out_file) as reader:
        assert reader.num_tokens == cached and len(reader.chunks) == whole + 1
    assert call(capsys, "verify", out_file)[0] == 0
    # --codec: what was asked for, the chunks stored in another codec re-encoded, those in it copied
    for codec, reencoded in (("raw", whole + 1), ("zstd", 0)):
        as_codec = tmp_path / f"prefix-{codec}.kvc"
        code, out, err = call(capsys, "store", "get", "--store", store_url, "--prompt", longer, "-o", as_codec,
                              "--codec", codec, "--json")
        assert code == 0, err
        got = json.loads(out)
        assert (got["codecs"], got["reencoded"], got["cached_tokens"]) == ([codec], reencoded, cached)
        with ContainerReader(as_codec) as reader, ContainerReader(out_file) as stored:
            assert {c.codec for c in reader.chunks} == {codec}
            assert torch.equal(reader.read_range(0, cached), stored.read_range(0, cached))  # lossless both
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no scratch file left
    code, _, err = call(capsys, "store", "get", "--store", store_url, "--prompt", longer, "-o", tmp_path / "x.kvc",
                        "--codec", "lz4")
    assert code == 2 and "lz4" in err

    code, out, err = call(capsys, "replay", "--store", store_url, "--prompt", longer,
                          "--compare", "--continue", "4", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["reused_tokens"] == cached and r["codecs"] == ["zstd"] and r["top1_agreement"] >= 0.75

    code, _, err = call(capsys, "store", "get", "--store", store_url, "--prompt", "Nothing like it.", "-o",
                        tmp_path / "none.kvc")
    assert code == 1 and "no whole chunk" in err and not (tmp_path / "none.kvc").exists()
    code, out, err = call(capsys, "replay", "--store", store_url, "--prompt", "Nothing like it.", "--continue", "2",
                          "--json")
    assert code == 0 and json.loads(out)["reused_tokens"] == 0


def test_redis_evicts_by_its_own_lru_policy(redis_server):
    """A Redis capped with maxmemory and allkeys-lru keeps what was used last (its LRU clock ticks
    once a second); what was evicted is a miss, and nothing returned is damaged."""
    import time

    from redis_server import RedisServer

    identity = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)
    with RedisServer(maxmemory="4mb") as server:
        store = open_store(server.url)
        cache = store.for_model(identity, chunk_size=64)
        sequences = []

        def put(i):
            tokens = [i * 1000 + t for t in range(64)]
            kv = torch.randn(2, 4, 64, 256).to(torch.bfloat16)  # 128 KiB a chunk
            cache.put_sequence(tokens, kv)
            sequences.append((tokens, kv))

        import redis

        client = redis.Redis.from_url(server.url)
        while len(sequences) < 100 and client.dbsize() == len(sequences):  # fill it: until one is evicted
            put(len(sequences))
        assert 3 <= client.dbsize() < len(sequences)
        time.sleep(1.2)
        hot = next(i for i, (t, _) in enumerate(sequences) if cache.lookup(t))
        assert torch.equal(cache.get_prefix(sequences[hot][0]).kv(), sequences[hot][1])  # used: now the newest
        time.sleep(1.2)
        for _ in range(2):  # two more: two of the others go
            put(len(sequences))
        client.close()
        kept = [cache.lookup(t) == 64 for t, _ in sequences]
        assert kept[hot] and kept[-1] and kept[-2] and not all(kept), (hot, kept)
        for (tokens, kv), present in zip(sequences, kept):
            hit = cache.get_prefix(tokens)
            assert hit.num_tokens == (64 if present else 0)
            if present:
                assert torch.equal(hit.kv(), kv)
        assert store.counters.refused == 0
        store.close()


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "vllm", "kv_tuple"])
def test_load_prefix_writes_straight_into_paged_buffers(tmp_path, layout):
    """load_prefix into the paged connector's buffers: each checked chunk lands in the engine's
    blocks at the sequence's (shuffled) slots; reading them back gives the stored KV."""
    from kvtool.connectors import ConnectorTarget, PagedMemConnectorV2

    from test_connectors import make_buffers

    identity = make_identity()  # 2 layers, 2 kv heads, head_dim 8
    cache = open_store(tmp_path / "s").for_model(identity, chunk_size=4)
    tokens = list(range(100, 114))
    kv = torch.randn(2, 2, 14, 16).to(torch.bfloat16)
    cache.put_sequence(tokens, kv, codec="zstd")
    block, blocks = 4, 6
    gen = torch.Generator().manual_seed(0)
    buffers = make_buffers(layout, 2, blocks, block, 2, 8, torch.bfloat16, gen, fill="zeros")
    order = torch.randperm(blocks, generator=gen)
    slots = torch.cat([order[i // block] * block + torch.arange(block) for i in range(0, 16, block)])[:14]
    connector = PagedMemConnectorV2(16, 2, layout=layout)
    hit = cache.load_prefix(tokens, ConnectorTarget(connector, kvcaches=buffers, slot_mapping=slots))
    assert hit.num_tokens == 12 and hit.chunks == [] and hit.codecs == ["zstd"] * 3
    back = connector.allocate(12, torch.bfloat16)
    connector.from_gpu(back, 0, 12, kvcaches=buffers, slot_mapping=slots)
    assert torch.equal(back.tensor, kv[:, :, :12])


def test_the_stored_chunk_size_is_found(store_url):
    """Without a chunk size, the store's reads use the stored size that covers the most."""
    identity = make_identity()
    store = open_store(store_url)
    tokens = list(range(300, 340))
    store.for_model(identity, 8).put_sequence(tokens[:16], torch.zeros(2, 2, 16, 16))
    store.for_model(identity, 12).put_sequence(tokens, torch.zeros(2, 2, 40, 16))
    assert store.chunk_sizes(identity) == [8, 12]
    assert store.best_cache(identity, tokens).chunk_size == 12  # 36 tokens at 12 beat 16 at 8
    assert store.best_cache(identity, tokens[:17]).chunk_size == 8  # 16 at 8 beat 12 at 12
    assert store.best_cache(identity, tokens, chunk_size=8).chunk_size == 8
    assert store.chunk_sizes(make_identity(num_layers=3)) == []
    assert store.best_cache(make_identity(num_layers=3), tokens).chunk_size == 256
    store.close()


@pytest.mark.parametrize("args, message", [
    (["store", "ls", "--limit", "0"], "--limit must be at least 1"),
    (["store", "ls", "--kind", "blob"], "is not one of chunk"),
    (["store", "rm"], "give object names"),
    (["store", "gc", "--max-bytes", "-1G"], "not a size"),
])
def test_store_bad_arguments_are_one_line(tmp_path, capsys, args, message):
    url = str(tmp_path / "store")
    open_store(url).close()
    code, out, err = call(capsys, *args, "--store", url)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in out + err
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["kvtool-store.json"]  # nothing written


@pytest.mark.model
def test_a_namespace_keeps_its_chunks_to_itself(tmp_path, capsys, default_model):
    """`--namespace`: chunks captured under one namespace are served to the same namespace only
    (store.md §3): another namespace, or none, gets misses through `replay --store` and `store get`."""
    store = tmp_path / "store"
    prompt = "Tenants share one store but never one another's chunks, whatever the prompt. " * 8
    code, out, err = call(capsys, "capture", "--prompt", prompt, "--store", store, "--chunk-size", "32",
                          "--namespace", "team-a", "--json")
    assert code == 0, err
    whole = json.loads(out)["store"]["stored"]
    assert whole >= 3
    reused = {}
    for namespace in ("team-a", "team-b", None):
        args = ["replay", "--store", store, "--prompt", prompt, "--continue", "1", "--json"]
        code, out, err = call(capsys, *args, *(["--namespace", namespace] if namespace else []))
        assert code == 0, err
        reused[namespace] = json.loads(out)["reused_tokens"]
    assert reused == {"team-a": whole * 32, "team-b": 0, None: 0}
    code, _, err = call(capsys, "store", "get", "--store", store, "--prompt", prompt, "-o", tmp_path / "b.kvc",
                        "--namespace", "team-b")
    assert code == 1 and "in namespace 'team-b'" in err
    code, _, err = call(capsys, "store", "get", "--store", store, "--prompt", prompt, "-o", tmp_path / "a.kvc",
                        "--namespace", "team-a")
    assert code == 0, err
    # the same file put under another namespace is that namespace's; fsck finds every object intact
    code, out, err = call(capsys, "store", "put", tmp_path / "a.kvc", "--store", store, "--namespace", "team-b",
                          "--json")
    assert code == 0 and json.loads(out)["totals"]["stored"] == whole, err
    code, out, _ = call(capsys, "store", "fsck", "--store", store, "--json")
    # both namespaces' chunks, and the block index entry of each of team-a's (captured at the
    # engine's 16-token block: one per 32-token chunk; `store put` writes whole chunks only)
    assert code == 0 and json.loads(out)["intact"] == 2 * whole + whole


def test_namespace_needs_a_store_and_fits_its_limits(capsys, tmp_path):
    code, _, err = call(capsys, "replay", tmp_path / "x.kvc", "--namespace", "a")
    assert code == 2 and "--namespace" in err
    code, _, err = call(capsys, "store", "put", tmp_path / "x.kvc", "--store", tmp_path / "s", "--namespace", "a" * 2000)
    assert code == 2 and "namespace must be UTF-8 text of at most 1024" in err
    code, _, err = call(capsys, "store", "put", tmp_path / "x.kvc", "--store", tmp_path / "s",
                        "--namespace", "team-\udcff")  # an argument of undecodable bytes
    assert code == 2 and "namespace must be UTF-8 text" in err and "Traceback" not in err


def test_a_redis_password_never_appears_in_messages(capsys):
    """A store URL's password (and user) is `***` wherever kvtool names the store: its `url`, the
    one-line error of a server that does not answer, `--json`."""
    from kvtool.store.redis_backend import redacted

    assert redacted("redis://:s3cret@127.0.0.1:6379/0") == "redis://***@127.0.0.1:6379/0"
    assert redacted("rediss://user:s3cret@[::1]:6380/2") == "rediss://***@[::1]:6380/2"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert "s3cret" not in redacted("redis://:s3cret@host:notaport/0")
    code, out, err = call(capsys, "store", "stats", "--store", "redis://:s3cret@127.0.0.1:1/0", "--json")
    assert code != 0 and "s3cret" not in out + err and "***@127.0.0.1:1/0" in out + err


def test_a_wrong_redis_password_or_an_acl_refusal_is_said_as_such(capsys, tmp_path):
    """A Redis server that answers and refuses the user name or password is not "unreachable", and
    is not retried as a lost server is; nor is a user whose ACL keys do not include kvtool's. The
    password never appears."""
    import time

    from redis_server import RedisServer

    users = ("--user", "default", "off", "--user", "kv", "on", ">s3cret-pw", "~kvtool:*", "+@all",
             "--user", "other", "on", ">0ther-pw", "~someone-else:*", "+@all")
    with RedisServer(extra=users) as server:
        url = "redis://{}@127.0.0.1:%d/0" % server.port
        code, out, err = call(capsys, "store", "stats", "--store", url.format("kv:s3cret-pw"), "--json")
        assert code == 0, err
        began = time.monotonic()
        code, out, err = call(capsys, "store", "stats", "--store", url.format("kv:wrong-pw"))
        assert code != 0 and "refused the user name or password" in err and "cannot be reached" not in err
        assert time.monotonic() - began < 3  # (a lost server is retried for ~5 s)
        assert "wrong-pw" not in out + err and len(err.strip().splitlines()) == 1
        kv = write_kv_file(tmp_path / "a.kvc", identity=make_identity(), num_tokens=16, chunk_size=4).path
        code, out, err = call(capsys, "store", "put", kv, "--store", url.format("other:0ther-pw"))
        assert code != 0 and "may not do this" in err and "0ther-pw" not in out + err, err
        code, out, err = call(capsys, "store", "put", kv, "--store", url.format("kv:s3cret-pw"))
        assert code == 0, err


def test_a_redis_password_can_stay_out_of_the_url(capsys, tmp_path, monkeypatch):
    """From KVTOOL_REDIS_PASSWORD, or the file the URL's password_file names; a password in the URL
    wins. None of them is ever shown."""
    from redis_server import RedisServer

    users = ("--user", "default", "off", "--user", "kv", "on", ">s3cret-pw", "~kvtool:*", "+@all")
    secret = tmp_path / "redis-password"
    secret.write_text("s3cret-pw\n")
    with RedisServer(extra=users) as server:
        at = f"redis://kv@127.0.0.1:{server.port}/0"
        monkeypatch.delenv("KVTOOL_REDIS_PASSWORD", raising=False)
        code, out, err = call(capsys, "store", "stats", "--store", at)
        assert code != 0 and "refused the user name or password" in err
        code, out, err = call(capsys, "store", "stats", "--store", f"{at}?password_file={secret}", "--json")
        assert code == 0 and "s3cret" not in out + err, err
        monkeypatch.setenv("KVTOOL_REDIS_PASSWORD", "s3cret-pw")
        code, out, err = call(capsys, "store", "stats", "--store", at, "--json")
        assert code == 0 and "s3cret" not in out + err, err
        monkeypatch.setenv("KVTOOL_REDIS_PASSWORD", "wrong-pw")  # the URL's own wins
        code, out, err = call(capsys, "store", "stats", "--store", f"redis://kv:s3cret-pw@127.0.0.1:{server.port}/0")
        assert code == 0, err
        code, out, err = call(capsys, "store", "stats", "--store", f"{at}?password_file={tmp_path / 'missing'}")
        assert code != 0 and "cannot read its password_file" in err and len(err.strip().splitlines()) == 1


def test_a_tls_only_redis_with_client_certificates(capsys, redis_tls_server):
    """rediss:// with the CA, a client certificate and an ACL user works, and shows no password;
    the same server without the client certificate is one line, never a traceback."""
    url = redis_tls_server.url.replace("rediss://", "rediss://kv:tls-s3cret@", 1)
    code, out, err = call(capsys, "store", "stats", "--store", url, "--json")
    assert code == 0 and "tls-s3cret" not in out + err and "***@127.0.0.1" in out, err
    bare = url.split("&ssl_certfile=")[0]  # the CA only: the server asks for a client certificate
    code, out, err = call(capsys, "store", "stats", "--store", bare)
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "tls-s3cret" not in out + err


def test_lookup_buffer_never_hands_out_an_entry_of_nan(store_url):
    """A lookup-buffer entry written with NaN and a valid CRC (the seed's `insert` stores what it is
    given) is refused at `drop_select` as a load refuses such a chunk: a miss, never the NaN."""
    identity = make_identity()
    buffer = StoreLookupBuffer(open_store(store_url), identity, chunk_size=4, owns_store=True)
    tokens, roi = torch.arange(10, 16), torch.ones(6, dtype=torch.bool)
    key = torch.randn(2, 6, 2, 8, generator=torch.Generator().manual_seed(1))
    key[1, 3, 0, 5] = float("nan")
    buffer.insert(tokens, roi, key, key.clone(), None)
    assert buffer.drop_select(tokens, roi) == [None] * 5
    assert buffer.store.counters.refused == 1
    buffer.close()
