"""The store and the served model, opened once per process (each side of the connector has its
own): a `ModelCache` per request's keys and KV cache group, so every lookup, load and save is keyed
by them."""

from __future__ import annotations

from ...engine.loader import model_identity
from ...store import ModelCache, open_store
from ...store.names import ExtraKeys
from .config import ConnectorConfig
from .groups import KVGroup, group_identity


class StoreCaches:
    def __init__(self, config: ConnectorConfig, model_path: str, groups: list[KVGroup] | None = None):
        self.store = open_store(config.store_url)  # an unreachable store stops vLLM here, named
        self.url = self.store.url
        self.chunk_size = config.chunk_size
        self.block_size = config.block_size  # prefixes match to vLLM's block (store.md §7)
        identity = model_identity(model_path)
        model = {**identity.to_dict(), "fingerprint": identity.fingerprint()}  # hashed once, not per request
        groups = groups or [KVGroup(0, (), tuple(range(identity.num_layers)))]
        self._models = [group_identity(model, group, groups) for group in groups]

    def cache(self, keys: ExtraKeys, group: int = 0) -> ModelCache:
        """The chunks of the served groups' `group`-th under a request's keys: it never sees
        another's, nor another group's. Prefixes match to vLLM's block: whole chunks, then the
        block-aligned tokens a stored sequence shares past them."""
        return self.store.for_model(self._models[group], self.chunk_size, keys, self.block_size)

    def close(self) -> None:
        self.store.close()
