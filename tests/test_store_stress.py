"""The chunk store under stress, with real processes, real files and a real redis-server.

- 4 processes put and read back prompts that share long prefixes, on the local store and on
  Redis, for a bounded time: no torn read, nothing lost, exactly one object per distinct chunk;
- writers killed with SIGKILL at random moments, several rounds: every visible object passes
  its checks, prefixes still read, `sweep` removes what they left behind (and never a live
  writer's temp file);
- Redis killed mid-run: the client gets one line (StoreUnavailable), not a hang; the same
  ChunkStore works again once a new server listens on the port.

Each run lasts KVTOOL_STRESS_SECONDS (default 30 in CI, 8 elsewhere). The processes are forked
by one helper process that imported everything once (this file run as a script: `python
tests/test_store_stress.py spawner`), so a round of kill -9 costs no interpreter start.
A restart of the local store in a new process is in test_store_contract.py.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from kvtool.errors import StoreUnavailable
from kvtool.store import ChunkStore, open_store
from kvtool.store.objects import check_chunk, chunk_name, model_key

from fixtures import make_identity, ref_prefix_hashes, same_tensor

DURATION = float(os.environ.get("KVTOOL_STRESS_SECONDS") or (30 if os.environ.get("CI") == "true" else 8))
CHUNK = 16
IDENTITY = make_identity(num_layers=2, num_kv_heads=2, head_dim=8)
KEY = model_key(IDENTITY)
VOCAB = 1000
BASE_TOKENS = 320  # 20 whole chunks every process shares
MAX_TAIL = 48
NUM_WORKERS = 4
_TABLES: list[torch.Tensor] = []


# --- what every process computes the same way ------------------------------------------


def expected_kv(tokens, start: int = 0) -> torch.Tensor:
    """KV_BLOB [2, L, T, C] of `tokens` at positions start.., a fixed function of (position,
    token): every process computes identical KV for the same prefix."""
    if not _TABLES:
        g = torch.Generator().manual_seed(1234)
        C = IDENTITY.num_kv_heads * IDENTITY.head_dim
        _TABLES.append(torch.randn(2, IDENTITY.num_layers, VOCAB, C, generator=g) * 3)
        _TABLES.append(torch.randn(2, IDENTITY.num_layers, BASE_TOKENS + MAX_TAIL, C, generator=g))
    by_token, by_position = _TABLES
    ids = torch.as_tensor([int(t) for t in tokens], dtype=torch.long)
    positions = torch.arange(start, start + len(ids))
    return (by_token[:, :, ids] + by_position[:, :, positions]).to(torch.bfloat16)


def bases() -> list[list[int]]:
    rng = random.Random(4321)
    return [[rng.randrange(VOCAB) for _ in range(BASE_TOKENS)] for _ in range(4)]


def stress_prompt(rng: random.Random, shared: list[list[int]]) -> list[int]:
    """A cut of a shared base (long common prefixes across processes), then a tail of its own."""
    base = shared[rng.randrange(len(shared))]
    return base[:rng.randrange(BASE_TOKENS + 1)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(MAX_TAIL))]


def next_prompt(rng: random.Random, shared: list[list[int]], step: int) -> list[int]:
    """Half the time the prompt all processes take at about this step (they race to write and
    read the same new chunks), else one of its own."""
    if rng.random() < 0.5:
        return stress_prompt(random.Random(step + rng.randrange(4)), shared)
    return stress_prompt(rng, shared)


def names_of(tokens) -> list[str]:
    """The names of the whole chunks of `tokens` (the spec's hash chain, not the store's code)."""
    whole = len(tokens) // CHUNK * CHUNK
    return [chunk_name(KEY, CHUNK, h) for h in ref_prefix_hashes(tokens[:whole], CHUNK)]


def chunk_is_expected(chunk: torch.Tensor, tokens, start: int) -> bool:
    return same_tensor(chunk, expected_kv(tokens[start:start + CHUNK], start))


def check_every_object(store: ChunkStore) -> int:
    """Every stored object passes §5's checks under its name and holds the expected KV."""
    names = [info.name for info in store.scan("chunks/")]
    for first in range(0, len(names), 256):
        batch = names[first:first + 256]
        for name, data in zip(batch, store.backend.get_many(batch)):
            obj = check_chunk(data, name, model=KEY, chunk_size=CHUNK)
            assert same_tensor(obj.decode(), expected_kv(obj.tokens.tolist(), obj.start)), name
            obj.reader.close()
    return len(names)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*.tmp") if p.is_file()]


