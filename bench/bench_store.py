"""The chunk store's throughput, deduplication and lookup latency, next to plain peers.

    python bench/bench_store.py [--quick] [--repeat 3] [--json OUT] [--dir TMP] [--fresh-malloc] [--only cluster]

1. put/get throughput of the memory tier (memory://), the local store (a folder) and Redis (a
   redis-server this bench starts, no maxmemory), each next to its plain peer moving the same
   object bytes in the same run: a Python dict; a plain file write (open/write/close, and
   write + fsync + rename + directory fsync, the store's atomicity) and read (open/read/close,
   results dropped or all kept); redis-py's SET/GET (and MGET of 8) on the store's own connection.
   Once at the backend level (`store.backend.put/get` of real chunk objects), once at the
   ModelCache level (`put_sequence`, `get_prefix` to tensors: every object check and the raw
   decode). Chunks of a SmolLM2-135M-shaped model (30 layers, 3 KV heads, head_dim 64, bf16,
   random KV): 256 tokens (5.9 MB) and 16 tokens (369 KB, for ops/s). Best of --repeat, peers and
   store in alternating order; minor page faults per op beside each time.
2. Where a get's and a get_prefix's time goes, step by step (256- and 16-token chunks), and where
   put_sequence's encode goes.
3. Deduplication: prompts sharing a long system prompt, put_sequence into a local store.
4. `lookup` latency of a 16-chunk prompt in stores of 1k and 100k chunks (a 1-layer, 1-head,
   head_dim 8 model at chunk size 16; filled through backend.put_many of encoded chunk objects),
   median and p99, next to the bare existence checks of the same names.
5. Block prefixes (`--blocks-only` runs this alone): per-object overhead against object size, the
   cost of a put at block size 16, and lookups among 100k sequences stored with their pieces and
   block index entries.
6. Redis Cluster and TLS (`--only cluster` runs this part alone): put_many/get_many throughput of
   one client process's threads (the same count in every row) through the store's backend against
   one plain redis-server, a cluster of 1 master and one of 3 masters (no replicas: what is
   measured is the spreading, not the replication), batches of 8; and the same server reached in
   plain text and over TLS (one redis-server with a plain and a TLS port, certificates made by
   openssl for the run).

Temp folders and the Redis server are removed at the end, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import ClassVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvtool.format.hashing import ZERO_HASH, chain_hash, crc32  # noqa: E402
from kvtool.format.manifest import parse_manifest  # noqa: E402
from kvtool.identity import ModelIdentity  # noqa: E402
from kvtool.store import open_store, objects  # noqa: E402
from kvtool.store.redis_backend import KEY_PREFIX  # noqa: E402
from tests.redis_server import RedisClusterServers, RedisServer, TlsFiles, free_port, redis_server_path  # noqa: E402

SMOL = ModelIdentity(
    name="SmolLM2-135M-Instruct", architecture="LlamaForCausalLM", num_layers=30, num_attention_heads=9,
    num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536, vocab_size=49152,
    rms_norm_eps=1e-5, tie_word_embeddings=True, rope={"rope_theta": 100000.0, "rope_scaling": None})
TINY = ModelIdentity(
    name="tiny", architecture="LlamaForCausalLM", num_layers=1, num_attention_heads=1, num_kv_heads=1,
    head_dim=8, hidden_size=8, intermediate_size=32, vocab_size=49152, rms_norm_eps=1e-5,
    tie_word_embeddings=True, rope={"rope_theta": 10000.0, "rope_scaling": None})
GOAL_RATIO = 0.8
LOOKUP_GOAL_US = 1000.0


# --- helpers ------------------------------------------------------------------------------


def warm_malloc() -> None:
    """Free one block just under glibc's 32 MiB cap on its dynamic mmap threshold.

    glibc serves a block over its mmap threshold (128 KiB in a fresh process) with a fresh mmap,
    whose every page faults on first touch, and raises the threshold (to at most 32 MiB) the
    first time such a block is freed. A 5.9 MB read or GET therefore costs several times more in
    a fresh process than in one that has run a while (measured here: a redis-py GET of 5.9 MB,
    24 ms and 5,722 page faults vs 5.7 ms and none), and whichever row happens to run first
    pays it. Raising the threshold once gives every row, peers and store alike, the state of a
    long-running process; --fresh-malloc skips it."""
    block = bytearray(30 << 20)
    del block


def random_kv(model: ModelIdentity, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, model.num_layers, tokens, model.num_kv_heads * model.head_dim, generator=g,
                       dtype=torch.bfloat16)


def random_tokens(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 49152, n, dtype=np.int64)


def chunk_objects(cache, tokens: np.ndarray, kv: torch.Tensor | None) -> list[tuple[str, bytes]]:
    """(name, object bytes) of each whole chunk of one sequence, as put_sequence writes them."""
    cs, out, parent = cache.chunk_size, [], ZERO_HASH
    kv_one = None if kv is not None else torch.zeros(2, cache.model["num_layers"], cs,
                                                     cache.model["num_kv_heads"] * cache.model["head_dim"],
                                                     dtype=torch.bfloat16)
    for start in range(0, len(tokens) - cs + 1, cs):
        part = tokens[start:start + cs]
        h = chain_hash(parent, part)
        chunk = kv[:, :, start:start + cs] if kv is not None else kv_one
        out.append((cache.name(h.hex()), objects.encode_chunk(cache.model, "bfloat16", parent, start, part, kv=chunk)))
        parent = h
    return out


def clock(fn, warm=None) -> tuple[float, int]:
    """(seconds, minor page faults) of one call of `fn`; `warm` first, untimed (e.g. one get of
    the first object)."""
    gc.collect()
    if warm is not None:
        warm()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def table(header: list[str], rows: list[list], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_ratio(r: float | None) -> str:
    return "" if r is None else f"{r:.2f}x"


# --- 1. throughput ------------------------------------------------------------------------


class Throughput:
    """One object size: every row's best time over the repeats (peers and store interleaved)."""

    def __init__(self, work: Path, server: RedisServer, chunk_size: int, count: int, seed: int):
        self.work, self.server = work, server
        self.chunk_size, self.count = chunk_size, count
        rng = np.random.default_rng(seed)
        self.tokens = random_tokens(chunk_size * count, rng)
        self.kv = random_kv(SMOL, chunk_size * count, seed)
        probe = open_store("memory://").for_model(SMOL, chunk_size)
        self.items = chunk_objects(probe, self.tokens, self.kv)
        self.bytes = sum(len(d) for _, d in self.items)
        self.raw_bytes = self.kv.numel() * 2
        self.best: dict[str, tuple[float, int]] = {}

    def note(self, key: str, measured: tuple[float, int]) -> None:
        if key not in self.best or measured[0] < self.best[key][0]:
            self.best[key] = measured

    def run_once(self, rep: int) -> None:
        items, datas = self.items, [d for _, d in self.items]
        base = self.work / f"tp{self.chunk_size}-{rep}"
        base.mkdir()
        flip = rep % 2 == 1  # odd passes run the store before its peer (no order bias)
        try:
            for step in ((lambda: self._files(base, datas), lambda: self._local(base, items)),
                         (lambda: self._dict(items), lambda: self._memory(items)),
                         (lambda: self._redis_pair(items, datas, flip),)):
                for fn in (step[::-1] if flip else step):
                    fn()
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _files(self, base: Path, datas: list[bytes]) -> None:
        plain, atomic = base / "plain", base / "atomic"
        plain.mkdir()
        atomic.mkdir()
        paths = [str(plain / f"{i:06d}.kvc") for i in range(len(datas))]

        def write():
            for p, d in zip(paths, datas):
                with open(p, "wb") as f:
                    f.write(d)

        def write_atomic():
            folder = str(atomic)
            for i, d in enumerate(datas):
                tmp, final = f"{folder}/.{i:06d}.tmp", f"{folder}/{i:06d}.kvc"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    write_all(fd, d)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, final)
                fsync_dir(folder)

        def read():
            for p in paths:
                with open(p, "rb") as f:
                    f.read()

        def read_kept():
            kept = []
            for p in paths:
                with open(p, "rb") as f:
                    kept.append(f.read())

        self.note("file write", clock(write))
        self.note("file write+fsync+rename", clock(write_atomic))
        self.note("file read", clock(read, lambda: Path(paths[0]).read_bytes()))
        self.note("file read kept", clock(read_kept))

    def _dict(self, items) -> None:
        d: dict[str, bytes] = {}

        def dict_put():
            for n, data in items:
                d[n] = data

        def dict_get():
            for n, _ in items:
                d.get(n)

        self.note("dict put", clock(dict_put))
        self.note("dict get", clock(dict_get))

    def _memory(self, items) -> None:
        store = open_store("memory://")
        self._backend_and_cache("memory", store, items)

    def _local(self, base: Path, items) -> None:
        with open_store(base / "store") as store:
            self._backend_and_cache("local", store, items)

    def _redis_pair(self, items, datas, flip: bool) -> None:
        """The plain commands go through the store's own redis-py client (one connection, one
        reply buffer): two clients' buffers sit in different places of the heap, and which one
        page-faults on a large reply is then the allocator's luck, not either's code."""
        with open_store(self.server.url) as store:
            pair = (lambda: self._redis_plain(store.backend.client, datas), lambda: self._redis(store, items))
            for fn in (pair[::-1] if flip else pair):
                fn()

    def _redis_plain(self, r, datas) -> None:
        keys = [f"plain:{i}" for i in range(len(datas))]

        def set_():
            for k, d in zip(keys, datas):
                r.set(k, d)

        def get_():
            for k in keys:
                r.get(k)

        def mget8():
            for i in range(0, len(keys), 8):
                r.mget(keys[i:i + 8])

        def get_kept():
            kept = []
            for k in keys:
                kept.append(r.get(k))

        self.note("redis SET", clock(set_))
        self.note("redis GET", clock(get_, lambda: r.get(keys[0])))
        self.note("redis GET kept", clock(get_kept))
        self.note("redis MGET 8", clock(mget8, lambda: r.mget(keys[:8])))
        r.delete(*keys)

    def _redis(self, store, items) -> None:
        self._backend_and_cache("redis", store, items)
        names = [n for n, _ in items]

        def get_many8():
            for i in range(0, len(names), 8):
                store.backend.get_many(names[i:i + 8])

        self.note("redis backend get_many 8", clock(get_many8, lambda: store.backend.get_many(names[:8])))
        for n in names:
            store.backend.delete(n)

    def _backend_and_cache(self, kind: str, store, items) -> None:
        backend = store.backend
        names = [n for n, _ in items]

        def put():
            for n, d in items:
                backend.put(n, d)

        def get():
            for n in names:
                backend.get(n)

        self.note(f"{kind} backend put", clock(put))
        self.note(f"{kind} backend get", clock(get, lambda: backend.get(names[0])))
        for n in names:  # the ModelCache level starts from an empty store
            backend.delete(n)
        cache = store.for_model(SMOL, self.chunk_size)
        result = {}

        def put_sequence():
            result["put"] = cache.put_sequence(self.tokens, self.kv)

        def get_prefix():
            result["hit"] = cache.get_prefix(self.tokens)

        self.note(f"{kind} put_sequence", clock(put_sequence))
        self.note(f"{kind} get_prefix", clock(get_prefix))
        assert result["put"].stored == self.count, result["put"]
        hit = result["hit"]
        assert hit.num_tokens == len(self.tokens) and len(hit.chunks) == self.count, hit.num_tokens
        assert torch.equal(hit.chunks[-1], self.kv[:, :, -self.chunk_size:])

    # the rows: (label, key, peer key, whether the ratio is a goal)
    ROWS: ClassVar[list[tuple[str, str, str | None, bool]]] = [
        ("plain: Python dict put", "dict put", None, False),
        ("plain: Python dict get", "dict get", None, False),
        ("memory backend put", "memory backend put", "dict put", False),
        ("memory backend get", "memory backend get", "dict get", False),
        ("memory ModelCache put_sequence", "memory put_sequence", "dict put", False),
        ("memory ModelCache get_prefix (every chunk kept, as it returns them)", "memory get_prefix", "dict get", False),
        ("plain: file write (open/write/close)", "file write", None, False),
        ("plain: file write + fsync + rename + dir fsync", "file write+fsync+rename", None, False),
        ("plain: file read (open/read/close)", "file read", None, False),
        ("plain: file read, every object kept (a list)", "file read kept", None, False),
        ("local backend put", "local backend put", "file write+fsync+rename", False),
        ("local backend get", "local backend get", "file read", True),
        ("local ModelCache put_sequence", "local put_sequence", "file write+fsync+rename", False),
        ("local ModelCache get_prefix (every chunk kept)", "local get_prefix", "file read kept", False),
        ("plain: redis-py SET (on the store's own connection)", "redis SET", None, False),
        ("plain: redis-py GET", "redis GET", None, False),
        ("plain: redis-py GET, every object kept", "redis GET kept", None, False),
        ("plain: redis-py MGET of 8", "redis MGET 8", None, False),
        ("redis backend put", "redis backend put", "redis SET", False),
        ("redis backend get", "redis backend get", "redis GET", True),
        ("redis backend get_many of 8", "redis backend get_many 8", "redis MGET 8", False),
        ("redis ModelCache put_sequence", "redis put_sequence", "redis SET", False),
        ("redis ModelCache get_prefix (every chunk kept)", "redis get_prefix", "redis GET kept", False),
    ]

    def report(self) -> dict:
        n, size = self.count, self.bytes / self.count
        print(f"\n**{self.chunk_size}-token chunks: {n} objects of {size / 1e6:.3f} MB "
              f"({self.raw_bytes / n / 1e6:.3f} MB of raw KV each), {self.bytes / 1e6:.0f} MB per pass**\n")
        rows, out = [], {"chunk_size": self.chunk_size, "objects": n, "object_bytes": size, "rows": {}}
        for label, key, peer, _goal in self.ROWS:
            t, faults = self.best[key]
            ratio = self.best[peer][0] / t if peer else None
            out["rows"][key] = {"seconds": t, "gb_s": self.bytes / t / 1e9, "ops_s": n / t,
                                "us_per_op": t / n * 1e6, "minor_faults_per_op": faults / n, "vs": peer, "ratio": ratio}
            rows.append([label, f"{self.bytes / t / 1e9:.2f}", f"{n / t:,.0f}", f"{t / n * 1e6:,.0f}", f"{faults / n:,.0f}",
                         f"{fmt_ratio(ratio)} {peer or ''}".strip() if peer else "peer"])
        print(table(["operation", "GB/s", "ops/s", "µs/op", "page faults/op", "vs the plain peer (throughput ratio)"], rows))
        return out


