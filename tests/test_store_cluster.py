"""The chunk store on a real Redis Cluster (`redis+cluster://`, store.md §6.2): 3 masters with a
replica each on loopback ports (tests/redis_server.py). The backends' whole contract runs on it in
test_store_contract.py ("redis-cluster"); here what only a cluster has: chunks spread over its
slots, batches that stay one round trip per node, scans, stats, gc and fsck over every primary,
a master killed mid-run (its replica promoted, the same client going on), and a node that stays
down (one line, after the single server's backoff)."""

from __future__ import annotations

import json
import random
import threading
import time
import traceback
from collections import Counter

import numpy as np
import pytest
import torch

from kvtool.cli.app import run
from kvtool.errors import StoreUnavailable, StoreUrlInvalid
from kvtool.store import open_store
from kvtool.store.urls import parse_store_url

from fixtures import make_identity, write_kv_file

CHUNK = 4
IDENTITY = make_identity(num_layers=2, num_kv_heads=2, head_dim=8)
VOCAB = 50_000


def call(capsys, *args):
    capsys.readouterr()
    code = run([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def expected_kv(tokens: list[int]) -> torch.Tensor:
    """KV that is a function of each token and its position alone: any chunk can be checked on its
    own against what it must hold (a torn or foreign chunk cannot pass)."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t[None, None, :, None] % 997) / 997 + pos[None, None, :, None] / 4096
    lanes = torch.arange(2 * IDENTITY.num_layers * IDENTITY.num_kv_heads * IDENTITY.head_dim,
                         dtype=torch.float32).reshape(2, IDENTITY.num_layers, 1, -1)
    return (base + lanes / 64).to(torch.bfloat16)


def chunk_is_expected(chunk: torch.Tensor, tokens: list[int], start: int) -> bool:
    return torch.equal(chunk, expected_kv(tokens)[:, :, start:start + CHUNK])


def keys_per_primary(cluster) -> Counter:
    import redis

    counts = Counter()
    for node in cluster.primaries():
        client = redis.Redis(port=node.port)
        counts[node.port] = sum(1 for _ in client.scan_iter(match="kvtool:*"))
        client.close()
    return counts


# --- URLs -----------------------------------------------------------------------------------


def test_cluster_urls_name_every_seed_and_hide_the_password():
    url = parse_store_url("rediss+cluster://kv:s3cret@h1:7000,[::1]:7001,h3/0?ssl_ca_certs=/ca.crt")
    assert url.kind == "cluster" and url.tls and url.password == "s3cret" and url.username == "kv"
    assert url.nodes == (("h1", 7000), ("::1", 7001), ("h3", 6379)) and url.options == (("ssl_ca_certs", "/ca.crt"),)
    assert url.shown == "rediss+cluster://***@h1:7000,[::1]:7001,h3:6379/0?ssl_ca_certs=/ca.crt"
    from kvtool.store.redis_backend import redacted

    shown = redacted("redis+cluster://kv:s3cret@h1:7000,h2:7001/0?password=other-s3cret")
    assert shown.startswith("redis+cluster://***@h1:7000,h2:7001/0") and "s3cret" not in shown
    for bad in ("redis+cluster://h1:7000,:7001/0", "redis+cluster://h1:notaport/0", "redis+cluster://h1:0/0"):
        with pytest.raises(StoreUrlInvalid):
            parse_store_url(bad)


def test_cluster_url_errors_are_one_line(capsys, redis_cluster):
    url = redis_cluster.url.replace("/0", "/3")
    code, _, err = call(capsys, "store", "stats", "--store", url)
    assert code == 2 and "database 0 only" in err and len(err.strip().splitlines()) == 1
    code, _, err = call(capsys, "store", "stats", "--store", "redis+cluster://127.0.0.1:x,127.0.0.1:1/0")
    assert code == 2 and "not a port" in err and len(err.strip().splitlines()) == 1


# --- slots, round trips, every primary ------------------------------------------------------


def test_chunks_spread_over_the_slots(redis_cluster, redis_cluster_url):
    store = open_store(redis_cluster_url)
    cache = store.for_model(IDENTITY, CHUNK)
    rng = np.random.default_rng(1)
    for _ in range(6):
        tokens = [int(t) for t in rng.integers(0, VOCAB, 8 * CHUNK)]
        assert cache.put_sequence(tokens, expected_kv(tokens)).stored == 8
    counts = keys_per_primary(redis_cluster)
    assert sum(counts.values()) == 48 and len(counts) == 3 and min(counts.values()) >= 5, counts
    store.close()


def test_batches_are_one_round_trip_per_node(redis_cluster_url, monkeypatch):
    """A prefix lookup, a multi-chunk get and a put each send every node at most one packet of
    commands (no per-key round trips, no CROSSSLOT refusal)."""
    import redis.connection

    store = open_store(redis_cluster_url)
    cache = store.for_model(IDENTITY, CHUNK)
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 8 * CHUNK)]  # 8 chunks: 8 slots
    sent: Counter = Counter()
    real = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        sent[self.port] += 1
        return real(self, command, check_health)
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)

    def round_trips(do, per_node=1):
        sent.clear()
        result = do()
        assert sent and max(sent.values()) == per_node and len(sent) <= 3, dict(sent)
        return result

    names = cache.chunk_names(tokens)
    assert round_trips(lambda: cache.put_sequence(tokens, expected_kv(tokens)), 2).stored == 8  # probe, put
    assert round_trips(lambda: cache.put_sequence(tokens, expected_kv(tokens))).present == 8  # the probe alone
    assert round_trips(lambda: cache.lookup(tokens)) == 8 * CHUNK
    got = round_trips(lambda: store.backend.get_many(names))
    assert all(g is not None for g in got) and round_trips(lambda: store.backend.exists_many(names)) == [True] * 8
    hit = round_trips(lambda: cache.get_prefix(tokens), 2)  # the probe, then one batch of 8
    assert hit.num_tokens == 8 * CHUNK and all(chunk_is_expected(c, tokens, i * CHUNK) for i, c in enumerate(hit.chunks))
    store.close()


def test_stats_gc_fsck_walk_every_primary(redis_cluster, redis_cluster_url, capsys, tmp_path):
    files = []
    for seed in range(3):
        kv = write_kv_file(tmp_path / f"{seed}.kvc", identity=IDENTITY, num_tokens=10 * CHUNK, chunk_size=CHUNK,
                           seed=seed)
        files.append(kv.path)
    code, out, err = call(capsys, "store", "put", *files, "--store", redis_cluster_url, "--namespace", "team-a", "--json")
    assert code == 0 and json.loads(out)["totals"]["stored"] == 30, err
    code, out, err = call(capsys, "store", "put", files[0], "--store", redis_cluster_url, "--json")
    assert code == 0 and json.loads(out)["totals"]["stored"] == 10, err
    assert len(keys_per_primary(redis_cluster)) == 3 and min(keys_per_primary(redis_cluster).values()) > 0
    code, out, err = call(capsys, "store", "stats", "--store", redis_cluster_url, "--json")
    assert code == 0 and json.loads(out)["objects"] == 40, err
    code, out, err = call(capsys, "store", "ls", "--store", redis_cluster_url, "--json")
    assert code == 0 and Counter(o.get("namespace") for o in json.loads(out)["objects"]) == {"team-a": 30, None: 10}
    import redis

    victim = redis_cluster.primaries()[1]  # damage one object on one primary: fsck finds it there
    client = redis.Redis(port=victim.port)
    key = next(client.scan_iter(match="kvtool:*"))
    client.setrange(key, 200, b"\xff\xfe")
    client.close()
    code, out, err = call(capsys, "store", "fsck", "--store", redis_cluster_url, "--json")
    report = json.loads(out)
    assert code == 0 and report["checked"] == 40 and report["removed"] == 1, err
    code, out, err = call(capsys, "store", "gc", "--store", redis_cluster_url, "--max-bytes", "0", "--json")
    assert code == 0 and json.loads(out)["removed"] == 39, err
    assert sum(keys_per_primary(redis_cluster).values()) == 0


# --- failover -------------------------------------------------------------------------------


@pytest.fixture
def own_cluster():
    """A cluster of this test's own (it kills nodes): 3 masters with a replica each, node timeout 1 s."""
    from conftest import _require_redis_cluster_tools
    from redis_server import RedisClusterServers

    _require_redis_cluster_tools()
    cluster = RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000).start()
    yield cluster
    cluster.close()


def test_a_master_killed_mid_run_fails_over(own_cluster):
    """Writers and readers run while a master is SIGKILLed: its replica is promoted, the same
    client goes on reading and writing, every chunk served is the one its prompt asked for, and
    what the dead master had not copied to its replica is a miss, counted, never an error."""
    store = open_store(own_cluster.url)
    cache = store.for_model(IDENTITY, CHUNK)
    events: list[tuple[str, float, str]] = []  # (what, when, detail)
    stop = threading.Event()
    written: list[list[int]] = []

    def writer(seed: int):
        rng = random.Random(seed)
        while not stop.is_set():
            tokens = [rng.randrange(VOCAB) for _ in range(4 * CHUNK + 1)]
            try:
                cache.put_sequence(tokens, expected_kv(tokens))
                written.append(tokens)
                events.append(("put", time.monotonic(), ""))
            except StoreUnavailable as err:  # the failover outlasted the backoff (a loaded machine)
                events.append(("unavailable", time.monotonic(), str(err)))
            except BaseException:  # noqa: BLE001
                events.append(("error", time.monotonic(), traceback.format_exc()))
                return

    def reader(seed: int):
        rng = random.Random(seed)
        while not stop.is_set():
            if not written:
                time.sleep(0.01)
                continue
            tokens = rng.choice(written)
            try:
                hit = cache.get_prefix(tokens)
                right = all(chunk_is_expected(c, tokens, i * CHUNK) for i, c in enumerate(hit.chunks))
                events.append(("hit" if right else "wrong", time.monotonic(), f"{hit.num_tokens}"))
            except StoreUnavailable as err:  # to an engine, a miss (its connector computes the prompt)
                events.append(("unavailable", time.monotonic(), str(err)))
            except BaseException:  # noqa: BLE001
                events.append(("error", time.monotonic(), traceback.format_exc()))
                return

    threads = [threading.Thread(target=writer, args=(s,), daemon=True) for s in (1, 2)]
    threads += [threading.Thread(target=reader, args=(s,), daemon=True) for s in (3, 4)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while sum(e[0] == "hit" for e in events) < 20:
            assert time.monotonic() < deadline and not any(e[0] == "error" for e in events), events[-3:]
            time.sleep(0.05)
        victim = own_cluster.primaries()[0]
        replica = own_cluster.replica_of(victim)
        assert replica is not None
        killed = time.monotonic()
        own_cluster.kill(victim)
        deadline = killed + 30
        while "role:master" not in own_cluster._cli("-p", str(replica.port), "info", "replication"):
            assert time.monotonic() < deadline, "the replica was not promoted"
            time.sleep(0.1)
        promoted = time.monotonic()
        while sum(e[0] in ("put", "hit") and e[1] > promoted + 0.5 for e in events) < 40:
            assert time.monotonic() < promoted + 30, f"no progress after the failover: {events[-3:]}"
            assert not any(e[0] == "error" for e in events), [e for e in events if e[0] == "error"][:1]
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    errors = [e for e in events if e[0] == "error"]
    assert not errors, errors[0][2]
    assert not any(e[0] == "wrong" for e in events)
    # the client rides out the failover with the single server's backoff (~5 s): where the
    # promotion took longer (a loaded machine), calls in between were one line each, never after
    away = [e for e in events if e[0] == "unavailable"]
    assert all(killed < e[1] < promoted + 6 and "\n" not in e[2] for e in away), away[-1:]
    # every prompt written reads back whole, or as a shorter prefix: a lost chunk is a counted miss
    refused_before = store.counters.refused
    for tokens in written[-50:]:
        hit = cache.get_prefix(tokens)
        assert all(chunk_is_expected(c, tokens, i * CHUNK) for i, c in enumerate(hit.chunks))
    assert store.counters.refused == refused_before
    print(f"failover: promoted {promoted - killed:.1f} s after the kill; {len(written)} prompts written, "
          f"{sum(e[0] == 'hit' for e in events)} reads, {store.counters.misses} chunk misses, "
          f"{len(away)} calls unavailable")
    store.close()


def test_a_node_that_stays_down_is_one_line(own_cluster, capsys):
    """A master and its replica both gone: after the single server's backoff, one line
    (StoreUnavailable, exit 2), no traceback; the rest of the store's slots are not blamed."""
    store = open_store(own_cluster.url)
    cache = store.for_model(IDENTITY, CHUNK)
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 12 * CHUNK)]
    cache.put_sequence(tokens, expected_kv(tokens))
    victim = own_cluster.primaries()[0]
    replica = own_cluster.replica_of(victim)
    own_cluster.kill(replica)
    own_cluster.kill(victim)
    began = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        for _ in range(3):
            cache.get_prefix(tokens)
    elapsed = time.monotonic() - began
    message = str(err.value)
    assert "\n" not in message and "the Redis cluster cannot be reached" in message
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert elapsed < 30, f"took {elapsed:.1f} s"
    store.close()
    code, out, cli_err = call(capsys, "store", "stats", "--store", own_cluster.url)
    assert code == 2 and len(cli_err.strip().splitlines()) == 1 and "Traceback" not in cli_err, cli_err


