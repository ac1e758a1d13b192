"""vLLM's KV lookup/store buffer API (seed 003), over the chunk store.

The three abstract classes restate the seed's contract in kvtool's words: same methods, same
arguments, same meaning. `StoreLookupBuffer` and `StoreKeyValueBuffer` implement them over a
`ChunkStore`, so what one process inserts another (on another host, with Redis) can select,
and every object read back passes the store's checks first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import dtype_name
from ..errors import ObjectRefused, UsageError
from ..identity import ModelIdentity
from ..notices import notice
from . import objects
from .loading import DAMAGE
from .chunk_store import ChunkStore, _as_token_array

if TYPE_CHECKING:
    import torch


class KVCacheBufferBase(ABC):
    """A KV cache buffer; `close` releases what it holds."""

    @abstractmethod
    def close(self) -> None:
        raise NotImplementedError


class KVLookupBufferBase(KVCacheBufferBase):
    """Entries keyed by a request's token ids and a mask of the tokens the KV is for (`roi`);
    each holds the KV's keys and values and the final hidden states."""

    @abstractmethod
    def insert(self, input_tokens: "torch.Tensor", roi: "torch.Tensor", key: "torch.Tensor",
               value: "torch.Tensor", hidden: "torch.Tensor") -> None:
        """`buffer[input_tokens, roi] = [key, value, hidden]`."""
        raise NotImplementedError

    @abstractmethod
    def drop_select(self, input_tokens: "torch.Tensor | None",
                    roi: "torch.Tensor | None") -> list["torch.Tensor | None"]:
        """Select an entry and remove it from the buffer. `None, None` selects any entry (the
        offload path). Returns `[input_tokens, roi, key, value, hidden]`, each None on a miss."""
        raise NotImplementedError


class KVStoreBufferBase(KVCacheBufferBase):
    """A key/value buffer of tensors: `put(key, tensor)`, `get(key)`; a None value deletes."""

    @abstractmethod
    def put(self, key: str, value: "torch.Tensor | None") -> None:
        raise NotImplementedError

    @abstractmethod
    def get(self, key: str) -> "torch.Tensor | None":
        raise NotImplementedError


class StoreLookupBuffer(KVLookupBufferBase):
    """The lookup buffer over a store, for one model.

    `key` and `value` hold every input token's KV: `[num_layers, num_tokens, num_kv_heads,
    head_dim]` (vLLM's per-request stack) or `[num_layers, num_tokens, num_kv_heads * head_dim]`;
    `hidden` is `[num_tokens, hidden_size]` or None. An entry is one object (format-spec/store.md
    §4.2); the whole chunks of its leading run of roi tokens also go into the prefix store, so
    other requests sharing the prefix reuse them. Two consumers selecting one entry: one gets
    it, the other a miss (the removal decides)."""

    def __init__(self, store: ChunkStore, model: ModelIdentity | dict[str, Any], chunk_size: int = 256,
                 *, owns_store: bool = False):
        self.cache = store.for_model(model, chunk_size)
        self.store = store
        self.owns_store = owns_store

    def insert(self, input_tokens, roi, key, value, hidden) -> None:
        import torch

        tokens = _as_token_array(input_tokens)
        n = len(tokens)
        mask = _as_mask(roi, n)
        model = self.cache.model
        layers, channels = model["num_layers"], model["num_kv_heads"] * model["head_dim"]
        if n == 0:
            raise UsageError("insert needs at least one token")
        kv = []
        for what, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4) or t.shape[0] != layers \
                    or t.shape[1] != n or t[0, 0].numel() != channels:
                raise UsageError(f"{what} must be [{layers}, {n}, {model['num_kv_heads']}, {model['head_dim']}] "
                                 f"or [{layers}, {n}, {channels}], got {list(getattr(t, 'shape', []))}")
            kv.append(t.detach().reshape(layers, n, channels))
        blob = torch.stack(kv)  # [2, L, N, C]
        if blob.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            blob = blob.float()
        data = objects.encode_entry(model, dtype_name(blob.dtype), tokens, mask, blob,
                                    None if hidden is None else hidden.detach(),
                                    self.cache.chunk_size, key_shape=list(key.shape))
        self.store.backend.put(self._name(tokens, mask), data, replace=True)
        leading = int(np.argmin(mask)) if not mask.all() else n
        whole = leading // self.cache.chunk_size * self.cache.chunk_size
        if whole:
            self.cache.put_sequence(tokens[:whole], blob[:, :, :whole])

    def drop_select(self, input_tokens, roi) -> list["torch.Tensor | None"]:
        if input_tokens is None and roi is None:
            names = [o.name for o in self.store.backend.scan(f"entries/{self.cache.key}/")]
        elif input_tokens is None or roi is None:
            raise UsageError("drop_select takes both input_tokens and roi, or neither")
        else:
            tokens = _as_token_array(input_tokens)
            names = [self._name(tokens, _as_mask(roi, len(tokens)))]
        for name in names:
            data = self.store.backend.get(name)
            if data is None:
                continue
            try:
                reader = objects.check_entry(data, name, self.cache.key)
            except ObjectRefused as err:
                self.store.refuse(name, err)
                continue
            if not self.store.backend.delete(name):
                continue  # another consumer selected it first
            with reader:
                try:
                    return _entry_tensors(reader)
                except DAMAGE as err:  # refused as a load refuses it (removed already: selected)
                    self.store.count_refusal(err)
                    notice(f"store: refused a damaged entry {name} ({err}); removed")
        return [None, None, None, None, None]

    def _name(self, tokens: np.ndarray, mask: np.ndarray) -> str:
        return objects.entry_name(self.cache.key, objects.entry_key(self.cache.key, tokens, mask))

    def close(self) -> None:
        if self.owns_store:
            self.store.close()