def goals_line(results: list[dict]) -> list[str]:
    lines = []
    for res in results:
        rows = res["rows"]
        for key, peer in (("local backend get", "file read"), ("redis backend get", "redis GET")):
            ratio = rows[key]["ratio"]
            verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
            lines.append(f"- {res['chunk_size']}-token chunks: {key} / plain {peer} = {ratio:.2f}x "
                         f"(goal >= {GOAL_RATIO}x: **{verdict}**)")
        for key, peer, kept in (("local get_prefix", "file read", "file read kept"),
                                ("redis get_prefix", "redis GET", "redis GET kept")):
            t = rows[key]["seconds"]
            lines.append(f"- {res['chunk_size']}-token chunks: {key} (checks + decode to tensors) = "
                         f"{rows[peer]['seconds'] / t:.2f}x plain {peer}, {rows[kept]['seconds'] / t:.2f}x "
                         f"plain {kept} (not the goal's measure)")
    return lines


# --- 2. where a local get_prefix's time goes ----------------------------------------------


def round_robin(fns: dict, n: int) -> dict[str, tuple[float, float]]:
    """(median µs, median minor page faults) of each function, over `n` rounds that call each
    once in turn, each round starting one step later (load that comes and goes, and whatever the
    step before left in the caches, hit every step alike); one untimed call first."""
    for fn in fns.values():
        fn()
    times: dict[str, list[int]] = {k: [] for k in fns}
    faults: dict[str, list[int]] = {k: [] for k in fns}
    order = list(fns.items())
    for i in range(n):
        for label, fn in order[i % len(order):] + order[:i % len(order)]:  # each round starts one later
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter_ns()
            fn()
            times[label].append(time.perf_counter_ns() - t0)
            faults[label].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {k: (statistics.median(times[k]) / 1e3, statistics.median(faults[k])) for k in fns}