# --- the worker processes ---------------------------------------------------------------


def worker_main(url: str, index: int, seconds: float, go: str, out: str) -> None:
    """Put and read back overlapping prompts until the time is up; check every chunk read.
    Its report (what it stored, what went wrong) goes to the file `out`."""
    shared = bases()
    while not os.path.exists(go):
        time.sleep(0.005)
    report = {"prompts": [], "errors": [], "checked": 0, "ops": 0}
    try:
        store = open_store(url)  # all four open it at once (a new folder: the race of its marker)
        cache = store.for_model(IDENTITY, CHUNK)
        rng = random.Random(1000 + index)
        codec = ("raw", "zstd")[index % 2]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(report["errors"]) < 5:
            tokens = next_prompt(rng, shared, report["ops"])
            whole = len(tokens) // CHUNK * CHUNK
            before = cache.lookup(tokens)
            hit = cache.get_prefix(tokens)
            if hit.num_tokens < before or hit.refused:  # nothing is ever removed or damaged here
                report["errors"].append(f"lookup {before}, get_prefix {hit.num_tokens}, refused {hit.refused}")
            for i, chunk in enumerate(hit.chunks):
                if not chunk_is_expected(chunk, tokens, i * CHUNK):
                    report["errors"].append(f"chunk {i} of a prompt is not its KV (a torn read?)")
            report["checked"] += len(hit.chunks)
            cache.put_sequence(tokens, expected_kv(tokens), codec=codec)
            if cache.lookup(tokens) != whole:
                report["errors"].append(f"after put_sequence, lookup {cache.lookup(tokens)} != {whole}")
            report["prompts"].append(tokens)
            report["ops"] += 1
        c = store.counters
        report.update(stored=c.stored, deduplicated=c.deduplicated, refused=c.refused, hits=c.hits)
        store.close()
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        report["errors"].append(traceback.format_exc())
    Path(out).write_text(json.dumps(report))


def writer_loop(path: str, seed: int, seconds: float = 60.0) -> None:
    """Store prompts until killed (forked by the spawner)."""
    store = open_store(path)
    cache = store.for_model(IDENTITY, CHUNK)
    rng, shared = random.Random(seed), bases()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tokens = stress_prompt(rng, shared)
        cache.put_sequence(tokens, expected_kv(tokens), codec=rng.choice(["raw", "zstd"]))


def writer_prompts(seed: int, count: int) -> list[list[int]]:
    """The first prompts `writer_loop(seed)` stores, as the test sees them."""
    rng, shared = random.Random(seed), bases()
    out = []
    for _ in range(count):
        out.append(stress_prompt(rng, shared))
        rng.choice(["raw", "zstd"])
    return out


def big_writer(path: str, name: str, size: int) -> None:
    open_store(path).backend.put(name, b"\x01" * size)


def spawner_main() -> None:
    """Import once, then fork a process for each command line on stdin (JSON: its role and
    arguments); print its pid."""
    torch.set_num_threads(1)
    expected_kv([0])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed writers
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                if cmd["role"] == "worker":
                    worker_main(cmd["url"], cmd["index"], cmd["seconds"], cmd["go"], cmd["out"])
                elif cmd["role"] == "writer":
                    writer_loop(cmd["path"], cmd["seed"])
                else:
                    big_writer(cmd["path"], cmd["name"], cmd["size"])
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 1
            os._exit(code)
        print(pid, flush=True)


# --- helpers for the test process -------------------------------------------------------


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no answer from process {proc.pid} in {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"process {proc.pid} exited with {proc.wait()}")
    return line.strip()