class StoreKeyValueBuffer(KVStoreBufferBase):
    """The key/value buffer over a store: any tensor under a string key; put replaces."""

    def __init__(self, store: ChunkStore, *, owns_store: bool = False):
        self.store = store
        self.owns_store = owns_store

    def put(self, key: str, value) -> None:
        import torch

        if not isinstance(key, str):
            raise UsageError(f"a key is a string, got {type(key).__name__}")
        name = objects.tensor_name(key)
        if value is None:
            self.store.backend.delete(name)
            return
        if not isinstance(value, torch.Tensor):
            raise UsageError(f"a value is a tensor or None, got {type(value).__name__}")
        self.store.backend.put(name, objects.encode_tensor(key, value), replace=True)

    def get(self, key: str):
        if not isinstance(key, str):
            raise UsageError(f"a key is a string, got {type(key).__name__}")
        name = objects.tensor_name(key)
        data = self.store.backend.get(name)
        if data is None:
            return None
        try:
            return objects.check_tensor(data, name, key)
        except ObjectRefused as err:
            self.store.refuse(name, err)
            return None

    def close(self) -> None:
        if self.owns_store:
            self.store.close()


def _checked_chunk(reader, index: int) -> "torch.Tensor":
    """Chunk `index` of an entry, checked as the load path checks what it hands to an engine: its
    CRC-32C, its decoding, every value finite (store.md §5, check 13)."""
    with reader.source(index, pread=True) as source:
        source.scan_values = True
        return source.decode()


def _entry_tensors(reader) -> list:
    import torch

    m = reader.manifest
    kv = torch.cat([_checked_chunk(reader, c.index) for c in m.chunks], dim=2)  # [2, L, N, C]
    shape = m.extensions["store"].get("key_shape")
    tokens = torch.from_numpy(reader.token_ids())
    roi = torch.from_numpy(reader.read_extra_array("roi_mask").astype(bool))
    key, value = kv[0], kv[1]
    if isinstance(shape, list) and len(shape) in (3, 4) and all(isinstance(d, int) for d in shape) \
            and int(np.prod(shape)) == key.numel():
        key, value = key.reshape(shape), value.reshape(shape)
    hidden = reader.read_extra("hidden_states") if "hidden_states" in m.extras else None
    return [tokens, roi, key, value, hidden]


def _as_mask(roi, n: int) -> np.ndarray:
    if hasattr(roi, "detach"):
        roi = roi.detach().cpu().numpy()
    mask = np.asarray(roi)
    if mask.shape != (n,):
        raise UsageError(f"roi must be a mask of the {n} input tokens, got shape {list(mask.shape)}")
    return mask.astype(bool)

