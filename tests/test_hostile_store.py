"""The store under attack (issue 27): what is at an object's name is never trusted. A chunk whose
values are NaN (with a valid CRC), a payload its codec cannot decode, a link, a folder, a FIFO, a
file we may not read, a Redis key of another type or not UTF-8, a huge sparse file: each is a
miss for a load (never handed to a model), never counted as stored, and `fsck` sees it, reports
it and goes on (removing what is not an object, keeping what it cannot read). Real folders, real
links and permissions, a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from fixtures import make_identity, make_kv
from kvtool.cli.app import run
from kvtool.errors import ObjectRefused
from kvtool.store import objects, open_store
from kvtool.store.upkeep import fsck

L, H, D, CS = 2, 2, 8, 8
TOKENS = list(range(100, 132))  # 4 whole chunks


def identity():
    return make_identity(num_layers=L, num_kv_heads=H, head_dim=D)


def filled(url: str, dtype=torch.float32):
    """A store at `url` holding TOKENS' 4 chunks, and its model cache."""
    cache = open_store(url).for_model(identity(), chunk_size=CS)
    cache.put_sequence(TOKENS, make_kv(identity(), 32, dtype))
    return cache


def paged(num_tokens: int = 32):
    from kvtool.connectors import ConnectorTarget, PagedMemConnectorV2

    caches = [torch.zeros(2, num_tokens // 4 + 2, 4, H, D) for _ in range(L)]
    connector = PagedMemConnectorV2(H * D, L, layout="flash_attn", num_kv_heads=H, head_dim=D)
    return ConnectorTarget(connector, kvcaches=caches, slot_mapping=torch.arange(num_tokens))


def replace_object(cache, index: int, data: bytes) -> str:
    """Object `index` of TOKENS replaced by `data` (a crafted object, put at its name)."""
    name = cache.chunk_names(TOKENS)[index]
    cache.backend.put(name, data, replace=True)
    return name


def crafted(cache, index: int, *, kv=None, payload=None, codec="raw", dtype="float32") -> bytes:
    """A chunk object for link `index` of TOKENS, as a writer would make it (valid CRCs, names)."""
    link = cache._chain(TOKENS)[index]
    return objects.encode_chunk(cache.model, dtype, link.parent, link.start, TOKENS[link.start:link.start + CS],
                                kv=kv, payload=payload, codec=codec)


def assert_a_miss_at(cache, index: int, refused: bool = True):
    """Every read path stops at chunk `index`: the load, the tensors, `store get`'s objects. A
    refused object is removed by the read that refused it (healed: store.md §7), so it is put back
    before each path, and once more after them (for the `fsck` that follows in the tests)."""
    name = cache.chunk_names(TOKENS)[index]
    bad = bytes(cache.backend.get(name)) if refused else None

    def read_paths():
        yield lambda: cache.load_prefix(TOKENS, paged())
        yield lambda: cache.get_prefix(TOKENS)
        yield lambda: list(cache.checked_objects(TOKENS))

    for read in read_paths():
        if bad is not None:
            cache.backend.put(name, bad, replace=True)
        got = read()
        assert (len(got) if isinstance(got, list) else got.num_tokens) == (index if isinstance(got, list) else index * CS)
        if not isinstance(got, list):
            assert bool(got.refused) == refused
        if refused:
            assert not cache.backend.exists(name)  # removed by the read that refused it
    if bad is not None:
        cache.backend.put(name, bad, replace=True)


# ---- 1. values a model must never see, written with valid CRCs ---------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_chunk_of_nan_with_a_valid_crc_is_a_miss_and_fsck_removes_it(tmp_path, dtype, value):
    cache = filled(str(tmp_path / "s"), dtype)
    kv = make_kv(identity(), CS, dtype)
    kv[1, 0, 5, 3] = value
    from kvtool.dtypes import dtype_name

    name = replace_object(cache, 2, crafted(cache, 2, kv=kv, dtype=dtype_name(dtype)))
    assert_a_miss_at(cache, 2)
    report = fsck(cache.store)
    assert [d["name"] for d in report.damaged] == [name] and report.removed == 1
    assert "NaN or infinite" in report.damaged[0]["reason"]
    assert not cache.backend.exists(name)


def test_a_nan_chunk_is_refused_on_every_load_path(tmp_path, monkeypatch):
    """The native checked scatter (from the file, mapped or in windows), the torch path (a private
    checked copy), the staged path's copy into its buffers, a memory tier's bytes."""
    from kvtool.connectors import paged_native
    from kvtool.load import load_chunks_staged

    cache = filled(str(tmp_path / "s"))
    kv = make_kv(identity(), CS, torch.float32)
    kv[0, 1, 0, 0] = float("nan")
    replace_object(cache, 1, crafted(cache, 1, kv=kv))
    for native in ("1", "0"):
        monkeypatch.setenv("KVTOOL_PAGED_NATIVE", native)
        assert cache.load_prefix(TOKENS, paged()).num_tokens == CS
    if paged_native.native_module() is not None:
        monkeypatch.setattr(paged_native, "MIN_BYTES_PER_THREAD", 1)
    tiered = open_store(str(tmp_path / "s"), memory_bytes=1 << 20).for_model(identity(), chunk_size=CS)
    for _ in range(2):  # read from the folder, then from the memory tier
        assert tiered.load_prefix(TOKENS, paged()).num_tokens == CS
    from kvtool.load import path as load_path

    def staged(tasks, destination, threads=None):  # the GPU's path, in its CPU mode
        return load_chunks_staged(tasks, destination, "cpu")

    monkeypatch.setattr(load_path, "load", staged)
    assert cache.load_prefix(TOKENS, paged()).num_tokens == CS


def test_a_zstd_payload_that_is_not_a_frame_is_a_miss_not_an_error(tmp_path):
    """Its CRC is valid (written so): `store get` never copies it out, a load counts a miss
    instead of failing with DecodeError, fsck removes it."""
    from kvtool.codecs import get_codec

    cache = filled(str(tmp_path / "s"))
    params = get_codec("zstd").default_params()
    link = cache._chain(TOKENS)[1]
    junk = objects.encode_chunk(cache.model, "float32", link.parent, link.start, TOKENS[CS:2 * CS],
                                payload=b"not a zstd frame" * 40, codec="zstd", params=params)
    name = replace_object(cache, 1, junk)
    assert_a_miss_at(cache, 1)
    report = fsck(cache.store)
    assert [d["name"] for d in report.damaged] == [name] and report.removed == 1


def occupied(tmp_path, index: int):
    """A filled store whose object `index` of TOKENS is removed, so a test can put something else at
    its name: (cache, name, path)."""
    cache = filled(str(tmp_path / "s"))
    name = cache.chunk_names(TOKENS)[index]
    path = tmp_path / "s" / name
    path.unlink()
    return cache, name, path


# ---- 2. links, folders and FIFOs at object names ------------------------------------------------

def test_a_link_at_an_object_name_is_never_followed(tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("root:x:0:0\n")
    cache, name, path = occupied(tmp_path, 1)
    path.symlink_to(outside)
    with pytest.raises(ObjectRefused, match="symbolic link"):
        cache.backend.open(name)
    assert not cache.backend.exists(name)  # never counted as present
    assert cache.load_prefix(TOKENS, paged()).num_tokens == CS
    report = fsck(cache.store, repair=False)
    assert [d["name"] for d in report.damaged] == [name] and report.checked == 4
    put = cache.put_sequence(TOKENS, make_kv(identity(), 32, torch.float32))  # a new capture stores it
    assert (put.stored, put.present) == (1, 3)
    assert path.is_file() and not path.is_symlink() and outside.read_text() == "root:x:0:0\n"
    assert cache.load_prefix(TOKENS, paged()).num_tokens == 32


def test_fsck_removes_a_link_not_what_it_points_to(tmp_path):
    outside = tmp_path / "keep.txt"
    outside.write_text("mine")
    cache, name, path = occupied(tmp_path, 0)
    path.symlink_to(outside)
    report = fsck(cache.store)
    assert report.removed == 1 and outside.read_text() == "mine"
    assert not os.path.lexists(tmp_path / "s" / name)


def test_a_folder_at_an_object_name(tmp_path):
    cache, name, path = occupied(tmp_path, 2)
    path.mkdir()
    (path / "inside").write_text("x")
    assert not cache.backend.exists(name)
    assert cache.load_prefix(TOKENS, paged()).num_tokens == 2 * CS
    put = cache.put_sequence(TOKENS, make_kv(identity(), 32, torch.float32))
    assert (put.stored, put.present) == (0, 3)  # not "already there": refused, with a notice
    assert cache.store.counters.refused == 1
    report = fsck(cache.store)
    assert [d["name"] for d in report.damaged] == [name] and report.removed == 1 and not path.exists()
    assert cache.put_sequence(TOKENS, make_kv(identity(), 32, torch.float32)).stored == 1


def test_a_fifo_at_an_object_name_never_blocks(tmp_path):
    cache, name, path = occupied(tmp_path, 1)
    os.mkfifo(path)
    with pytest.raises(ObjectRefused, match="not a regular file"):
        cache.backend.open(name)
    assert cache.load_prefix(TOKENS, paged()).num_tokens == CS
    report = fsck(cache.store)
    assert [d["name"] for d in report.damaged] == [name] and report.removed == 1 and not os.path.lexists(path)


def test_a_folder_on_the_way_that_links_out_of_the_store(tmp_path):
    """`chunks/<model>/8` made a link to a folder elsewhere holding copies of the objects: they
    are read from outside the store, so refused."""
    import shutil

    cache = filled(str(tmp_path / "s"))
    size_dir = tmp_path / "s" / Path(cache.chunk_names(TOKENS)[0]).parents[1]
    shutil.copytree(size_dir, tmp_path / "elsewhere")
    shutil.rmtree(size_dir)
    size_dir.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ObjectRefused, match="out of the store"):
        cache.backend.open(cache.chunk_names(TOKENS)[0])
    assert cache.load_prefix(TOKENS, paged()).num_tokens == 0


# ---- 3. one bad entry never stops the sweep -----------------------------------------------------

def without_read_override() -> list[str]:
    """How to run a command that permissions bind: as it is for a user; for root, without the
    capabilities that let it read anything (setpriv, util-linux)."""
    if os.geteuid() != 0:
        return []
    import shutil

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root reads any file, and setpriv (util-linux) is not here to drop that")
    drop = "-dac_override,-dac_read_search"
    return [setpriv, "--bounding-set", drop, "--inh-caps", drop]


def test_an_object_that_cannot_be_read_is_a_miss_and_fsck_goes_on(tmp_path):
    """Mode 000 (run as an unprivileged user: root reads anything): the load counts a miss with a
    notice, `fsck` reports the object, keeps it (its bytes may be intact: another user's) and
    checks every other one; `store get` and `replay --store` never exit 2 for it."""
    root = Path(tempfile.mkdtemp(prefix="kvtool-perm-"))
    try:
        cache = filled(str(root / "s"))
        damaged = replace_object(cache, 3, b"junk")  # damage to find past the unreadable one
        unreadable = cache.chunk_names(TOKENS)[1]
        os.chmod(root / "s" / unreadable, 0)
        script = (
            "import sys, json; sys.path.insert(0, 'tests')\n"
            "from fixtures import make_identity\n"
            "from kvtool.store import open_store\n"
            "from kvtool.store.upkeep import fsck\n"
            f"cache = open_store({str(root / 's')!r}).for_model(make_identity(num_layers={L}, num_kv_heads={H}, "
            f"head_dim={D}), chunk_size={CS})\n"
            f"hit = cache.get_prefix({TOKENS!r})\n"
            "report = fsck(cache.store)\n"
            "print(json.dumps([hit.num_tokens, report.checked, report.removed, report.damaged]))\n")
        out = subprocess.run([*without_read_override(), sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=300, cwd=Path(__file__).resolve().parents[1])
        assert out.returncode == 0, out.stderr
        loaded, checked, removed, found = json.loads(out.stdout)
        assert loaded == CS and "cannot be read here" in out.stderr
        assert checked == 4 and removed == 1
        assert sorted(d["name"] for d in found) == sorted([unreadable, damaged])
        assert next(d for d in found if d["name"] == unreadable).get("kept")
        assert (root / "s" / unreadable).exists() and not (root / "s" / damaged).exists()
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


# ---- Redis: keys of another type, keys that are not UTF-8 ---------------------------------------

@pytest.fixture
def redis_store(redis_server):
    """A database of the session's redis-server of its own, empty (other tests share the server)."""
    url = redis_server.url.rsplit("/", 1)[0] + "/7"
    _raw_redis(url).flushdb()
    return url


def _raw_redis(url: str):
    import redis

    return redis.Redis.from_url(url)


def test_a_redis_key_of_another_type_is_refused_and_fsck_goes_on(redis_store, capsys):
    cache = filled(redis_store)
    names = cache.chunk_names(TOKENS)
    client = _raw_redis(redis_store)
    client.delete("kvtool:1:" + names[1])
    client.hset("kvtool:1:" + names[1], "a", "b")
    client.set("kvtool:1:" + names[3], b"junk")
    with pytest.raises(ObjectRefused, match="another type"):
        cache.backend.get(names[1])
    assert not cache.backend.exists(names[1])
    assert cache.load_prefix(TOKENS, paged()).num_tokens == CS
    assert run(["store", "fsck", "--store", redis_store, "--json"]) == 0  # damage found and removed
    report = json.loads(capsys.readouterr().out)
    assert report["checked"] == 4 and report["removed"] == 2
    assert sorted(d["name"] for d in report["damaged"]) == sorted([names[1], names[3]])
    cache.put_sequence(TOKENS, make_kv(identity(), 32, torch.float32))
    assert cache.load_prefix(TOKENS, paged()).num_tokens == 32


def test_a_put_replaces_a_redis_key_of_another_type(redis_store):
    cache = filled(redis_store)
    name = cache.chunk_names(TOKENS)[2]
    client = _raw_redis(redis_store)
    client.delete("kvtool:1:" + name)
    client.rpush("kvtool:1:" + name, "x")
    put = cache.put_sequence(TOKENS, make_kv(identity(), 32, torch.float32))
    assert (put.stored, put.present) == (1, 3)
    assert client.type("kvtool:1:" + name) == b"string"


def test_redis_keys_that_are_not_utf8(redis_store, capsys):
    cache = filled(redis_store)
    client = _raw_redis(redis_store)
    client.set(b"kvtool:1:chunks/\xff\xfe.kvc", b"junk")
    client.set(f"kvtool:1:chunks/{cache.key}/".encode() + b"\xff", b"junk")
    for args in (["store", "ls", "--store", redis_store], ["store", "stats", "--store", redis_store],
                 ["store", "ls", "--store", redis_store, "--json"]):
        assert run(args) == 0, capsys.readouterr()
    assert "\\xff" in capsys.readouterr().out
    assert cache.load_prefix(TOKENS, paged()).num_tokens == 32
    assert open_store(redis_store).chunk_sizes(identity()) == [CS]
    assert run(["store", "fsck", "--store", redis_store]) == 0, capsys.readouterr()
    assert client.get(b"kvtool:1:chunks/\xff\xfe.kvc") is None
    assert run(["store", "gc", "--store", redis_store, "--max-bytes", "1G"]) == 0, capsys.readouterr()


# ---- 5. a huge file at a name is judged by its header ------------------------------------------

def test_a_sparse_gigabyte_at_an_object_name_is_never_read_whole(tmp_path):
    cache = filled(str(tmp_path / "s"))
    name = cache.chunk_names(TOKENS)[1]
    path = tmp_path / "s" / name
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: no disk, 1 GiB to whoever reads it whole
    script = (
        "import resource, sys, json; sys.path.insert(0, 'tests')\n"
        "from fixtures import make_identity\n"
        "from kvtool.store import open_store\n"
        "from kvtool.store.upkeep import fsck\n"
        f"cache = open_store({str(tmp_path / 's')!r}).for_model(make_identity(num_layers={L}, num_kv_heads={H}, "
        f"head_dim={D}), chunk_size={CS})\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "report = fsck(cache.store, repair=False)\n"
        f"n = len(list(cache.checked_objects({TOKENS!r})))\n"  # (refused, and removed: after fsck looked)
        "print(json.dumps([n, len(report.damaged), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    got, damaged, grown_mb = json.loads(out.stdout)
    assert got == 1 and damaged == 1 and not path.exists()
    assert grown_mb < 64, f"reading the store grew the process by {grown_mb} MB"


def test_a_chunk_in_the_wrong_two_digit_folder_is_foreign(tmp_path):
    """store.md §3: the fan-out folder is the hash's first two hex digits; a copy of a valid object
    in another folder is not a name this store gives: never read, and fsck removes it."""
    import shutil

    from kvtool.store.names import parse_name

    cache = filled(str(tmp_path / "s"))
    name = cache.chunk_names(TOKENS)[0]
    head, fan, leaf = name.rsplit("/", 2)
    wrong = f"{head}/{'00' if fan != '00' else '01'}/{leaf}"
    assert parse_name(name) is not None and parse_name(wrong) is None
    (tmp_path / "s" / wrong).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / "s" / name, tmp_path / "s" / wrong)
    report = fsck(cache.store)
    assert [d["name"] for d in report.damaged] == [wrong] and "not a store object's name" in report.damaged[0]["reason"]
    assert report.removed == 1 and (tmp_path / "s" / name).exists()


@pytest.mark.parametrize("segment,why", [({"version": 1, "stored_start": 5}, "rotated for positions from 5"),
                                         ({"version": 2, "stored_start": 0}, "segment"),
                                         ({"version": 1}, "stored_start")])
def test_a_chunk_object_marked_a_rotated_or_unreadable_segment_is_refused(tmp_path, segment, why):
    """store.md §5 check 5 and segment.md §1: the store is a prefix consumer; an object whose
    `segment` key says its keys were rotated elsewhere, or does not check, is never loaded, and
    fsck removes it (before, store get and fsck accepted them)."""
    from kvtool.format import ContainerWriter
    from kvtool.store.names import STORE_VERSION, link_hash

    cache = filled(str(tmp_path / "s"))
    link = cache._chain(TOKENS)[1]
    tokens = TOKENS[CS:2 * CS]
    extension = {"version": STORE_VERSION, "kind": "chunk", "start": link.start, "parent_hash": link.parent.hex(),
                 "prefix_hash": link_hash(link.parent, tokens).hex()}
    writer = ContainerWriter(None, cache.model, tokens, kv_dtype="float32", chunk_size=CS, alignment=64,
                             extensions={"store": extension, "segment": segment})
    writer.write_chunk(make_kv(identity(), CS, torch.float32))
    writer.finish()
    name = replace_object(cache, 1, writer.getvalue())
    assert_a_miss_at(cache, 1)
    report = fsck(cache.store)
    assert [d["name"] for d in report.damaged] == [name] and why in report.damaged[0]["reason"]


def test_fsck_removes_what_verify_refuses_non_zero_padding(tmp_path):
    """Issue 27 #1: whatever `verify` refuses, fsck removes; padding is never loaded (it is not
    KV), so loads need not read it, but an object with bytes there is not one a writer made. The
    object is written with 64-byte alignment (kvtool's own are packed), so it has padding."""
    from kvtool.format import ContainerReader, ContainerWriter
    from kvtool.store.names import STORE_VERSION

    cache = filled(str(tmp_path / "s"))
    link = cache._chain(TOKENS)[1]
    extension = {"version": STORE_VERSION, "kind": "chunk", "start": link.start, "parent_hash": link.parent.hex(),
                 "prefix_hash": link.prefix_hash}
    writer = ContainerWriter(None, cache.model, TOKENS[CS:2 * CS], kv_dtype="float32", chunk_size=CS, alignment=64,
                             extensions={"store": extension})
    writer.write_chunk(make_kv(identity(), CS, torch.float32), codec="zstd")  # a length that leaves padding
    writer.finish()
    data = bytearray(writer.getvalue())
    name = replace_object(cache, 1, bytes(data))
    assert not fsck(cache.store, repair=False).damaged  # as written: intact
    path = tmp_path / "s" / name
    with ContainerReader(path) as reader:
        chunk = reader.manifest.chunks[0].blob
        gap = chunk.offset + chunk.length  # the chunk's end, then zeros up to the next 64-aligned blob
        assert gap % 64 and reader.manifest.tokens.offset > gap
    data[gap] = 0x5A
    path.write_bytes(bytes(data))
    assert cache.load_prefix(TOKENS, paged()).num_tokens == 32  # loads never read padding
    report = fsck(cache.store)
    assert [d["name"] for d in report.damaged] == [name] and "padding" in report.damaged[0]["reason"]