def lean_get(path: str) -> bytes:
    """A plain read that also sets the LRU clock on the open descriptor (futimens), as the
    store's get does: the store's get minus its name check and its own writable buffer."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        data = f.read(st.st_size + 1)
        os.utime(f.fileno(), ns=(time.time_ns(), st.st_mtime_ns))
    return data


GET = "LocalBackend.get (name check, open, fstat, read into its own buffer, utime on the fd)"
CHECK = "check_chunk without the payload CRC (open_object + fingerprint, tokens CRC, SHA-256, names)"
DECODE = "decode, payload already checked (raw, local bytes: a view, no copy)"


def breakdown(work: Path, server: RedisServer, chunk_size: int, iters: int) -> dict:
    """One chunk of the default shape, step by step (median of `iters` rounds); then `count`
    chunks kept, as get_prefix keeps them (per chunk)."""
    count = 8
    rng = np.random.default_rng(7)
    tokens = random_tokens(chunk_size * count, rng)
    kv = random_kv(SMOL, chunk_size * count, 7)
    folder = work / f"breakdown{chunk_size}"
    steps: dict[str, tuple[float, float] | None] = {}
    with open_store(folder) as store, open_store(server.url) as rstore:
        r = rstore.backend.client  # plain commands on the store's own connection (see _redis_pair)
        mstore = open_store("memory://")
        cache, rcache, mcache = (s.for_model(SMOL, chunk_size) for s in (store, rstore, mstore))
        for c in (cache, rcache, mcache):
            c.put_sequence(tokens, kv)
        chain, prefix = [], ZERO_HASH
        for s in range(0, len(tokens), chunk_size):
            prefix = chain_hash(prefix, tokens[s:s + chunk_size])
            chain.append(prefix.hex())
        names = [cache.name(h) for h in chain]
        start, name = chunk_size * 3, names[3]  # the fourth chunk
        path = str(folder / name)
        datas = [store.backend.get(n) for n in names]
        flat = []
        for i, d in enumerate(datas):
            flat.append(str(work / f"flat{chunk_size}-{i}.kvc"))
            Path(flat[-1]).write_bytes(d)
            r.set(f"plain:bd:{i}", d)
        data = datas[3]
        kw = {"model": cache.key, "chunk_size": chunk_size, "prefix_hash": chain[3], "start": start}

        def read(p):
            with open(p, "rb") as f:
                return f.read()

        obj = objects.check_chunk(data, name, **kw)
        payload = obj.reader.chunk_payload(0, verify=False)
        trailer = obj.reader.trailer
        raw = bytes(data[trailer.manifest_offset:trailer.manifest_offset + trailer.manifest_length])
        crc_label = f"payload CRC-32C ({len(payload) / 1e6:.2f} MB)"
        one = {
            "plain file read (open/read/close) of a flat copy": lambda: read(flat[3]),
            "plain file read of the store's own file (its deeper path)": lambda: read(path),
            GET: lambda: store.backend.get(name),
            "of which the name check (_path: one regex, a str join)": lambda: store.backend._path(name),
            "a plain read with the LRU clock set on its fd (the store's get without its name check "
            "and own buffer)": lambda: lean_get(path),
            "plain redis-py GET (the store's connection)": lambda: r.get("plain:bd:3"),
            "RedisBackend.get": lambda: rstore.backend.get(name),
            "open_object: header, trailer, manifest CRC-32C + parse": lambda: objects.open_object(data, name),
            f"of which parse_manifest ({len(raw):,} B: JSON + validation)":
                lambda: parse_manifest(raw, data_end=trailer.manifest_offset, alignment=obj.reader.header.alignment),
            "of which json.loads of the same bytes": lambda: json.loads(raw),
            CHECK: lambda: objects.check_chunk(data, name, verify_payload=False, **kw),
            crc_label: lambda: crc32(payload),
            DECODE: obj.decode,
            "a bytearray(payload) (one memcpy: what a decode of shared bytes costs more)": lambda: bytearray(payload),
        }
        steps["**one object, its result dropped (memory recycled)**"] = None
        steps.update(round_robin(one, iters))
        obj.reader.close()
        payloads = [objects.check_chunk(d, n).reader.chunk_payload(0, verify=False) for d, n in zip(datas, names)]
        kept = {
            "plain file read of the flat copies, kept": lambda: [read(p) for p in flat],
            "plain redis-py GET, kept": lambda: [r.get(f"plain:bd:{i}") for i in range(count)],
            "bytearray(payload) of each, kept (the raw decode's copy of shared bytes: Redis, memory)":
                lambda: [bytearray(p) for p in payloads],
            "plain file read, kept, + a bytearray copy of each, kept (get_prefix's two buffers a chunk)":
                lambda: [(d, bytearray(d)) for d in (read(p) for p in flat)],
            "memory get_prefix (no read: checks + decode)": lambda: mcache.get_prefix(tokens),
            "local get_prefix": lambda: cache.get_prefix(tokens),
            "redis get_prefix": lambda: rcache.get_prefix(tokens),
        }
        steps[f"**{count} chunks, every result kept (as get_prefix returns them): per chunk**"] = None
        steps.update({k: (t / count, f / count) for k, (t, f) in round_robin(kept, iters).items()})
        for i in range(count):
            r.delete(f"plain:bd:{i}")
        for n in names:
            rstore.backend.delete(n)
    shutil.rmtree(folder, ignore_errors=True)
    for p in flat:
        os.unlink(p)
    size = len(data)
    print(f"\n## Where a get's and a get_prefix's time goes: {chunk_size}-token chunks "
          f"({size / 1e6:.3f} MB), median of {iters} rounds\n")
    print(table(["step", "µs", "minor page faults"],
                [[k, "", ""] if v is None else [k, f"{v[0]:,.0f}", f"{v[1]:,.0f}"] for k, v in steps.items()]))
    get, check, crc_t, dec = (steps[k][0] for k in (GET, CHECK, crc_label, DECODE))
    print(f"\nThe steps of one local chunk add up to {get + check + crc_t + dec:,.0f} µs "
          f"(get {get:,.0f} + checks {check:,.0f} + CRC {crc_t:,.0f} + decode {dec:,.0f}) with memory recycled; "
          f"get_prefix measured {steps['local get_prefix'][0]:,.0f} µs per chunk, with "
          f"{steps['local get_prefix'][1]:,.0f} minor page faults per chunk ({size / 4096:,.0f} pages per object).")
    return {"chunk_size": chunk_size, "object_bytes": size,
            "steps": {k: {"us": v[0], "minor_faults": v[1]} for k, v in steps.items() if v is not None}}


def encode_breakdown(iters: int) -> dict:
    """Where put_sequence's encode goes: one 256-token chunk of the default shape."""
    from kvtool.codecs.raw import tensor_bytes

    rng = np.random.default_rng(9)
    tokens = random_tokens(512, rng)
    kv = random_kv(SMOL, 512, 9)
    cache = open_store("memory://").for_model(SMOL, 256)
    part = kv[:, :, 256:512]  # a strided slice, as put_sequence hands it over
    data = objects.encode_chunk(cache.model, "bfloat16", ZERO_HASH, 0, tokens[:256], kv=part)
    blob = objects.open_object(data, "x").manifest.chunks[0].blob
    contiguous = part.contiguous()
    payload = tensor_bytes(contiguous)
    head, tail = data[:blob.offset], data[blob.offset + blob.length:]

    def bytesio():
        buf = io.BytesIO()
        buf.write(head)
        buf.write(payload)
        buf.write(tail)
        return buf.getvalue()

    steps = round_robin({
        "encode_chunk (ContainerWriter into memory), whole":
            lambda: objects.encode_chunk(cache.model, "bfloat16", ZERO_HASH, 0, tokens[:256], kv=part),
        "the slice's .contiguous() copy": part.contiguous,
        "payload CRC-32C": lambda: crc32(payload),
        "io.BytesIO: write header, payload, the rest; getvalue() (the writer's buffer)": bytesio,
        "b''.join of the same three parts (one copy)": lambda: b"".join((head, payload, tail)),
    }, iters)
    print(f"\n## Where put_sequence's encode goes: one 256-token chunk ({len(data) / 1e6:.3f} MB), "
          f"median of {iters} rounds\n")
    print(table(["step", "µs", "minor page faults"], [[k, f"{v[0]:,.0f}", f"{v[1]:,.0f}"] for k, v in steps.items()]))
    return {"object_bytes": len(data), "steps": {k: {"us": v[0], "minor_faults": v[1]} for k, v in steps.items()}}


