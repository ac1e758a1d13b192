"""The Redis backend: the store many hosts share (format-spec/store.md §6.2).

Each object is one Redis string under `kvtool:1:<name>`, or for a chunk of a namespace under
`kvtool:ns:<namespace>:1:<name>` (`key_prefix`), so that a Redis ACL key pattern can confine a
tenant's user to its own chunks; written with `SET ... NX` (put-once, atomic). Batches go in one
pipeline (one round trip). Eviction is Redis' own: run the server with `maxmemory` and
`maxmemory-policy allkeys-lru`. A server that is unreachable, or goes away mid-run, is retried
with backoff for a few seconds, then reported in one line; the next call reconnects by itself
when the server is back. Redis Cluster is `redis_cluster.py`, this class with another client.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..errors import ObjectRefused, StoreAccessDenied, StoreError, StoreUnavailable, StoreUrlInvalid, UsageError
from .backend import PROBE_TAIL, Backend, ObjectInfo
from .urls import StoreUrl, parse_store_url, redacted  # noqa: F401  (`redacted`: public here too)

#: The key prefix of objects without a namespace (1: the backend layout's version, §9).
KEY_PREFIX = "kvtool:1:"
#: Where each namespace's keys start: `kvtool:ns:<escaped namespace>:1:`.
NAMESPACE_PREFIX = "kvtool:ns:"
#: Characters a namespace keeps as they are in its key prefix; any other is %XX of its UTF-8 bytes,
#: so that no prefix is another's (no ':'), and an ACL pattern or SCAN glob, or a cluster hash
#: tag ('{...}'), never reads one as anything but literal text.
_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
#: How long a command keeps retrying a lost server before it reports it (seconds of backoff).
RETRY_SECONDS = 5.0


def key_prefix(namespace: str) -> str:
    """The Redis key prefix of a namespace's objects ("": those without one), store.md §6.2. The
    ACL key pattern that confines a tenant to namespace N is `tenant_acl(N)`'s `~kvtool:ns:<N>:*`."""
    return f"{NAMESPACE_PREFIX}{_escaped(namespace)}:1:" if namespace else KEY_PREFIX


def _escaped(namespace: str) -> str:
    return "".join(c if c in _PLAIN else "".join(f"%{b:02X}" for b in c.encode("utf-8")) for c in namespace)


#: What a tenant's Redis user needs (store.md §6.2): the commands the backend sends, no others.
TENANT_COMMANDS = ("-@all", "+ping", "+get", "+mget", "+set", "+type", "+strlen", "+getrange", "+del", "+scan",
                   "+object|idletime", "+memory|usage")
#: ... and on a Redis Cluster, what redis-py asks to learn the slot map.
CLUSTER_COMMANDS = ("+cluster|slots", "+cluster|shards", "+cluster|nodes", "+command")


def tenant_acl(namespace: str, *, cluster: bool = False) -> list[str]:
    """The ACL rules (for `ACL SETUSER name on >password ...rules`, or `user name on >password
    ...rules` in an ACL file) that confine a user to `namespace`'s chunks (store.md §6.2)."""
    return ["resetkeys", f"~{NAMESPACE_PREFIX}{_escaped(namespace)}:*", "resetchannels", *TENANT_COMMANDS,
            *(CLUSTER_COMMANDS if cluster else ())]


def _namespace_of(key: str) -> tuple[str, str] | None:
    """(namespace, name) of a key under NAMESPACE_PREFIX; None for one that no namespace's
    prefix gives (a foreign key: not the store's, never read or removed by it)."""
    from urllib.parse import unquote

    escaped, sep, rest = key[len(NAMESPACE_PREFIX):].partition(":1:")
    if not sep or not escaped:
        return None
    try:
        namespace = unquote(escaped, errors="strict")
        return (namespace, rest) if key_prefix(namespace) == key[:len(key) - len(rest)] else None
    except UnicodeError:  # %-escapes that are not UTF-8, or a key's own bytes that are not
        return None


#: Where a password kept out of the store's URL comes from: this environment variable, or the file
#: named by the URL's `password_file` query argument (its first line). A password in the URL wins.
PASSWORD_VARIABLE = "KVTOOL_REDIS_PASSWORD"


