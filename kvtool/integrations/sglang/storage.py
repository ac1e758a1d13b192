"""`KVToolHiCacheStorage`: SGLang's HiCache L3 tier over kvtool's chunk store.

SGLang hands a backend page keys (its chain of SHA-256 over each page's tokens) and host pages;
each page is one checked tensor object of the store (`kvtool/store/sglang_pages.py`), so the same
store serves vLLM, SGLang and the command line, and `kvtool store ls/stats/fsck/gc` see the pages.
Every read is checked (CRC-32C, the object's key, shape, dtype, every value finite): a missing,
damaged or foreign page is a miss (False, or None), never data, and a damaged one is removed so the
next backup writes it again. A store failure is a miss or an unsaved page, logged, never an
exception in SGLang's threads.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from ...errors import KvtoolError
from ...store import open_store
from ...store.names import model_key
from ...store.sglang_pages import PageKeys, put_pages, read_pages, shard_name
from . import pages
from .config import read_config

log = logging.getLogger("sglang.kvtool")


class KVToolHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.config = read_config(storage_config.extra_config)
        if storage_config.attn_cp_size > 1 or storage_config.dcp_size > 1:
            raise ValueError("kvtool HiCache backend: context parallelism (attn-cp, dcp) is not supported")
        self.storage_config = storage_config
        identity = _identity(self.config.model or storage_config.model_name)
        self.model = identity.name
        self._model_key = model_key(identity)
        self.store = open_store(self.config.store_url, memory_bytes=self.config.memory_bytes)
        self.keys: PageKeys | None = None  # known once SGLang registers its host pool
        self.mem_pool_host = None

    def register_mem_pool_host(self, mem_pool_host) -> None:
        pages.check_pool(mem_pool_host)
        self.mem_pool_host = mem_pool_host
        c = self.storage_config
        mla = pages.is_mla(mem_pool_host)
        shard = shard_name(tp_rank=c.tp_rank, tp_size=c.tp_size, pp_rank=c.pp_rank, pp_size=c.pp_size, mla=mla)
        self.keys = PageKeys(self._model_key, mem_pool_host.page_size, shard, self.config.namespace)
        self._shape = pages.page_shape(mem_pool_host)
        # MLA: every rank holds the same KV; one writes (SGLang's is_storage_writer), all read
        self._writes = not mla or c.is_storage_writer
        log.info("kvtool: store %s, model %s, %s pages of %d tokens (%s layout), shard %s%s", self.store.url,
                 self.model, "MLA" if mla else "MHA", mem_pool_host.page_size, mem_pool_host.layout, shard,
                 "" if self._writes else " (reads only: another rank writes MLA pages)")

    # --- reads -----------------------------------------------------------------------------

    def _read(self, keys: List[str]) -> list:
        """The checked pages of `keys` (None: missing or refused), in batches of the store's size."""
        out = []
        try:
            for at in range(0, len(keys), 64):
                got = read_pages(self.store.backend, self.keys, keys[at:at + 64], self._shape,
                                 self.mem_pool_host.dtype)
                for why in got.refused:
                    log.warning("kvtool: page refused, a miss (%s)", why)
                out.extend(got.pages)
        except KvtoolError as err:  # the store went away: misses, never a crash
            log.warning("kvtool: pages could not be read from %s (%s)", self.store.url, err)
            out.extend([None] * (len(keys) - len(out)))
        return out

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Zero copy: each checked page is copied straight into the host pool at its indices."""
        page_size = self.mem_pool_host.page_size
        done = []
        for i, page in enumerate(self._read(keys)):
            if page is not None:
                pages.copy_into(pages.page_view(self.mem_pool_host, int(host_indices[i * page_size])), page)
            done.append(page is not None)
        return done

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """The generic interface: flat pages in the host layout's order, filled in place."""
        targets = target_locations or [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        out = []
        for page, target in zip(self._read(keys), targets):
            if page is not None:
                pages.copy_into(pages.flat_view(self.mem_pool_host, target), page)
            out.append(target if page is not None else None)
        return out

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages are stored (one batch). Existence alone: a page damaged inside
        is found here and refused by the read, which SGLang then counts as a miss."""
        try:
            present = self.store.backend.exists_many([self.keys.name(k) for k in keys])
        except KvtoolError as err:
            log.warning("kvtool: %s could not be asked for pages (%s)", self.store.url, err)
            return 0
        return present.index(False) if False in present else len(present)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- writes ----------------------------------------------------------------------------

    def _write(self, items: list[tuple[str, torch.Tensor]]) -> List[bool]:
        if not self._writes:
            return [True] * len(items)  # the MLA writer rank stores these very bytes
        try:
            stored = []
            for at in range(0, len(items), 64):
                stored.extend(put_pages(self.store.backend, self.keys, items[at:at + 64]))
        except KvtoolError as err:  # the store is unreachable or full: serving goes on, unsaved
            log.warning("kvtool: pages not saved to %s (%s)", self.store.url, err)
            return [False] * len(items)
        if not all(stored):
            log.warning("kvtool: %d pages not saved: values that are not finite", stored.count(False))
        return stored

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        page_size = self.mem_pool_host.page_size
        pool = self.mem_pool_host
        return self._write([(k, pages.contiguous(pages.page_view(pool, int(host_indices[i * page_size]))))
                            for i, k in enumerate(keys)])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """The generic interface: flat pages in the host layout's order."""
        return all(self._write([(k, pages.contiguous(pages.flat_view(self.mem_pool_host, v.contiguous())))
                                for k, v in zip(keys, values)]))

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # --- the rest --------------------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's "clear the L3 tier": a shared store is not wiped by one engine (`kvtool store
        rm` / `gc` remove pages)."""
        log.info("kvtool: clear() leaves %s as it is (a shared store); use kvtool store gc", self.store.url)

    def close(self) -> None:
        self.store.close()


def _identity(model: str | None):
    """The served model's identity (its folder's configuration and weights digest): it names
    every page, so another model's pages are never found."""
    from ...engine.loader import model_identity

    if not model:
        raise ValueError("kvtool HiCache backend: no model path to name pages by (give extra config 'model')")
    try:
        return model_identity(model)
    except KvtoolError as err:
        raise ValueError(f"kvtool HiCache backend: {err} (extra config 'model': the served model's folder)") from None
