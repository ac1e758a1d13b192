"""The native CPU paged gather/scatter (`kvtool._paged_native`, kernels/paged_copy_cpu.c).

Each (layer, K/V) tensor becomes a segment: its address map (where a slot's K or V starts, as
byte strides read off the tensor: paged_layout's arithmetic) and the slots; the kernel computes
each row's place per token and copies on a few threads, the GIL released, instead of one
`index_copy_` per tensor over an index tensor. vLLM's transposed CPU K pages move a row per
(token, head) with strided channels. Same contract and bytes as the reference
(tests/test_connectors.py compares them on every layout). `paged_copy` picks it for CPU buffers;
when the extension was not built, or KVTOOL_PAGED_NATIVE=0, the torch reference runs. vLLM's AMX
pages ("vllm_cpu_amx") are not a row map (a token's place in a page is not affine in its offset:
paged_layout.amx_page_offset), so they always take the torch reference.
"""

from __future__ import annotations

from types import ModuleType
from typing import Sequence

import numpy as np
import torch

from ..chunk_source import ChunkSource
from ..errors import KvtoolError
from ..native_loader import NativeExtension
from ..devices import host_threads
from .paged_layout import (LayerKV, PagedLayout, buffers_signature, channel_stride, layer_tensors, paged_geometry,
                           run_offset, tensors_signature)

EXTENSION = NativeExtension("_paged_native", "KVTOOL_PAGED_NATIVE", "paged copy", "the torch path")
MIN_BYTES_PER_THREAD = 1 << 20  # below this a thread costs more than it copies


def native_module() -> ModuleType | None:
    """The extension, imported once (`kvtool.native_loader`); None when not built or switched off
    (the torch path runs, silently: it is exact, only slower)."""
    return EXTENSION.module()


