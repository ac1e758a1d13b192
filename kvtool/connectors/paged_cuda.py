"""The fused paged gather/scatter kernel for CUDA buffers (kernels/paged_copy.cu).

`gather` / `scatter` have the contract of `paged_copy.gather_paged` /
`scatter_paged` (which call them for CUDA buffers), plus: the blob may also be
a *pinned* host tensor, which the kernel reads or writes in place over the bus
(zero-copy; synchronise the stream before reading it on the host).

They return False for the cases the kernel does not take (layers with
different strides, K and V with different strides, a dtype conversion outside
bf16/fp16/fp32) with the blob on the device: `paged_copy` then runs the torch
reference, which gives the same bytes.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from .. import cuda_build
from ..errors import ConnectorError
from .paged_layout import LayerKV, PagedLayout, layer_tensors, paged_geometry

LAYOUT_CODES = {
    PagedLayout.FLASH_ATTN: 0,
    PagedLayout.FLASHINFER: 1,
    PagedLayout.VLLM: 2,
    PagedLayout.KV_TUPLE: 3,
}
_CONVERTIBLE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
GATHER, SCATTER = 0, 1

_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The loaded paged_copy library (built on first use); CudaUnavailable if impossible."""
    global _lib
    if _lib is None:
        lib = cuda_build.load("paged_copy").lib
        i64, u64, vp, i32 = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
        lib.kvt_paged_copy.restype = i32
        lib.kvt_paged_copy.argtypes = [i32, i32, ctypes.POINTER(i64), i64, i64, i64, i64, i64, vp, u64, vp, i64,
                                       vp, i32, i32, i32, vp]
        lib.kvt_paged_last_error.restype = ctypes.c_char_p
        lib.kvt_paged_last_error.argtypes = []
        lib.kvt_paged_last_vec_bytes.restype = i32
        lib.kvt_paged_last_vec_bytes.argtypes = []
        _lib = lib
    return _lib


def _dtype_code(dt: torch.dtype, other: torch.dtype) -> int | None:
    if dt == other:
        es = torch.empty((), dtype=dt).element_size()
        if dt in _CONVERTIBLE:
            return _CONVERTIBLE[dt]
        return 16 + es if es in (1, 2, 4, 8) else None
    return _CONVERTIBLE.get(dt) if other in _CONVERTIBLE else None


_ptr_tables: dict[tuple, torch.Tensor] = {}


def _ptr_table(ptrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Device int64 array of the layer base addresses (cached per address set)."""
    key = (device.index, ptrs)
    t = _ptr_tables.get(key)
    if t is None:
        if len(_ptr_tables) >= 64:
            _ptr_tables.clear()
        t = _ptr_tables[key] = torch.tensor(ptrs, dtype=torch.int64).to(device)
    return t


def _prepare(kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor, blob: torch.Tensor):
    """Everything the kernel call needs, or None when the kernel does not take
    this case (the torch reference does)."""
    geo = paged_geometry(kv_caches[0], layout)
    first = layer_tensors(kv_caches[0], layout)[0]
    dev = first.device
    if dev.type != "cuda":
        raise ConnectorError(f"the CUDA paged copy needs CUDA buffers, got {dev}")
    strides = first.stride()
    ptrs: list[int] = []
    for layer in kv_caches:
        for t in layer_tensors(layer, layout):
            if t.stride() != strides or t.device != dev or t.dtype != first.dtype:
                return None
            ptrs.append(t.data_ptr())
    L = len(kv_caches)
    T = int(slots.shape[0])
    if tuple(blob.shape) != (2, L, T, geo.hidden):
        raise ConnectorError(f"blob has shape {tuple(blob.shape)}, expected {(2, L, T, geo.hidden)}")
    if not blob.is_contiguous():
        raise ConnectorError("the blob must be contiguous")
    on_host = blob.device.type == "cpu"
    if on_host and not blob.is_pinned():
        raise ConnectorError("a host blob must be pinned memory for the CUDA paged copy")
    if not on_host and blob.device != dev:
        raise ConnectorError(f"blob is on {blob.device}, buffers on {dev}")
    cdt = _dtype_code(first.dtype, blob.dtype)
    bdt = _dtype_code(blob.dtype, first.dtype)
    if cdt is None or bdt is None:
        return None
    align = 0
    for p in ptrs:
        align |= p
    if slots.dtype != torch.int64 or slots.device != dev or not slots.is_contiguous():
        slots = slots.to(device=dev, dtype=torch.int64).contiguous()
    return dict(geo=geo, dev=dev, strides=strides, ptrs=tuple(ptrs), align=align, T=T, L=L, slots=slots,
                on_host=on_host, cdt=cdt, bdt=bdt)


def _run(direction: int, layout: PagedLayout, prep: dict, blob: torch.Tensor) -> None:
    lib = library()
    geo = prep["geo"]
    dev = prep["dev"]
    st = prep["strides"]
    arr = (ctypes.c_int64 * 5)(*st, *([0] * (5 - len(st))))
    table = _ptr_table(prep["ptrs"], dev)
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev).cuda_stream
        rc = lib.kvt_paged_copy(direction, LAYOUT_CODES[layout], arr, prep["L"], geo.num_kv_heads, geo.head_dim,
                                geo.block_size, geo.num_blocks, ctypes.c_void_p(table.data_ptr()),
                                ctypes.c_uint64(prep["align"]), ctypes.c_void_p(prep["slots"].data_ptr()), prep["T"],
                                ctypes.c_void_p(blob.data_ptr()), int(prep["on_host"]), prep["cdt"], prep["bdt"],
                                ctypes.c_void_p(stream))
    if rc != 0:
        raise RuntimeError(f"kvtool CUDA paged copy: {lib.kvt_paged_last_error().decode(errors='replace')}")


def gather(kv_caches: Sequence[LayerKV], layout: PagedLayout | str, slots: torch.Tensor,
           out_blob: torch.Tensor) -> bool:
    """`out_blob[kv, l, t, :] = KV of layer l, K/V kv, slot slots[t]` in one launch; False
    when the kernel does not take this case (the caller runs the torch reference)."""
    return _copy(GATHER, kv_caches, PagedLayout.parse(layout), slots, out_blob)


def scatter(blob: torch.Tensor, kv_caches: Sequence[LayerKV], layout: PagedLayout | str,
            slots: torch.Tensor) -> bool:
    """Write `blob[kv, l, t]` into slot `slots[t]` of layer l (slots distinct) in one launch;
    False when the kernel does not take this case."""
    return _copy(SCATTER, kv_caches, PagedLayout.parse(layout), slots, blob)


def _copy(direction: int, kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor,
          blob: torch.Tensor) -> bool:
    if layout not in LAYOUT_CODES:  # a layout the kernel does not know (vllm_cpu): the torch path
        if blob.device.type != "cuda":
            raise ConnectorError(f"layout {layout.value!r} has no CUDA kernel: its blob must be on the buffers' device")
        return False
    if slots.shape[0] == 0:
        return True
    prep = _prepare(kv_caches, layout, slots, blob)
    if prep is None:
        if blob.device.type != "cuda":  # the torch reference cannot read or write host memory from the GPU
            raise ConnectorError("this buffer/dtype combination needs a blob on the buffers' device")
        return False
    _run(direction, layout, prep, blob)
    return True


def last_vec_bytes() -> int:
    """Access width in bytes of the last kernel call (16 on the fast path)."""
    return int(library().kvt_paged_last_vec_bytes())
