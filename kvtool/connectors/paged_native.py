"""The native CPU paged gather/scatter (`kvtool._paged_native`, kernels/paged_copy_cpu.c).

It takes the torch reference's plan (`paged_torch._plan`: each tensor as `[num_rows, run]` rows
and the row indices the tokens touch), or where that goes element by element a row per (token,
head) with strided channels, and moves the rows on a few threads, the GIL released, instead of
one `index_copy_` per tensor. Same contract and bytes as the reference
(tests/test_connectors.py compares them on every layout). `paged_copy` picks it for CPU buffers;
when the extension was not built, or KVTOOL_PAGED_NATIVE=0, the torch reference runs.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Sequence

import torch

from ..checksum import PayloadCheck
from ..devices import host_threads
from .paged_layout import (LayerKV, PagedLayout, channel_stride, layer_tensors, paged_geometry, run_offset,
                           slot_to_block_offset)
from .paged_torch import _plan

_module: ModuleType | None = None
_loaded = False
MIN_BYTES_PER_THREAD = 1 << 20  # below this a thread costs more than it copies


def native_module() -> ModuleType | None:
    global _module, _loaded
    if os.environ.get("KVTOOL_PAGED_NATIVE", "1").strip() in ("0", "false", "no", "off"):
        return None
    if not _loaded:
        _loaded = True
        try:
            from .. import _paged_native as m  # type: ignore[attr-defined]

            _module = m
        except ImportError:  # not built (no compiler at install): the torch path runs
            _module = None
    return _module


def _threads(total_bytes: int) -> int:
    return max(1, min(host_threads(), 16, total_bytes // MIN_BYTES_PER_THREAD))


@dataclass(frozen=True)
class _NativePlan:
    """Where the blob's rows for one paged tensor go: row i starts at byte rows[i] * unit of the
    tensor and is `run` bytes, contiguous (stride 0) or elements `stride` bytes apart."""

    rows: torch.Tensor  # int64, contiguous
    unit: int
    run: int
    stride: int
    elem: int
    span: int  # bytes of the tensor reachable from its data pointer


def _native_plan(t: torch.Tensor, layout: PagedLayout, kv: int, block, offset, geo) -> _NativePlan:
    """The torch reference's rows where they are runs; a row per (token, head) with its channels
    at their stride where the reference goes element by element (vLLM's transposed CPU K pages,
    permuted buffers): one index per D channels instead of one per channel."""
    size, strides = t.element_size(), t.stride()
    span = (1 + sum((n - 1) * s for n, s in zip(t.shape, strides))) * size
    if not (layout is PagedLayout.VLLM_CPU and kv == 0):
        plan = _plan(t, layout, kv, block, offset, geo)
        if plan.run > 1:
            return _NativePlan(plan.rows.contiguous(), plan.run * size, plan.run * size, 0, size, span)
    heads = torch.arange(geo.num_kv_heads)
    starts = run_offset(layout, kv, block[:, None], offset[:, None], heads[None, :], strides, geo.head_dim)  # [T, H]
    step = channel_stride(layout, kv, strides, geo.block_size)
    run = geo.head_dim * size
    return _NativePlan(starts.reshape(-1).contiguous(), size, run, 0 if step == 1 else step * size, size, span)


def _segments(kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor, blob: torch.Tensor):
    """One segment (9 uint64: see kernels/paged_copy_cpu.c) per (layer, K/V) tensor, in blob order
    (K of every layer, then V), and the plans whose row lists they point into (keep them alive)."""
    geo = paged_geometry(kv_caches[0], layout)
    block, offset = slot_to_block_offset(slots.to(torch.int64), geo.block_size)
    blobs = [b.unbind(0) for b in blob.unbind(0)]  # blobs[kv][layer]: [T, H*D], contiguous
    tuple_layout = layout is PagedLayout.KV_TUPLE
    plans: dict[tuple, _NativePlan] = {}
    segments: list[list[int]] = [[], []]
    for li, layer in enumerate(kv_caches):
        ts = layer_tensors(layer, layout)
        for kv in (0, 1):
            t = ts[kv] if tuple_layout else ts[0]
            key = (t.stride(), 0 if tuple_layout else kv)
            plan = plans.get(key)
            if plan is None:
                plan = plans[key] = _native_plan(t, layout, kv, block, offset, geo)
            part = blobs[kv][li]
            nrows = plan.rows.numel()
            if part.numel() * part.element_size() != nrows * plan.run:
                raise ValueError("paged_native: the blob does not match the plan")  # a bug, not bad input
            segments[kv].extend((t.data_ptr(), plan.span, part.data_ptr(), nrows, plan.run, plan.rows.data_ptr(),
                                 plan.unit, plan.stride, plan.elem))
    flat = segments[0] + segments[1]
    return struct.pack(f"<{len(flat)}Q", *flat), list(plans.values())


def _copy(kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor, blob: torch.Tensor,
          scatter: bool) -> bool:
    module = native_module()
    if module is None or slots.numel() == 0:
        return False
    packed, keep = _segments(kv_caches, layout, slots, blob)
    module.copy_segments(packed, int(scatter), _threads(blob.numel() * blob.element_size()))
    del keep
    return True


def native_scatter_checked(blob: torch.Tensor, kv_caches: Sequence[LayerKV], layout: PagedLayout,
                           slots: torch.Tensor, check: PayloadCheck) -> bool:
    """`native_scatter` of a blob viewing unchecked stored bytes (`check.payload`), CRC-32C
    checked as it is copied (`scatter_checked`): one read of the bytes. Raises ChecksumMismatch
    after the copy when the payload does not match. False (nothing done) when not taken."""
    module = native_module()
    first = layer_tensors(kv_caches[0], layout)[0]
    if module is None or first.device.type != "cpu" or blob.device.type != "cpu" \
            or blob.dtype != first.dtype or not blob.is_contiguous() or slots.numel() == 0:
        return False
    packed, keep = _segments(kv_caches, layout, slots, blob)
    crc = module.scatter_checked(packed, check.payload, _threads(blob.numel() * blob.element_size()))
    del keep
    if crc != check.crc32c:
        raise check.mismatch()
    return True


def native_gather(kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor,
                  out_blob: torch.Tensor) -> bool:
    """`paged_torch.torch_gather` natively; False (nothing done) when this case is not taken."""
    first = layer_tensors(kv_caches[0], layout)[0]
    if first.device.type != "cpu" or out_blob.device.type != "cpu" or out_blob.dtype != first.dtype \
            or not out_blob.is_contiguous():
        return False
    return _copy(kv_caches, layout, slots, out_blob, scatter=False)


def native_scatter(blob: torch.Tensor, kv_caches: Sequence[LayerKV], layout: PagedLayout,
                   slots: torch.Tensor) -> bool:
    """`paged_torch.torch_scatter` natively; False (nothing done) when this case is not taken."""
    first = layer_tensors(kv_caches[0], layout)[0]
    if first.device.type != "cpu" or blob.device.type != "cpu":
        return False
    if blob.dtype != first.dtype:
        blob = blob.to(first.dtype)  # rounding as the reference does
    return _copy(kv_caches, layout, slots, blob.contiguous(), scatter=True)
