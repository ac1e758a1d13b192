"""Paged KV buffers: layouts, index arithmetic, and the gather/scatter boundary.

This module is the ONE place where a device kernel plugs in: the connectors
call only `gather_paged` and `scatter_paged`. Both dispatch on the buffers'
device type to an implementation registered with `register_device_impl` (a
CUDA kernel, later) and otherwise run the vectorised torch reference below.

Engine layouts (per layer; H = num_kv_heads, D = head_dim, NB = num_blocks,
BS = block_size):

=============  ==========================================  =========================
layout         per-layer buffer                            used by
=============  ==========================================  =========================
"flash_attn"   one tensor ``[2, NB, BS, H, D]``            vLLM <= 0.22, kvtool engine
"flashinfer"   one tensor ``[NB, 2, BS, H, D]``            vLLM ~0.23, FlashInfer
"vllm"         one tensor ``[NB, H, BS, 2*D]``             vLLM 0.32 (K = first D
                                                           channels, V = last D)
"kv_tuple"     tuple ``(K, V)``, each ``[NB, BS, H, D]``   vLLM V1-style
=============  ==========================================  =========================

Token `t` lives in slot `slot_mapping[t]`; ``slot = block * BS + offset``.

Index arithmetic (mirror these two functions in the C header): a slot gives
`(block, offset)`; then the D channels of head `h` of K (kv=0) or V (kv=1)
start at element `run_offset(...)` of the tensor that holds them and follow at
the tensor's last-dim stride. Strides are in elements, so the same formula
serves contiguous and permuted buffers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Callable, Sequence, Union

import torch

from .base import ConnectorError

LayerKV = Union[torch.Tensor, Sequence[torch.Tensor]]


class PagedLayout(str, enum.Enum):
    """Per-layer paged KV buffer layout (see the module docstring)."""

    FLASH_ATTN = "flash_attn"
    FLASHINFER = "flashinfer"
    VLLM = "vllm"
    KV_TUPLE = "kv_tuple"

    @classmethod
    def parse(cls, value: "PagedLayout | str") -> "PagedLayout":
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise ConnectorError(f"unknown paged layout {value!r}; expected one of {names}") from None


# ---------------------------------------------------------------------------
# Index arithmetic. Works on Python ints and on integer tensors alike.
# ---------------------------------------------------------------------------


def slot_to_block_offset(slot, block_size: int):
    """`slot -> (block, offset)` with ``slot = block * block_size + offset``."""
    return slot // block_size, slot % block_size


def run_offset(layout: PagedLayout, kv, block, offset, head, strides: Sequence[int], head_dim: int):
    """Element offset of the first of the `head_dim` channels of head `head`
    of the token at `(block, offset)`, K if `kv == 0` else V, from the start of
    the tensor that holds it (for "kv_tuple": the K or the V tensor; `kv` then
    picks the tensor and does not enter the offset). `strides` are that
    tensor's element strides; channel `c` is at `+ c * strides[-1]`."""
    s = strides
    if layout is PagedLayout.FLASH_ATTN:  # [2, NB, BS, H, D]
        return kv * s[0] + block * s[1] + offset * s[2] + head * s[3]
    if layout is PagedLayout.FLASHINFER:  # [NB, 2, BS, H, D]
        return block * s[0] + kv * s[1] + offset * s[2] + head * s[3]
    if layout is PagedLayout.VLLM:  # [NB, H, BS, 2*D]
        return block * s[0] + head * s[1] + offset * s[2] + kv * head_dim * s[3]
    if layout is PagedLayout.KV_TUPLE:  # K or V: [NB, BS, H, D]
        return block * s[0] + offset * s[1] + head * s[2]
    raise ConnectorError(f"unknown paged layout {layout!r}")


