"""The Redis backend: the store many hosts share (format-spec/store.md §6).

Each object is one Redis string under `kvtool:1:<name>`, written with `SET ... NX` (put-once,
atomic). Batches go in one pipeline (one round trip). Eviction is Redis' own: run the server
with `maxmemory` and `maxmemory-policy allkeys-lru`. A server that is unreachable, or goes away
mid-run, is retried with backoff for a few seconds, then reported in one line; the next call
reconnects by itself when the server is back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..errors import ObjectRefused, StoreAccessDenied, StoreError, StoreUnavailable, UsageError
from .backend import Backend, ObjectInfo

KEY_PREFIX = "kvtool:1:"
#: How long a command keeps retrying a lost server before it reports it (seconds of backoff).
RETRY_SECONDS = 5.0


def redacted(url: str) -> str:
    """`url` with its password (and a username that may be a token) replaced by `***`."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        if parts.password is None and parts.username is None:
            return url
        host = parts.hostname or ""
        netloc = "***@" + (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    except ValueError:  # (a malformed port): show only the scheme
        return url.split("://", 1)[0] + "://***"
    return urlunsplit(parts._replace(netloc=netloc))


#: Where a password kept out of the store's URL comes from: this environment variable, or the file
#: named by the URL's `password_file` query argument (its first line). A password in the URL wins.
PASSWORD_VARIABLE = "KVTOOL_REDIS_PASSWORD"


def _password_outside(url: str, shown: str) -> tuple[str, str | None]:
    """`url` without a `password_file` argument, and the password kept outside it (None: the URL's
    own, or none). Errors name the store as `shown` (redacted) and never hold the password."""
    import os
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    files = [value for key, value in query if key == "password_file"]
    if files:
        url = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in query if k != "password_file"])))
    try:
        has_own = parts.password is not None
    except ValueError:
        has_own = False
    if has_own:
        return url, None
    if files:
        try:
            with open(files[-1], encoding="utf-8") as f:
                first = f.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as err:
            raise StoreError(f"{shown}: cannot read its password_file ({getattr(err, 'strerror', None) or err})") from None
        if not first:
            raise StoreError(f"{shown}: its password_file is empty")
        return url, first
    return url, os.environ.get(PASSWORD_VARIABLE) or None


def _retry_but_not_refusals(retry_class):
    """redis-py's Retry, except that a refused user name or password (an AuthenticationError,
    which redis-py counts as a lost connection) is not tried again: it would not change."""
    from redis.exceptions import AuthenticationError

    class RetryButNotRefusals(retry_class):
        def call_with_retry(self, do, fail, is_retryable=None, *args, **kwargs):
            def retryable(error):
                return not isinstance(error, AuthenticationError) and (is_retryable is None or is_retryable(error))
            return super().call_with_retry(do, fail, retryable, *args, **kwargs)
    return RetryButNotRefusals