def start_spawner(stderr) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "spawner"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=Path(__file__).parent)


def wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} did not die")


def run_workers(spawn, url: str, tmp_path: Path) -> list[dict]:
    """NUM_WORKERS worker processes on `url` for DURATION seconds; their reports."""
    go = tmp_path / "go"
    outs = [tmp_path / f"worker{i}.json" for i in range(NUM_WORKERS)]
    pids = [spawn(role="worker", url=url, index=i, seconds=DURATION, go=str(go), out=str(out))
            for i, out in enumerate(outs)]
    go.touch()  # all at once
    try:
        for pid in pids:
            wait_gone(pid, timeout=DURATION + 120)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    reports = []
    for i, out in enumerate(outs):
        assert out.exists(), f"worker {i} died without its report: {spawn.errors()[-3000:]}"
        report = json.loads(out.read_text())
        assert report["errors"] == [], f"worker {i}: {report['errors'][:3]}"
        reports.append(report)
    return reports


def check_after_workers(store: ChunkStore, reports: list[dict]) -> None:
    distinct = {n for r in reports for tokens in r["prompts"] for n in names_of(tokens)}
    stored = {o.name for o in store.scan(f"chunks/{KEY}/")}
    assert all(r["ops"] > 0 for r in reports), [r["ops"] for r in reports]
    assert sum(r["checked"] for r in reports) > 0  # prompts were read back, not only written
    assert all(r["refused"] == 0 for r in reports)
    assert stored == distinct  # nothing lost, nothing extra
    assert sum(r["stored"] for r in reports) == len(distinct)  # each chunk written by one process once
    assert sum(r["deduplicated"] for r in reports) > 0  # and they did race for shared chunks
    assert check_every_object(store) == len(distinct)
    cache = store.for_model(IDENTITY, CHUNK)
    for tokens in random.Random(7).sample([t for r in reports for t in r["prompts"]], 100):
        hit = cache.get_prefix(tokens)
        assert hit.num_tokens == len(tokens) // CHUNK * CHUNK
        assert all(chunk_is_expected(c, tokens, i * CHUNK) for i, c in enumerate(hit.chunks))
    assert store.counters.refused == 0


# --- 4 processes, overlapping prompts -----------------------------------------------------


@pytest.fixture(scope="module")
def spawner(tmp_path_factory):
    with open(tmp_path_factory.mktemp("spawner") / "stderr", "w+") as err:
        yield from _spawner(err)


def _spawner(err):
    proc = start_spawner(stderr=err)
    assert read_line(proc, 120) == "ready"

    def spawn(**cmd) -> int:
        proc.stdin.write(json.dumps(cmd) + "\n")
        proc.stdin.flush()
        return int(read_line(proc, 30))

    def errors(since: int = 0) -> str:
        """What the forked processes wrote to stderr (tracebacks), from offset `since`."""
        err.flush()
        err.seek(since)
        return err.read()

    spawn.errors = errors
    try:
        yield spawn
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_concurrent_processes_local(spawner, tmp_path):
    root = tmp_path / "store"  # not created yet: the four processes open a new folder together
    reports = run_workers(spawner, str(root), tmp_path)
    store = open_store(root)
    check_after_workers(store, reports)
    assert temp_files(root) == []  # every writer removed its own temp files
    assert store.backend.sweep() == 0


def test_concurrent_processes_redis(spawner, redis_url, tmp_path):
    reports = run_workers(spawner, redis_url, tmp_path)
    store = open_store(redis_url)
    check_after_workers(store, reports)
    assert len(store.scan()) == len(store.scan(f"chunks/{KEY}/"))
    store.close()


# --- kill -9 ----------------------------------------------------------------------------