# Which dim of the per-layer tensor (or of K/V for kv_tuple) indexes heads.
_HEAD_DIM_INDEX = {
    PagedLayout.FLASH_ATTN: 3,
    PagedLayout.FLASHINFER: 3,
    PagedLayout.VLLM: 1,
    PagedLayout.KV_TUPLE: 2,
}


@dataclass(frozen=True)
class PagedGeometry:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def hidden(self) -> int:
        return self.num_kv_heads * self.head_dim


def layer_tensors(layer: LayerKV, layout: PagedLayout) -> tuple[torch.Tensor, ...]:
    """The tensor(s) a layer entry holds: `(K, V)` for kv_tuple, `(T,)` otherwise."""
    if layout is PagedLayout.KV_TUPLE:
        if isinstance(layer, torch.Tensor) or not isinstance(layer, (tuple, list)) or len(layer) != 2:
            raise ConnectorError("layout 'kv_tuple' needs each layer to be a (K, V) pair of tensors")
        k, v = layer
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise ConnectorError("layout 'kv_tuple' needs each layer to be a (K, V) pair of tensors")
        if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            raise ConnectorError(
                f"K and V differ: {tuple(k.shape)}/{k.dtype}/{k.device} vs {tuple(v.shape)}/{v.dtype}/{v.device}"
            )
        return (k, v)
    if not isinstance(layer, torch.Tensor):
        raise ConnectorError(f"layout {layout.value!r} needs each layer to be one tensor, got {type(layer).__name__}")
    return (layer,)


def paged_geometry(layer: LayerKV, layout: PagedLayout) -> PagedGeometry:
    """Read (num_blocks, block_size, H, D) off one layer's buffer, checking its rank."""
    t = layer_tensors(layer, layout)[0]
    shape = tuple(t.shape)
    if layout is PagedLayout.FLASH_ATTN:
        ok = len(shape) == 5 and shape[0] == 2
        nb, bs, h, d = shape[1:] if ok else (0, 0, 0, 0)
    elif layout is PagedLayout.FLASHINFER:
        ok = len(shape) == 5 and shape[1] == 2
        nb, _, bs, h, d = shape if ok else (0,) * 5
    elif layout is PagedLayout.VLLM:
        ok = len(shape) == 4 and shape[3] % 2 == 0
        nb, h, bs, d2 = shape if ok else (0,) * 4
        d = d2 // 2
    else:
        ok = len(shape) == 4
        nb, bs, h, d = shape if ok else (0,) * 4
    want = {
        PagedLayout.FLASH_ATTN: "[2, num_blocks, block_size, H, D]",
        PagedLayout.FLASHINFER: "[num_blocks, 2, block_size, H, D]",
        PagedLayout.VLLM: "[num_blocks, H, block_size, 2*D]",
        PagedLayout.KV_TUPLE: "(K, V), each [num_blocks, block_size, H, D]",
    }[layout]
    if not ok or min(nb, bs, h, d) < 1:
        raise ConnectorError(f"layout {layout.value!r} expects {want} per layer, got shape {shape}")
    return PagedGeometry(nb, bs, h, d)


# ---------------------------------------------------------------------------
# The kernel boundary.
# ---------------------------------------------------------------------------

GatherFn = Callable[[Sequence[LayerKV], PagedLayout, torch.Tensor, torch.Tensor], None]
ScatterFn = Callable[[torch.Tensor, Sequence[LayerKV], PagedLayout, torch.Tensor], None]
_DEVICE_IMPLS: dict[str, tuple[GatherFn, ScatterFn]] = {}


def register_device_impl(device_type: str, gather: GatherFn, scatter: ScatterFn) -> None:
    """Route `gather_paged`/`scatter_paged` for buffers on `device_type`
    (e.g. "cuda") to a kernel with the same signature and contract."""
    _DEVICE_IMPLS[device_type] = (gather, scatter)


def unregister_device_impl(device_type: str) -> None:
    _DEVICE_IMPLS.pop(device_type, None)


