"""vLLM engines for the tests: one-shot engine processes and long-lived shared ones.

Starting a vLLM engine is the dearest step of the suite (35-75 s on a 2-core machine), so:

- `serve(workdir, prompts, **job)`: one fresh engine process (scripts/vllm_serve.py) serving
  `prompts` in order, as a user's server would; its result and its log. For a test whose point is
  a fresh engine (a second engine loading what the first saved, a store changed under an engine,
  an engine that must refuse to start).
- `env=IN_PROCESS`: vLLM's engine core and its CPU worker in the process that serves (about 35 s
  an engine here instead of 75: two fewer spawns, each importing vLLM again). vLLM's usual three
  processes (the default) are what the scheduler-to-worker hand-over, the counters that cross
  processes and the failure reports are shown in; a test about neither can run in one.
- `EngineServer` / the `vllm_engine` fixture (tests/conftest.py): one long-lived in-process engine
  per configuration for the whole session, taking one job (a list of prompts) at a time: every
  test that asks for the same configuration shares one engine start. A job's log is the lines
  the engine wrote while serving it. Share an engine where tests cannot see each other: no
  connector (references), or a connector whose store each test keeps apart (its own cache salt);
  a connector's saving thread may still be writing after a job returns, so a test that counts
  saves runs its whole sequence as one job.

Runs with the Python that has vLLM: this one, or $KVTOOL_VLLM_PYTHON.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import re
import subprocess
import sys
import threading
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
    takes 10-20 s here), by every module that needs it."""
    probe = subprocess.run([PYTHON, "-c", "import vllm, kvtool.integrations.vllm"], capture_output=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    return probe.returncode == 0


def engine_env(env: dict | None = None) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}


def serve(workdir: Path, prompts: list, connector: str = "kvtool", env: dict | None = None, **job) -> dict:
    """One fresh vLLM engine process serving `prompts` in order; its result and its log (also
    kept beside the job, job-N.log)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"job-{len(list(workdir.glob('job-*.json')))}.json"
    spec.write_text(json.dumps({"prompts": prompts, "connector": connector, **job}))
    out = subprocess.run([PYTHON, str(SERVE), str(spec)], capture_output=True, text=True, timeout=900,
                         env=engine_env(env), cwd=workdir)
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
        self._log = (workdir / "engine.log").open("w")
        self._proc = subprocess.Popen([PYTHON, str(SERVE), "--serve", str(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=engine_env({**IN_PROCESS, **(env or {})}), cwd=workdir)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._ready = False  # awaited by the first job: the engine starts while the caller goes on

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._log.write(line)
            self._log.flush()
            self._lines.put(line.rstrip("\n"))
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
        self._proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
        self._proc.stdin.flush()
        lines = self._until(lambda line: re.fullmatch(r"JOB-END \d+", line) is not None, "serve a job")
        result = next(x for x in lines if x.startswith("RESULT "))
        log = "\n".join(x for x in lines if not re.fullmatch(r"JOB-(BEGIN|END) \d+", x) and x is not result)
        return {**json.loads(result[len("RESULT "):]), "log": log}

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # the end of its jobs: it exits
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=30)
        self._log.close()


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
