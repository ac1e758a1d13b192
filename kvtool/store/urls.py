"""Store URLs (format-spec/store.md §6): the one parser of every `--store` text, for every kind
of store: a folder, `file://PATH`, `memory://`, `redis://`, `rediss://`, `unix://`,
`redis+cluster://` and `rediss+cluster://`.

A text is parsed whole, or refused in one line (`StoreUrlInvalid`) that never holds its password:
every refusal names the store by `_conservative(text)`, worked out before anything else is read,
and never quotes a value, a library's message or a piece the parser could not place (that piece
might be half a password). Only the query arguments of `_ARGUMENTS` are taken, each by its exact
name; a text that looks like a URL (a scheme-like `word:` or `redis//` prefix, a `://` anywhere,
spaces around it, `user:password@` in a path) is never taken for a folder. What a result shows
(`StoreUrl.shown`) is the canonical form with the credentials as `***`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from urllib.parse import quote

from ..errors import StoreUrlInvalid

#: Every scheme kvtool opens, and the kind of store each names.
KINDS = {"file": "folder", "memory": "memory", "redis": "redis", "rediss": "redis", "unix": "redis",
         "redis+cluster": "cluster", "rediss+cluster": "cluster"}
#: The forms, for refusals.
FORMS = ("a folder, file://PATH, memory://, redis://HOST:PORT/DB, rediss://HOST:PORT/DB, unix:///SOCKET?db=DB, "
         "redis+cluster://HOST:PORT,HOST:PORT/0 or rediss+cluster://...")
#: How a password holding a character that ends a URL's parts is written.
ESCAPES = "a user name or password holding '@', ':', '/', '?' or '#' is written %40, %3A, %2F, %3F, %23"

_SCHEME_PREFIX = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)(://|:|//)")  # `redis://`; `redis:/`, `redis:`, `redis//`
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?\Z")
_PORT = re.compile(r"[0-9]{1,5}\Z")
_DB_PATH = re.compile(r"/?\Z|/([0-9]{1,10})\Z")
_ARGUMENT_NAME = re.compile(r"[A-Za-z0-9_.%+-]{1,40}\Z")  # a name a refusal may quote
_MAX_DB = 2**31 - 1


@dataclass(frozen=True)
class StoreUrl:
    """A parsed store URL. `shown` is what messages, logs and `--json` show (credentials `***`);
    the credentials themselves are never in its repr."""

    kind: str  # "folder", "memory", "redis" (one server), "cluster"
    scheme: str  # lower case; "" for a folder path
    shown: str
    path: str = ""  # the folder (a folder, file://), the socket (unix://)
    nodes: tuple[tuple[str, int], ...] = ()  # (host, port): the server, or a cluster's seeds
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None
    options: tuple[tuple[str, object], ...] = ()  # redis-py keyword arguments from the query
    max_bytes: int | None = None  # memory://?max_bytes=N

    @property
    def tls(self) -> bool:
        return self.scheme.startswith("rediss")

    def __str__(self) -> str:
        return self.shown


def parse_store_url(url: str | os.PathLike) -> StoreUrl:
    """`url` parsed whole, or `StoreUrlInvalid` in one line without its password."""
    text = os.fsdecode(url)
    shown = _printable(_conservative(text))
    if text != text.strip():
        raise StoreUrlInvalid(f"{shown}: a store URL or folder has no space at its start or end")
    if not text:
        raise StoreUrlInvalid(f"give the store: {FORMS}")
    if _CONTROL.search(text):
        raise StoreUrlInvalid(f"{shown}: a store URL or folder holds no control character")
    m = _SCHEME_PREFIX.match(text)
    if m is None or (m.group(2) == "//" and m.group(1).lower() not in KINDS):
        return _folder(text, shown)  # (`data//x` is a folder; `redis//x` is a URL missing its colon)
    word, scheme, rest = m.group(1), m.group(1).lower(), text[m.end():]
    if scheme not in KINDS:
        raise StoreUrlInvalid(f"{_scheme_shown(word)} is not a store URL scheme (a store is {FORMS}; "
                              "a folder whose name holds ':' is written ./NAME)")
    if m.group(2) != "://":  # (what it meant is shown as typed, but its credentials)
        meant = _printable(_conservative(f"{word}://{rest.lstrip('/')}"))
        missing = "colon" if m.group(2) == "//" else "slash"
        raise StoreUrlInvalid(f"a {word}: store URL missing a {missing}: did you mean {meant}?")
    if KINDS[scheme] == "folder":
        return _file(rest, shown)
    if not _is_utf8(rest):  # (an argument of undecodable bytes: a folder may be named so, a URL not)
        raise StoreUrlInvalid(f"{shown}: a store URL is UTF-8 text")
    if KINDS[scheme] == "memory":
        return _memory(rest, shown)
    return _redis(scheme, rest, shown)


def redacted(url: str | os.PathLike) -> str:
    """`url` as messages show it: its canonical form with the credentials as `***`, or, for a text
    that is not a store URL, `_conservative`'s."""
    try:
        return parse_store_url(url).shown
    except StoreUrlInvalid:
        return _printable(_conservative(os.fsdecode(url)))


