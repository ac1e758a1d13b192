"""Store URLs (issue 46, findings 1, 2 and 7's first half; kvtool/store/urls.py): one parser for every
kind of store, which takes a URL whole or refuses it in one line that never holds its password,
never takes something that looks like a URL for a folder, and takes only the query arguments it
knows. Each reproducer through the real CLI (`python -m kvtool`), against a real Redis whose user
`kv` has the passwords SECRETPW and SECRETPW#1; then the URL matrix x four store commands."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import make_identity, write_kv_file
from kvtool.cli.app import run
from kvtool.errors import StoreUrlInvalid
from kvtool.store.urls import parse_store_url, redacted

REPO = Path(__file__).resolve().parents[1]
SECRET = "SECRETPW"


def _forms():
    spec = importlib.util.spec_from_file_location("fuzz_store_urls", REPO / "fuzz" / "fuzz_store_urls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (atheris is imported by its main() only)
    return module.FORMS


FORMS = _forms()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from redis_server import RedisServer

    sock = tmp_path_factory.mktemp("sock") / "redis.sock"
    users = ("--user", "default", "off", "--user", "kv", "on", ">SECRETPW", ">SECRETPW#1", "~kvtool:*", "+@all",
             "--unixsocket", str(sock), "--unixsocketperm", "700")
    with RedisServer(extra=users) as server:
        server.sock = sock
        yield server


@pytest.fixture
def places(tmp_path, monkeypatch):
    """An empty working folder (a URL taken for a folder would be made there) and a .kvc to put."""
    cwd, inputs = tmp_path / "cwd", tmp_path / "in"
    cwd.mkdir()
    inputs.mkdir()
    monkeypatch.chdir(cwd)
    kvc = write_kv_file(inputs / "a.kvc", identity=make_identity(), num_tokens=8, chunk_size=4).path
    secret = inputs / "password"
    secret.write_text("SECRETPW\n")
    return cwd, kvc, secret


def fill(form: str, server, secret: Path) -> str:
    return form.format(port=server.port, sock=server.sock, file=secret)


def kvtool(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("KVTOOL_REDIS_PASSWORD", None)
    return subprocess.run([sys.executable, "-m", "kvtool", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


# --- each reproducer of the issue, through the real CLI -------------------------------------------

REPRODUCERS = [
    ("redis://kv:SECRETPW#1@127.0.0.1:{port}/0", "redis://***: a '#' in a store URL"),
    ("redis://kv:SECRETPW/1@127.0.0.1:{port}/0", "redis://***@127.0.0.1:{port}/0: an '@' where a store URL cannot"),
    ("redis://kv:SECRETPW?1@127.0.0.1:{port}/0", "redis://***: an '@' where a store URL cannot hold one"),
    ("valkey://kv:SECRETPW@127.0.0.1:{port}/0", "'valkey:' is not a store URL scheme"),
    ("http://kv:SECRETPW@127.0.0.1:{port}/0", "'http:' is not a store URL scheme"),
    ("redis+sentinel://kv:SECRETPW@127.0.0.1:{port}/0", "'redis+sentinel:' is not a store URL scheme"),
    ("redis://kv@127.0.0.1:{port}/0?pass%77ord=SECRETPW", "'pass%77ord' is not an argument of a redis:// store URL"),
    ("redis//kv:SECRETPW@127.0.0.1:{port}/0", "missing a colon: did you mean redis://***@127.0.0.1:{port}/0?"),
    (" redis://kv:SECRETPW@127.0.0.1:{port}/0", "no space at its start or end"),
    ("redis://127.0.0.1:{port}/0?foo=1", "redis://127.0.0.1:{port}/0: 'foo' is not an argument"),
    ("redis://kv@127.0.0.1:{port}/0?PASSWORD=SECRETPW", "'PASSWORD' is not an argument of a redis:// store URL "
                                                        "(arguments are lower case: password)"),
    ("redis://127.0.0.1:{port}/0?ssl_cert_reqs=required", "'ssl_cert_reqs' is not an argument of a redis:// store"),
    ("redis://kv:SECRETPW@[::1/0", "redis://***@[::1/0: an IPv6 address is written [ADDRESS]"),
    ("redis://kv:SECRETPW@127.0.0.1:{port}/abc", "the database is a number after the host"),
]


@pytest.mark.parametrize("form, said", REPRODUCERS, ids=[f for f, _ in REPRODUCERS])
def test_each_reproducer_is_one_line_exit_2_without_the_password(server, places, form, said):
    cwd, kvc, secret = places
    url = fill(form, server, secret)
    for args in (("store", "put", kvc), ("store", "stats")):
        out = kvtool(*args, "--store", url, "--json", cwd=cwd)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("kvtool: error: "), out.stderr
        assert fill(said, server, secret) in out.stderr, out.stderr
        assert SECRET not in out.stdout + out.stderr and "Traceback" not in out.stderr
        assert json.loads(out.stdout)["error"]["type"] == "StoreUrlInvalid"
        assert not any(cwd.iterdir())  # no folder named after the URL (or its password)


def test_a_password_argument_or_an_escaped_one_works_and_is_never_shown(server, places):
    """`?password=` (the name spelled as it is) and a password with '#' written %23 authenticate;
    `--json`'s "store" is the canonical form, `***` for the credentials."""
    cwd, _, secret = places
    for form in ("redis://kv@127.0.0.1:{port}/0?password=SECRETPW", "redis://kv:SECRETPW%231@127.0.0.1:{port}/0"):
        out = kvtool("store", "stats", "--store", fill(form, server, secret), "--json", cwd=cwd)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["store"] == f"redis://***@127.0.0.1:{server.port}/0"
        assert SECRET not in out.stdout + out.stderr
    assert not any(cwd.iterdir())


