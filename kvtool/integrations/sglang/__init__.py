"""kvtool inside SGLang 0.5.23: `KVToolHiCacheStorage`, a HiCache L3 storage backend over kvtool's
chunk store, loaded by SGLang out of tree:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtool",
        "module_path": "kvtool.integrations.sglang", "class_name": "KVToolHiCacheStorage",
        "interface_v1": 1, "store": "<URL>"}'

    storage.py  the backend: both interfaces SGLang calls (the generic `batch_get`/`batch_set` of
                flat pages; with "interface_v1": 1, `batch_get_v1`/`batch_set_v1` with host indices,
                copying straight between the host pool and the store), `batch_exists` (leading
                hits), MHA and MLA host pools
    pages.py    SGLang's host layouts (layer_first, page_first, page_first_direct) as one canonical
                page, so a page written from one layout is read into any other
    config.py   the extra config's keys

Pages are the store's tensor objects (format-spec/store.md §4.8): keyed by the model's identity,
the page size, the writer's shard (its tensor-parallel rank for MHA; MLA's one writer, whose pages
every rank reads), the namespace and SGLang's page key, which SGLang derives from the page's tokens
and, when a request has them, its extra key (LoRA) and cache salt: a tenant's pages are never
another's. A missing, damaged or foreign page is a miss.

Extra config: `store` (required), `codec` (raw only: a page is stored as its bytes are),
`namespace` (a partition of a shared store; default none), `model` (the served model's folder,
whose identity names the pages; default SGLang's model path), `memory_bytes` (an in-process memory
tier in front of the store; default 0).
"""

from .storage import KVToolHiCacheStorage

__all__ = ["KVToolHiCacheStorage"]