# --- 3. deduplication ---------------------------------------------------------------------


def dedup(work: Path, prompts: int, system: int, unique: tuple[int, int], chunk_size: int) -> dict:
    rng = np.random.default_rng(11)
    sys_tokens = random_tokens(system, rng)
    lengths = rng.integers(unique[0], unique[1] + 1, prompts)
    kv = random_kv(SMOL, system + unique[1], 11)  # every prompt's KV: its first tokens (values do not matter)
    folder = work / "dedup"
    offered_chunks = stored_chunks = stored_bytes = offered_tokens = 0
    seqs = []
    with open_store(folder) as store:
        cache = store.for_model(SMOL, chunk_size)
        t0 = time.perf_counter()
        for n in lengths:
            seq = np.concatenate([sys_tokens, random_tokens(int(n), rng)])
            seqs.append(seq)
            res = cache.put_sequence(seq, kv[:, :, :len(seq)])
            offered_chunks += res.chunks
            stored_chunks += res.stored
            stored_bytes += res.stored_bytes
            offered_tokens += len(seq)
        seconds = time.perf_counter() - t0
        sizes = {o.name: o.size for o in store.scan("chunks/")}
        offered_bytes = 0
        for seq in seqs:
            parent = ZERO_HASH
            for s in range(0, len(seq) - chunk_size + 1, chunk_size):
                parent = chain_hash(parent, seq[s:s + chunk_size])
                offered_bytes += sizes[cache.name(parent.hex())]
        covered = sum(cache.lookup(seq) for seq in seqs)
    shutil.rmtree(folder, ignore_errors=True)
    assert len(sizes) == stored_chunks and sum(sizes.values()) == stored_bytes
    raw_offered = offered_tokens * 2 * SMOL.num_layers * SMOL.num_kv_heads * SMOL.head_dim * 2
    print(f"\n## Deduplication: {prompts} prompts = a {system}-token shared system prompt + "
          f"{unique[0]}-{unique[1]} unique tokens each, chunk size {chunk_size}, local store\n")
    rows = [["whole chunks", f"{offered_chunks:,}", f"{stored_chunks:,}", f"{offered_chunks / stored_chunks:.2f}x"],
            ["object bytes", f"{offered_bytes / 1e9:.2f} GB", f"{stored_bytes / 1e9:.2f} GB",
             f"{offered_bytes / stored_bytes:.2f}x"]]
    print(table(["", "offered", "stored", "offered / stored"], rows))
    print(f"\n{offered_tokens:,} tokens offered ({raw_offered / 1e9:.2f} GB of raw KV; the last partial chunk "
          f"of each prompt is not stored); put_sequence of all {prompts}: {seconds:.1f} s; "
          f"lookup afterwards covers {covered:,} of {offered_tokens:,} tokens ({covered / offered_tokens:.1%}).")
    return {"prompts": prompts, "system_tokens": system, "unique": list(unique), "chunk_size": chunk_size,
            "offered_chunks": offered_chunks, "stored_chunks": stored_chunks, "offered_bytes": offered_bytes,
            "stored_bytes": stored_bytes, "offered_tokens": offered_tokens, "seconds": seconds,
            "covered_tokens": covered}


