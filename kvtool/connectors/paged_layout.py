"""Paged KV buffers: the layouts engines use and their index arithmetic.

`paged_copy.gather_paged` / `scatter_paged` move KV between such buffers and
KV_BLOB tensors; this module only says where a token's K and V live.

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
"vllm_cpu"     one tensor ``[NB, H, BS, 2*D]``, each       vLLM 0.32's CPU backend
               (block, head) page holding K transposed     (docs/vllm-cpu-0.32-notes.md)
               ``[D, BS]``, then V ``[BS, D]``
"vllm_cpu_amx" one tensor ``[NB, H, BS, 2*D]``, each       vLLM 0.32's CPU backend
               (block, head) page holding K then V in      with isa "amx" (bfloat16
               AMX tiles (`amx_page_offset`)               on AMX CPUs)
=============  ==========================================  =========================

Token `t` lives in slot `slot_mapping[t]`; ``slot = block * BS + offset``.

Index arithmetic (mirror these two functions in the C header): a slot gives
`(block, offset)`; then the D channels of head `h` of K (kv=0) or V (kv=1)
start at element `run_offset(...)` of the tensor that holds them and follow at
`channel_stride(...)`: the tensor's last-dim stride, except for K in "vllm_cpu"
(transposed: one channel every BS elements; its pages must be contiguous).
Strides are in elements, so the same formula serves contiguous and permuted
buffers. The CUDA kernel knows the first four layouts; "vllm_cpu" runs the
torch path (its buffers are host memory). "vllm_cpu_amx" has no run with one
channel stride (K's channels go in pairs, V's in tiles): `amx_page_offset`
places each element, and only the torch path copies it.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from .base import ConnectorError

LayerKV = Union[torch.Tensor, Sequence[torch.Tensor]]


class PagedLayout(str, enum.Enum):
    """Per-layer paged KV buffer layout (see the module docstring)."""

    FLASH_ATTN = "flash_attn"
    FLASHINFER = "flashinfer"
    VLLM = "vllm"
    KV_TUPLE = "kv_tuple"
    VLLM_CPU = "vllm_cpu"
    VLLM_CPU_AMX = "vllm_cpu_amx"

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
    if layout is PagedLayout.VLLM_CPU:  # [NB, H, BS, 2*D]; a page: K^T [D, BS], then V [BS, D]
        block_size = s[1] // (2 * head_dim * s[3])
        if kv == 0:
            return block * s[0] + head * s[1] + offset * s[3]
        return block * s[0] + head * s[1] + (block_size * head_dim + offset * head_dim) * s[3]
    if layout is PagedLayout.VLLM_CPU_AMX:  # no run of channels: amx_page_offset places each element
        raise ConnectorError("layout 'vllm_cpu_amx' has no run per head: use amx_page_offset")
    raise ConnectorError(f"unknown paged layout {layout!r}")


#: vLLM's AMX tiles: K in 16-token tiles, V in 16-channel tiles (both in pairs, see below)
AMX_TILE = 16


def amx_page_offset(kv, offset, channel, block_size: int, head_dim: int):
    """Element offset, from the start of its (block, head) page, of channel `channel` of the
    token at `offset` in "vllm_cpu_amx": K (kv=0) or V. Measured on vLLM 0.32 by writing coded
    bfloat16 K/V with `cpu_attn_reshape_and_cache(..., "amx")` (tests/test_vllm_keys.py checks
    it against vLLM on every AMX machine). The page is K (BS*D elements), then V (BS*D):

    * K: tiles of 16 tokens, each ``[D/2, 16, 2]``: channel pairs (VNNI), the 16 tokens of a
      pair side by side: ``(o//16)*16*D + (c//2)*32 + (o%16)*2 + c%2``;
    * V: tiles of 16 channels, each ``[BS/2, 16, 2]``: token pairs (VNNI), the 16 channels of a
      pair side by side: ``BS*D + (c//16)*16*BS + (o//2)*32 + (c%16)*2 + o%2``.

    Works on Python ints and integer tensors alike."""
    if kv == 0:
        return (offset // AMX_TILE) * AMX_TILE * head_dim + (channel // 2) * 2 * AMX_TILE \
            + (offset % AMX_TILE) * 2 + channel % 2
    return block_size * head_dim + (channel // AMX_TILE) * AMX_TILE * block_size + (offset // 2) * 2 * AMX_TILE \
        + (channel % AMX_TILE) * 2 + offset % 2


def page_start(block, head, strides: Sequence[int]):
    """Element offset of the (block, head) page of "vllm_cpu" / "vllm_cpu_amx" ([NB, H, BS, 2*D])."""
    return block * strides[0] + head * strides[1]


def channel_stride(layout: PagedLayout, kv: int, strides: Sequence[int], block_size: int) -> int:
    """Elements between consecutive channels of one head's K (kv=0) or V (kv=1)."""
    if layout is PagedLayout.VLLM_CPU and kv == 0:
        return block_size * strides[3]
    return strides[-1]


#: vLLM's CPU page layouts: one contiguous (block, head) page of K then V, host memory
HOST_PAGE_LAYOUTS = (PagedLayout.VLLM_CPU, PagedLayout.VLLM_CPU_AMX)


# Which dim of the per-layer tensor (or of K/V for kv_tuple) indexes heads.
HEAD_DIM_INDEX = {
    PagedLayout.FLASH_ATTN: 3,
    PagedLayout.FLASHINFER: 3,
    PagedLayout.VLLM: 1,
    PagedLayout.KV_TUPLE: 2,
    PagedLayout.VLLM_CPU: 1,
    PagedLayout.VLLM_CPU_AMX: 1,
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
    elif layout in (PagedLayout.VLLM, *HOST_PAGE_LAYOUTS):
        ok = len(shape) == 4 and shape[3] % 2 == 0
        nb, h, bs, d2 = shape if ok else (0,) * 4
        d = d2 // 2
        st = t.stride()
        if ok and layout in HOST_PAGE_LAYOUTS and not (st[3] == 1 and st[2] == d2 and st[1] == bs * d2):
            raise ConnectorError(f"layout {layout.value!r} needs each (block, head) page contiguous, "
                                 "as vLLM allocates it")
        if ok and layout is PagedLayout.VLLM_CPU_AMX and (bs % (2 * AMX_TILE) or d % (2 * AMX_TILE)):
            # vLLM picks "amx" only for these (its _get_attn_isa), and only these were measured
            raise ConnectorError(f"layout 'vllm_cpu_amx' needs a block size and head dim that are multiples of "
                                 f"{2 * AMX_TILE}, got {bs} and {d}")
    else:
        ok = len(shape) == 4
        nb, bs, h, d = shape if ok else (0,) * 4
    want = {
        PagedLayout.FLASH_ATTN: "[2, num_blocks, block_size, H, D]",
        PagedLayout.FLASHINFER: "[num_blocks, 2, block_size, H, D]",
        PagedLayout.VLLM: "[num_blocks, H, block_size, 2*D]",
        PagedLayout.KV_TUPLE: "(K, V), each [num_blocks, block_size, H, D]",
        PagedLayout.VLLM_CPU: "[num_blocks, H, block_size, 2*D]",
        PagedLayout.VLLM_CPU_AMX: "[num_blocks, H, block_size, 2*D]",
    }[layout]
    if not ok or min(nb, bs, h, d) < 1:
        raise ConnectorError(f"layout {layout.value!r} expects {want} per layer, got shape {shape}")
    return PagedGeometry(nb, bs, h, d)


def buffers_signature(kv_caches: Sequence[LayerKV], layout: PagedLayout) -> tuple | None:
    """What the checks of a connector call and the native copy's address maps read off the
    buffers (`tensors_signature` of them, and the layout). Equal signatures mean the same buffers,
    checked already: engines pass the same KV caches to every call, so a connector checks them and
    maps their addresses once. None when `kv_caches` is not a list of tensors (or of (K, V) pairs)
    at all: the full checks then say what is wrong."""
    try:
        tensors = [t for layer in kv_caches for t in layer] if layout is PagedLayout.KV_TUPLE \
            else list(kv_caches)
    except TypeError:
        return None
    signature = tensors_signature(tensors)
    return None if signature is None else Signature((layout, *signature))


class Signature(tuple):
    """A buffers signature that hashes once: templates are looked up by it on every call, and a
    tuple of ~100 items (sizes and strides among them) rehashes in as long as a small copy. A
    connector hands on the signature object it checked first while the buffers stay equal."""

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash: int = tuple.__hash__(self)
            return self._hash


def tensors_signature(tensors: Sequence[torch.Tensor]) -> tuple | None:
    """Each tensor's address, shape and strides, and the first one's dtype and device (no tensor
    is kept); None when they are not tensors. (A tensor's extent, from its address, shape and
    strides, always lies inside its storage: a map kept under an equal signature never writes
    outside a buffer.)"""
    try:
        first = tensors[0]
        return (first.dtype, first.device, *map(torch.Tensor.data_ptr, tensors), *map(_shape, tensors),
                *map(torch.Tensor.stride, tensors))
    except (TypeError, AttributeError, RuntimeError, IndexError):
        return None


_shape = operator.attrgetter("shape")
