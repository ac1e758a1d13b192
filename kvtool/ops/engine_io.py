"""Moving whole sequences of KV between KV_BLOB tensors and the engine's paged cache,
through the connector a serving engine would use (shared by capture, replay and the benches)."""

from __future__ import annotations

import torch

from ..connectors import PagedMemConnectorV2
from ..engine import LoadedModel, PagedKVCache, Runner
from ..engine import model as engine_model


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


def run_with_query_energy(model: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """KV_BLOB [2, L, T, C] (bfloat16) of `ids`, and the summed squared queries [L, Hkv, D] (over
    tokens and the query heads of each KV head). The queries are seen by wrapping the engine's
    attention function for the length of this call (the engine keeps no hook for it)."""
    cfg = model.config
    energy = torch.zeros(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
    calls = [0]
    real = engine_model.attention

    def seeing_queries(q, *args, **kwargs):
        layer = calls[0] % cfg.num_layers
        group = cfg.num_heads // cfg.num_kv_heads
        energy[layer] += q.float().pow(2).view(q.shape[0], cfg.num_kv_heads, group, cfg.head_dim).sum((0, 2)).double().cpu()
        calls[0] += 1
        return real(q, *args, **kwargs)

    n = len(ids)
    cache = PagedKVCache.for_tokens(cfg, n, kv_dtype=torch.bfloat16, device=model.device, shuffle_seed=0)
    seq = cache.new_sequence(n)
    engine_model.attention = seeing_queries
    try:
        Runner(model, cache).prefill(seq, ids, prefill_chunk=n, logits="none")
    finally:
        engine_model.attention = real
    connector = paged_connector(model)
    memory = connector.allocate(n, torch.bfloat16, model.device)
    connector.from_gpu(memory, 0, n, kvcaches=cache.kv_caches, slot_mapping=seq.slot_mapping(n))
    return memory.tensor.cpu().clone(), energy
