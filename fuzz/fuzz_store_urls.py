"""A standing coverage-guided fuzzer of the store URL parser (atheris, libFuzzer's engine; issue 46).

Every input is the text of a `--store` option (UTF-8, undecodable bytes kept as surrogates, as an
argument of them is). `kvtool.store.urls.parse_store_url` either takes it or refuses it with
`StoreUrlInvalid`, never another exception; and, whichever:

  * no message and no shown form holds what could be a password (`secrets_in`: in
    `user:password@`, a `password=` value; the seeds hold `SECRETPW` there), nor the parsed one;
  * a text that looks like a URL (`://` in it, spaces around it) is never taken for a folder;
  * a Redis URL that parses builds redis-py's client from its options without a TypeError (an
    argument redis-py does not take) - the client is made, never connected.

    python fuzz/fuzz_store_urls.py -runs=100000 -timeout=10 WORKDIR/corpus
    python fuzz/fuzz_store_urls.py -max_total_time=20 ...      (CI: tests/test_fuzz_store_urls.py)

With an empty corpus folder it first writes its seeds there: `FORMS`, the URL matrix of issue 46
(tests/test_store_urls.py runs the same forms through the CLI), with port 6379 and socket
/tmp/redis.sock.
"""

from __future__ import annotations

import re
import sys

SECRET = "SECRETPW"
#: The URL matrix: (form, exit code through the CLI against a live server whose user `kv` has
#: the passwords SECRETPW and SECRETPW#1; `{port}`, `{sock}` and `{file}` (a password_file) filled in).
FORMS: list[tuple[str, int]] = [
    ("redis://kv:SECRETPW@127.0.0.1:{port}/0", 0),
    ("redis://kv:SECRETPW@127.0.0.1:{port}", 0),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/", 0),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/1", 0),
    ("REDIS://kv:SECRETPW@127.0.0.1:{port}/0", 0),
    ("redis://kv:SECRETPW%231@127.0.0.1:{port}/0", 0),
    ("redis://kv@127.0.0.1:{port}/0?password=SECRETPW", 0),
    ("redis://kv@127.0.0.1:{port}/0?password_file={file}", 0),
    ("redis://kv:SECRETPW@localhost:{port}/0?socket_timeout=5&socket_connect_timeout=2", 0),
    ("unix://kv:SECRETPW@{sock}?db=0", 0),
    ("redis://kv:SECRETPWX@127.0.0.1:{port}/0", 2),  # a wrong password: refused by the server
    ("redis://kv:SECRETPW#1@127.0.0.1:{port}/0", 2),
    ("redis://kv:SECRETPW/1@127.0.0.1:{port}/0", 2),
    ("redis://kv:SECRETPW?1@127.0.0.1:{port}/0", 2),
    ("redis://kv:SECRET@PW@127.0.0.1:{port}/0", 2),
    ("valkey://kv:SECRETPW@127.0.0.1:{port}/0", 2),
    ("http://kv:SECRETPW@127.0.0.1:{port}/0", 2),
    ("redis+sentinel://kv:SECRETPW@127.0.0.1:{port}/0", 2),
    ("redis://kv@127.0.0.1:{port}/0?pass%77ord=SECRETPW", 2),
    ("redis//kv:SECRETPW@127.0.0.1:{port}/0", 2),
    (" redis://kv:SECRETPW@127.0.0.1:{port}/0", 2),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/0\n", 2),
    ("redis://127.0.0.1:{port}/0?foo=1", 2),
    ("redis://kv@127.0.0.1:{port}/0?PASSWORD=SECRETPW", 2),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/0?ssl_cert_reqs=none", 2),
    ("redis://kv:SECRETPW@[::1/0", 2),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/abc", 2),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/-1", 2),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/0/1", 2),
    ("redis://kv:SECRETPW@127.0.0.1:notaport/0", 2),
    ("redis://kv:SECRETPW@127.0.0.1:99999/0", 2),
    ("redis://kv:SECRETPW@:{port}/0", 2),
    ("redis:/kv:SECRETPW@127.0.0.1:{port}/0", 2),
    ("redis:kv:SECRETPW@127.0.0.1:{port}/0", 2),
    ("redis://kv:SECRETPW", 2),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/0?password=SECRETPW", 2),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/0?socket_timeout=SECRETPW", 2),
    ("redis://kv:SEC%ZZRETPW@127.0.0.1:{port}/0", 2),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/0?password_file=", 2),
    ("redis+cluster://kv:SECRETPW@127.0.0.1:{port}/3", 2),
    ("redis+cluster://kv:SECRETPW@127.0.0.1:x,127.0.0.1:1/0", 2),
    ("rediss://kv:SECRETPW@127.0.0.1:{port}/0?ssl_cert_reqs=maybe", 2),
    ("redis://kv:SECRETPW\x1b[2J@127.0.0.1:{port}/0", 2),
    ("file://kv:SECRETPW@host/x", 2),
    ("memory://kv:SECRETPW@x", 2),
    (":SECRETPW@127.0.0.1:{port}", 2),
    ("unix://kv:SECRETPW@127.0.0.1{sock}", 2),
    ("redis://127.0.0.1:{port}/0?password=a@SECRETPW", 2),
]