def _threads(total_bytes: int) -> int:
    return max(1, min(host_threads(), 16, total_bytes // MIN_BYTES_PER_THREAD))


def _address_map(t: torch.Tensor, layout: PagedLayout, kv: int, geo) -> tuple[int, ...]:
    """Where tensor `t` keeps K (kv=0) or V of a slot, in bytes, for kernels/paged_copy_cpu.c:
    (groups, a, sb, so, sh, run, stride, elem): row g of a token in (block, offset) starts at
    a + block*sb + offset*so + g*sh and is `run` bytes, contiguous (stride 0) or elements
    `stride` bytes apart. The arithmetic of paged_layout.run_offset, read off `t`'s strides."""
    size, strides, H, D = t.element_size(), t.stride(), geo.num_kv_heads, geo.head_dim

    def at(block: int, offset: int, head: int) -> int:  # run_offset is affine in each of them
        return int(run_offset(layout, kv, block, offset, head, strides, D)) * size

    a = at(0, 0, 0)
    sb, so, sh = at(1, 0, 0) - a, at(0, 1, 0) - a, at(0, 0, 1) - a
    step = channel_stride(layout, kv, strides, geo.block_size) * size
    if step == size and (H == 1 or sh == D * size):  # a token's heads and channels are one stretch
        return (1, a, sb, so, sh, H * D * size, 0, size)
    return (H, a, sb, so, sh, D * size, 0 if step == size else step, size)


def _span(t: torch.Tensor) -> int:
    """Bytes of `t`'s storage reachable from its data pointer."""
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


class _Template:
    """The buffers' half of the segments (kernels/paged_copy_cpu.c): one row of 14 uint64 per
    (layer, K/V) tensor, with the tensor's pointer, span and address map filled in and, where the
    blob's address goes, the tensor's part of the blob (K of layer l is part l, V part L + l).
    The kernel fills in a call's blob, token count and slots. Two orders: blob order (K of every
    layer, then V: the checked scatter reads the payload in order) and layer order (K and V of
    each layer in turn: copy_segments moves a layer's K and V together where they share rows, as
    in vLLM's CUDA layout)."""

    def __init__(self, kv_caches: Sequence[LayerKV], layout: PagedLayout):
        geo = paged_geometry(kv_caches[0], layout)
        self.row_bytes = geo.num_kv_heads * geo.head_dim  # elements of one token's K or V
        tuple_layout = layout is PagedLayout.KV_TUPLE
        maps: dict[tuple, tuple[int, ...]] = {}  # (shape, strides, kv) -> (span, address map)
        rows: list[list[tuple[int, ...]]] = [[], []]
        for layer in kv_caches:
            for kv in (0, 1):
                t = layer[kv] if tuple_layout else layer
                key = (t.shape, t.stride(), 0 if tuple_layout else kv)
                known = maps.get(key)
                if known is None:
                    known = maps[key] = (_span(t), *_address_map(t, layout, kv, geo))
                part = kv * len(kv_caches) + len(rows[kv])
                rows[kv].append((t.data_ptr(), known[0], part, 0, 0, geo.block_size, *known[1:]))
        table = np.array(rows[0] + rows[1], dtype=np.uint64).reshape(-1, 14)
        self.parts = len(table)
        self.blob_order = table.tobytes()
        self.layer_order = table.reshape(2, -1, 14).transpose(1, 0, 2).tobytes()


_TEMPLATES: dict[tuple, _Template] = {}  # buffers_signature -> template; engines keep one set of buffers
_MAX_TEMPLATES = 16


def _template(kv_caches: Sequence[LayerKV], layout: PagedLayout, signature: tuple | None) -> _Template:
    if signature is None:
        signature = buffers_signature(kv_caches, layout)
    template = _TEMPLATES.get(signature) if signature is not None else None
    if template is None:
        template = _Template(kv_caches, layout)
        if signature is not None:
            if len(_TEMPLATES) >= _MAX_TEMPLATES:
                _TEMPLATES.clear()
            _TEMPLATES[signature] = template
    return template


def _call(template: _Template, slots: torch.Tensor, blob: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """This call's half of the segments, as the kernel takes it: (blob address, tokens, slots
    address), and the int64 slots (keep them alive for the call)."""
    index = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
    tokens = index.numel()
    if blob.numel() != template.parts * tokens * template.row_bytes:
        raise ValueError("paged_native: the blob does not match the slots")  # a bug, not bad input
    return blob.data_ptr(), tokens, index


def _row_mapped(layout: PagedLayout) -> bool:
    """Whether the kernel's address map (`_address_map`) describes `layout`."""
    return layout is not PagedLayout.VLLM_CPU_AMX


def _copy(kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor, blob: torch.Tensor,
          scatter: bool, signature: tuple | None) -> bool:
    module = native_module()
    if module is None or slots.numel() == 0 or not _row_mapped(layout):
        return False
    template = _template(kv_caches, layout, signature)
    base, tokens, index = _call(template, slots, blob)
    module.copy_segments(template.layer_order, int(scatter), _threads(blob.numel() * blob.element_size()),
                         base, tokens, index.data_ptr())
    return True


def native_scatter_source(source: ChunkSource, kv_caches: Sequence[LayerKV], layout: PagedLayout,
                          slots: torch.Tensor, signature: tuple | None = None) -> bool:
    """`native_scatter` of a raw stored chunk straight from its stored bytes, CRC-32C checked as
    it is copied (`scatter_checked`, or `scatter_checked_file` for a payload still in its file:
    mapped behind a fault guard, or read a window at a time): one read of the bytes. Raises
    ChecksumMismatch after the copy when the payload does not match. False (nothing done) when
    not taken (no module, buffers off the CPU or of another dtype)."""
    module = native_module()
    first = layer_tensors(kv_caches[0], layout)[0]
    if module is None or not source.raw or first.device.type != "cpu" or slots.numel() == 0 \
            or source.dtype not in _NAMES_OF.get(first.dtype, ()) or not _row_mapped(layout):
        return False
    template = _template(kv_caches, layout, signature)
    threads = _threads(source.length)
    kind = source._finite_kind()  # every value scanned for NaN and infinity in the same pass
    if source.in_file:  # still in its file: mapped behind a fault guard (or read a window at a time)
        index = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
        if source.length != template.parts * index.numel() * template.row_bytes * first.element_size():
            raise ValueError("paged_native: the chunk does not match the slots")  # a bug, not bad input
        try:
            crc, bad = _checked(module.scatter_checked_file(template.blob_order, source.fd, source.offset,
                                                            source.length, threads, index.numel(), index.data_ptr(),
                                                            kind))
        except EOFError:
            raise source.truncated() from None
        except OSError as err:
            raise source.read_failed(err) from None
    else:
        blob = source.tensor(source.data)
        base, tokens, index = _call(template, slots, blob)
        try:  # (a mapped file's payload: a file cut short under the copy faults, and is refused)
            crc, bad = _checked(module.scatter_checked(template.blob_order, source.data, threads, base, tokens,
                                                       index.data_ptr(), kind))
        except EOFError:
            raise source.truncated() from None
    refusal = _refusal(source, crc, bad)
    if refusal is not None:
        raise refusal
    return True


def _refusal(source: ChunkSource, crc: int, bad: int) -> "KvtoolError | None":
    """Why a chunk copied and checked is refused (its CRC-32C not the stored one, values not
    finite), or None: the one verdict of every checked scatter."""
    if not source.checked and crc != source.crc32c:
        return source.mismatch()
    try:
        source.refuse_nonfinite(bad)
    except KvtoolError as err:
        return err
    return None


def native_scatter_sources(sources: list[ChunkSource], kv_caches: Sequence[LayerKV], layout: PagedLayout,
                           slots: torch.Tensor, signature: tuple | None = None) -> "list[KvtoolError | None] | None":
    """`native_scatter_source` of whole raw chunks in memory or a mapping, one after the other
    (`slots`: all of theirs, in order), in one call (`scatter_checked_many`: the threads share
    every chunk's parts, no hand-off per chunk). Per chunk: None, or why it is refused
    (ChecksumMismatch: damaged or cut short under the copy; NonFiniteValues), all of them
    copied. None when not taken (no module, buffers off the CPU or of another dtype, a chunk
    still in its file): nothing written."""
    module = native_module()
    first = layer_tensors(kv_caches[0], layout)[0]
    names = _NAMES_OF.get(first.dtype, ())
    if module is None or first.device.type != "cpu" or not sources or slots.numel() == 0 or not _row_mapped(layout) \
            or any(not s.raw or s.data is None or s.dtype not in names for s in sources):
        return None
    kinds = {s._finite_kind() for s in sources}
    if len(kinds) != 1:
        return None
    template = _template(kv_caches, layout, signature)
    index = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
    items = np.empty((len(sources), 2), dtype=np.uint64)
    at, row = 0, template.parts * template.row_bytes * first.element_size()
    for i, source in enumerate(sources):
        if source.length != row * source.num_tokens:
            raise ValueError("paged_native: a chunk does not match the slots")  # a bug, not bad input
        items[i] = (source.num_tokens, index.data_ptr() + at * index.element_size())
        at += source.num_tokens
    if at != index.numel():
        raise ValueError("paged_native: the chunks do not match the slots")  # a bug, not bad input
    results = module.scatter_checked_many(template.blob_order, [s.data for s in sources],
                                          _threads(row * at), items.tobytes(), kinds.pop())
    return [source.truncated() if result is None else _refusal(source, *result)
            for source, result in zip(sources, results)]


def _checked(result) -> tuple[int, int]:
    """(CRC-32C, values not finite) of a checked copy: with a finiteness scan asked for it says
    both, without one only the CRC."""
    return (result, 0) if isinstance(result, int) else result


_NAMES_OF = {torch.bfloat16: ("bf16", "bfloat16"), torch.float16: ("fp16", "float16"),
             torch.float32: ("fp32", "float32")}


def native_slots_ok(slots: torch.Tensor, num_slots: int, distinct: bool) -> bool | None:
    """Whether the int64 CPU `slots` lie in [0, num_slots) and (distinct) none repeats, checked
    natively; None when not taken (no module, another dtype or device): the torch checks run."""
    module = native_module()
    if module is None or slots.device.type != "cpu" or slots.dtype != torch.int64 or not slots.is_contiguous():
        return None
    return module.slots_ok(slots.data_ptr(), slots.numel(), num_slots, distinct)


def native_gather(kv_caches: Sequence[LayerKV], layout: PagedLayout, slots: torch.Tensor,
                  out_blob: torch.Tensor, signature: tuple | None = None) -> bool:
    """`paged_torch.torch_gather` natively; False (nothing done) when this case is not taken."""
    first = layer_tensors(kv_caches[0], layout)[0]
    if first.device.type != "cpu" or out_blob.device.type != "cpu" or out_blob.dtype != first.dtype \
            or not out_blob.is_contiguous():
        return False
    return _copy(kv_caches, layout, slots, out_blob, False, signature)


def native_scatter(blob: torch.Tensor, kv_caches: Sequence[LayerKV], layout: PagedLayout,
                   slots: torch.Tensor, signature: tuple | None = None) -> bool:
    """`paged_torch.torch_scatter` natively; False (nothing done) when this case is not taken."""
    first = layer_tensors(kv_caches[0], layout)[0]
    if first.device.type != "cpu" or blob.device.type != "cpu":
        return False
    if blob.dtype != first.dtype:
        blob = blob.to(first.dtype)  # rounding as the reference does
    return _copy(kv_caches, layout, slots, blob.contiguous(), True, signature)


def native_token_copy(tensors: Sequence[torch.Tensor], start: int, end: int, blob: torch.Tensor, scatter: bool,
                      source: ChunkSource | None = None) -> bool:
    """Tokens [start, end) between whole-sequence tensors and a KV_BLOB, natively: `tensors` are
    the connector's tokens-first views in blob order (K of every layer, then V), each [T, H, D] or
    [T, H*D] with unit channel stride (a Hugging Face [1, H, T, D] layer seen as [T, H, D]). Each
    is a "paged" tensor of one block of T slots, so the same kernel copies it (per token and
    head, or one stretch when a token's heads are adjacent) in one call, the GIL released.
    `source`: `blob` views a stored chunk's unchecked bytes in memory (`source.data`), checked as
    they are copied (scatter only).
    False (nothing done) when the case is not taken: another device or dtype, odd strides."""
    module = native_module()
    first = tensors[0]
    if module is None or first.device.type != "cpu" or blob.device.type != "cpu" or blob.dtype != first.dtype \
            or not blob.is_contiguous() or end <= start:
        return False
    template = _token_template(tensors)
    if template is None or (scatter and template.overlapping):
        return False  # (torch refuses to write a tensor whose elements share memory; so do we)
    tokens = end - start
    rows = template.rows.copy()
    rows[:, 2] = template.part_elements * np.uint64(tokens * first.element_size()) + np.uint64(blob.data_ptr())
    rows[:, 3] = tokens
    index = torch.arange(start, end, dtype=torch.int64)
    rows[:, 4] = index.data_ptr()
    threads = _threads(blob.numel() * blob.element_size())
    if source is not None:
        if not scatter or source.data is None:
            raise ValueError("native_token_copy: a stored chunk in memory goes with a scatter")  # a bug
        try:
            crc, bad = _checked(module.scatter_checked(rows.tobytes(), source.data, threads, 0, 0, 0,
                                                       source._finite_kind()))
        except EOFError:
            raise source.truncated() from None
        if not source.checked and crc != source.crc32c:
            raise source.mismatch()
        source.refuse_nonfinite(bad)
    else:
        module.copy_segments(rows.tobytes(), int(scatter), threads)
    del index
    return True


class _TokenTemplate:
    """The tensors' half of native_token_copy's segments (see _Template), and whether any of them
    has elements sharing memory."""

    def __init__(self, rows: list[tuple[int, ...]], part_elements: list[int], overlapping: bool):
        self.rows = np.array(rows, dtype=np.uint64).reshape(-1, 14)
        self.part_elements = np.array(np.cumsum([0] + part_elements[:-1]), dtype=np.uint64)  # blob offset / tokens
        self.overlapping = overlapping


_TOKEN_TEMPLATES: dict[tuple, _TokenTemplate | None] = {}


def _token_template(tensors: Sequence[torch.Tensor]) -> _TokenTemplate | None:
    """Cached per set of tensors (addresses, shapes, strides, dtype): a Hugging Face cache keeps
    its tensors between steps of one length, and their 2L checks cost as much as a short copy."""
    key = tensors_signature(tensors)
    if key is None:
        return None
    if key in _TOKEN_TEMPLATES:
        return _TOKEN_TEMPLATES[key]
    elem, rows, parts, overlapping = tensors[0].element_size(), [], [], False
    template: _TokenTemplate | None = None
    for t in tensors:
        if t.dtype != tensors[0].dtype or t.dim() not in (2, 3) or t.stride(-1) != 1:
            break
        total = t.shape[0]
        heads, dim = (t.shape[1], t.shape[2]) if t.dim() == 3 else (1, t.shape[1])
        head_stride = t.stride(1) * elem if t.dim() == 3 else dim * elem
        if heads == 1 or head_stride == dim * elem:  # a token's channels are one stretch
            groups, run, head_stride = 1, heads * dim * elem, 0
        else:
            groups, run = heads, dim * elem
        rows.append((t.data_ptr(), _span(t), 0, 0, 0, total, groups, 0, 0, t.stride(0) * elem, head_stride, run,
                     0, elem))
        parts.append(heads * dim)
        overlapping = overlapping or _overlaps(t)
    else:
        template = _TokenTemplate(rows, parts, overlapping)
    if len(_TOKEN_TEMPLATES) >= _MAX_TEMPLATES:
        _TOKEN_TEMPLATES.clear()
    _TOKEN_TEMPLATES[key] = template
    return template


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of `t` share memory (a broadcast view, say): each stride, smallest
    first, must step past everything the smaller ones reach."""
    reach = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < reach:
            return True
        reach = stride * size
    return False
