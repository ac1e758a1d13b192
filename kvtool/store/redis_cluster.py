"""The Redis backend over a Redis Cluster (format-spec/store.md §6.2): `redis+cluster://` and
`rediss+cluster://` (TLS) URLs, through redis-py's `RedisCluster`.

The keys are the single server's (`kvtool:1:<name>`, `kvtool:ns:<namespace>:1:<name>`): they
carry no hash tag, so chunks spread over the cluster's slots. No command names two keys (no
MGET: it would be refused across slots); a batch is a pipeline, which redis-py's cluster client
splits by node: one round trip per node, never one per key. SCAN, and with it stats, gc and fsck,
walks every primary.

A primary that goes away is retried with the single server's backoff (0.1, 0.2, 0.4, then 0.5 s,
about `retry_seconds` in all), during which its replica is promoted and the client learns the new
slot map (redis-py reloads it on a lost node, a MOVED or a CLUSTERDOWN): reads and writes go on
with the same client. What the lost primary had not yet copied to its replica is gone: a miss.
A node that stays down is one line, `StoreUnavailable`, once the backoff is spent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager

from ..errors import StoreUnavailable
from .redis_backend import RedisBackend
from .urls import StoreUrl


class RedisClusterBackend(RedisBackend):
    """`RedisBackend` with a cluster client: batches pipelined per node, scans over every primary,
    and a failover (or a MOVED slot) ridden out with the single server's backoff."""

    KIND, KIND_NAME = "cluster", "a Redis Cluster (redis+cluster://, rediss+cluster://)"

    def _connect(self, redis, options: dict, url: StoreUrl):
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        self._cluster_errors = (redis.exceptions.ClusterError, redis.exceptions.TryAgainError,
                                redis.exceptions.MovedError, redis.exceptions.RedisClusterException)

        def make():
            # the client's own retries only follow a moved slot at once; waiting for a failover is
            # `_run`'s backoff, the same as the single server's (the first seed is host and port)
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in url.nodes[1:]],
                                retry=Retry(NoBackoff(), 3), **options)
        last = None
        for wait in [*_backoff(self.retry_seconds), None]:
            try:
                return make()
            except (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError):
                raise  # (said by `_talking`, at once: it would not change)
            except self._cluster_errors + (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
                text = str(err)
                if any(w in text for w in ("WRONGPASS", "invalid username-password", "NOAUTH", "NOPERM")):
                    raise redis.exceptions.AuthenticationError(self._said(err)) from None
                last = err  # no seed answered the slot map: tried again, as a lost server is
            if wait is not None:
                time.sleep(wait)
        raise StoreUnavailable(f"{self.url}: the Redis cluster cannot be reached ({self._said(last)})") from None

    def _ping(self) -> None:
        self.client.ping(target_nodes=self.client.PRIMARIES)

    def _run(self, do):
        """`do()`, again after each backoff step while the cluster is failing over or a node is
        away (a command that had gone through is idempotent: GET, TYPE, SET NX, OBJECT)."""
        waits = _backoff(self.retry_seconds)
        while True:
            try:
                with self._talking():
                    return do()
            except StoreUnavailable:
                if not waits:
                    raise
                time.sleep(waits.pop(0))

    @contextmanager
    def _talking(self):
        """The single server's messages; a cluster that is failing over (CLUSTERDOWN, TRYAGAIN, a
        slot no node serves yet) is one that cannot be reached for now."""
        try:
            with super()._talking():
                try:
                    yield
                except self._cluster_errors as err:
                    raise self._errors.ConnectionError(f"the cluster is failing over or a node is away: "
                                                       f"{self._said(err)}") from None
        except StoreUnavailable as err:
            raise StoreUnavailable(str(err).replace("the Redis server", "the Redis cluster", 1)) from None

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """A GET per name in one pipeline (one round trip per node); a key of another type is a
        miss, as MGET answers it."""
        if not names:
            return []

        def do():
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.get(self._key(name))
            replies = pipe.execute(raise_on_error=False)
            for reply in replies:  # (raised here, a lost node is tried again by `_run`)
                if isinstance(reply, Exception) and "WRONGTYPE" not in str(reply):
                    raise reply
            return [None if isinstance(r, Exception) else r for r in replies]
        return self._run(do)

    def _scan_keys(self, pattern: bytes) -> list[bytes]:
        """SCAN on every primary (each holds its own slots' keys)."""
        return self._run(lambda: list(self.client.scan_iter(match=pattern, count=1000,
                                                            target_nodes=self.client.PRIMARIES)))


def _backoff(retry_seconds: float) -> list[float]:
    """The single server's waits between tries: 0.1, 0.2, 0.4, then 0.5 s, about `retry_seconds`."""
    waits, n = [], 1
    while sum(waits) < retry_seconds - 0.05:
        waits.append(min(0.5, 0.05 * 2 ** n))
        n += 1
    return waits


__all__ = ["RedisClusterBackend"]