def _password_of(url: StoreUrl) -> str | None:
    """The URL's own password, else its password_file's first line, else the environment's.
    Errors name the store as `url.shown` and never hold the password."""
    import os

    if url.password is not None:
        return url.password
    if url.password_file is not None:
        try:
            with open(url.password_file, encoding="utf-8") as f:
                first = f.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as err:
            raise StoreError(f"{url.shown}: cannot read its password_file "
                             f"({getattr(err, 'strerror', None) or type(err).__name__})") from None
        if not first:
            raise StoreError(f"{url.shown}: its password_file is empty")
        return first
    return os.environ.get(PASSWORD_VARIABLE) or None


def client_options(url: StoreUrl, password: str | None) -> dict:
    """redis-py's client keyword arguments for `url` (never its URL parser: `urls.py` is the one)."""
    options: dict = {"socket_connect_timeout": 1.0, "socket_timeout": 5.0, **dict(url.options)}
    if url.username is not None:
        options["username"] = url.username
    if password:
        options["password"] = password
    if url.tls:
        options["ssl"] = True
    if url.path:
        options["unix_socket_path"] = url.path
    else:
        options["host"], options["port"] = url.nodes[0]
    if url.kind == "redis":
        options["db"] = url.db
    return options


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
    """One Redis server (or, in `RedisClusterBackend`, a cluster). `within(namespace)` is the same
    connection seen through that namespace's key prefix: what a `ModelCache` of the namespace uses."""

    writes_in_batches = True

    #: the kind of `urls.StoreUrl` this backend opens
    KIND, KIND_NAME = "redis", "one Redis server (redis://, rediss://, unix://)"

    def __init__(self, url: str | StoreUrl, *, retry_seconds: float = RETRY_SECONDS):
        parsed = url if isinstance(url, StoreUrl) else parse_store_url(url)
        if parsed.kind != self.KIND:
            raise StoreUrlInvalid(f"{parsed.shown}: not a URL of {self.KIND_NAME}")
        try:
            import redis
        except ImportError:
            raise UsageError("a redis:// store needs redis-py: pip install 'redis>=5'") from None
        self._errors = redis.exceptions
        self.url = parsed.shown  # what messages and logs show: never the password (urls.py's canonical form)
        self.namespace = ""
        self._prefix = KEY_PREFIX
        self._root, self._views = self, {}
        password = _password_of(parsed)
        #: what a library's message must never show (redis-py's name hosts, not passwords: a guard; a
        #: password of 1 to 3 characters is in much text, so it is not cut out of words)
        self._secrets = (password,) if password and len(password) >= 4 else ()
        self.retry_seconds = retry_seconds
        try:
            with self._talking():  # (a cluster client talks to its seeds as it is made)
                self.client = self._connect(redis, client_options(parsed, password), parsed)
        except ValueError:  # (its message may quote an argument: never shown)
            raise StoreUrlInvalid(f"{self.url}: redis-py refused the URL's arguments") from None
        self._run(self._ping)

    def _connect(self, redis, options: dict, url: StoreUrl):
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        # redis-py waits 0.1, 0.2, 0.4, then 0.5 s between tries: about `retry_seconds` of waiting
        # for a refused connection, plus up to 1 s per try for a host that does not answer
        retries = max(1, int((self.retry_seconds - 0.7) / 0.5) + 3)
        return redis.Redis(**options,
                           retry=_retry_but_not_refusals(Retry)(ExponentialBackoff(cap=0.5, base=0.05), retries),
                           retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])

    def _ping(self) -> None:
        self.client.ping()

    def within(self, namespace: str) -> "RedisBackend":
        """This store as a namespace's requests see it: the same connection, that namespace's keys."""
        root = self._root
        if not namespace:
            return root
        view = root._views.get(namespace)
        if view is None:
            view = object.__new__(type(root))
            view.__dict__.update(root.__dict__)
            view.namespace, view._prefix, view._views = namespace, key_prefix(namespace), {}
            root._views[namespace] = view
        return view

    def _run(self, do):
        """`do()`, its Redis exceptions one line naming the server (a subclass retries here)."""
        with self._talking():
            return do()

    @contextmanager
    def _talking(self):
        """Redis' exceptions become one line naming the server."""
        try:
            yield
        except self._errors.AuthenticationError as err:  # (a ConnectionError to redis-py: not one to us)
            raise StoreAccessDenied(f"{self.url}: the Redis server refused the user name or password "
                                    f"({self._said(err)})") from None
        except self._errors.NoPermissionError as err:
            raise self._refused(err) from None
        except (self._errors.ConnectionError, self._errors.TimeoutError) as err:
            raise StoreUnavailable(f"{self.url}: the Redis server cannot be reached ({self._said(err)})") from None
        except self._errors.RedisError as err:
            if "NOPERM" in str(err) or "no permissions" in str(err):  # (a pipeline's, as a ResponseError)
                raise self._refused(err) from None
            raise StoreError(f"{self.url}: Redis refused the command ({self._said(err)})") from None

    def _refused(self, err: Exception) -> StoreAccessDenied:
        """An ACL refusal, naming the namespace asked for: a tenant's user reading another's."""
        what = f"read or write namespace {self.namespace!r}" if self.namespace else "do this"
        return StoreAccessDenied(f"{self.url}: the Redis user may not {what} (ACL: {self._said(err)})")

    def _said(self, err: BaseException) -> str:
        """The first line of a library's error, with this store's credentials cut out if it held any."""
        return _first_line(err, self._secrets)

    def _key(self, name: str) -> bytes:
        """The Redis key of a name; a name read from a key that is not UTF-8 gives its bytes back."""
        return (self._prefix + name).encode("utf-8", "surrogateescape")

    def _pipelined(self, command: str, keys: Sequence[bytes], *args, **kwargs) -> list:
        """`command key *args` for each key, in one non-transactional pipeline: one round trip (a
        cluster's pipeline sends each node its own keys, one round trip per node)."""
        if not keys:
            return []

        def do():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                getattr(pipe, command)(key, *args, **kwargs)
            return pipe.execute()
        return self._run(do)

    # --- reads -----------------------------------------------------------------------

    def get(self, name: str) -> bytes | None:
        """The object's bytes; a key of another type at its name (a hash, a list) is not an
        object: refused (a miss), and `fsck` removes it."""
        try:
            return self._run(lambda: self.client.get(self._key(name)))
        except StoreError as err:
            if "WRONGTYPE" not in str(err):
                raise
            raise ObjectRefused(f"{name}: a Redis value of another type than a string is at its key "
                                "(not an object; fsck removes it)") from None

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        if not names:  # (MGET answers nil for a key of another type: a miss)
            return []
        return self._run(lambda: self.client.mget([self._key(n) for n in names]))

    def exists(self, name: str) -> bool:
        return self.exists_many([name])[0]

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """A string at each key (TYPE: like EXISTS it is not a use): a key of another type is not
        an object, never counted as present, so a put replaces it."""
        return [t in (b"string", "string") for t in self._pipelined("type", [self._key(n) for n in names])]

    def probe_many(self, names: Sequence[str]) -> list[tuple[int, bytes] | None]:
        """STRLEN and GETRANGE of the last PROBE_TAIL bytes of each key, one pipeline (one round
        trip; a cluster's: one per node). A missing key has length 0; a key of another type answers
        an error: neither is an object."""
        if not names:
            return []

        def do():
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(self._key(name))
                pipe.getrange(self._key(name), -PROBE_TAIL, -1)
            replies = pipe.execute(raise_on_error=False)
            for reply in replies:  # (raised here, a lost node is tried again)
                if isinstance(reply, Exception) and "WRONGTYPE" not in str(reply):
                    raise reply
            return replies
        replies = self._run(do)
        found: list[tuple[int, bytes] | None] = []
        for size, tail in zip(replies[0::2], replies[1::2]):
            usable = isinstance(size, int) and size > 0 and isinstance(tail, bytes)
            found.append((size, tail) if usable else None)
        return found

    def _scan_keys(self, pattern: bytes) -> list[bytes]:
        """Every key matching `pattern` (SCAN, never KEYS: the server keeps answering others)."""
        return self._run(lambda: list(self.client.scan_iter(match=pattern, count=1000)))

    def _scan_partition(self, prefix: str) -> list[tuple[bytes, str, str]]:
        """(key, namespace, name) of this view's objects whose name starts with `prefix`."""
        pattern = (self._prefix + _glob_escape(prefix)).encode("utf-8", "surrogateescape") + b"*"
        # a key that is not UTF-8 keeps its bytes (surrogates): listed as foreign, removable
        return [(key, self.namespace, key.decode("utf-8", "surrogateescape")[len(self._prefix):])
                for key in self._scan_keys(pattern)]

    def _scan_namespaces(self, prefix: str) -> list[tuple[bytes, str, str]]:
        """(key, namespace, name) of every namespace's objects whose name starts with `prefix`."""
        found = []
        for key in self._scan_keys(NAMESPACE_PREFIX.encode() + b"*"):
            place = _namespace_of(key.decode("utf-8", "surrogateescape"))
            if place is not None and place[1].startswith(prefix):
                found.append((key, *place))
        return found

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """This view's objects; the store itself (no namespace) lists every namespace's too, so
        that stats, gc and fsck see the whole store (an ACL-confined user cannot: refused)."""
        now = time.time()
        keys = self._scan_partition(prefix)
        if self is self._root:
            keys += self._scan_namespaces(prefix)
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]

            def do():
                pipe = self.client.pipeline(transaction=False)
                for key, _, _ in batch:  # neither counts as a use (STRLEN would: it resets the LRU clock)
                    pipe.object("idletime", key)
                    pipe.memory_usage(key)
                return pipe.execute(raise_on_error=False)
            replies = self._run(do)
            for i, (_key, namespace, name) in enumerate(batch):
                idle, size = replies[2 * i], replies[2 * i + 1]
                if isinstance(size, self._errors.NoPermissionError):  # another tenant's key: refused
                    raise self._refused(size) from None
                if not isinstance(size, int) or size == 0:  # removed meanwhile
                    continue
                idle = idle if isinstance(idle, int) else 0
                yield ObjectInfo(name, size, now - idle, namespace)

    def children(self, prefix: str) -> set[str]:
        """The next name parts under `prefix` among this view's own objects (a namespace's chunk
        sizes are its own)."""
        return {name[len(prefix):].split("/", 1)[0] for _, _, name in self._scan_partition(prefix)}

    # --- writes ----------------------------------------------------------------------

    def put(self, name: str, data: bytes, *, replace: bool = False) -> bool:
        if replace:
            return bool(self._run(lambda: self.client.set(self._key(name), bytes(data))))
        return self.put_many([(name, data)])[0]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """SET NX each (put-once); a name held by a key of another type (not an object) is
        overwritten by the object instead of counting as stored."""
        if not items:
            return []

        def do():
            pipe = self.client.pipeline(transaction=False)
            for name, data in items:
                pipe.set(self._key(name), bytes(data), nx=True)
            return [bool(x) for x in pipe.execute()]
        created = self._run(do)
        taken = [i for i, c in enumerate(created) if not c]
        kinds = self._pipelined("type", [self._key(items[i][0]) for i in taken])
        for i, kind in zip(taken, kinds):
            if kind not in (b"string", "string"):
                created[i] = bool(self._run(lambda i=i: self.client.set(self._key(items[i][0]), bytes(items[i][1]))))
        return created

    def delete(self, name: str) -> bool:
        return bool(self._run(lambda: self.client.delete(self._key(name))))

    def close(self) -> None:
        if self is not self._root:  # a view: the connection is the store's
            return
        try:
            self.client.close()
        except Exception:  # closing a connection to a server that is gone
            pass


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _first_line(err: BaseException, secrets: Sequence[str] = ()) -> str:
    """A library's error in one line, never holding one of `secrets` (a password, a user name)."""
    text = str(err).strip() or type(err).__name__
    line = text.splitlines()[0]
    for secret in secrets:
        line = line.replace(secret, "***")
    return line
