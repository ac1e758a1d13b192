"""Connectors: move KV between an inference engine's buffers and KV_BLOB memory objects.

Our own implementation of LMCache's GPU connector contract:

* `MemoryObj` (`.tensor`, `.metadata.fmt`), `MemoryObjMetadata`, `MemoryFormat`
  (`UNDEFINED`, `KV_BLOB`, `BINARY`). KV_BLOB is
  ``[2, num_layers, num_tokens, num_kv_heads * head_dim]``, K then V: the
  canonical chunk layout of kvtool's file format.
* `GPUConnectorInterface`: ``from_gpu(memory_obj, start, end, **kwargs)``
  (engine -> memory object), ``to_gpu(memory_obj, start, end, **kwargs)``
  (memory object -> engine), ``get_shape(num_tokens)``, plus
  ``allocate(num_tokens, dtype, device, pin_memory=)``; and kvtool's own
  ``gather(blob, start, end, **kwargs)`` / ``scatter(blob, start, end, **kwargs)``,
  the same transfers with the KV_BLOB tensor itself (what kvtool uses inside:
  a `MemoryObj` is made only where LMCache's contract is the surface).
* `NestedTupleConnector(hidden_dim_size, num_layers)`: LMCache's
  `VLLMNestedTupleGPUConnector`: whole-sequence tuple over layers of (K, V),
  each ``[T, H, D]``, ``[T, H*D]`` or HF's ``[1, H, T, D]``; kwarg ``kvcaches``.
* `PagedMemConnector(hidden_dim_size, num_layers, num_kv_heads=None, head_dim=None)`:
  LMCache's `VLLMPagedMemGPUConnector`: per layer (K, V) each
  ``[num_blocks, block_size, H, D]``; kwargs ``kvcaches``, ``slot_mapping``.
* `PagedMemConnectorV2(hidden_dim_size, num_layers, use_gpu=False,
  layout="kv_tuple", num_kv_heads=None, head_dim=None, chunk_size=None)`:
  LMCache's `VLLMPagedMemGPUConnectorV2` (kvtool's own engine, capture and replay use it):
  full per-token slot mapping with -1 for prefix-cached tokens, layouts
  `PagedLayout` = "flash_attn" | "flashinfer" | "vllm" | "kv_tuple".
* `to_gpu_source(source, start, end, **kwargs)`: a stored chunk (`kvtool.chunk_source`) into
  the engine's buffers, a raw one copied straight from its stored bytes and checked as copied;
  `ConnectorTarget(connector, **kwargs)` makes the buffers a destination of `kvtool.load.load`.
* `ConnectorError`: every documented failure; a `ValueError` and a
  `kvtool.errors.KvtoolError`.
* `gather_paged` / `scatter_paged` (in `paged_copy`): the one place that picks
  the fused CUDA kernel (`paged_cuda`) or the torch reference (`paged_torch`)
  by the buffers' device; `slot_to_block_offset` and `run_offset`
  (`paged_layout`) are the index arithmetic the C header mirrors.
"""

from .base import BLOB_DTYPES, ConnectorError, GPUConnectorInterface
from .memory import MemoryFormat, MemoryObj, MemoryObjMetadata
from .nested import NestedTupleConnector
from .paged import PagedMemConnector, PagedMemConnectorV2
from .paged_copy import gather_paged, scatter_paged
from .paged_layout import PagedGeometry, PagedLayout, paged_geometry, run_offset, slot_to_block_offset
from .base import ConnectorTarget

__all__ = [
    "BLOB_DTYPES",
    "ConnectorError",
    "ConnectorTarget",
    "GPUConnectorInterface",
    "MemoryFormat",
    "MemoryObj",
    "MemoryObjMetadata",
    "NestedTupleConnector",
    "PagedGeometry",
    "PagedLayout",
    "PagedMemConnector",
    "PagedMemConnectorV2",
    "gather_paged",
    "paged_geometry",
    "run_offset",
    "scatter_paged",
    "slot_to_block_offset",
]
