"""An engine's per-layer paged KV buffers, addressed by block ids: what the vLLM connector's worker
side reads and writes. Kept free of vLLM imports so that it is tested everywhere, on the CPU and,
where one is present, on a GPU (tests/test_engine_blocks.py).

The caller says which kvtool layout (`PagedLayout`) the tensors are in: the vLLM connector maps
what vLLM's attention backend declares to one (`kvtool.integrations.vllm.layout`); the tensors'
shapes are only checked against it, never used to guess it:

    "vllm_cpu"    [NB, H, BS, 2*D]  each (block, head) page K^T [D, BS] then V [BS, D]  (native copy)
    "vllm_cpu_amx" [NB, H, BS, 2*D] each page K then V in vLLM's AMX tiles (paged_layout.amx_page_offset;
                                    bfloat16 on AMX CPUs)                               (torch path)
    "vllm"        [NB, H, BS, 2*D]  each token's K then V (strides may be permuted)     (fused CUDA kernel)
    "flash_attn"  [2, NB, BS, H, D]                                                    (fused CUDA kernel)
    "flashinfer"  [NB, 2, BS, H, D]                                                    (fused CUDA kernel)

Token t of a request whose blocks are `block_ids` lives in slot
`block_ids[t // BS] * BS + t % BS`.

Multi-head latent attention keeps one latent per token and layer instead (`LatentBlocks`; vLLM's
CPU_MLA backend: `[NB, BS, kv_lora_rank + rope_dim]` a layer, token t's latent the row of its
slot), which kvtool stores as an mla_latent chunk `[1, L, T, kv_lora_rank + rope_dim]`.
"""

from __future__ import annotations

import threading
import warnings
from typing import Sequence

import torch

from ..connectors import ConnectorTarget, PagedLayout, PagedMemConnectorV2, paged_geometry
from ..connectors.paged_layout import HOST_PAGE_LAYOUTS
from ..destination import Destination
from ..errors import ConnectorError


class UnsupportedKVLayout(ValueError):
    """The engine's KV tensors are in a layout kvtool does not know, or not in the one declared."""


def checked_layout(tensor: torch.Tensor, layout: PagedLayout | str) -> tuple[PagedLayout, int, int]:
    """(layout, heads, head dim) of one of the engine's per-layer tensors, which must fit `layout`."""
    name = getattr(layout, "value", layout)
    try:
        layout = PagedLayout.parse(layout)
        geometry = paged_geometry(tensor, layout)
    except ConnectorError as err:
        raise UnsupportedKVLayout(f"the engine's KV tensors do not fit kvtool layout {name!r}: {err}") from None
    if layout in HOST_PAGE_LAYOUTS and tensor.device.type != "cpu":
        raise UnsupportedKVLayout(f"kvtool layout {layout.value!r} is host memory; the tensors are on {tensor.device}")
    return layout, geometry.num_kv_heads, geometry.head_dim


