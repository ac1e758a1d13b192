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


def redis_cli_path() -> str | None:
    return shutil.which("redis-cli") or next(
        (p for p in ("/usr/bin/redis-cli", "/usr/local/bin/redis-cli") if os.path.exists(p)), None)


class RedisClusterServers:
    """A real Redis Cluster on loopback: `masters` primaries with `replicas` replicas each, made by
    `redis-cli --cluster create` (Debian's package `redis-tools`). A small `cluster-node-timeout`
    (ms) makes a killed master's replica take over within a couple of seconds. Each node's cluster
    bus has its own free port (`cluster-port`), so no port + 10000 has to be free."""

    def __init__(self, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                 extra: tuple[str, ...] = ()):
        if redis_cli_path() is None:
            raise FileNotFoundError("redis-cli is not installed (apt-get install redis-tools)")
        if not (masters >= 3 or (masters == 1 and replicas == 0)):  # what `redis-cli --cluster create` makes
            raise ValueError("a cluster of 3 or more masters, or 1 master without replicas")
        self.masters, self.replicas = masters, replicas
        self.nodes = [RedisServer(extra=("--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                                         "--cluster-node-timeout", str(node_timeout_ms), *extra))
                      for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        """Every node as a seed: `redis+cluster://h:p,h:p,.../0`."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes) + "/0"

    def start(self) -> "RedisClusterServers":
        try:
            for node in self.nodes:
                node.start()
            if self.masters > 1:
                self._cli("--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                          "--cluster-replicas", str(self.replicas), "--cluster-yes")
            else:  # one master: `--cluster create` wants three; give it every slot itself
                self._cli("-p", str(self.nodes[0].port), "cluster", "addslotsrange", "0", "16383")
            self.wait_until_ok()
        except BaseException:
            self.close()
            raise
        return self

    def _cli(self, *args: str) -> str:
        done = subprocess.run([redis_cli_path(), *args], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args[:2])} failed: {done.stdout[-500:]} {done.stderr[-500:]}")
        return done.stdout

    def info(self, node: RedisServer, what: str = "info") -> str:
        return self._cli("-p", str(node.port), "cluster", what)

    def wait_until_ok(self, timeout: float = 30.0) -> None:
        """Until every running node says `cluster_state:ok` and knows as many masters as were made,
        each with its replicas attached (a replica that is still syncing has no data to fail over with)."""
        deadline = time.monotonic() + timeout
        while True:
            running = [n for n in self.nodes if n.proc is not None]
            try:
                if all("cluster_state:ok" in self.info(n) for n in running) and self._replicas_synced(running):
                    return
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not become ok")
            time.sleep(0.1)

    def _replicas_synced(self, running: list[RedisServer]) -> bool:
        for node in running:
            text = self._cli("-p", str(node.port), "info", "replication")
            if "role:slave" in text and "master_link_status:up" not in text:
                return False
        return True

    def primaries(self) -> list[RedisServer]:
        """The running nodes that are masters now (after a failover, a former replica)."""
        return [n for n in self.nodes if n.proc is not None
                and "role:master" in self._cli("-p", str(n.port), "info", "replication")]

    def replica_of(self, master: RedisServer) -> RedisServer | None:
        """A running replica of `master` (by its node id)."""
        master_id = self._cli("-p", str(master.port), "cluster", "myid").strip()
        for line in self.info(master, "nodes").splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[3] == master_id and "slave" in fields[2]:
                port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                return next((n for n in self.nodes if n.port == port and n.proc is not None), None)
        return None

    def kill(self, node: RedisServer) -> None:
        """SIGKILL: the node vanishes mid-run, as a crashed host does."""
        node.stop()

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> "RedisClusterServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
