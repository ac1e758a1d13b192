"""vLLM engines for the tests: one-shot engine processes and long-lived shared ones.

Starting a vLLM engine is the dearest step of the suite, mostly importing vLLM (8-15 s a process
on a 2-core machine), so:

- `serve(workdir, prompts, **job)`: one fresh engine process (scripts/vllm_serve.py) serving
  `prompts` in order, as a user's server would; its result and its log. For a test whose point is
  a fresh engine (a second engine loading what the first saved, a store changed under an engine,
  an engine that must refuse to start).
- `env=IN_PROCESS`: vLLM's engine core and its CPU worker in the process that serves (an engine
  up in about 3 s here, forked as below, instead of 13: vLLM spawns its worker, which imports vLLM
  again). vLLM's usual three
  processes (the default) are what the scheduler-to-worker hand-over, the counters that cross
  processes and the failure reports are shown in; a test about neither can run in one.
- `EngineServer` / the `vllm_engine` fixture (tests/conftest.py): one long-lived in-process engine
  per configuration for the whole session, taking one job (a list of prompts) at a time: every
  test that asks for the same configuration shares one engine start. A job's log is the lines
  the engine wrote while serving it. Share an engine where tests cannot see each other: no
  connector (references), or a connector whose store each test keeps apart (its own cache salt);
  a connector's saving thread may still be writing after a job returns, so a test that counts
  saves runs its whole sequence as one job.

Each engine process (both kinds) is forked from one process per session that imported vLLM once
(`ForkServer`, scripts/vllm_serve.py --fork-server; `has_vllm` is that process coming up): a
forked process is otherwise the process `python scripts/vllm_serve.py` would be: its own
environment, folder, streams and exit code; vLLM's three processes, where asked for, are that
process's own children as before (`run_serve` for a test that reads a refusal's exit code itself).

Runs with the Python that has vLLM: this one, or $KVTOOL_VLLM_PYTHON.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("KVTOOL_VLLM_PYTHON", sys.executable)
SERVE = REPO / "scripts" / "vllm_serve.py"
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: The most long-lived engines kept at once (each holds its model and 1 GiB of KV pages).
MAX_LIVE_ENGINES = 2


@functools.cache
def has_vllm() -> bool:
    """Whether vLLM and kvtool's connector import in PYTHON: asked once a session (importing vLLM
    takes 10-20 s here), by every module that needs it, of the fork server that imports both."""
    return fork_server().ready()


def engine_env(env: dict | None = None) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}


class Forked:
    """A process the fork server started: `poll`, `wait` and `kill` as subprocess.Popen's (its exit
    is set by the server's reader, which may hear of it first)."""

    def __init__(self):
        self.pid, self.returncode, self._exited = None, None, threading.Event()

    def exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode if self._exited.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"vllm_serve.py (pid {self.pid})", timeout)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkServer:
    """scripts/vllm_serve.py --fork-server: vLLM imported once; `start(argv, ...)` forks a process
    that runs as `python scripts/vllm_serve.py *argv` would, in `env`, `cwd`, with these streams."""

    def __init__(self, env: dict):
        self.env = env
        self._proc = subprocess.Popen([PYTHON, str(SERVE), "--fork-server"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self._lock, self._ids = threading.Lock(), itertools.count()
        self._forked: dict[int, tuple[Forked, threading.Event]] = {}  # id -> (the process, started)
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _record(self, number: int) -> tuple[Forked, threading.Event]:
        with self._lock:
            return self._forked.setdefault(number, (Forked(), threading.Event()))

    def _read(self) -> None:
        for line in self._proc.stdout:
            words = line.split()
            if words == ["READY"]:
                self._ready.set()
            elif len(words) == 3 and words[0] == "STARTED":
                forked, started = self._record(int(words[1]))
                forked.pid = int(words[2])
                started.set()
            elif len(words) == 3 and words[0] == "EXIT":
                self._record(int(words[1]))[0].exited(int(words[2]))
        self._ready.set()  # it exited: start() says so

    def ready(self) -> bool:
        """Whether it imported vLLM and kvtool's connector (it says READY then, or exits)."""
        self._ready.wait(timeout=300)
        return self.alive()

    def alive(self) -> bool:
        """Running and taking requests."""
        return self._proc.poll() is None and not self._proc.stdin.closed

    def start(self, argv: list[str], env: dict, cwd: Path, stdout: Path, stderr: Path, stdin: Path | None = None) -> Forked:
        assert self.ready(), "the vLLM fork server exited (does vLLM import? python scripts/vllm_serve.py --fork-server)"
        number = next(self._ids)
        forked, started = self._record(number)
        request = {"id": number, "argv": argv, "env": env, "cwd": str(cwd), "stdout": str(stdout),
                   "stderr": str(stderr), "stdin": str(stdin) if stdin else None}
        with self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        assert started.wait(timeout=60), "the vLLM fork server did not start a process in 60 s"
        return forked

    def close(self, wait: bool = True) -> None:
        if not self._proc.stdin.closed:
            self._proc.stdin.close()  # it exits once its processes have
        if wait and self._proc.poll() is None:
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()


_fork_server: list[ForkServer] = []


def fork_server() -> ForkServer:
    """The session's fork server, started on first use. A forked process takes its own whole
    environment; the server's (this process's when it started) is only what vLLM and kvtool read
    as they are imported, which is nothing a job sets: vLLM reads its settings (VLLM_*) when an
    engine starts, kvtool its own when it is used."""
    if not _fork_server or not _fork_server[0].alive():
        _fork_server[:] = [ForkServer(engine_env())]
    return _fork_server[0]


atexit.register(lambda: [server.close() for server in _fork_server])


def run_serve(workdir: Path, spec: Path, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python scripts/vllm_serve.py SPEC` in `workdir` with engine_env(env), as subprocess.run
    would run it with capture_output and text (a process forked by the fork server): its exit
    code, stdout and stderr (kept beside the job, SPEC.stdout and SPEC.stderr)."""
    stdout, stderr = spec.with_suffix(".stdout"), spec.with_suffix(".stderr")
    process = fork_server().start([str(spec)], engine_env(env), workdir, stdout, stderr)
    try:
        returncode = process.wait(timeout=timeout)
    finally:
        process.kill()  # (past the timeout)
    return subprocess.CompletedProcess([PYTHON, str(SERVE), str(spec)], returncode, stdout.read_text(),
                                       stderr.read_text())


def serve(workdir: Path, prompts: list, connector: str = "kvtool", env: dict | None = None, **job) -> dict:
    """One fresh vLLM engine process serving `prompts` in order; its result and its log (also
    kept beside the job, job-N.log)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"job-{len(list(workdir.glob('job-*.json')))}.json"
    spec.write_text(json.dumps({"prompts": prompts, "connector": connector, **job}))
    out = run_serve(workdir, spec, env)
    log = out.stdout + out.stderr  # vLLM logs to stdout
    spec.with_suffix(".log").write_text(log)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return {**json.loads(lines[-1][len("RESULT "):]), "log": log}


class EngineServer:
    """One long-lived in-process engine (scripts/vllm_serve.py --serve) with fixed settings (`job`
    without prompts); `run(prompts)` serves a job and returns what `serve` returns (the first
    waits for the engine to be up: made early, it starts beside other work). Its whole log is
    kept in `workdir/engine.log`."""

    def __init__(self, workdir: Path, env: dict | None = None, **job):
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.settings = workdir, job
        spec = workdir / "engine.json"
        spec.write_text(json.dumps(job))
        jobs, log = workdir / "jobs.fifo", workdir / "engine.log"
        os.mkfifo(jobs)
        self._jobs = os.open(jobs, os.O_RDWR)  # (a FIFO opened to read and write never waits for its other end)
        log.touch()
        self._proc = fork_server().start(["--serve", str(spec)], engine_env({**IN_PROCESS, **(env or {})}), workdir,
                                         stdout=log, stderr=log, stdin=jobs)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(log,), daemon=True).start()
        self._ready = False  # awaited by the first job: the engine starts while the caller goes on

    def _read(self, path: Path) -> None:
        """The engine's log as it writes it, a line at a time, until it exits and its log is read."""
        partial = ""
        with path.open() as log:
            while True:
                exited = self._proc.poll() is not None  # (asked before reading: its last lines are read after)
                for piece in iter(log.readline, ""):
                    partial += piece
                    if partial.endswith("\n"):
                        self._lines.put(partial.rstrip("\n"))
                        partial = ""
                if exited:
                    break
                time.sleep(0.02)
        if partial:
            self._lines.put(partial)
        self._lines.put(None)  # the engine exited

    def _until(self, last, what: str, timeout: float = 900) -> list[str]:
        """Lines up to and with the first for which `last` is true; an engine that exits first fails."""
        lines = []
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"the engine did not {what} in {timeout:.0f} s: " + "\n".join(lines[-40:]))
            if line is None:
                raise AssertionError(f"the engine exited before it could {what}: " + "\n".join(lines[-80:]))
            lines.append(line)
            if last(line):
                return lines

    def run(self, prompts: list) -> dict:
        if not self._ready:
            self._until(lambda line: line == "READY", "start")
            self._ready = True
        os.write(self._jobs, (json.dumps({"prompts": prompts}) + "\n").encode())
        lines = self._until(lambda line: re.fullmatch(r"JOB-END \d+", line) is not None, "serve a job")
        result = next(x for x in lines if x.startswith("RESULT "))
        log = "\n".join(x for x in lines if not re.fullmatch(r"JOB-(BEGIN|END) \d+", x) and x is not result)
        return {**json.loads(result[len("RESULT "):]), "log": log}

    def close(self) -> None:
        os.close(self._jobs)  # the end of its jobs: it exits
        if self._proc.poll() is None:
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=30)


class EngineServers:
    """The session's long-lived engines, one per configuration, started on first use; at most
    MAX_LIVE_ENGINES at once (the one used longest ago is stopped to make room)."""

    def __init__(self, workdir_for):
        self._workdir_for = workdir_for  # a name -> a fresh folder (tmp_path_factory.mktemp)
        self._live: dict[str, EngineServer] = {}

    def get(self, env: dict | None = None, **job) -> EngineServer:
        key = json.dumps({"env": env or {}, **job}, sort_keys=True)
        engine = self._live.pop(key, None)
        if engine is None:
            while len(self._live) >= MAX_LIVE_ENGINES:
                self._live.pop(next(iter(self._live))).close()
            engine = EngineServer(self._workdir_for("vllm-engine"), env=env, **job)
        self._live[key] = engine  # the most recently used last
        return engine

    def close(self) -> None:
        while self._live:
            self._live.popitem()[1].close()
