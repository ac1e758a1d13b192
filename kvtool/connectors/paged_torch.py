"""The torch reference of the paged gather/scatter: any device, vectorised, a loop over layers.

`paged_cuda` is the fused kernel for CUDA buffers; it must give the same bytes
(tests/test_cuda.py compares them). `paged_copy` chooses between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .paged_layout import (HEAD_DIM_INDEX, LayerKV, PagedGeometry, PagedLayout, amx_page_offset, channel_stride,
                           layer_tensors, page_start, paged_geometry, run_offset, slot_to_block_offset)


@dataclass(frozen=True)
class _Plan:
    rows: torch.Tensor  # int64 row indices into a [num_rows, run] view
    run: int  # elements per row
    num_rows: int


def _plan(t: torch.Tensor, layout: PagedLayout, kv: int, block, offset, geo: PagedGeometry) -> _Plan:
    """How to reach the (kv) entries of `slots` in tensor `t` with one
    index_select/index_copy_ over a `[num_rows, run]` view of its storage.

    run = H*D when a token's heads and channels are one contiguous stretch
    (contiguous flash_attn / flashinfer / kv_tuple); run = D when each head's
    channels are contiguous (vllm, permuted buffers); run = 1 otherwise
    (element-wise; strided channels)."""
    H, D = geo.num_kv_heads, geo.head_dim
    strides = t.stride()
    if layout is PagedLayout.VLLM_CPU_AMX:  # AMX tiles: each element placed by amx_page_offset
        return _amx_plan(t, kv, block, offset, geo)
    if layout is PagedLayout.VLLM_CPU and kv == 0:  # K is transposed in its page: element by element
        heads = torch.arange(H, device=block.device)
        start = run_offset(layout, kv, block[:, None], offset[:, None], heads[None, :], strides, D)  # [T, H]
        chan = torch.arange(D, device=block.device) * channel_stride(layout, kv, strides, geo.block_size)
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, strides))
        return _Plan((start[..., None] + chan).reshape(-1), 1, span)
    s_last = strides[-1]
    s_head = strides[HEAD_DIM_INDEX[layout]]
    heads_adjacent = layout is not PagedLayout.VLLM and (H == 1 or s_head == D)
    if s_last == 1 and heads_adjacent:
        run, groups = H * D, 1
    elif s_last == 1:
        run, groups = D, H
    else:
        run, groups = 1, H
    dev = block.device
    heads = torch.arange(groups, device=dev)
    start = run_offset(layout, kv, block[:, None], offset[:, None], heads[None, :], strides, D)  # [T, G]
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, strides))  # elements from storage_offset
    if run > 1 and (span % run or bool((start % run != 0).any())):
        run = 1  # runs not aligned to a row grid: fall back to elements
    if run == 1:
        chan = torch.arange(D, device=dev) * s_last
        if groups == 1:  # heads adjacent but channels strided: expand heads here
            heads = torch.arange(H, device=dev)
            start = run_offset(layout, kv, block[:, None], offset[:, None], heads[None, :], strides, D)
        elems = start[..., None] + chan  # [T, H, D]
        return _Plan(elems.reshape(-1), 1, span)
    return _Plan((start // run).reshape(-1), run, span // run)


def _amx_plan(t: torch.Tensor, kv: int, block, offset, geo: PagedGeometry) -> _Plan:
    """Element by element: a token's channels are in pairs (K) or 16 at stride 2 (V), never one
    run (paged_layout.amx_page_offset); the pages are contiguous (paged_geometry checks it)."""
    dev = block.device
    heads = torch.arange(geo.num_kv_heads, device=dev)
    chan = torch.arange(geo.head_dim, device=dev)
    pages = page_start(block[:, None, None], heads[None, :, None], t.stride())  # [T, H, 1]
    elems = pages + amx_page_offset(kv, offset[:, None, None], chan[None, None, :], geo.block_size, geo.head_dim)
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return _Plan(elems.reshape(-1), 1, span)


def _plans_for(kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor):
    """Per layer `[(K rows, K plan), (V rows, V plan)]`, "rows" being a
    `[num_rows, run]` view of the tensor's storage; plans are computed once per
    distinct stride pattern (normally once per call)."""
    geo = paged_geometry(kv_caches[0], layout)
    block, offset = slot_to_block_offset(slots.to(torch.int64), geo.block_size)
    cache: dict[tuple, _Plan] = {}
    tuple_layout = layout is PagedLayout.KV_TUPLE
    result = []
    for layer in kv_caches:
        ts = layer_tensors(layer, layout)
        entry = []
        for kv in (0, 1):
            t = ts[kv] if tuple_layout else ts[0]
            key = (t.stride(), 0 if tuple_layout else kv)
            plan = cache.get(key)
            if plan is None:
                plan = cache[key] = _plan(t, layout, kv, block, offset, geo)
            if t.is_contiguous():
                rows = t.view(-1, plan.run)
            else:
                rows = t.as_strided((plan.num_rows, plan.run), (plan.run, 1))
            entry.append((rows, plan))
        result.append(entry)
    return result


def torch_gather(kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor,
                 out_blob: torch.Tensor) -> None:
    num_tokens = slots.shape[0]
    outs = [o.unbind(0) for o in out_blob.unbind(0)]  # outs[kv][layer]: [T, H*D]
    for li, entry in enumerate(_plans_for(kv_caches, layout, slots)):
        for kv, (src, plan) in enumerate(entry):
            dst = outs[kv][li]
            if dst.dtype == src.dtype:
                torch.index_select(src, 0, plan.rows, out=dst.view(-1, plan.run))
            else:
                dst.copy_(src.index_select(0, plan.rows).view(num_tokens, -1))


def torch_scatter(blob: torch.Tensor, kv_caches: Sequence[LayerKV], layout: PagedLayout,
                  slots: torch.Tensor) -> None:
    dtype = layer_tensors(kv_caches[0], layout)[0].dtype
    if blob.dtype != dtype:
        blob = blob.to(dtype)
    srcs = [b.unbind(0) for b in blob.unbind(0)]  # srcs[kv][layer]: [T, H*D]
    for li, entry in enumerate(_plans_for(kv_caches, layout, slots)):
        for kv, (dst, plan) in enumerate(entry):
            dst.index_copy_(0, plan.rows, srcs[kv][li].reshape(-1, plan.run))