def test_writers_killed_at_random_moments(spawner, tmp_path):
    root = tmp_path / "store"
    rng = random.Random(99)
    seeds, rounds, writers = [], 6, 3
    errors_from = len(spawner.errors())
    for r in range(rounds):
        started = time.monotonic()
        pids = []
        for w in range(writers):
            seeds.append(10_000 * r + w)
            pids.append(spawner(role="writer", path=str(root), seed=seeds[-1]))
        for pid, at in sorted(zip(pids, (rng.uniform(0.05, 1.2) for _ in pids)), key=lambda x: x[1]):
            time.sleep(max(0.0, started + at - time.monotonic()))
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            wait_gone(pid)
    assert "Traceback" not in spawner.errors(errors_from)  # the writers died of SIGKILL, not of errors

    store = open_store(root)
    names = {o.name for o in store.scan()}
    assert len(names) > 50, "the writers stored little before they were killed"
    assert check_every_object(store) == len(names)  # every visible object is whole and right
    # prefixes read: every writer's prompts, as far as they got, exactly
    cache = store.for_model(IDENTITY, CHUNK)
    hits = 0
    for seed in seeds:
        for tokens in writer_prompts(seed, 20):
            found = cache.lookup(tokens)
            hit = cache.get_prefix(tokens)
            assert hit.num_tokens == found and hit.refused == []
            assert all(chunk_is_expected(c, tokens, i * CHUNK) for i, c in enumerate(hit.chunks))
            hits += hit.num_tokens > 0
    assert hits > 0 and store.counters.refused == 0

    # what the killed writers left: temp files, whose locks died with them
    temps = temp_files(root)
    assert all(p.name.startswith(".") and p.name.endswith(".tmp") for p in temps)
    assert store.backend.sweep() == 0 or _stale_seconds() == 0  # too young to be swept yet
    _age(temps)
    assert store.backend.sweep() == len(temps)
    assert temp_files(root) == []
    assert {o.name for o in store.scan()} == names  # no object removed by the sweep


def _stale_seconds() -> float:
    from kvtool.store import local

    return getattr(local, "STALE_TEMP_SECONDS", 0)


def _age(paths) -> None:
    """As if the crash were long ago: sweep leaves young temp files alone (their writer may not
    hold its lock yet)."""
    then = time.time() - _stale_seconds() - 60
    for p in paths:
        os.utime(p, (then, then))


def test_sweep_spares_a_live_writer_and_takes_a_dead_ones(spawner, tmp_path):
    """A writer stopped mid-write (SIGSTOP) holds the lock of its temp file: sweep leaves it,
    however old it looks. Killed, its temp file is swept, and its object never appears."""
    root = tmp_path / "store"
    store = open_store(root)
    name = chunk_name(KEY, CHUNK, "ab" * 32)
    for attempt in range(8):
        pid = spawner(role="big", path=str(root), name=name, size=256 << 20)
        caught = None
        deadline = time.monotonic() + 30
        while caught is None and time.monotonic() < deadline and not (root / name).exists():
            for p in temp_files(root):
                try:
                    if p.stat().st_size > 0:  # writing: its lock is taken before the first byte
                        os.kill(pid, signal.SIGSTOP)
                        caught = p
                        break
                except FileNotFoundError:
                    pass
        # stopped before it linked its object: it holds the temp file's lock
        if caught is not None and caught.exists() and not (root / name).exists():
            break
        os.kill(pid, signal.SIGKILL)  # it got too far first: again
        wait_gone(pid)
        store.backend.delete(name)
        for p in temp_files(root):
            p.unlink()
    else:
        pytest.fail("never caught the writer mid-write")
    try:
        _age([caught])
        assert store.backend.sweep() == 0  # locked by a live (stopped) writer
        assert caught.exists()
    finally:
        os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    assert store.backend.sweep() == 1  # its writer is gone
    assert temp_files(root) == []
    assert not store.backend.exists(name) and list(store.scan()) == []


# --- Redis restarted mid-run ----------------------------------------------------------------


