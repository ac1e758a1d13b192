"""The content-addressed chunk store (format-spec/store.md): local folder, Redis, memory tier;
the prefix API engines use, and vLLM's KV lookup/store buffer API over it (`buffers`)."""

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

if TYPE_CHECKING:
    from .backend import Backend, ObjectInfo
    from .chunk_store import ChunkStore, ModelCache, PrefixHit, PutResult, StoreCounters, open_store

# Loaded on first use (PEP 562): a request's checks read `store.names` alone, before numpy,
# the container format or a backend is imported (a usage error answers as fast as --help).
_WHERE = {"Backend": ".backend", "ObjectInfo": ".backend", "ChunkStore": ".chunk_store", "ModelCache": ".chunk_store",
          "PrefixHit": ".chunk_store", "PutResult": ".chunk_store", "StoreCounters": ".chunk_store",
          "open_store": ".chunk_store"}


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE)

__all__ = ["Backend", "ChunkStore", "ModelCache", "ObjectInfo", "PrefixHit", "PutResult", "StoreCounters",
           "open_store"]