def test_an_unreachable_cluster_is_one_line_and_fast():
    from redis_server import free_port

    from kvtool.store.redis_cluster import RedisClusterBackend

    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/0"  # nothing listens there
    began = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        RedisClusterBackend(url, retry_seconds=0.5)
    assert time.monotonic() - began < 10
    message = str(err.value)
    assert "\n" not in message and url in message and "the Redis cluster cannot be reached" in message
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_what_the_dead_master_had_not_replicated_is_a_miss(own_cluster):
    """The replica is stopped (SIGSTOP) while ~30 MB of chunks are written, so that the master holds
    writes its replica never got; the master is SIGKILLed and the replica resumed and promoted.
    The lost chunks are misses (counted, no refusal, no error), every chunk served is the one asked
    for, and the next put re-stores exactly the holes."""
    import os
    import signal

    model = make_identity(num_layers=8, num_kv_heads=4, head_dim=64)  # 512 KB objects
    store = open_store(own_cluster.url)
    cache = store.for_model(model, 64)
    victim = own_cluster.primaries()[0]
    replica = own_cluster.replica_of(victim)
    rng = np.random.default_rng(7)
    sequences = []
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(20):
            tokens = [int(t) for t in rng.integers(0, VOCAB, 8 * 64)]
            kv = torch.from_numpy(rng.standard_normal((2, 8, len(tokens), 256), dtype=np.float32)).to(torch.bfloat16)
            assert cache.put_sequence(tokens, kv).stored == 8
            sequences.append((tokens, kv))
        own_cluster.kill(victim)
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while "role:master" not in own_cluster._cli("-p", str(replica.port), "info", "replication"):
        assert time.monotonic() < deadline, "the replica was not promoted"
        time.sleep(0.1)
    served = 0
    for tokens, kv in sequences:
        hit = cache.get_prefix(tokens)
        served += len(hit.chunks)
        assert all(torch.equal(c, kv[:, :, i * 64:(i + 1) * 64]) for i, c in enumerate(hit.chunks))
    assert store.counters.refused == 0
    assert served + store.counters.misses == 20 * 8 and store.counters.misses > 0, (served, store.counters.misses)
    restored = sum(cache.put_sequence(tokens, kv).stored for tokens, kv in sequences)
    assert restored >= 1 and all(cache.get_prefix(t).num_tokens == 8 * 64 for t, _ in sequences)
    print(f"after the failover {20 * 8 - served} of 160 chunks were misses (a lost chunk ends its prefix); "
          f"{restored} lost chunks re-stored")
    store.close()
