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
                 extra: tuple[str, ...] = (), tls: "TlsFiles | None" = None):
        self.binary = redis_server_path()
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.maxmemory, self.policy, self.extra = maxmemory, policy, tuple(extra)  # (more server arguments)
        self.tls = tls  # TLS only: the port speaks TLS, and no plain port is open
        self.dir = tempfile.mkdtemp(prefix="kvtool-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return (f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}&ssl_certfile={self.tls.client_cert}"
                    f"&ssl_keyfile={self.tls.client_key}")
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no",
                "--proto-max-bulk-len", "1gb", "--loglevel", "warning"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        if self.tls is not None:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.server_cert),
                         "--tls-key-file", str(self.tls.server_key), "--tls-ca-cert-file", str(self.tls.ca),
                         "--tls-auth-clients", "yes"]
        args += list(self.extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with self._connect() as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # (answering: a password is asked)
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def _connect(self):
        plain = socket.create_connection(("127.0.0.1", self.port), timeout=0.2)
        if self.tls is None:
            return plain
        import ssl

        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return context.wrap_socket(plain, server_hostname="127.0.0.1")

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


class TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made by `openssl` in
    `folder` (the tests' own: nothing from the system's trust store)."""

    def __init__(self, folder):
        from pathlib import Path

        d = Path(folder)
        self.ca, self.ca_key = d / "ca.crt", d / "ca.key"
        self.server_cert, self.server_key = d / "server.crt", d / "server.key"
        self.client_cert, self.client_key = d / "client.crt", d / "client.key"

        def openssl(*args):
            subprocess.run(["openssl", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvtool test CA",
                "-keyout", str(self.ca_key), "-out", str(self.ca))
        for cert, key, name in ((self.server_cert, self.server_key, "server"), (self.client_cert, self.client_key, "client")):
            request = d / f"{name}.csr"
            openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=kvtool test {name}", "-keyout", str(key),
                    "-out", str(request))
            extensions = d / f"{name}.ext"
            extensions.write_text("subjectAltName=IP:127.0.0.1\n" if name == "server" else "extendedKeyUsage=clientAuth\n")
            openssl("x509", "-req", "-in", str(request), "-CA", str(self.ca), "-CAkey", str(self.ca_key),
                    "-CAcreateserial", "-days", "2", "-extfile", str(extensions), "-out", str(cert))