# --- the URL matrix x store commands --------------------------------------------------------------


@pytest.mark.parametrize("form, code", FORMS, ids=[repr(f) for f, _ in FORMS])
def test_the_url_matrix_never_shows_the_password_nor_a_traceback(server, places, capsys, monkeypatch, form, code):
    monkeypatch.delenv("KVTOOL_REDIS_PASSWORD", raising=False)
    cwd, kvc, secret = places
    url = fill(form, server, secret)
    for args in (("store", "ls"), ("store", "stats"), ("store", "put", kvc), ("store", "fsck")):
        capsys.readouterr()
        got = run([*map(str, args), "--store", url, "--json"])  # (anything but a KvtoolError would raise here)
        out, err = capsys.readouterr()
        assert got == code, (args, out, err)
        assert SECRET not in out + err and "RETPW" not in out + err, (args, out, err)
        doc = json.loads(out)
        if code == 0:
            assert "***@" in doc["store"]
        else:
            assert err.count("kvtool: error: ") == 1 and doc["error"]["exit_code"] == 2
        assert not any(cwd.iterdir()), (args, list(cwd.iterdir()))


# --- the parser itself -----------------------------------------------------------------------------


@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1", "redis://127.0.0.1:6379/0"),
    ("redis://kv:pw%40x@host:6380/2", "redis://***@host:6380/2"),
    ("rediss://kv:s@[::1]:6380/0?ssl_ca_certs=/ca.crt&ssl_cert_reqs=required",
     "rediss://***@[::1]:6380/0?ssl_ca_certs=/ca.crt&ssl_cert_reqs=required"),
    ("redis+cluster://h1:7000,h2/0", "redis+cluster://h1:7000,h2:6379/0"),
    ("unix:///tmp/r.sock?db=3", "unix:///tmp/r.sock?db=3"),
    ("redis://kv@h/0?password_file=/run/s", "redis://***@h:6379/0?password_file=/run/s"),
    ("memory://", "memory://"), ("memory://?max_bytes=4096", "memory://?max_bytes=4096"),
    ("file:///tmp/s", "file:///tmp/s"), ("store", "store"), ("data//x", "data//x"),
])
def test_every_kind_has_one_canonical_form(url, shown):
    assert parse_store_url(url).shown == shown == redacted(url)
    assert parse_store_url(shown).shown == shown  # what a result shows opens the same store


def test_the_database_is_the_number_in_the_path():
    assert parse_store_url("redis://h:1/15").db == 15 and parse_store_url("redis://h:1").db == 0
    for bad in ("/abc", "/-1", "/1.5", "/0/1", "/ 1", "/99999999999"):
        with pytest.raises(StoreUrlInvalid, match="the database is a number"):
            parse_store_url(f"redis://h:1{bad}")


def test_a_parsed_url_never_shows_its_credentials():
    url = parse_store_url("redis://user:SECRETPW@h:1/0")
    assert url.password == SECRET and url.username == "user"
    assert SECRET not in repr(url) + str(url) and "user" not in repr(url) + str(url)


@pytest.mark.parametrize("form", [f for f, _ in FORMS])
def test_what_a_refusal_shows_never_holds_the_password(form):
    text = form.format(port=6379, sock="/tmp/r.sock", file="/run/s")
    try:
        assert SECRET not in parse_store_url(text).shown
    except StoreUrlInvalid as err:
        assert SECRET not in str(err) and "RETPW" not in str(err) and "\n" not in str(err)
    assert SECRET not in redacted(text)
