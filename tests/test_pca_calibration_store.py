"""pca's calibration travels with the data through the store (issue 50 item 2, store.md §4.7,
pca.md §3.1): a writer of pca chunks puts the calibration object once, under its digest; a reader
without it fetches it by that digest, checks it, and keeps it in its own calibration folder.

The two hosts are two processes with separate cache folders ($KVTOOL_CACHE) sharing one real
redis-server; only the writer's folder holds the object (as `kvtool calibrate` leaves it). The
calibration is the test vectors' (format-spec/vectors/pca: 2 layers, one KV head of 8)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fixtures import cli, make_identity, write_kv_file
from kvtool.codecs.pca import calibration as calmod
from pca_hosts import DIGEST, VECTORS, as_reader_host, writer_host  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
PARAMS = {"version": 1, "calibration": DIGEST, "quality": "97", "step": 0.8, "sinks": 4, "lanes": 16, "position": 0}

# one process's side: put (the writer) or load (a reader) 3 chunks of 4 tokens of pca KV, then
# print what it loaded (the chunks' bytes, hashed) and what it found
SIDE = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    sys.path.insert(0, {tests!r})
    from fixtures import make_identity, make_kv
    from kvtool.store import open_store
    role, url = sys.argv[1], sys.argv[2]
    identity = make_identity(num_layers=2, num_kv_heads=1, head_dim=8)
    tokens = list(range(100, 112))
    with open_store(url) as store:
        cache = store.for_model(identity, chunk_size=4)
        if role == "put":
            put = cache.put_sequence(tokens, make_kv(identity, 12, seed=7), codec="pca", params={params!r})
            assert put.stored == 3, put
        hit = cache.get_prefix(tokens)
        print(json.dumps({{"chunks": len(hit.chunks), "codecs": hit.codecs, "unreadable": hit.unreadable,
                          "kv": hashlib.sha256(b"".join(c.contiguous().view(torch.int16).numpy().tobytes()
                                                         for c in hit.chunks)).hexdigest(),
                          "misses": store.counters.misses}}))
""")


