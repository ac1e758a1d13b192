"""KV between a transformers cache and kvtool's KV_BLOBs, through kvtool's paged connector.

transformers keeps each layer's K and V contiguous, `[batch, kv_heads, T, head_dim]`. With batch
1 that is, seen through a permuted view `[1, T, kv_heads, head_dim]`, a paged buffer of one block
of T slots in the connector's "kv_tuple" layout, token t in slot t. So KV leaves and enters a
transformers cache the way it leaves and enters any engine's paged buffers: `gather` gathers a
chunk out of it, and a load (`kvtool.load.load`, a file's chunks or the store's objects) scatters
chunks into it, checked as they are copied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ...connectors import ConnectorTarget, PagedMemConnectorV2
from ...errors import UnsupportedCache, UsageError
from ...identity import ModelIdentity
from .models import HFModel


#: The keyword a model's forward and `generate` take a cache by: `cache` from transformers 5.24
#: on, where `past_key_values` still works but warns that it is deprecated; `past_key_values` before.
CACHE_KEYWORD = "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"


def cache_argument(cache: Cache | None) -> dict[str, Cache | None]:
    """`{keyword: cache}` for a model's forward or `generate` (`CACHE_KEYWORD`)."""
    return {CACHE_KEYWORD: cache}


def connector(identity: ModelIdentity) -> PagedMemConnectorV2:
    """The paged connector over a transformers cache of this model (one block per layer)."""
    return PagedMemConnectorV2(identity.num_kv_heads * identity.head_dim, identity.num_layers, layout="kv_tuple",
                               num_kv_heads=identity.num_kv_heads, head_dim=identity.head_dim)


def as_paged(keys: list[torch.Tensor], values: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V `[1, H, T, D]` as the connector's paged buffers `[1 block, T slots, H, D]`
    (views: nothing is copied)."""
    return [(k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)) for k, v in zip(keys, values)]


def slots(num_tokens: int) -> torch.Tensor:
    """Token t in slot t: the one block holds the tokens in order."""
    return torch.arange(num_tokens, dtype=torch.int64)


def cached_tokens(cache, identity: ModelIdentity) -> int:
    """How many tokens a transformers cache holds, checked to be plain K/V that kvtool can hold:
    one sequence, every layer of the model, K and V of the model's heads for every token (a
    sliding-window layer that dropped tokens, a linear-attention state, other widths are refused)."""
    if not isinstance(cache, Cache):
        raise UsageError(f"expected a transformers cache (DynamicCache), got {type(cache).__name__}")
    layers = cache.layers
    if len(layers) != identity.num_layers:
        raise UnsupportedCache(f"the cache has {len(layers)} layers, the model {identity.num_layers}")
    lengths = set()
    for index, layer in enumerate(layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise UnsupportedCache(f"layer {index} of the cache is a {type(layer).__name__}; kvtool holds plain K/V "
                                   f"per layer (DynamicLayer)")
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            raise UsageError(f"layer {index} of the cache holds no tokens")
        keys, values = layer.keys, layer.values
        if keys.shape != values.shape or keys.dim() != 4:
            raise UnsupportedCache(f"layer {index} holds K {list(keys.shape)} and V {list(values.shape)}; kvtool "
                                   f"holds K and V of one shape, [batch, kv_heads, tokens, head_dim]")
        batch, heads, tokens, head_dim = keys.shape
        if batch != 1:
            raise UsageError(f"the cache holds a batch of {batch} sequences; a kvtool file holds one: "
                             f"save each (cache.batch_select_indices) on its own")
        if (heads, head_dim) != (identity.num_kv_heads, identity.head_dim):
            raise UnsupportedCache(f"layer {index} holds {heads} KV heads x {head_dim}, the model's config says "
                                   f"{identity.num_kv_heads} x {identity.head_dim}")
        if getattr(layer, "cumulative_length", tokens) != tokens:
            raise UnsupportedCache(f"layer {index} is a sliding-window layer that kept the last {tokens} of "
                                   f"{layer.cumulative_length} tokens: the others' KV is gone")
        lengths.add(tokens)
    if len(lengths) != 1:
        raise UnsupportedCache(f"the cache's layers hold different numbers of tokens ({sorted(lengths)})")
    return lengths.pop()


def gather(cache, identity: ModelIdentity, start: int, end: int, kv_dtype: torch.dtype,
           device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
    """Tokens [start, end) of a (checked) transformers cache as a KV_BLOB `[2, L, end - start, C]`
    in `kv_dtype` on `device`, gathered by the paged connector."""
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    paged = connector(identity)
    blob = torch.empty(paged.get_shape(end - start), dtype=kv_dtype, device=device, pin_memory=pin_memory)
    paged.gather(blob, start, end, kvcaches=as_paged(keys, values), slot_mapping=slots(keys[0].shape[2]))
    return blob


def load_cache(model: HFModel, num_tokens: int, load: Callable[[ConnectorTarget, int], int]) -> DynamicCache:
    """A transformers cache of `num_tokens` tokens from 0 in the model's dtype on its device, filled
    by `load(destination, num_tokens)` (a file's chunks or the store's objects, through
    `kvtool.load.load`; it returns how many tokens from 0 it loaded: the cache holds those)."""
    identity = model.identity
    shape = (1, identity.num_kv_heads, max(num_tokens, 1), identity.head_dim)
    keys = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in range(identity.num_layers)]
    values = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in range(identity.num_layers)]
    loaded = 0
    if num_tokens:
        target = connector(identity).target(kvcaches=as_paged(keys, values), slot_mapping=slots(num_tokens))
        loaded = load(target, num_tokens)
    return filled_cache(model, [k[:, :, :loaded] for k in keys], [v[:, :, :loaded] for v in values])


def filled_cache(model: HFModel, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A cache made as transformers makes one for the model (`DynamicCache(config=...)`: each
    layer's kind, sliding windows included) and filled with each layer's K and V through its own
    `update` (a sliding-window layer keeps what its window needs). Empty tensors: an empty cache."""
    cache = DynamicCache(config=model.model.config)
    if keys and keys[0].shape[2]:
        for layer, k, v in zip(cache.layers, keys, values):
            layer.update(k, v)
    return cache


__all__ = ["as_paged", "cached_tokens", "connector", "filled_cache", "gather", "load_cache", "slots"]