# --- 4. lookup latency --------------------------------------------------------------------


def latencies(fns: dict, calls: int) -> dict[str, tuple[float, float]]:
    """(median µs, p99 µs) of each function over `calls` rounds that call each once in turn
    (each round starting one later); 100 untimed rounds first."""
    for _ in range(min(100, calls)):
        for fn in fns.values():
            fn()
    times: dict[str, list[int]] = {k: [] for k in fns}
    gc.collect()
    order = list(fns.items())
    for i in range(calls):
        for label, fn in order[i % len(order):] + order[:i % len(order)]:
            t0 = time.perf_counter_ns()
            fn()
            times[label].append(time.perf_counter_ns() - t0)
    out = {}
    for label, ts in times.items():
        ts.sort()
        out[label] = (statistics.median(ts) / 1e3, ts[min(len(ts) - 1, int(len(ts) * 0.99))] / 1e3)
    return out


def lookup_bench(work: Path, server: RedisServer, sizes: list[int], calls: int) -> dict:
    cs, chunks = 16, 16
    rng = np.random.default_rng(5)
    probe = open_store("memory://").for_model(TINY, cs)
    prompt = random_tokens(cs * chunks, rng)
    novel = random_tokens(cs * chunks, rng)
    t0 = time.perf_counter()
    fill = chunk_objects(probe, prompt, None)
    depth = 100
    while len(fill) < sizes[-1]:
        fill += chunk_objects(probe, random_tokens(cs * min(depth, sizes[-1] - len(fill)), rng), None)
    encode_s = time.perf_counter() - t0
    obj_size = statistics.mean(len(d) for _, d in fill[:1000])
    print(f"\n## lookup of a {chunks}-chunk prompt ({cs * chunks} tokens, chunk size {cs}; objects of "
          f"{obj_size:,.0f} B, 1-layer 1-head head_dim-8 model), median and p99 of {calls:,} calls\n")
    print(f"(encoding the {len(fill):,} objects: {encode_s:.1f} s, {encode_s / len(fill) * 1e6:.0f} µs each)\n")
    names = probe.chunk_names(prompt)
    results, rows, hashing = {}, [], []
    folder = work / "lookup"
    plain_keys = [KEY_PREFIX + n for n in names]
    paths = [str(folder / n) for n in names]
    with ExitStack() as stack:
        stores = {"memory": stack.enter_context(open_store("memory://")),
                  "local": stack.enter_context(open_store(folder)),
                  "redis": stack.enter_context(open_store(server.url))}
        plain_redis = stores["redis"].backend.client  # plain commands on the store's connection
        pool = stack.enter_context(ThreadPoolExecutor(4))
        done = 0
        for size in sizes:
            batch = fill[done:size]
            for kind, store in stores.items():
                t0 = time.perf_counter()
                parts = [batch[i:i + 500] for i in range(0, len(batch), 500)]
                if kind == "local":  # fsync-bound: four writers, as several processes would
                    list(pool.map(store.backend.put_many, parts))
                else:
                    for part in parts:
                        store.backend.put_many(part)
                fill_s = time.perf_counter() - t0
                cache = store.for_model(TINY, cs)
                assert cache.lookup(prompt) == cs * chunks and cache.lookup(novel) == 0
                if kind == "local":
                    assert sum(1 for _ in store.backend.scan("chunks/")) == size
                if kind == "memory":
                    peer_fn, peer_label = (lambda b=store.backend: [n in b._objects for n in names]), "16 dict lookups"
                elif kind == "local":
                    peer_fn, peer_label = (lambda: [os.path.isfile(p) for p in paths]), "16 os.path.isfile"
                else:
                    def peer_fn():
                        p = plain_redis.pipeline(transaction=False)
                        for k in plain_keys:
                            p.exists(k)
                        p.execute()
                    peer_label = "plain redis-py pipeline of 16 EXISTS"
                got = latencies({"hit": lambda c=cache: c.lookup(prompt), "miss": lambda c=cache: c.lookup(novel),
                                 "peer": peer_fn,
                                 "hashing": lambda: probe.chunk_names(prompt)}, calls)
                hit, miss, peer = got["hit"], got["miss"], got["peer"]
                hashing.append(got["hashing"])
                goal = "met" if hit[1] < LOOKUP_GOAL_US else "NOT met"
                rows.append([kind, f"{size:,}", f"{hit[0]:.0f}", f"{hit[1]:.0f}", f"{miss[0]:.0f}", f"{miss[1]:.0f}",
                             f"{peer[0]:.0f} ({peer_label})", f"{len(batch) / fill_s:,.0f}", goal])
                results[f"{kind}/{size}"] = {"hit_median_us": hit[0], "hit_p99_us": hit[1], "miss_median_us": miss[0],
                                             "miss_p99_us": miss[1], "peer": peer_label, "peer_median_us": peer[0],
                                             "peer_p99_us": peer[1], "hashing_median_us": got["hashing"][0],
                                             "fill_objects_per_s": len(batch) / fill_s}
            done = size
        plain_redis.flushall()
    shutil.rmtree(folder, ignore_errors=True)
    print(table(["store", "chunks stored", "hit median µs", "hit p99 µs", "miss median µs", "miss p99 µs",
                 "peer median µs (the same 16 names, precomputed)", "fill objects/s", "p99 < 1 ms"], rows))
    hash_med = statistics.median(h[0] for h in hashing)
    print(f"\nHashing the chain and naming the 16 chunks alone (common to every store; measured in the same "
          f"rounds): median {hash_med:.0f} µs (from {min(h[0] for h in hashing):.0f} to "
          f"{max(h[0] for h in hashing):.0f} over the rows), p99 up to {max(h[1] for h in hashing):.0f} µs.")
    results["hashing"] = {"median_us": hash_med, "p99_us_max": max(h[1] for h in hashing)}
    results["object_bytes"] = obj_size
    return results


