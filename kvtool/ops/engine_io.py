"""Moving whole sequences of KV between KV_BLOB tensors and the engine's paged cache,
through the connector a serving engine would use (shared by capture, replay and the benches)."""

from __future__ import annotations

import torch

from ..connectors import PagedMemConnectorV2
from ..engine import LoadedModel, PagedKVCache


def paged_connector(model: LoadedModel) -> PagedMemConnectorV2:
    cfg = model.config
    return PagedMemConnectorV2(cfg.num_kv_heads * cfg.head_dim, cfg.num_layers, layout="flash_attn",
                               num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)


def new_cache(model: LoadedModel, total: int, kv_dtype: torch.dtype, block_size: int, seed: int):
    """A fresh paged cache on the model's device with shuffled blocks, and a sequence of `total` slots."""
    cache = PagedKVCache.for_tokens(model.config, total, block_size=block_size, kv_dtype=kv_dtype,
                                    device=model.device, shuffle_seed=seed)
    seq = cache.new_sequence(total)
    return cache, seq


def write_kv(model: LoadedModel, cache: PagedKVCache, seq, kv: torch.Tensor, slot_mapping: torch.Tensor,
             chunk_size: int = 256) -> None:
    """Write a whole-sequence KV_BLOB [2, L, T, C] into the paged cache, chunk by chunk."""
    connector = paged_connector(model)
    num_tokens = kv.shape[2]
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        memory = connector.allocate(end - start, cache.kv_dtype, cache.device)
        memory.tensor.copy_(kv[:, :, start:end])
        connector.to_gpu(memory, start, end, kvcaches=cache.kv_caches, slot_mapping=slot_mapping)
    seq.num_tokens = num_tokens