def seeds() -> list[bytes]:
    return [form.format(port=6379, sock="/tmp/redis.sock", file="/run/secrets/kv").encode("utf-8", "surrogateescape")
            for form, _ in FORMS]


def secrets_in(text: str) -> list[str]:
    """SECRETPW when it lies where a password can be, by any reading of `text`: in
    `user:password@` (between the first ':' after the scheme's slashes and the last '@'), or in a
    `password=` argument's value. What follows the last '@' is a host by every reading."""
    before, at, host = text.rpartition("@")
    if SECRET in host or SECRET in text.partition("://")[0]:  # (shown as a host, or as a scheme or folder word)
        return []
    _, colon, password = before.split("//", 1)[-1].partition(":")
    values = [password] if at and colon else []
    values += [m.group(1) for m in re.finditer(r"password=([^&#]*)", text, re.IGNORECASE)]
    return [SECRET] if any(SECRET in v for v in values) else []  # (the marker: any other text may be a host)


def _credentials_of(shown: str) -> str:
    """The part of a shown URL where credentials would stand (between "://" and the last "@"):
    `***` or a user name, never a password. The rest is the scheme, host, port and database, which
    a short password may equal by chance ("6379", "edis:")."""
    rest = shown.partition("://")[2]
    return rest.rpartition("@")[0] if "@" in rest else ""


def one_input(data: bytes) -> None:
    from kvtool.errors import StoreUrlInvalid
    from kvtool.store.redis_backend import client_options
    from kvtool.store.urls import parse_store_url, redacted

    text = data.decode("utf-8", "surrogateescape")
    secrets = secrets_in(text)
    try:
        url = parse_store_url(text)
    except StoreUrlInvalid as err:
        for shown in (str(err), redacted(text)):
            assert not any(s in shown for s in secrets) and "\n" not in shown, (text, shown)
        return
    public = (f"{url.scheme}://", text.rpartition("@")[2])  # shown as they are: the scheme, the host and what follows
    if url.password and len(url.password) >= 4 and not any(url.password in p for p in public):
        secrets.append(url.password)  # (unless those hold the same text: "edis:" is in "redis://")
    if url.kind != "folder" or "@" in text:  # (a folder is shown as its path: only user:password@ marks a secret)
        for shown in (_credentials_of(url.shown), _credentials_of(redacted(text)), repr(url.options)):
            assert not any(s in shown for s in secrets), (text, shown)
    if url.kind == "folder":
        assert "://" not in text[len("file://"):] if url.scheme else "://" not in text, text
        assert text == text.strip(), text
    if url.kind in ("redis", "cluster"):
        import redis

        redis.Redis(**client_options(url, url.password)).close()  # made, never connected


def main() -> None:
    import atheris

    with atheris.instrument_imports(include=["kvtool.store.urls"]):
        import kvtool.store.urls  # noqa: F401
    from corpus import seed_empty_corpus  # (fuzz/, this script's folder)

    seed_empty_corpus(seeds())
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
