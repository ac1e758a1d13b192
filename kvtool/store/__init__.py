"""The content-addressed chunk store (format-spec/store.md): local folder, Redis, memory tier;
the prefix API engines use, and vLLM's KV lookup/store buffer API over it (`buffers`)."""

from .backend import Backend, ObjectInfo
from .chunk_store import ChunkStore, ModelCache, PrefixHit, PutResult, StoreCounters, open_store

__all__ = ["Backend", "ChunkStore", "ModelCache", "ObjectInfo", "PrefixHit", "PutResult", "StoreCounters",
           "open_store"]
