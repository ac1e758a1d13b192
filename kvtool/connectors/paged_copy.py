"""`gather_paged` / `scatter_paged`: the one place that chooses how KV moves
between paged engine buffers and KV_BLOB tensors.

Buffers on a CUDA device go through the fused kernel (`paged_cuda`, built on
first use) when it takes the case; host buffers through the native row copy
(`paged_native`, built at install); everything else, and a GPU whose kernel
cannot be built, runs the torch reference (`paged_torch`), which gives the same
bytes. A kernel that cannot be used is said once, as a notice.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..chunk_source import ChunkSource
from ..cuda_build import usable_or_notice
from ..errors import KvtoolError
from . import paged_native, paged_torch
from .paged_layout import LayerKV, PagedLayout, layer_tensors


def gather_paged(kv_caches: Sequence[LayerKV], layout: PagedLayout | str, slots: torch.Tensor,
                 out_blob: torch.Tensor, *, signature: tuple | None = None) -> None:
    """`out_blob[kv, l, t, :] = KV of layer l, K/V kv, slot slots[t]`.

    Contract (the caller, i.e. the connector, has checked it): `kv_caches` is a
    list over layers in `layout`, all layers of one shape, dtype and device;
    `slots` is a 1-D int64 tensor on that device, every value in
    ``[0, num_blocks*block_size)``; `out_blob` is a contiguous
    ``[2, L, len(slots), H*D]`` tensor on that device (or, for CUDA buffers,
    pinned host memory). Its dtype may differ from the buffers' dtype: values
    are converted as by `Tensor.copy_`. `signature`: the buffers' `buffers_signature`, when the
    caller has computed it (the native copy keys its address maps on it)."""
    layout = PagedLayout.parse(layout)
    kernel = _cuda_kernel(kv_caches, layout)
    if kernel is not None and kernel.gather(kv_caches, layout, slots, out_blob):
        return
    if kernel is None and paged_native.native_gather(kv_caches, layout, slots, out_blob, signature):
        return
    paged_torch.torch_gather(kv_caches, layout, slots, out_blob)


def scatter_paged(blob: torch.Tensor, kv_caches: Sequence[LayerKV], layout: PagedLayout | str,
                  slots: torch.Tensor, *, signature: tuple | None = None) -> None:
    """The inverse of `gather_paged`: write `blob[kv, l, t]` into slot `slots[t]`
    of layer l. Same contract; additionally the slots are distinct. Slots not
    in `slots` are left untouched. A dtype difference is converted (rounding
    to nearest as `Tensor.to` does)."""
    layout = PagedLayout.parse(layout)
    kernel = _cuda_kernel(kv_caches, layout)
    if kernel is not None and kernel.scatter(blob, kv_caches, layout, slots):
        return
    if kernel is None and paged_native.native_scatter(blob, kv_caches, layout, slots, signature):
        return
    paged_torch.torch_scatter(blob, kv_caches, layout, slots)


def scatter_paged_source(source: ChunkSource, kv_caches: Sequence[LayerKV], layout: PagedLayout | str,
                         slots: torch.Tensor, *, signature: tuple | None = None) -> None:
    """`scatter_paged` of a stored chunk: a raw chunk into host buffers goes through the native
    checked scatter, straight from its stored bytes (memory, a mapping behind the fault guard, or
    its file a window at a time), CRC-32C checked as it is copied: one pass over the bytes. Any
    other chunk or path is decoded from checked bytes first. A mismatch raises ChecksumMismatch
    after the copy; the slots written then hold no loaded tokens (the load ends there)."""
    layout = PagedLayout.parse(layout)
    if source.raw and _cuda_kernel(kv_caches, layout) is None \
            and paged_native.native_scatter_source(source, kv_caches, layout, slots, signature):
        return
    scatter_paged(source.decode(), kv_caches, layout, slots, signature=signature)


def scatter_paged_sources(sources: list[ChunkSource], kv_caches: Sequence[LayerKV], layout: PagedLayout | str,
                          slots: torch.Tensor, *, signature: tuple | None = None) -> "list[KvtoolError | None] | None":
    """`scatter_paged_source` of whole raw chunks in memory or a mapping, one after the other
    (`slots`: all of theirs, in order), in one native call: per chunk None or why it is refused
    (checked as copied, all of them copied). None when not taken (buffers on a GPU, no native
    module, another dtype): nothing written."""
    layout = PagedLayout.parse(layout)
    if _cuda_kernel(kv_caches, layout) is not None:
        return None
    return paged_native.native_scatter_sources(sources, kv_caches, layout, slots, signature)


def _cuda_kernel(kv_caches: Sequence[LayerKV], layout: PagedLayout):
    """The fused kernel's module for CUDA buffers, loaded (built on first use); None for other
    devices, or after a notice when the kernel cannot be used here."""
    if layer_tensors(kv_caches[0], layout)[0].device.type != "cuda":
        return None
    return load_cuda_kernel()


def load_cuda_kernel():
    """`paged_cuda` with its library loaded, or None after a one-line notice (also a warm-up)."""
    from . import paged_cuda

    return usable_or_notice(paged_cuda, "paged copy kernel", "the torch path")
