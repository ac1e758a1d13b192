"""The native CPU paged gather/scatter (`kvtool._paged_native`, kernels/paged_copy_cpu.c).

It takes the torch reference's plan (`paged_torch._plans_for`: each tensor as `[num_rows, run]`
rows and the row indices the tokens touch) and moves the rows with memcpy on a few threads, the
GIL released, instead of one `index_copy_` per tensor. Same contract and bytes as the reference
(tests/test_connectors.py compares them on every layout). `paged_copy` picks it for CPU buffers;
when the extension was not built, or KVTOOL_PAGED_NATIVE=0, the torch reference runs.
"""

from __future__ import annotations

import os
import struct
from types import ModuleType
from typing import Sequence

import torch

from ..checksum import PayloadCheck
from ..devices import host_threads
from .paged_layout import LayerKV, PagedLayout, layer_tensors
from .paged_torch import _plans_for

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


def _copy(kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor, blob: torch.Tensor,
          scatter: bool) -> bool:
    module = native_module()
    if module is None or slots.numel() == 0:
        return False
    blobs = [b.unbind(0) for b in blob.unbind(0)]  # blobs[kv][layer]: [T, H*D], contiguous
    itemsize = blob.element_size()
    groups: dict[int, tuple[object, list[int]]] = {}  # plan -> (plan, flattened quadruples)
    for li, entry in enumerate(_plans_for(kv_caches, layout, slots)):
        for kv, (rows, plan) in enumerate(entry):
            part = blobs[kv][li]
            if scatter and plan.run == 1:  # element by element (vLLM's CPU K pages): index_copy_ is
                rows.index_copy_(0, plan.rows, part.reshape(-1, 1))  # faster here (bench_load.py)
                continue
            quad = [rows.data_ptr(), plan.num_rows, part.data_ptr(), part.numel() // plan.run]
            groups.setdefault(id(plan), (plan, []))[1].extend(quad)
    for plan, quads in groups.values():
        run_bytes = plan.run * itemsize
        pairs = struct.pack(f"<{len(quads)}Q", *quads)
        index = plan.rows.contiguous()
        total = (len(quads) // 4) * index.numel() * run_bytes
        module.copy_rows(pairs, memoryview(index.numpy()).cast("B"), run_bytes, int(scatter), _threads(total))
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
    blobs = [b.unbind(0) for b in blob.unbind(0)]  # blobs[kv][layer]: [T, H*D], contiguous
    itemsize = blob.element_size()
    segments, keep = [], []  # keep: the row-index tensors the kernel reads through raw pointers
    for li, entry in enumerate(_plans_for(kv_caches, layout, slots)):
        for kv, (rows, plan) in enumerate(entry):
            part = blobs[kv][li]
            index = plan.rows if plan.rows.is_contiguous() else plan.rows.contiguous()
            keep.append(index)
            segments.append((part.data_ptr(), rows.data_ptr(), plan.num_rows, part.numel() // plan.run,
                             plan.run * itemsize, index.data_ptr()))
    segments.sort()  # payload order: K of every layer, then V
    quads = [v for blob_ptr, paged, paged_rows, nrows, run, rows in segments
             for v in (paged, paged_rows, blob_ptr, nrows, run, rows)]
    crc = module.scatter_checked(struct.pack(f"<{len(quads)}Q", *quads), check.payload,
                                 _threads(blob.numel() * itemsize))
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