def gather_paged(kv_caches: Sequence[LayerKV], layout: PagedLayout | str, slots: torch.Tensor, out_blob: torch.Tensor) -> None:
    """`out_blob[kv, l, t, :] = KV of layer l, K/V kv, slot slots[t]`.

    Contract (the caller, i.e. the connector, has checked it): `kv_caches` is a
    list over layers in `layout`, all layers of one shape, dtype and device;
    `slots` is a 1-D int64 tensor on that device, every value in
    ``[0, num_blocks*block_size)``; `out_blob` is a contiguous
    ``[2, L, len(slots), H*D]`` tensor on that device. Its dtype may differ
    from the buffers' dtype: values are converted as by `Tensor.copy_`."""
    layout = PagedLayout.parse(layout)
    impl = _device_impl(kv_caches, layout)
    if impl is not None:
        impl[0](kv_caches, layout, slots, out_blob)
        return
    _torch_gather(kv_caches, layout, slots, out_blob)


def scatter_paged(blob: torch.Tensor, kv_caches: Sequence[LayerKV], layout: PagedLayout | str, slots: torch.Tensor) -> None:
    """The inverse of `gather_paged`: write `blob[kv, l, t]` into slot `slots[t]`
    of layer l. Same contract; additionally the slots are distinct. Slots not
    in `slots` are left untouched. A dtype difference is converted (rounding
    to nearest as `Tensor.to` does)."""
    layout = PagedLayout.parse(layout)
    impl = _device_impl(kv_caches, layout)
    if impl is not None:
        impl[1](blob, kv_caches, layout, slots)
        return
    _torch_scatter(blob, kv_caches, layout, slots)


def _device_impl(kv_caches: Sequence[LayerKV], layout: PagedLayout) -> Optional[tuple[GatherFn, ScatterFn]]:
    """The kernel for the engine buffers' device (the blob may be pinned host memory).

    The first CUDA copy imports `kvtool.cuda`, which registers its fused kernel
    (built on first use; on failure it prints one line and the torch path runs)."""
    device_type = layer_tensors(kv_caches[0], layout)[0].device.type
    if device_type == "cuda" and "cuda" not in _DEVICE_IMPLS and not _cuda_tried:
        _try_register_cuda()
    return _DEVICE_IMPLS.get(device_type)


_cuda_tried = False


def _try_register_cuda() -> None:
    global _cuda_tried
    _cuda_tried = True
    try:
        from .. import cuda
    except ImportError:
        return
    cuda.register()


# ---------------------------------------------------------------------------
# Torch reference implementation (any device; vectorised, a loop over layers).
# ---------------------------------------------------------------------------


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
    s_last = strides[-1]
    s_head = strides[_HEAD_DIM_INDEX[layout]]
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


def _torch_gather(kv_caches, layout, slots, out_blob) -> None:
    num_tokens = slots.shape[0]
    outs = [o.unbind(0) for o in out_blob.unbind(0)]  # outs[kv][layer]: [T, H*D]
    for li, entry in enumerate(_plans_for(kv_caches, layout, slots)):
        for kv, (src, plan) in enumerate(entry):
            dst = outs[kv][li]
            if dst.dtype == src.dtype:
                torch.index_select(src, 0, plan.rows, out=dst.view(-1, plan.run))
            else:
                dst.copy_(src.index_select(0, plan.rows).view(num_tokens, -1))


def _torch_scatter(blob, kv_caches, layout, slots) -> None:
    dtype = layer_tensors(kv_caches[0], layout)[0].dtype
    if blob.dtype != dtype:
        blob = blob.to(dtype)
    srcs = [b.unbind(0) for b in blob.unbind(0)]  # srcs[kv][layer]: [T, H*D]
    for li, entry in enumerate(_plans_for(kv_caches, layout, slots)):
        for kv, (dst, plan) in enumerate(entry):
            dst.index_copy_(0, plan.rows, srcs[kv][li].reshape(-1, plan.run))