# --- a folder ----------------------------------------------------------------------------


def _folder(path: str, shown: str, scheme: str = "") -> StoreUrl:
    if "://" in path:
        raise StoreUrlInvalid(f"{shown}: looks like a URL, not a folder (a store is {FORMS})")
    if re.search(r":[^@]*@|//[^/]*@", path):  # `user:password@host` (a password may hold '/'), `//user@host`
        raise StoreUrlInvalid(f"{shown}: looks like a URL's user:password@host, not a folder (a store is {FORMS})")
    return StoreUrl("folder", scheme, f"{scheme}://{path}" if scheme else path, path=path)


def _file(rest: str, shown: str) -> StoreUrl:
    """`file://PATH`: the folder PATH as written (relative, or absolute as `file:///abs`)."""
    if not rest:
        raise StoreUrlInvalid(f"{shown}: give the store's folder (file://PATH)")
    if "?" in rest or "#" in rest:
        raise StoreUrlInvalid(f"{shown}: a file:// URL takes no arguments")
    if "@" in rest.split("/", 1)[0]:
        raise StoreUrlInvalid(f"{shown}: a file:// URL names a folder, never a user or host")
    return _folder(rest, shown, "file")


# --- memory:// ---------------------------------------------------------------------------


def _memory(rest: str, shown: str) -> StoreUrl:
    if rest in ("", "/"):
        return StoreUrl("memory", "memory", "memory://")
    m = re.fullmatch(r"/?\?max_bytes=([0-9]{1,19})", rest)
    if m is None:
        raise StoreUrlInvalid(f"{shown}: memory:// takes nothing but ?max_bytes=N")
    size = int(m.group(1))
    if size < 1:
        raise StoreUrlInvalid(f"{shown}: max_bytes must be at least 1")
    return StoreUrl("memory", "memory", f"memory://?max_bytes={size}", max_bytes=size)


# --- Redis ---------------------------------------------------------------------------------


def _seconds(value: str) -> float:
    """seconds, more than 0 and at most 3600"""
    seconds = float(value)
    if not 0 < seconds <= 3600:
        raise ValueError(value)
    return seconds


def _flag(value: str) -> bool:
    """true or false"""
    return {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}[value.lower()]


def _choice(*values: str):
    def pick(value: str) -> str:
        if value not in values:
            raise ValueError(value)
        return value
    pick.__doc__ = " or ".join(values)
    return pick


def _db(value: str) -> int:
    """a database number, 0 to 2147483647"""
    if not re.fullmatch(r"[0-9]{1,10}", value) or int(value) > _MAX_DB:
        raise ValueError(value)
    return int(value)


#: The query arguments each kind of Redis URL takes, with the conversion of each value (its kwarg
#: of redis-py's client, but `password` and `password_file`, read here and by the backend).
_COMMON = {"password": str, "password_file": str, "socket_timeout": _seconds, "socket_connect_timeout": _seconds}
_TLS = {"ssl_ca_certs": str, "ssl_ca_path": str, "ssl_certfile": str, "ssl_keyfile": str,
        "ssl_cert_reqs": _choice("none", "optional", "required"), "ssl_check_hostname": _flag}
_ARGUMENTS = {"redis": _COMMON, "rediss": {**_COMMON, **_TLS}, "unix": {**_COMMON, "db": _db},
              "redis+cluster": _COMMON, "rediss+cluster": {**_COMMON, **_TLS}}


