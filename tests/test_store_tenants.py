"""Tenants kept apart by the Redis server too (store.md §6.2): a namespace's chunks live under
its own key prefix, `kvtool:ns:<namespace>:1:`, so that an ACL key pattern confines a tenant's
Redis user to them. Real ACL users on a real redis-server: a tenant reads and writes its own
namespace, and asking for another's is a refusal, one line, through the API and the CLI."""

from __future__ import annotations

import json

import pytest

from kvtool.cli.app import run
from kvtool.errors import StoreAccessDenied
from kvtool.store import open_store
from kvtool.store.names import ExtraKeys
from kvtool.store.redis_backend import _namespace_of, key_prefix, tenant_acl

from fixtures import make_identity, make_kv, write_kv_file

CHUNK = 4
IDENTITY = make_identity(num_layers=2, num_kv_heads=2, head_dim=8)
TOKENS = list(range(100, 100 + 4 * CHUNK))


def call(capsys, *args):
    capsys.readouterr()
    code = run([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_namespace_is_its_own_key_prefix():
    assert key_prefix("") == "kvtool:1:"  # no namespace: the layout of before, unchanged
    assert key_prefix("tenant-a") == "kvtool:ns:tenant-a:1:"
    # ':' and glob or hash-tag characters never reach the key as themselves: no namespace's prefix
    # (or ACL pattern) covers another's, and a pattern is always literal
    assert key_prefix("a:b*{c}") == "kvtool:ns:a%3Ab%2A%7Bc%7D:1:"
    assert key_prefix("équipe %") == "kvtool:ns:%C3%A9quipe%20%25:1:"
    assert not key_prefix("a:1:x").startswith(key_prefix("a")[:-2])
    for namespace in ("tenant-a", "a:b*{c}", "équipe %", "x" * 1024):
        assert _namespace_of(key_prefix(namespace) + "chunks/n.kvc") == (namespace, "chunks/n.kvc")
    assert _namespace_of("kvtool:ns:a%3ab:1:x") is None  # not how kvtool spells it: not a namespace's key
    assert _namespace_of("kvtool:ns:oops") is None
    assert _namespace_of("kvtool:ns:%FF:1:x") is None and _namespace_of(b"kvtool:ns:\xff:1:x".decode("utf-8", "surrogateescape")) is None
    assert tenant_acl("tenant-a")[:2] == ["resetkeys", "~kvtool:ns:tenant-a:*"]


@pytest.fixture(scope="module")
def tenants_server(redis_server):  # redis_server: skipped locally, failed in CI, without Redis
    """A redis-server with no default user, an admin, and one user per tenant confined by
    `tenant_acl` (the rules store.md §6.2 gives operators)."""
    from redis_server import RedisServer

    users = ["--user", "default", "off", "--user", "admin", "on", ">admin-pw", "~*", "+@all"]
    for tenant in ("tenant-a", "tenant-b"):
        users += ["--user", tenant, "on", f">{tenant}-pw", *tenant_acl(tenant)]
    with RedisServer(extra=tuple(users)) as server:
        yield server


def url_of(server, user: str) -> str:
    return f"redis://{user}:{user}-pw@127.0.0.1:{server.port}/0"


def test_a_tenant_reads_its_own_namespace_and_is_refused_anothers(tenants_server):
    import redis

    admin = redis.Redis.from_url(url_of(tenants_server, "admin"))
    admin.flushall()
    kv = make_kv(IDENTITY, len(TOKENS))
    stores = {t: open_store(url_of(tenants_server, t)) for t in ("tenant-a", "tenant-b")}
    for tenant, store in stores.items():
        cache = store.for_model(IDENTITY, CHUNK, ExtraKeys(namespace=tenant))
        assert cache.put_sequence(TOKENS, kv).stored == 4
        assert cache.get_prefix(TOKENS).num_tokens == len(TOKENS)
        assert store.chunk_sizes(IDENTITY, ExtraKeys(namespace=tenant)) == [CHUNK]
    keys = sorted(k.decode() for k in admin.scan_iter(match="*"))
    assert len(keys) == 8 and all(k.startswith(("kvtool:ns:tenant-a:1:chunks/", "kvtool:ns:tenant-b:1:chunks/"))
                                  for k in keys)
    a = stores["tenant-a"]
    for namespace in ("tenant-b", ""):  # another tenant's chunks, or the store's own: refused
        other = a.for_model(IDENTITY, CHUNK, ExtraKeys(namespace=namespace))
        for attempt in (lambda: other.lookup(TOKENS), lambda: other.get_prefix(TOKENS),
                        lambda: other.put_sequence(TOKENS, kv)):
            with pytest.raises(StoreAccessDenied) as err:
                attempt()
            message = str(err.value)
            assert "\n" not in message and "tenant-a-pw" not in message and "may not" in message
    b_name = stores["tenant-b"].for_model(IDENTITY, CHUNK, ExtraKeys(namespace="tenant-b")).chunk_names(TOKENS)[0]
    with pytest.raises(StoreAccessDenied, match="namespace 'tenant-b'"):
        a.backend.within("tenant-b").get(b_name)
    with pytest.raises(StoreAccessDenied):  # the whole store's upkeep is the admin's
        list(a.backend.scan())
    for store in stores.values():
        store.close()
    admin.close()


def test_tenants_through_the_cli(tenants_server, capsys, tmp_path):
    import redis

    admin_url = url_of(tenants_server, "admin")
    admin = redis.Redis.from_url(admin_url)
    admin.flushall()
    admin.close()
    kv = write_kv_file(tmp_path / "a.kvc", identity=IDENTITY, num_tokens=4 * CHUNK, chunk_size=CHUNK).path
    a_url, b_url = url_of(tenants_server, "tenant-a"), url_of(tenants_server, "tenant-b")
    code, out, err = call(capsys, "store", "put", kv, "--store", a_url, "--namespace", "tenant-a", "--json")
    assert code == 0 and json.loads(out)["totals"]["stored"] == 4 and "tenant-a-pw" not in out + err, err
    code, out, err = call(capsys, "store", "put", kv, "--store", b_url, "--namespace", "tenant-a")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "may not read or write namespace 'tenant-a'" in err and "tenant-b-pw" not in out + err
    code, out, err = call(capsys, "store", "put", kv, "--store", b_url, "--namespace", "tenant-b", "--json")
    assert code == 0, err
    code, out, err = call(capsys, "store", "stats", "--store", b_url, "--json")  # the whole store: not a tenant's
    assert code == 2 and json.loads(out)["error"]["type"] == "StoreAccessDenied" and "tenant-b-pw" not in out + err
    # the admin sees, checks and lists both namespaces
    code, out, err = call(capsys, "store", "fsck", "--store", admin_url, "--json")
    assert code == 0 and json.loads(out)["intact"] == 8, err
    code, out, err = call(capsys, "store", "ls", "--store", admin_url, "--json")
    assert sorted(o["namespace"] for o in json.loads(out)["objects"]) == ["tenant-a"] * 4 + ["tenant-b"] * 4


def test_fsck_removes_a_chunk_found_under_another_namespace(tenants_server, capsys):
    """A chunk of namespace b copied under a's key prefix is never served to a (its recorded
    namespace is checked) nor found by b: fsck removes it as foreign."""
    import redis

    admin_url = url_of(tenants_server, "admin")
    admin = redis.Redis.from_url(admin_url)
    admin.flushall()
    store = open_store(admin_url)
    cache = store.for_model(IDENTITY, CHUNK, ExtraKeys(namespace="tenant-b"))
    cache.put_sequence(TOKENS, make_kv(IDENTITY, len(TOKENS)))
    name = cache.chunk_names(TOKENS)[0]
    admin.set(key_prefix("tenant-a") + name, admin.get(key_prefix("tenant-b") + name))
    for junk in (b"kvtool:ns:\xff:1:x", b"kvtool:ns:junk", b"kvtool:ns:a%3ab:1:x"):  # no namespace's keys
        admin.set(junk, b"not the store's")
    code, out, err = call(capsys, "store", "fsck", "--store", admin_url, "--json")
    report = json.loads(out)
    assert code == 0 and report["checked"] == 5 and report["removed"] == 1, err
    assert "another namespace" in report["damaged"][0]["reason"]
    assert admin.exists(b"kvtool:ns:\xff:1:x", b"kvtool:ns:junk", b"kvtool:ns:a%3ab:1:x") == 3  # left alone
    store.close()
    admin.close()


def test_the_spec_gives_the_rules_tenant_acl_gives():
    """store.md §6.2's ACL line is `tenant_acl`'s: what the tests confine tenants with is what
    operators are told to write."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "format-spec" / "store.md").read_text()
    assert "user tenant-a on >PASSWORD " + " ".join(tenant_acl("tenant-a")) + "\n" in text
    cluster_extra = tenant_acl("tenant-a", cluster=True)[len(tenant_acl("tenant-a")):]
    assert "`" + " ".join(cluster_extra) + "`" in text


def test_a_tenant_on_a_redis_cluster(capsys):
    """The same confinement on a real Redis Cluster (3 masters, a replica each), with the cluster's
    extra rules: the tenant's chunks spread over the primaries; another namespace is refused, a
    wrong password too, each in one line."""
    from conftest import _require_redis_cluster_tools
    from redis_server import RedisClusterServers

    _require_redis_cluster_tools()
    users = ("--user", "tenant-a", "on", ">tenant-a-pw", *tenant_acl("tenant-a", cluster=True))
    with RedisClusterServers(extra=users) as cluster:  # the default user stays: redis-cli makes the cluster
        url = cluster.url.replace("redis+cluster://", "redis+cluster://tenant-a:tenant-a-pw@")
        store = open_store(url)
        cache = store.for_model(IDENTITY, CHUNK, ExtraKeys(namespace="tenant-a"))
        tokens = list(range(1000, 1000 + 12 * CHUNK))
        assert cache.put_sequence(tokens, make_kv(IDENTITY, len(tokens))).stored == 12
        assert cache.get_prefix(tokens).num_tokens == len(tokens)
        with pytest.raises(StoreAccessDenied, match="namespace 'tenant-b'"):
            store.for_model(IDENTITY, CHUNK, ExtraKeys(namespace="tenant-b")).lookup(tokens)
        store.close()
        code, out, err = call(capsys, "store", "stats", "--store", url.replace("tenant-a-pw", "wrong-pw"))
        assert code == 2 and "refused the user name or password" in err and "wrong-pw" not in out + err
        assert len(err.strip().splitlines()) == 1


def test_a_tenant_stores_and_finds_block_prefixes_within_its_namespace(tenants_server, capsys):
    """Block prefixes (pieces and block index entries, store.md §4.5-4.6) of a tenant go under its
    own key prefix too: its confined user writes and finds them, another tenant finds none, and the
    admin's fsck checks every one of them within its namespace (an entry's object is looked up there)."""
    import redis

    admin_url = url_of(tenants_server, "admin")
    admin = redis.Redis.from_url(admin_url)
    admin.flushall()
    tokens = TOKENS + [900, 901, 902, 903, 904, 905]  # 5 whole chunks of 4, then a piece of 1 block of 2
    kv = make_kv(IDENTITY, len(tokens))
    a = open_store(url_of(tenants_server, "tenant-a"))
    cache = a.for_model(IDENTITY, CHUNK, ExtraKeys(namespace="tenant-a"), 2)  # blocks of 2 tokens
    put = cache.put_sequence(tokens, kv)
    assert (put.stored, put.pieces) == (5, 1) and put.block_entries > 0
    assert cache.lookup(tokens[:-1] + [999]) == 20 and cache.get_prefix(tokens).num_tokens == 22
    keys = [k.decode() for k in admin.scan_iter(match="*")]
    assert keys and all(k.startswith("kvtool:ns:tenant-a:1:chunks/") for k in keys)
    assert any("/pieces/" in k for k in keys) and any("/blocks/" in k for k in keys)
    b = open_store(url_of(tenants_server, "tenant-b"))
    assert b.for_model(IDENTITY, CHUNK, ExtraKeys(namespace="tenant-b"), 2).lookup(tokens) == 0
    code, out, err = call(capsys, "store", "fsck", "--store", admin_url, "--json")
    report = json.loads(out)
    assert code == 0 and report["damaged"] == [] and report["intact"] == len(keys), err
    for store in (a, b):
        store.close()
    admin.close()
