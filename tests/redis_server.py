"""A real `redis-server` on a free localhost port, for the tests and the benches.

Debian's package `redis-server` (`.ci/run` installs it). Nothing is written to disk (no RDB,
no AOF): each instance starts empty. `stop()` and `start()` again on the same port is a
server restart, as a client sees it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time


def redis_server_path() -> str | None:
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.path.exists(p)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, *, maxmemory: str | None = None, policy: str = "allkeys-lru", port: int | None = None,
                 extra: tuple[str, ...] = ()):
        self.binary = redis_server_path()
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.maxmemory, self.policy, self.extra = maxmemory, policy, tuple(extra)  # (more server arguments)
        self.dir = tempfile.mkdtemp(prefix="kvtool-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no",
                "--proto-max-bulk-len", "1gb", "--loglevel", "warning"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        args += list(self.extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # (answering: a password is asked)
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