def _redis(scheme: str, rest: str, shown: str) -> StoreUrl:
    if "#" in rest:
        raise StoreUrlInvalid(f"{shown}: a '#' in a store URL ({ESCAPES})")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    path, _, query = tail.partition("?")
    if "@" in tail or authority.count("@") > 1:  # a password that holds '/', '?' or '@' as it is
        raise StoreUrlInvalid(f"{shown}: an '@' where a store URL cannot hold one ({ESCAPES})")
    userinfo, at, hosts = authority.rpartition("@")
    username, password = _credentials(userinfo, shown) if at else (None, None)
    arguments = _query(scheme, query, shown)
    if "password" in arguments:
        if password is not None:
            raise StoreUrlInvalid(f"{shown}: two passwords (in the URL's user part and its password argument)")
        password = arguments.pop("password")
    password_file = arguments.pop("password_file", None)
    if scheme == "unix":
        if hosts:
            raise StoreUrlInvalid(f"{shown}: a unix:// URL names a socket, unix:///PATH/TO/SOCKET, never a host")
        socket = _decoded(path, shown, "the socket's path")
        if not socket.startswith("/") or socket == "/":
            raise StoreUrlInvalid(f"{shown}: give the socket's absolute path, unix:///PATH/TO/SOCKET")
        db = arguments.pop("db", 0)
        nodes: tuple[tuple[str, int], ...] = ()
        place = quote(socket, safe="/")
    else:
        db = _db_of(path, shown)
        cluster = KINDS[scheme] == "cluster"
        if cluster and db != 0:
            raise StoreUrlInvalid(f"{shown}: a Redis Cluster has database 0 only")
        parts = hosts.split(",")
        if not cluster and len(parts) > 1:
            raise StoreUrlInvalid(f"{shown}: a {scheme}:// URL names one server (a cluster is {scheme}+cluster://)")
        nodes = tuple(_host_port(part, shown) for part in parts)
        socket = ""
        place = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in nodes) + f"/{db}"
    credentials = "***@" if username is not None or password is not None else ""
    shown_query = "&".join(f"{k}={quote(str(v), safe='/:')}" for k, v in
                           ([("password_file", password_file)] if password_file is not None else [])
                           + [(k, raw) for k, raw in _raw_values(query) if k in arguments])
    canonical = f"{scheme}://{credentials}{place}" + (f"?{shown_query}" if shown_query else "")
    if scheme == "unix" and db:
        canonical += ("&" if shown_query else "?") + f"db={db}"
    return StoreUrl(KINDS[scheme], scheme, canonical, path=socket, nodes=nodes, db=db, username=username,
                    password=password, password_file=password_file, options=tuple(arguments.items()))