def host(tmp_path: Path, name: str) -> dict:
    """A host's environment: its own cache folder, no calibration folders of the vectors'."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTOOL_CALIBRATION")}
    env["KVTOOL_CACHE"] = str(tmp_path / name / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_side(role: str, url: str, env: dict) -> dict:
    script = SIDE.format(tests=str(ROOT / "tests"), params=PARAMS)
    done = subprocess.run([sys.executable, "-c", script, role, url], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_hosts_sharing_redis_read_each_others_pca_chunks(redis_url, tmp_path):
    """Host A (the object in its cache folder) puts pca chunks; host B, whose folders hold no
    calibration, loads all of them, decoded exactly as A decodes them, having fetched the object
    from the store by its digest and kept it in its own folder. Before, B counted every chunk a
    miss ("calibration object ... not found")."""
    a, b = host(tmp_path, "a"), host(tmp_path, "b")
    own = Path(a["KVTOOL_CACHE"]) / "calibration"
    own.mkdir(parents=True)
    shutil.copy(VECTORS / f"{DIGEST}.kvcal", own)  # what `kvtool calibrate` leaves on the writer's host
    wrote = run_side("put", redis_url, a)
    assert wrote["chunks"] == 3 and wrote["codecs"] == ["pca"] * 3
    kept = Path(b["KVTOOL_CACHE"]) / "calibration" / f"{DIGEST}.kvcal"
    assert not kept.exists()
    read = run_side("load", redis_url, b)
    assert read == {**wrote, "misses": 0}  # every chunk, the same KV bytes
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == DIGEST  # kept in B's own cache folder
    import redis

    client = redis.Redis.from_url(redis_url)
    names = [k.decode() for k in client.keys("*calibrations/*")]
    assert len(names) == 1 and names[0].endswith(f"calibrations/{DIGEST[:2]}/{DIGEST}.kvcal")
    client.delete(*names)  # gone from the store (an eviction): B reads from its own folder now
    client.close()
    assert run_side("load", redis_url, b) == read


def pca_file(tmp_path: Path) -> Path:
    return write_kv_file(tmp_path / "p.kvc", identity=make_identity(num_layers=2, num_kv_heads=1, head_dim=8),
                         num_tokens=12, chunk_size=4, codec="pca", params=dict(PARAMS)).path


def test_store_put_of_a_pca_file_puts_its_calibration_once(writer_host, tmp_path, capsys, monkeypatch):
    """`store put` of a pca file: the object is put with the chunks (once: a second put writes
    nothing); `store ls --kind calibration` lists it, `fsck` checks it intact; a reader host
    without it loads every chunk."""
    store = tmp_path / "store"
    f = pca_file(tmp_path)
    assert cli(capsys, "store", "put", f, "--store", store, "--json")[0] == 0
    obj = store / "calibrations" / DIGEST[:2] / f"{DIGEST}.kvcal"
    assert obj.read_bytes() == (writer_host / f"{DIGEST}.kvcal").read_bytes()
    mtime = obj.stat().st_mtime_ns
    assert cli(capsys, "store", "put", f, "--store", store, "--json")[0] == 0
    assert obj.stat().st_mtime_ns == mtime
    code, listing, _ = cli(capsys, "store", "ls", "--store", store, "--kind", "calibration", "--json")
    assert code == 0 and [r["digest"] for r in listing["objects"]] == [DIGEST]
    code, report, _ = cli(capsys, "store", "fsck", "--store", store, "--json")
    assert code == 0 and report["damaged"] == [] and report["checked"] == 4
    reader = as_reader_host(monkeypatch, tmp_path)
    from kvtool.store import open_store

    with open_store(store) as opened:
        hit = opened.for_model(make_identity(num_layers=2, num_kv_heads=1, head_dim=8), chunk_size=4) \
            .get_prefix(tokens_of(f))
        assert len(hit.chunks) == 3 and not hit.unreadable
    assert (reader / f"{DIGEST}.kvcal").exists()


def tokens_of(f: Path) -> list[int]:
    import kvtool

    with kvtool.open(f) as r:
        return r.token_ids().tolist()


def test_a_damaged_calibration_object_is_refused_removed_and_the_chunks_missed(writer_host, tmp_path, monkeypatch):
    """Bytes that do not hash to the name are never used: refused, removed (so the next writer
    puts it back), the reader's chunks misses that say why; nothing is kept in its folder."""
    from kvtool.store import open_store

    identity = make_identity(num_layers=2, num_kv_heads=1, head_dim=8)
    with open_store(tmp_path / "store") as store:
        from fixtures import make_kv

        store.for_model(identity, chunk_size=4).put_sequence(list(range(8)), make_kv(identity, 8, seed=3),
                                                             codec="pca", params=dict(PARAMS))
    obj = tmp_path / "store" / "calibrations" / DIGEST[:2] / f"{DIGEST}.kvcal"
    data = bytearray(obj.read_bytes())
    data[-1] ^= 1
    obj.write_bytes(bytes(data))
    reader = as_reader_host(monkeypatch, tmp_path)
    with open_store(tmp_path / "store") as store:
        hit = store.for_model(identity, chunk_size=4).get_prefix(list(range(8)))
        assert hit.chunks == [] and hit.unreadable and DIGEST[:16] in hit.unreadable[0]
    assert not obj.exists() and not (reader / f"{DIGEST}.kvcal").exists()


def test_a_closed_or_dropped_store_is_no_longer_looked_in(tmp_path, monkeypatch):
    """A store offers its objects to pca's decoder while it is open: closed (or dropped unclosed),
    it is neither asked nor named in the one line of a miss."""
    import gc

    from kvtool.store import open_store

    as_reader_host(monkeypatch, tmp_path)
    closed, dropped = open_store(tmp_path / "closed"), open_store(tmp_path / "dropped")
    urls = [closed.url, dropped.url]
    closed.close()
    del dropped
    gc.collect()
    with pytest.raises(calmod.CalibrationNotFound) as err:
        calmod.find(DIGEST)
    assert not any(url in str(err.value) for url in urls)
    with open_store(tmp_path / "open") as store:
        with pytest.raises(calmod.CalibrationNotFound) as err:
            calmod.find(DIGEST)
        assert store.url in str(err.value)