# --- 6. Redis Cluster and TLS ---------------------------------------------------------------


def spread_throughput(url: str, items: list[tuple[str, bytes]], clients: int, repeat: int) -> dict:
    """Best of `repeat` passes: `clients` threads put (then get) their share of `items` through
    one store's backend (one client, shared as engines' threads share it), batches of 8."""
    store = open_store(url)
    backend = store.backend
    shares = [items[i::clients] for i in range(clients)]
    total = sum(len(d) for _, d in items)
    best = {"put": float("inf"), "get": float("inf")}

    def put(share):
        for i in range(0, len(share), 8):
            assert all(backend.put_many(share[i:i + 8]))

    def get(share):
        for i in range(0, len(share), 8):
            got = backend.get_many([n for n, _ in share[i:i + 8]])
            assert all(g is not None for g in got)

    with ThreadPoolExecutor(clients) as pool:
        for _ in range(repeat):
            for what, fn in (("put", put), ("get", get)):
                gc.collect()
                t0 = time.perf_counter()
                list(pool.map(fn, shares))
                best[what] = min(best[what], time.perf_counter() - t0)
            for name, _ in items:
                backend.delete(name)
    store.close()
    return {what: {"seconds": s, "objects_per_s": len(items) / s, "mb_per_s": total / s / 1e6}
            for what, s in best.items()}