def _credentials(userinfo: str, shown: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    user = _decoded(user, shown, "the user name")
    password = _decoded(password, shown, "the password") if colon else ""
    return user or None, password or None


def _host_port(text: str, shown: str) -> tuple[str, int]:
    """(host, port) of `host`, `host:port`, `[v6]` or `[v6]:port` (6379 when left out)."""
    if text.startswith("["):
        host, bracket, port = text[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            raise StoreUrlInvalid(f"{shown}: an IPv6 address is written [ADDRESS] or [ADDRESS]:PORT")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise StoreUrlInvalid(f"{shown}: not an IPv6 address in [...]") from None
        port = port[1:] if port else None
    else:
        host, colon, port = text.partition(":")
        port = port if colon else None
        if not _HOST_NAME.match(host):
            raise StoreUrlInvalid(f"{shown}: give each server as HOST:PORT (a name, an IPv4 address or [an IPv6 "
                                  "address]; a cluster's as HOST:PORT,HOST:PORT)")
    if port is None:
        return host, 6379
    if not _PORT.match(port) or not 0 < int(port) < 65536:
        raise StoreUrlInvalid(f"{shown}: not a port (a port is a number from 1 to 65535)")
    return host, int(port)


def _db_of(path: str, shown: str) -> int:
    m = _DB_PATH.match(path)
    if m is None or (m.group(1) is not None and int(m.group(1)) > _MAX_DB):
        raise StoreUrlInvalid(f"{shown}: the database is a number after the host, /0 to /{_MAX_DB}")
    return int(m.group(1)) if m.group(1) is not None else 0


def _raw_values(query: str) -> list[tuple[str, str]]:
    return [(name, _unescaped(value)) for name, _, value in (item.partition("=") for item in query.split("&"))
            if query]


def _query(scheme: str, query: str, shown: str) -> dict[str, object]:
    """The query's arguments, converted; an unknown name, one given twice, an empty or a wrong
    value refused by name (a value is never quoted: it may be a password)."""
    allowed = _ARGUMENTS[scheme]
    found: dict[str, object] = {}
    for item in query.split("&") if query else []:
        name, equals, raw = item.partition("=")
        said = f"'{name}'" if _ARGUMENT_NAME.match(name) else "an argument"
        if name not in allowed:
            hint = (f"arguments are lower case: {name.lower()}" if name.lower() in allowed
                    else f"it takes {', '.join(sorted(allowed))}")
            raise StoreUrlInvalid(f"{shown}: {said} is not an argument of a {scheme}:// store URL ({hint})")
        if name in found:
            raise StoreUrlInvalid(f"{shown}: {said} given twice")
        if not equals or not raw:
            raise StoreUrlInvalid(f"{shown}: {said} needs a value")
        value = _decoded(raw, shown, f"the value of {said}")
        try:
            found[name] = allowed[name](value)
        except (ValueError, KeyError):
            what = allowed[name].__doc__ if allowed[name] is not str else None
            raise StoreUrlInvalid(f"{shown}: {said} has a value it cannot take" + (f" ({what})" if what else "")) from None
    return found


def _decoded(text: str, shown: str, what: str) -> str:
    """`text` with its %XX escapes decoded as UTF-8; a '%' that is not one is refused."""
    try:
        return _unescaped(text, strict=True)
    except ValueError:
        raise StoreUrlInvalid(f"{shown}: {what} holds a '%' that is not %XX of UTF-8 ({ESCAPES})") from None


def _unescaped(text: str, strict: bool = False) -> str:
    if strict and re.search(r"%(?![0-9A-Fa-f]{2})", text):
        raise ValueError("a bare %")
    from urllib.parse import unquote

    return unquote(text, errors="strict" if strict else "replace")


# --- what a refusal shows ----------------------------------------------------------------


def _conservative(text: str) -> str:
    """`text` with everything that might be a credential cut out, worked out without parsing it:
    all before the last '@' (a password may hold '@', '/', '?' or '#' as it is), and every query
    argument. When a '?' or '#' comes before that '@' (the '@' might be a query value's), or when
    no '@' is given and the part before the path is not plainly HOST:PORT (a password typed
    without its '@'), only the scheme is shown."""
    text = text.strip()
    m = _SCHEME_PREFIX.match(text)
    head, rest = (text[:m.end()], text[m.end():]) if m else ("", text)
    before, at, after = rest.rpartition("@")
    if at:
        if "?" in before or "#" in before:
            return f"{head}***"
        host = re.split(r"[?#]|://", after, maxsplit=1)[0]
        plain = re.match(r"[A-Za-z0-9._:,\[\]/-]*", host).group()  # (what is not plainly host:port/db: cut)
        return f"{head}***@{plain}" + ("***" if plain != after else "")
    if not m:
        if "://" in text:  # (a URL in a folder's place)
            return text.partition("://")[0] + "://***"
        path = re.split(r"[?#]", text, maxsplit=1)[0]  # a folder path (what may be arguments cut)
        return path + ("***" if path != text else "")
    authority, _, path = re.split(r"[?#]", rest, maxsplit=1)[0].partition("/")
    plain = all(re.fullmatch(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{0,5})?", part)
                for part in authority.split(",")) if authority else True
    if not plain or not re.fullmatch(r"[0-9]*|[A-Za-z0-9._/-]*", path) or (not authority and path and
                                                                         head.lower().startswith("redis")):
        return f"{head}***"
    return f"{head}{authority}" + (f"/{path}" if path or rest.startswith(f"{authority}/") else "")


def _printable(text: str) -> str:
    """Control characters and undecodable bytes as escapes: a refusal never moves the terminal's
    cursor, and is always text stderr can write."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _scheme_shown(word: str) -> str:
    return f"'{word[:40]}:'" 


__all__ = ["KINDS", "StoreUrl", "parse_store_url", "redacted"]
