"""`NestedTupleConnector`: whole-sequence KV held as a tuple over layers of (K, V)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..chunk_source import ChunkSource
from . import paged_native
from .base import ConnectorError, GPUConnectorInterface
from .memory import MemoryFormat, MemoryObj


class NestedTupleConnector(GPUConnectorInterface):
    """Engine KV = tuple over layers of `(K, V)`, covering the WHOLE token sequence: LMCache's
    `VLLMNestedTupleGPUConnector` (public: a caller that holds such tuples, a Hugging Face
    cache's layers among them, moves their KV to and from KV_BLOBs with it).

    Each of K and V is one of (T = number of tokens in the sequence):

    * ``[T, num_kv_heads, head_dim]``
    * ``[T, num_kv_heads * head_dim]``
    * ``[1, num_kv_heads, T, head_dim]`` (a Hugging Face cache layer, batch 1)

    kwargs of `from_gpu` / `to_gpu`: ``kvcaches`` (required). Tokens
    `start..end` map to positions `start..end` of the tensors. Dtypes are
    converted when the memory object's differs from the buffers'.

    Raises ConnectorError (a ValueError) when `kvcaches` is missing or
    malformed, the memory object is not KV_BLOB / has no tensor / has the
    wrong shape, dtype or device, or `start..end` is invalid.
    """

    def __init__(self, hidden_dim_size: int, num_layers: int, **kwargs: Any):
        super().__init__(hidden_dim_size, num_layers)
        if kwargs:
            raise TypeError(f"unexpected constructor argument(s): {', '.join(sorted(kwargs))}")

    def _token_views(self, kwargs: dict[str, Any]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """Views `[T, hidden]`-compatible (token dim first) of every K and V, and T."""
        kvcaches = self._require_kwarg(kwargs, "kvcaches")
        if isinstance(kvcaches, torch.Tensor) or not isinstance(kvcaches, Sequence):
            raise ConnectorError("'kvcaches' must be a tuple over layers of (K, V) tensors")
        if len(kvcaches) != self.num_layers:
            raise ConnectorError(f"'kvcaches' has {len(kvcaches)} layers, expected {self.num_layers}")
        views: list[tuple[torch.Tensor, torch.Tensor]] = []
        ref = None
        for li, layer in enumerate(kvcaches):
            if isinstance(layer, torch.Tensor) or not isinstance(layer, Sequence) or len(layer) != 2:
                raise ConnectorError(f"layer {li} of 'kvcaches' is not a (K, V) pair")
            pair = []
            for t in layer:
                if not isinstance(t, torch.Tensor):
                    raise ConnectorError(f"layer {li} of 'kvcaches' holds a {type(t).__name__}, not a tensor")
                sig = (tuple(t.shape), t.dtype, t.device)
                if ref is None:
                    ref = sig
                elif sig != ref:
                    raise ConnectorError(
                        f"layer {li}: K/V {sig[0]}/{sig[1]}/{sig[2]} differs from layer 0's {ref[0]}/{ref[1]}/{ref[2]}"
                    )
                pair.append(self._tokens_first(t))
            views.append((pair[0], pair[1]))
        return views, views[0][0].shape[0]

    def _tokens_first(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4 and t.shape[0] == 1:  # HF: [1, H, T, D]
            t = t[0].transpose(0, 1)
        elif t.dim() not in (2, 3):
            raise ConnectorError(
                f"K/V of shape {tuple(t.shape)}: expected [T, H, D], [T, H*D] or [1, H, T, D]"
            )
        hidden = 1
        for n in t.shape[1:]:
            hidden *= n
        if hidden != self.hidden_dim_size:
            raise ConnectorError(
                f"K/V of shape {tuple(t.shape)} has {hidden} channels per token, expected {self.hidden_dim_size}"
            )
        return t

    @staticmethod
    def _blob_order(views: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        return [pair[0] for pair in views] + [pair[1] for pair in views]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.gather(self._tensor_of(memory_obj, reading=False), start, end, **kwargs)
        memory_obj.metadata.fmt = MemoryFormat.KV_BLOB

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.scatter(self._tensor_of(memory_obj, reading=True), start, end, **kwargs)

    def gather(self, blob: torch.Tensor, start: int, end: int, **kwargs: Any) -> None:
        views, total = self._token_views(kwargs)
        start, end = self._check_range(start, end, total)
        blob = self._check_blob(blob, end - start, views[0][0].device)
        if paged_native.native_token_copy(self._blob_order(views), start, end, blob, scatter=False):
            return
        n = end - start
        for li, pair in enumerate(views):
            for kv in (0, 1):
                src = pair[kv][start:end]
                blob[kv, li].view(n, *src.shape[1:]).copy_(src)

    def scatter(self, blob: torch.Tensor, start: int, end: int, **kwargs: Any) -> None:
        views, total = self._token_views(kwargs)
        start, end = self._check_range(start, end, total)
        blob = self._check_blob(blob, end - start, views[0][0].device)
        if paged_native.native_token_copy(self._blob_order(views), start, end, blob, scatter=True):
            return
        self._copy_in(views, start, end, blob)

    def to_gpu_source(self, source: ChunkSource, start: int, end: int, **kwargs: Any) -> None:
        """A stored chunk into the tensors: a raw one in memory straight from its stored bytes,
        checked as copied (one pass); otherwise decoded from checked bytes first."""
        views, total = self._token_views(kwargs)
        start, end = self._check_range(start, end, total)
        if source.raw and not source.in_file and source.shape == tuple(self.get_shape(end - start)):
            blob = source.tensor(source.data)
            if blob.dtype == views[0][0].dtype and paged_native.native_token_copy(
                    self._blob_order(views), start, end, blob, scatter=True, source=source):
                return
        blob = self._check_blob(source.decode(), end - start, views[0][0].device)
        self._copy_in(views, start, end, blob)

    def _copy_in(self, views, start: int, end: int, blob: torch.Tensor) -> None:
        n = end - start
        for li, pair in enumerate(views):
            for kv in (0, 1):
                dst = pair[kv][start:end]
                dst.copy_(blob[kv, li].view(n, *dst.shape[1:]))