def test_redis_restart_mid_run(redis_server):  # redis_server: skips (or fails in CI) without Redis
    """A client thread keeps putting and reading while the server is killed and started again on
    the same port: one-line StoreUnavailable while it is away, then the same ChunkStore works."""
    from redis_server import RedisServer

    from kvtool.store.redis_backend import RedisBackend

    server = RedisServer().start()
    try:
        store = ChunkStore(RedisBackend(server.url, retry_seconds=0.5))
        cache = store.for_model(IDENTITY, CHUNK)
        events: list[tuple[str, float, float, str]] = []  # (what, started, seconds, detail)
        stop = threading.Event()

        def client():
            rng = random.Random(5)
            while not stop.is_set():
                tokens = [rng.randrange(VOCAB) for _ in range(3 * CHUNK + 5)]  # unrelated prompts
                t0 = time.monotonic()
                try:
                    cache.put_sequence(tokens, expected_kv(tokens))
                    hit = cache.get_prefix(tokens)
                    right = hit.num_tokens == 3 * CHUNK and all(
                        chunk_is_expected(c, tokens, i * CHUNK) for i, c in enumerate(hit.chunks))
                    events.append(("ok" if right else "wrong", t0, time.monotonic() - t0, ""))
                except StoreUnavailable as err:
                    events.append(("unavailable", t0, time.monotonic() - t0, str(err)))
                except BaseException:  # noqa: BLE001
                    events.append(("error", t0, time.monotonic() - t0, traceback.format_exc()))
                    return

        def wait_for(what: str, after: float, count: int, timeout: float = 30.0) -> None:
            deadline = time.monotonic() + timeout
            while sum(e[0] == what and e[1] >= after for e in events) < count:
                assert time.monotonic() < deadline, f"no {what!r} after {timeout} s: {events[-5:]}"
                assert not any(e[0] == "error" for e in events), [e for e in events if e[0] == "error"]
                time.sleep(0.02)

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        wait_for("ok", 0, 5)
        server.stop()  # kill -9
        stopped = time.monotonic()
        wait_for("unavailable", stopped, 2)
        server.start()  # a new server on the same port (empty: nothing persisted)
        restarted = time.monotonic()
        wait_for("ok", restarted, 5)
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive()

        assert [e for e in events if e[0] in ("error", "wrong")] == []
        failures = [e for e in events if e[0] == "unavailable"]
        for _, started, seconds, message in failures:
            assert "\n" not in message and server.url in message and "cannot be reached" in message
            assert seconds < 10, f"a call hung {seconds:.1f} s"
            assert stopped - 1 <= started <= restarted
        # the same objects, from the main thread: it reconnected, and works both ways
        tokens = [7] * (2 * CHUNK)
        assert cache.put_sequence(tokens, expected_kv(tokens)).stored == 2
        hit = cache.get_prefix(tokens)
        assert hit.num_tokens == 2 * CHUNK and chunk_is_expected(hit.chunks[1], tokens, CHUNK)
        assert store.counters.refused == 0
        store.close()
    finally:
        server.close()


def test_redis_restart_within_the_retry_window_is_invisible(redis_server):
    """A server back within the retry budget: the call in flight waits, then succeeds."""
    from redis_server import RedisServer

    server = RedisServer().start()
    try:
        store = open_store(server.url)  # the default retry budget (about 5 s)
        cache = store.for_model(IDENTITY, CHUNK)
        tokens = list(range(2 * CHUNK))
        cache.put_sequence(tokens, expected_kv(tokens))
        server.stop()
        restart = threading.Timer(1.0, server.start)
        restart.start()
        t0 = time.monotonic()
        try:
            result = cache.put_sequence(tokens, expected_kv(tokens))  # the new server is empty
        finally:
            restart.join()
        elapsed = time.monotonic() - t0
        assert result.stored == 2
        assert 0.9 <= elapsed < 8, elapsed
        hit = cache.get_prefix(tokens)
        assert hit.num_tokens == 2 * CHUNK and chunk_is_expected(hit.chunks[0], tokens, 0)
        store.close()
    finally:
        server.close()


if __name__ == "__main__":
    if sys.argv[1:] != ["spawner"]:
        raise SystemExit("usage: python tests/test_store_stress.py spawner")
    spawner_main()