class RedisBackend(Backend):
    def __init__(self, url: str, *, retry_seconds: float = RETRY_SECONDS):
        try:
            import redis
            from redis.backoff import ExponentialBackoff
            from redis.retry import Retry
        except ImportError:
            raise UsageError("a redis:// store needs redis-py: pip install 'redis>=5'") from None
        self._errors = redis.exceptions
        self.url = redacted(url)  # what messages and logs show: never the password
        # redis-py waits 0.1, 0.2, 0.4, then 0.5 s between tries: about `retry_seconds` of waiting
        # for a refused connection, plus up to 1 s per try for a host that does not answer
        retries = max(1, int((retry_seconds - 0.7) / 0.5) + 3)
        url, password = _password_outside(url, self.url)
        try:
            self.client = redis.Redis.from_url(
                url, socket_connect_timeout=1.0, socket_timeout=5.0, **({"password": password} if password else {}),
                retry=_retry_but_not_refusals(Retry)(ExponentialBackoff(cap=0.5, base=0.05), retries),
                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])
        except ValueError as err:
            raise StoreError(f"{self.url}: not a Redis URL ({err})") from None
        with self._talking():
            self.client.ping()

    @contextmanager
    def _talking(self):
        """Redis' exceptions become one line naming the server."""
        try:
            yield
        except self._errors.AuthenticationError as err:  # (a ConnectionError to redis-py: not one to us)
            raise StoreAccessDenied(f"{self.url}: the Redis server refused the user name or password "
                                    f"({_first_line(err)})") from None
        except self._errors.NoPermissionError as err:
            raise StoreAccessDenied(f"{self.url}: the Redis user may not do this (ACL: {_first_line(err)})") from None
        except (self._errors.ConnectionError, self._errors.TimeoutError) as err:
            raise StoreUnavailable(f"{self.url}: the Redis server cannot be reached ({_first_line(err)})") from None
        except self._errors.RedisError as err:
            raise StoreError(f"{self.url}: Redis refused the command ({_first_line(err)})") from None

    # --- reads -----------------------------------------------------------------------

    def get(self, name: str) -> bytes | None:
        """The object's bytes; a key of another type at its name (a hash, a list) is not an
        object: refused (a miss), and `fsck` removes it."""
        try:
            with self._talking():
                return self.client.get(_key(name))
        except StoreError as err:
            if "WRONGTYPE" not in str(err):
                raise
            raise ObjectRefused(f"{name}: a Redis value of another type than a string is at its key "
                                "(not an object; fsck removes it)") from None

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        if not names:  # (MGET answers nil for a key of another type: a miss)
            return []
        with self._talking():
            return self.client.mget([_key(n) for n in names])

    def exists(self, name: str) -> bool:
        return self.exists_many([name])[0]

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """A string at each key (TYPE: like EXISTS it is not a use): a key of another type is not
        an object, never counted as present, so a put replaces it."""
        if not names:
            return []
        with self._talking():
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.type(_key(n))
            return [t in (b"string", "string") for t in pipe.execute()]

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        now = time.time()
        with self._talking():
            keys = list(self.client.scan_iter(match=_key(_glob_escape(prefix)) + b"*", count=1000))
            for start in range(0, len(keys), 1000):
                batch = keys[start:start + 1000]
                pipe = self.client.pipeline(transaction=False)
                for key in batch:  # neither counts as a use (STRLEN would: it resets the LRU clock)
                    pipe.object("idletime", key)
                    pipe.memory_usage(key)
                replies = pipe.execute(raise_on_error=False)
                for i, key in enumerate(batch):
                    idle, size = replies[2 * i], replies[2 * i + 1]
                    if not isinstance(size, int) or size == 0:  # removed meanwhile
                        continue
                    idle = idle if isinstance(idle, int) else 0
                    # a key that is not UTF-8 keeps its bytes (surrogates): listed as foreign, removable
                    yield ObjectInfo(key.decode("utf-8", "surrogateescape")[len(KEY_PREFIX):], size, now - idle)

    # --- writes ----------------------------------------------------------------------

    def put(self, name: str, data: bytes, *, replace: bool = False) -> bool:
        if replace:
            with self._talking():
                return bool(self.client.set(_key(name), bytes(data)))
        return self.put_many([(name, data)])[0]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """SET NX each (put-once); a name held by a key of another type (not an object) is
        overwritten by the object instead of counting as stored."""
        if not items:
            return []
        with self._talking():
            pipe = self.client.pipeline(transaction=False)
            for name, data in items:
                pipe.set(_key(name), bytes(data), nx=True)
            created = [bool(x) for x in pipe.execute()]
            taken = [i for i, c in enumerate(created) if not c]
            if taken:
                pipe = self.client.pipeline(transaction=False)
                for i in taken:
                    pipe.type(_key(items[i][0]))
                for i, kind in zip(taken, pipe.execute()):
                    if kind not in (b"string", "string"):
                        created[i] = bool(self.client.set(_key(items[i][0]), bytes(items[i][1])))
            return created

    def delete(self, name: str) -> bool:
        with self._talking():
            return bool(self.client.delete(_key(name)))

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # closing a connection to a server that is gone
            pass


def _key(name: str) -> bytes:
    """The Redis key of a name; a name read from a key that is not UTF-8 gives its bytes back."""
    return (KEY_PREFIX + name).encode("utf-8", "surrogateescape")


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _first_line(err: Exception) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