class EngineBlocks:
    """The engine's KV buffers (one tensor per layer, in model order, in `layout`) as
    block-addressed storage."""

    def __init__(self, layers: Sequence[torch.Tensor], block_size: int, layout: PagedLayout | str):
        self.layers = list(layers)
        self.block_size = block_size
        self.layout, heads, head_dim = checked_layout(self.layers[0], layout)
        self.dtype = self.layers[0].dtype
        self.device = self.layers[0].device
        on_gpu = self.device.type == "cuda"  # the fused kernels do the copies
        self.paged = PagedMemConnectorV2(heads * head_dim, len(self.layers), layout=self.layout, use_gpu=on_gpu,
                                         num_kv_heads=heads, head_dim=head_dim)

    def slots(self, block_ids: Sequence[int], end: int) -> torch.Tensor:
        """Slot of each token in [0, end) of a request holding `block_ids`."""
        t = torch.arange(end)
        return torch.as_tensor(list(block_ids), dtype=torch.int64)[t // self.block_size] * self.block_size \
            + t % self.block_size

    def write(self, kv: torch.Tensor, block_ids: Sequence[int], start: int) -> None:
        """Deprecated: `target(block_ids, start + T).scatter(kv, start, start + T)`."""
        warnings.warn("EngineBlocks.write is deprecated: use EngineBlocks.target(block_ids, end).scatter(kv, start, end)",
                      DeprecationWarning, stacklevel=2)
        end = start + kv.shape[2]
        self.target(block_ids, end).scatter(kv.contiguous(), start, end)

    def target(self, block_ids: Sequence[int], end: int) -> ConnectorTarget:
        """The blocks of a request holding `block_ids`, tokens [0, end), as the destination of a
        load (`kvtool.load`): tokens [start, stop) go to their slots; safe from several threads.
        Its `scatter(kv, start, stop)` puts a KV_BLOB `[2, L, stop - start, H*D]` there itself."""
        return self.paged.target(kvcaches=self.layers, slot_mapping=self.slots(block_ids, end))

    def scatter_into(self, block_ids: Sequence[int], end: int) -> ConnectorTarget:
        """Deprecated: `target`."""
        warnings.warn("EngineBlocks.scatter_into is deprecated: use EngineBlocks.target", DeprecationWarning,
                      stacklevel=2)
        return self.target(block_ids, end)

    def read(self, block_ids: Sequence[int], start: int, end: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [start, end) of a request from its blocks, as a host [2, L, end - start, H*D] tensor:
        a new one, or a view of `into` (a contiguous host buffer of this dtype, large enough: a
        recycled `SaveBuffers` buffer) when it fits."""
        shape = self.paged.get_shape(end - start)
        if into is not None and into.dtype == self.dtype and into.device.type == "cpu" and into.is_contiguous() \
                and into.numel() >= shape.numel():
            blob = into.view(-1)[:shape.numel()].view(shape)
        else:
            blob = torch.empty(shape, dtype=self.dtype)
        self.paged.gather(blob, start, end, kvcaches=self.layers, slot_mapping=self.slots(block_ids, end))
        return blob


class LatentBlocks:
    """An MLA engine's latent pages (one `[NB, BS, W]` or `[NB, 1, BS, W]` tensor per layer, in model order; W =
    kv_lora_rank + rope_dim) as block-addressed storage of mla_latent chunks `[1, L, T, W]`: a
    token's latent is the row of its slot. The same calls as `EngineBlocks` (`read`, `target`,
    `paged.get_shape`), by torch indexing: a latent row is one copy, nothing to transpose."""

    def __init__(self, layers: Sequence[torch.Tensor], block_size: int):
        # vLLM's CPU worker hands each layer as [NB, 1, BS, W] (its pages' one "head"): the same rows
        self.layers = [t[:, 0] if t.dim() == 4 and t.shape[1] == 1 else t for t in layers]
        first = self.layers[0]
        if first.dim() != 3 or first.shape[1] != block_size or any(t.shape != first.shape or t.dtype != first.dtype
                                                                   for t in self.layers):
            raise UnsupportedKVLayout(f"latent pages must be [blocks, {block_size}, width] alike in every layer; "
                                      f"the engine's first is {list(first.shape)}")
        self.block_size, self.width = block_size, first.shape[2]
        self.dtype, self.device = first.dtype, first.device
        self._rows = [t.view(-1, self.width) for t in self.layers]  # [NB * BS, W]: a slot's row (views, no copy)
        self.paged = self  # (the worker asks `blocks.paged.get_shape`, as of EngineBlocks)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size((1, len(self.layers), num_tokens, self.width))

    def slots(self, block_ids: Sequence[int], end: int) -> torch.Tensor:
        t = torch.arange(end)
        return torch.as_tensor(list(block_ids), dtype=torch.int64)[t // self.block_size] * self.block_size \
            + t % self.block_size

    def read(self, block_ids: Sequence[int], start: int, end: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [start, end) as a host `[1, L, end - start, W]` tensor (a view of `into` when it fits)."""
        shape = self.get_shape(end - start)
        if into is not None and into.dtype == self.dtype and into.is_contiguous() and into.numel() >= shape.numel():
            out = into.view(-1)[:shape.numel()].view(shape)
        else:
            out = torch.empty(shape, dtype=self.dtype)
        slots = self.slots(block_ids, end)[start:].to(self.device)
        for layer, rows in enumerate(self._rows):
            out[0, layer].copy_(rows.index_select(0, slots))
        return out

    def target(self, block_ids: Sequence[int], end: int) -> "LatentTarget":
        """The blocks of tokens [0, end) as a load's destination."""
        return LatentTarget(self, self.slots(block_ids, end).to(self.device))


class LatentTarget(Destination):
    """Latent pages as a load's destination: decoded `[1, L, stop - start, W]` chunks go to their
    tokens' rows (each chunk's rows are its own: several loading threads never write one row)."""

    def __init__(self, blocks: LatentBlocks, slots: torch.Tensor):
        self.blocks, self.slots, self.device = blocks, slots, blocks.device

    def scatter(self, kv: torch.Tensor, start: int, end: int) -> None:
        if tuple(kv.shape) != tuple(self.blocks.get_shape(end - start)):
            raise ConnectorError(f"a latent chunk of shape {list(kv.shape)} does not fit "
                                 f"{list(self.blocks.get_shape(end - start))}")
        slots = self.slots[start:end]
        for layer, rows in enumerate(self.blocks._rows):
            rows.index_copy_(0, slots, kv[0, layer].to(device=rows.device, dtype=rows.dtype))


class SaveBuffers:
    """Host buffers for saves, given back once their chunks are stored. A save gathers vLLM's
    blocks into host memory in vLLM's step; into a fresh tensor of a chunk's size (10-30 MB) the
    page faults of first touch cost as much as the gather itself. At most `keep` are kept."""

    def __init__(self, keep: int = 6):
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A free buffer of `dtype` holding at least `numel` elements, or None (read allocates)."""
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.dtype == dtype and buffer.numel() >= numel:
                    return self._free.pop(i)
        return None

    def give(self, buffer: torch.Tensor) -> None:
        """`buffer` (from `take`, or the tensor `read` returned) is no longer used by anyone."""
        storage = buffer.untyped_storage()  # the whole buffer, not the view a smaller save used
        whole = torch.empty(0, dtype=buffer.dtype).set_(storage, 0, (storage.nbytes() // buffer.element_size(),))
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(whole)