def cluster_tls_bench(work: Path, quick: bool, repeat: int) -> dict:
    clients = 4
    rng = np.random.default_rng(13)
    sets = {}
    for model, cs, n in ((SMOL, 16, 48 if quick else 256), (TINY, 16, 400 if quick else 4000)):
        cache = open_store("memory://").for_model(model, cs)
        objs: list[tuple[str, bytes]] = []
        while len(objs) < n:
            objs += chunk_objects(cache, random_tokens(cs * 16, rng), random_kv(model, cs * 16, len(objs))
                                  if model is SMOL else None)
        sets[f"{len(objs[0][1]) / 1e3:,.1f} KB objects"] = objs[:n]
    rows, results = [], {}
    tls = TlsFiles(work)
    tls_port = free_port()
    servers = {
        "one redis-server (redis://)": lambda: RedisServer(),
        "cluster, 1 master (redis+cluster://)": lambda: RedisClusterServers(masters=1, replicas=0),
        "cluster, 3 masters (redis+cluster://)": lambda: RedisClusterServers(masters=3, replicas=0),
        "one redis-server, its plain port": None,  # (below: the TLS server's own plain port)
        "the same server, its TLS port (rediss://)": None,
    }
    tls_args = ("--tls-port", str(tls_port), "--tls-cert-file", str(tls.server_cert), "--tls-key-file",
                str(tls.server_key), "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "no")
    for label, make in servers.items():
        if make is None:
            continue
        with make() as server:
            for what, objs in sets.items():
                r = spread_throughput(server.url, objs, clients, repeat)
                results[f"{label} / {what}"] = r
                rows.append([label, what, f"{r['put']['objects_per_s']:,.0f}", f"{r['put']['mb_per_s']:,.0f}",
                             f"{r['get']['objects_per_s']:,.0f}", f"{r['get']['mb_per_s']:,.0f}"])
    with RedisServer(extra=tls_args) as server:
        tls_url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={tls.ca}"
        for what, objs in sets.items():
            for label, url in (("one redis-server, its plain port", server.url),
                               ("the same server, its TLS port (rediss://)", tls_url)):
                r = spread_throughput(url, objs, clients, repeat)
                results[f"{label} / {what}"] = r
                rows.append([label, what, f"{r['put']['objects_per_s']:,.0f}", f"{r['put']['mb_per_s']:,.0f}",
                             f"{r['get']['objects_per_s']:,.0f}", f"{r['get']['mb_per_s']:,.0f}"])
    print(f"\n## Redis Cluster and TLS: {clients} client threads, one store (one client), put_many / get_many "
          f"in batches of 8, best of {repeat}; every node on this machine's {os.cpu_count()} cores\n")
    print(table(["server", "objects", "put objects/s", "put MB/s", "get objects/s", "get MB/s"], rows))
    results["clients"] = clients
    return results
def cachegen_by_size(work: Path) -> dict:
    """What small pieces cost CacheGen's ratio: real KV (the default model, kvtool's engine, a
    1,024-token prompt of prose) cut into pieces of 16..256 tokens, each encoded alone with the
    codec's default parameters (as a piece or chunk object holds it): raw bytes / CacheGen bytes."""
    from kvtool.codecs import get_codec
    from kvtool.engine import load_model
    from kvtool.format import ContainerReader
    from kvtool.ops.capture import capture

    model = load_model(None)
    text = " ".join(f"Section {i}. The river town kept records of its {i * 3} bridges, its markets and the "
                    f"weather; in year {1800 + i} the council counted {i * 17 % 101} boats." for i in range(60))
    ids = model.tokenizer.encode(text)[:1024]
    path = work / "cachegen-kv.kvc"
    capture(model, ids, path, chunk_size=1024)
    with ContainerReader(path) as reader:
        kv = reader.read_chunk(0)
    codec = get_codec("cachegen")
    params = codec.default_params()
    rows, out = [], {}
    for size in (16, 32, 64, 128, 256):
        raw = total = 0
        for start in range(0, 1024, size):
            part = kv[:, :, start:start + size].contiguous()
            payload, _ = codec.encode(part, params)
            raw += part.numel() * part.element_size()
            total += len(payload)
        out[size] = raw / total
        rows.append([size, f"{raw / total:.1f}×"])
    rows = [r + [f"{out[r[0]] / out[256]:.2f}"] for r in rows]
    print(f"\nCacheGen ratio (raw bf16 bytes / CacheGen bytes) by piece size, real KV of the default model "
          f"({len(ids)} tokens), default parameters:\n")
    print(table(["tokens per piece", "ratio", "vs 256-token chunks"], rows))
    return out


def blocks_bench(work: Path, server: RedisServer, sequences: int, calls: int) -> dict:
    """Block prefixes (store.md §7): what they cost.

    1. Per-object overhead against object size: a SmolLM2-shaped raw object (chunk or piece) of
       16..256 tokens, its bytes next to its KV's; a block index entry's bytes (and on the folder,
       its disk blocks); put_sequence of a 2,048-token prompt (8 chunks, a 240-token piece) at
       block size 16 next to whole chunks only, per backend (the extra objects and round trips).
    2. lookup of a prompt whose whole chunks and a block prefix are stored, among `sequences`
       sequences each stored with its chunks, block index entries and piece (the TINY model,
       chunk size 16, block size 4: the same probe, 2 chunk names and 2 names per block prefix)."""
    out: dict = {}
    print("\n## block prefixes: per-object overhead (SmolLM2-135M shape, bf16, raw)\n")
    rng = np.random.default_rng(11)
    rows = []
    mem = open_store("memory://")
    for tokens in (16, 32, 64, 128, 256):
        kv = random_kv(SMOL, tokens, tokens)
        data = objects.encode_chunk({**SMOL.to_dict(), "fingerprint": SMOL.fingerprint()}, "bfloat16", ZERO_HASH, 0,
                                    random_tokens(tokens, rng), kv=kv, piece_of=None if tokens == 256 else 256)
        payload = kv.numel() * 2
        rows.append([tokens, f"{len(data):,}", f"{payload:,}", f"{len(data) - payload:,}",
                     f"{(len(data) - payload) / payload:.2%}"])
        out[f"object/{tokens}"] = {"object_bytes": len(data), "kv_bytes": payload}
    entry = objects.encode_block_entry(128, objects.chunk_name("0" * 32, 256, "ab" * 32))
    print(table(["tokens", "object bytes", "KV bytes", "overhead bytes", "overhead / KV"], rows))
    folder = work / "blocks-entry"
    local = open_store(folder)
    local.backend.put(objects.block_name("0" * 32, 256, "cd" * 32), entry)
    disk = next(p for p in folder.rglob("*.kvi")).stat().st_blocks * 512
    local.close()
    print(f"\nA block index entry: {len(entry)} bytes ({disk:,} bytes of disk on this folder's file system); "
          f"one per block prefix of a stored chunk: at block 16, 15 entries per 256-token chunk "
          f"({15 * len(entry) / out['object/256']['object_bytes']:.3%} of a raw chunk's bytes, "
          f"{15 * disk / out['object/256']['object_bytes']:.2%} on disk); at vLLM's CPU block (128), 1.")
    out["entry_bytes"], out["entry_disk_bytes"] = len(entry), disk
    prompt = random_tokens(2048 + 240, rng)
    kv = random_kv(SMOL, len(prompt), 3)
    rows = []
    for kind, url in (("memory", "memory://"), ("local", str(work / "blocks-put")), ("redis", server.url)):
        times = {}
        for block in (None, 16):
            with open_store(url) as store:
                cache = store.for_model(SMOL, 256, block_size=block)
                best = float("inf")
                for rep in range(3):
                    for info in list(store.backend.scan("chunks/")):
                        store.backend.delete(info.name)
                    t0 = time.perf_counter()
                    put = cache.put_sequence(prompt, kv)
                    best = min(best, time.perf_counter() - t0)
                times[block] = (best, put)
        (plain, p0), (blocks, p1) = times[None], times[16]
        rows.append([kind, f"{plain * 1e3:.0f}", f"{blocks * 1e3:.0f}", f"{blocks / plain - 1:+.0%}",
                     f"{p1.pieces} piece, {p1.block_entries} entries", f"{p1.stored_bytes / p0.stored_bytes - 1:+.1%}"
                     f" (entries {p1.block_entries * len(entry) / p0.stored_bytes:.3%}; the rest the piece's KV)"])
        out[f"put/{kind}"] = {"whole_s": plain, "blocks_s": blocks, "entries": p1.block_entries,
                              "bytes_whole": p0.stored_bytes, "bytes_blocks": p1.stored_bytes}
    if server is not None:
        open_store(server.url).backend.client.flushall()
    print("\nput_sequence of a 2,288-token prompt (8 chunks, then 240 tokens), best of 3:\n")
    print(table(["store", "whole chunks ms", "block size 16 ms", "time", "extra objects", "bytes"], rows))

    out["cachegen_by_size"] = cachegen_by_size(work)

    cs, block = 16, 4
    probe = open_store("memory://").for_model(TINY, cs, block_size=block)
    model = probe.model
    zeros = torch.zeros(2, 1, cs, 8, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    fill: list[tuple[str, bytes]] = []
    chunk_bytes = None
    for i in range(sequences):  # each: 1 whole chunk (3 entries), then 10 tokens: a piece of 8 (1 entry)
        toks = random_tokens(cs + 10, rng)
        h = chain_hash(ZERO_HASH, toks[:cs])
        name = probe.name(h.hex())
        if chunk_bytes is None:
            chunk_bytes = objects.encode_chunk(model, "bfloat16", ZERO_HASH, 0, toks[:cs], kv=zeros)
        fill.append((name, chunk_bytes))  # (the bytes are not read by a lookup)
        for m in range(block, cs, block):
            fill.append((objects.block_name(probe.key, cs, chain_hash(ZERO_HASH, toks[:m]).hex()),
                         objects.encode_block_entry(m, name)))
        piece = objects.piece_name(probe.key, cs, chain_hash(h, toks[cs:cs + 8]).hex())
        fill += [(piece, chunk_bytes), (objects.block_name(probe.key, cs, chain_hash(h, toks[cs:cs + 4]).hex()),
                                        objects.encode_block_entry(4, piece))]
    query = random_tokens(cs * 16 + 10, rng)  # 16 chunks stored, then a piece of 8: a hit of 264 tokens
    qk = torch.zeros(2, 1, len(query), 8, dtype=torch.bfloat16)
    novel = random_tokens(cs * 16 + 10, rng)
    print(f"\n## lookup with {sequences:,} sequences stored, each with its chunk, block index entries and piece "
          f"({len(fill):,} objects; filled in {time.perf_counter() - t0:.0f} s of encoding); a prompt of 16 "
          f"chunks and 10 tokens, chunk size {cs}, block size {block}: median and p99 of {calls:,} calls\n")
    rows = []
    local_cap = 6 * 20_000  # a folder fills at ~1,000 fsynced files/s: 20k sequences (its lookup is stats, not a scan)
    for kind, url in (("memory", "memory://"), ("local", str(work / "blocks-lookup")), ("redis", server.url)):
        with open_store(url) as store:
            t0 = time.perf_counter()
            mine = fill[:local_cap] if kind == "local" else fill
            parts = [mine[i:i + 1000] for i in range(0, len(mine), 1000)]
            if kind == "local":
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(store.backend.put_many, parts))
            else:
                for part in parts:
                    store.backend.put_many(part)
            fill_s = time.perf_counter() - t0
            cache = store.for_model(TINY, cs, block_size=block)
            cache.put_sequence(query, qk)
            assert cache.lookup(query) == cs * 16 + 8 and cache.lookup(novel) == 0
            partial = list(query[:cs * 15 + 9]) + [1, 2, 3]  # 15 chunks, then 2 blocks of the 16th: a second probe
            assert cache.lookup(partial) == cs * 15 + 8
            got = latencies({"hit": lambda: cache.lookup(query), "partial": lambda: cache.lookup(partial),
                             "miss": lambda: cache.lookup(novel)}, calls)
            rows.append([kind, f"{len(mine):,}"] + [f"{got[k][0]:.0f} / {got[k][1]:.0f}" for k in ("hit", "partial", "miss")]
                        + [f"{len(mine) / fill_s:,.0f}", "met" if max(got[k][1] for k in got) < LOOKUP_GOAL_US else "NOT met"])
            out[f"lookup/{kind}"] = {k: {"median_us": v[0], "p99_us": v[1]} for k, v in got.items()}
            if kind == "redis":
                store.backend.client.flushall()
    shutil.rmtree(work / "blocks-lookup", ignore_errors=True)
    print(table(["store", "objects", "hit µs (med / p99)", "hit in a chunk's blocks µs", "miss µs", "fill objects/s",
                 "p99 < 1 ms"], rows))
    return out


# --- main ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, seconds (validates the bench)")
    ap.add_argument("--repeat", type=int, default=None, help="passes of the throughput rows (best of; default 3, quick 1)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--dir", type=Path, default=None, help="folder for the temp stores (default: the system temp)")
    ap.add_argument("--blocks-only", action="store_true", help="only the block prefixes' section (5)")
    ap.add_argument("--fresh-malloc", action="store_true",
                    help="leave glibc's mmap threshold where a fresh process has it (see warm_malloc)")
    ap.add_argument("--only", choices=["all", "cluster"], default="all",
                    help="cluster: part 5 alone (Redis Cluster at 1 and 3 masters, TLS against plain)")
    args = ap.parse_args()
    q = args.quick
    repeat = args.repeat or (2 if q else 3)
    big_n, small_n = (4, 16) if q else (32, 256)
    prompts = 8 if q else 64
    sizes = [1000, 5000] if q else [1000, 100_000]
    calls = 300 if q else 3000
    iters = 5 if q else 30
    torch.set_num_threads(1)
    if not args.fresh_malloc:
        warm_malloc()

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (a background job)
    redis_version = subprocess.run([redis_server_path() or "redis-server", "--version"], capture_output=True, text=True, check=False).stdout.split()
    fs = subprocess.run(["df", "-T", str(args.dir or tempfile.gettempdir())], capture_output=True, text=True, check=False).stdout
    print(f"# kvtool bench_store{' --quick' if q else ''}: {os.cpu_count()} cores, 1-min load "
          f"{os.getloadavg()[0]:.2f} at start; Python {platform.python_version()}, torch {torch.__version__} "
          f"(1 thread), numpy {np.__version__}, redis-py {__import__('redis').__version__} "
          f"(hiredis: {'yes' if _has('hiredis') else 'no'}), {' '.join(redis_version[:3])}; "
          f"temp folder on {fs.splitlines()[-1].split()[1] if fs else '?'}; malloc "
          f"{'fresh (--fresh-malloc)' if args.fresh_malloc else 'warmed (one 30 MiB buffer freed at start)'}\n")
    out: dict = {"quick": q, "repeat": repeat, "load_start": os.getloadavg()[0]}
    work = Path(tempfile.mkdtemp(prefix="kvtool-bench-store-", dir=args.dir))
    server = None
    try:
        if args.only == "cluster":
            out["cluster_tls"] = cluster_tls_bench(work, q, repeat)
            out["load_end"] = os.getloadavg()[0]
            print(f"\n1-min load at the end: {out['load_end']:.2f}")
            save(args.json, out)
            return
        server = RedisServer().start()
        if args.blocks_only:
            out["blocks"] = blocks_bench(work, server, 10_000 if q else 100_000, calls)
            raise _Done
        print(f"## put/get throughput: best of {repeat}, each row over the same object bytes; "
              f"page cache warm; Redis on localhost (no maxmemory)")
        tps = []
        for cs, n, seed in ((256, big_n, 1), (16, small_n, 2)):
            tp = Throughput(work, server, cs, n, seed)
            t0 = time.perf_counter()
            for rep in range(repeat):
                tp.run_once(rep)
            tps.append(tp.report())
            print(f"\n({time.perf_counter() - t0:.0f} s for these rows)")
            del tp
            gc.collect()
        print("\nGoals (issue): local get >= 0.8x a plain file read, Redis get >= 0.8x a plain GET:\n")
        goals = goals_line(tps)
        print("\n".join(goals))
        out["throughput"], out["goals"] = tps, goals
        out["breakdown"] = [breakdown(work, server, cs, iters) for cs in (256, 16)]
        out["encode"] = encode_breakdown(iters)
        out["dedup"] = dedup(work, prompts, 2048, (256, 768), 256)
        out["lookup"] = lookup_bench(work, server, sizes, calls)
        out["cluster_tls"] = cluster_tls_bench(work, q, repeat)
        out["blocks"] = blocks_bench(work, server, 10_000 if q else 100_000, calls)
        out["load_end"] = os.getloadavg()[0]
        print(f"\n1-min load at the end: {out['load_end']:.2f}")
    except _Done:
        pass
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        raise SystemExit(130)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)
    save(args.json, out)


def save(path: Path | None, out: dict) -> None:
    if path:
        path.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"(results written to {path})")


class _Done(Exception):
    """--blocks-only: the one section has run."""


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
