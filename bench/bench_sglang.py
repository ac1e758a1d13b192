"""kvtool inside SGLang: backup and prefetch throughput of the kvtool HiCache backend against
SGLang's own `HiCacheFile`, on the same host pages, in one run.

    python bench/bench_sglang.py [--pages 64] [--page-size 64] [--repeat 3] [--json OUT] [--dir TMP]

Real SGLang 0.5.23 objects on the CPU: a device pool of the default model's KV geometry (30 layers,
3 KV heads of 64, bfloat16 as SGLang serves it) and SGLang's host pool over it (`page_first`, the
zero-copy layout), filled with random KV. Each row calls the backend as SGLang's HiCacheController
does: backup = `batch_set` of the pages (HiCacheFile and kvtool's generic interface: flat pages the
controller copies out with `get_data_page`; kvtool's interface_v1: host indices, each page read
from the pool itself), prefetch = `batch_exists` then `batch_get` of the same pages into other host
slots (generic: into flat pages the controller then copies in with `set_from_flat_data_page`).
Backup writes a fresh store each pass; prefetch reads what it wrote (the files in the page cache,
as a warm L3 is). MB/s counts the pages' KV bytes; the best of --repeat passes. Every prefetch is
checked byte for byte against the pages backed up. kvtool checks every page it reads (CRC-32C, its
key, shape, dtype, finite values); HiCacheFile reads raw bytes and checks nothing. Needs a Python
with sglang (`make test` installs it into .venv).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from sglang_pools import device_pool, fill, host_pool, import_torchvision_beside_cpu_torch, storage_config  # noqa: E402

import_torchvision_beside_cpu_torch()  # as the tests do (tests/sglang_pools.py)


def controller_calls(backend, host, keys, generic: bool):
    """(backup, prefetch) as HiCacheController's page functions call the backend."""
    page = host.page_size
    src = torch.arange(len(keys) * page)
    dst = torch.arange(len(keys) * page, 2 * len(keys) * page)

    def backup():
        if generic:
            return backend.batch_set(keys, [host.get_data_page(int(src[i * page])) for i in range(len(keys))])
        return all(backend.batch_set_v1(keys, src))

    def prefetch():
        hits = backend.batch_exists(keys)
        if generic:
            got = backend.batch_get(keys[:hits], [host.get_dummy_flat_data_page() for _ in range(hits)])
            for i, flat in enumerate(got):
                if flat is None:
                    return i
                host.set_from_flat_data_page(int(dst[i * page]), flat)
            return len(got)
        return sum(backend.batch_get_v1(keys[:hits], dst[:hits * page]))

    return backup, prefetch, src, dst


def make_backend(kind: str, store: str, host, model_dir: str):
    if kind == "HiCacheFile":
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        b = HiCacheFile(storage_config(model=model_dir, layout=host.layout, file_storage_path=store), file_path=store)
    else:
        from kvtool.integrations.sglang import KVToolHiCacheStorage

        b = KVToolHiCacheStorage(storage_config(model=model_dir, layout=host.layout, store=store))
    b.register_mem_pool_host(host)
    return b


def run_row(name: str, kind: str, generic: bool, store_of, host, keys, repeat: int, model_dir: str) -> dict:
    from kvtool.integrations.sglang import pages

    page_bytes = host.get_data_page(0).numel() * host.dtype.itemsize
    total = page_bytes * len(keys)
    backups, prefetches = [], []
    for r in range(repeat):
        store = store_of(r)
        b = make_backend(kind, store, host, model_dir)
        backup, prefetch, src, dst = controller_calls(b, host, keys, generic)
        t = time.perf_counter()
        assert backup()
        backups.append(time.perf_counter() - t)
        b = make_backend(kind, store, host, model_dir)  # a fresh backend: no state of the writer's
        backup, prefetch, src, dst = controller_calls(b, host, keys, generic)
        for i in range(len(keys)):  # the slots prefetched into hold nothing of the pages before
            pages.page_view(host, int(dst[i * host.page_size])).zero_()
        t = time.perf_counter()
        got = prefetch()
        prefetches.append(time.perf_counter() - t)
        assert got == len(keys), (name, got)
        page = host.page_size
        for i in range(len(keys)):
            assert torch.equal(pages.page_view(host, int(src[i * page])), pages.page_view(host, int(dst[i * page])))
        if hasattr(b, "close"):
            b.close()
    return {"row": name, "pages": len(keys), "page_bytes": page_bytes, "backup_s": min(backups),
            "prefetch_s": min(prefetches), "backup_MBps": total / min(backups) / 1e6,
            "prefetch_MBps": total / min(prefetches) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--redis", action=argparse.BooleanOptionalAction, default=True,
                    help="also the kvtool backend on Redis")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--dir", type=Path, default=None, help="folder for the stores (default: the system temp)")
    args = ap.parse_args()

    from kvtool.engine.default_model import default_model_path

    model_dir = str(default_model_path())
    dev = device_pool("mha", args.page_size, tokens=args.pages * args.page_size, dtype=torch.bfloat16)
    host = host_pool(dev, "page_first", ratio=2.0)
    fill(host, seed=0)
    keys = [f"{i:064x}" for i in range(args.pages)]
    root = Path(tempfile.mkdtemp(prefix="bench-sglang-", dir=args.dir))
    rows = []
    try:
        rows.append(run_row("SGLang HiCacheFile (generic)", "HiCacheFile", True, lambda r: str(root / f"file{r}"),
                            host, keys, args.repeat, model_dir))
        rows.append(run_row("kvtool folder, generic", "kvtool", True, lambda r: str(root / f"kg{r}"), host, keys,
                            args.repeat, model_dir))
        rows.append(run_row("kvtool folder, interface_v1", "kvtool", False, lambda r: str(root / f"kv{r}"), host,
                            keys, args.repeat, model_dir))
        if args.redis:
            from redis_server import RedisServer

            server = RedisServer()
            server.start()
            try:
                base = server.url.rsplit("/", 1)[0]
                rows.append(run_row("kvtool Redis, interface_v1", "kvtool", False, lambda r: f"{base}/{r + 1}", host,
                                    keys, args.repeat, model_dir))
            finally:
                server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ref = rows[0]
    print(f"{args.pages} pages of {args.page_size} tokens ({ref['page_bytes'] / 1e6:.2f} MB each, bfloat16, "
          f"default model's KV), page_first host pool; best of {args.repeat}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'backend':32s} {'backup MB/s':>12s} {'vs file':>8s} {'prefetch MB/s':>14s} {'vs file':>8s}")
    for row in rows:
        print(f"{row['row']:32s} {row['backup_MBps']:12.0f} {row['backup_MBps'] / ref['backup_MBps']:7.2f}x "
              f"{row['prefetch_MBps']:14.0f} {row['prefetch_MBps'] / ref['prefetch_MBps']:7.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
