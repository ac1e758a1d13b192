"""Connectors for paged KV buffers (vLLM-style block tables flattened to slots)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..chunk_source import ChunkSource
from ..errors import KvtoolError
from .base import ConnectorError, ConnectorTarget, GPUConnectorInterface
from .memory import MemoryFormat, MemoryObj
from .paged_copy import gather_paged, scatter_paged, scatter_paged_source, scatter_paged_sources
from .paged_native import native_slots_ok
from .paged_layout import LayerKV, PagedGeometry, PagedLayout, buffers_signature, layer_tensors, paged_geometry


class _PagedConnector(GPUConnectorInterface):
    """Shared machinery of the paged connectors (checks, staging, dispatch)."""

    def __init__(
        self,
        hidden_dim_size: int,
        num_layers: int,
        layout: PagedLayout | str,
        use_gpu: bool,
        num_kv_heads: Optional[int],
        head_dim: Optional[int],
        chunk_size: Optional[int],
    ):
        super().__init__(hidden_dim_size, num_layers)
        self.layout = PagedLayout.parse(layout)
        self.use_gpu = bool(use_gpu)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        if num_kv_heads is not None and head_dim is not None and num_kv_heads * head_dim != hidden_dim_size:
            raise ConnectorError(
                f"num_kv_heads*head_dim = {num_kv_heads}*{head_dim} != hidden_dim_size {hidden_dim_size}"
            )
        self.chunk_size = chunk_size
        self._staging: Optional[torch.Tensor] = None  # reused device buffer (use_gpu=True)
        self._checked: Optional[tuple[tuple, PagedGeometry]] = None  # the buffers last checked, their geometry

    # ---- checks ------------------------------------------------------------

    def _check_kvcaches(self, kwargs: dict[str, Any], *,
                        remembered: bool = True) -> tuple[list[LayerKV], PagedGeometry, torch.Tensor, tuple | None]:
        """Validate `kvcaches`; return it as a list, its geometry, layer 0's first tensor and the
        buffers' signature. For the calls of LMCache's contract (`remembered`: each call names its
        buffers again) the buffers last checked are not checked again (their signature); a load's
        target checks its buffers once itself (`PagedTarget`), so it neither asks nor tells."""
        kvcaches = self._require_kwarg(kwargs, "kvcaches")
        if isinstance(kvcaches, torch.Tensor) or not isinstance(kvcaches, Sequence):
            raise ConnectorError("'kvcaches' must be a list or tuple over layers")
        kvcaches = list(kvcaches)
        signature = buffers_signature(kvcaches, self.layout) if len(kvcaches) == self.num_layers else None
        checked = self._checked if remembered else None  # one read: load workers call from several threads
        if signature is not None and checked is not None and checked[0] == signature:
            return kvcaches, checked[1], layer_tensors(kvcaches[0], self.layout)[0], checked[0]  # checked already
        if len(kvcaches) != self.num_layers:
            raise ConnectorError(f"'kvcaches' has {len(kvcaches)} layers, expected {self.num_layers}")
        geo = paged_geometry(kvcaches[0], self.layout)
        if geo.hidden != self.hidden_dim_size:
            raise ConnectorError(
                f"buffers hold {geo.num_kv_heads} heads x {geo.head_dim} = {geo.hidden} channels, "
                f"expected hidden_dim_size {self.hidden_dim_size}"
            )
        if self.num_kv_heads is not None and geo.num_kv_heads != self.num_kv_heads:
            raise ConnectorError(f"buffers hold {geo.num_kv_heads} KV heads, expected {self.num_kv_heads}")
        if self.head_dim is not None and geo.head_dim != self.head_dim:
            raise ConnectorError(f"buffers have head_dim {geo.head_dim}, expected {self.head_dim}")
        first = layer_tensors(kvcaches[0], self.layout)[0]
        ref = (first.shape, first.dtype, first.device)
        for li, layer in enumerate(kvcaches):
            for t in layer_tensors(layer, self.layout):
                if (t.shape, t.dtype, t.device) != ref:
                    raise ConnectorError(
                        f"layer {li} buffer is {tuple(t.shape)}/{t.dtype}/{t.device}, "
                        f"layer 0's is {tuple(ref[0])}/{ref[1]}/{ref[2]}"
                    )
                if not t.dtype.is_floating_point:
                    raise ConnectorError(f"KV buffers must be floating point, got {t.dtype}")
        if self.use_gpu and first.device.type != "cuda":
            raise ConnectorError(f"use_gpu=True needs CUDA kvcaches, got buffers on {first.device}")
        if remembered:
            self._checked = None if signature is None else (signature, geo)
        return kvcaches, geo, first, signature

    @staticmethod
    def _check_slots(
        kwargs: dict[str, Any], start: int, end: int, geo: PagedGeometry, device: torch.device, *, distinct: bool
    ) -> torch.Tensor:
        """`slot_mapping[start:end]` as int64 on `device`, after every check."""
        return _PagedConnector._slots_of(_PagedConnector._slot_tensor(kwargs), start, end, geo, device,
                                         distinct=distinct)

    @staticmethod
    def _slot_tensor(kwargs: dict[str, Any]) -> torch.Tensor:
        """`slot_mapping` as a 1-D integer tensor, checked (its entries are checked per range)."""
        sm = kwargs.get("slot_mapping")
        if sm is None:
            raise ConnectorError("'slot_mapping' must be provided in kwargs")
        if not isinstance(sm, torch.Tensor):
            try:
                sm = torch.as_tensor(sm, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ConnectorError(f"'slot_mapping' is not a sequence of ints: {e}") from None
        if sm.dim() != 1:
            raise ConnectorError(f"'slot_mapping' must be 1-D, got shape {tuple(sm.shape)}")
        if sm.dtype.is_floating_point or sm.dtype.is_complex or sm.dtype == torch.bool:
            raise ConnectorError(f"'slot_mapping' must be an integer tensor, got {sm.dtype}")
        return sm

    @staticmethod
    def _slots_of(sm: torch.Tensor, start: int, end: int, geo: PagedGeometry, device: torch.device, *,
                  distinct: bool) -> torch.Tensor:
        """`sm[start:end]` (a `_slot_tensor`) as int64 on `device`, after the range checks."""
        if sm.shape[0] < end:
            raise ConnectorError(
                f"'slot_mapping' has {sm.shape[0]} entries, too short for token range {start}..{end}"
            )
        s = sm[start:end]
        if s.device.type == "cpu" and native_slots_ok(s, geo.num_slots, distinct):
            return s if device.type == "cpu" else s.to(device)  # (the torch checks below, a few small
            # ops, cost as much as copying a chunk; on the host, checked natively, for any buffers)
        s = s.to(torch.int64)
        lo, hi = torch.aminmax(s)
        lo, hi = int(lo), int(hi)
        if lo < 0:
            bad = int(torch.nonzero(s < 0)[0, 0]) + start
            if int(sm[bad]) == -1:
                raise ConnectorError(
                    f"slot_mapping[{bad}] is -1 (a prefix-cached or padding token) inside token range "
                    f"{start}..{end}; start must be past the cached prefix"
                )
            raise ConnectorError(f"slot_mapping[{bad}] = {int(sm[bad])} is negative")
        if hi >= geo.num_slots:
            bad = int(torch.nonzero(s >= geo.num_slots)[0, 0]) + start
            raise ConnectorError(
                f"slot_mapping[{bad}] = {int(sm[bad])} is out of range for buffers of "
                f"{geo.num_blocks} blocks x {geo.block_size} = {geo.num_slots} slots"
            )
        if distinct and torch.unique(s).numel() != s.numel():
            raise ConnectorError(f"'slot_mapping' repeats a slot within token range {start}..{end}")
        return s.to(device)

    # ---- staging -------------------------------------------------------------

    def _device_blob(self, num_tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shape = self.get_shape(num_tokens)
        numel = shape.numel()
        if not self.use_gpu:
            return torch.empty(shape, dtype=dtype, device=device)
        st = self._staging
        if st is None or st.dtype != dtype or st.device != device or st.numel() < numel:
            cap = max(numel, self.get_shape(self.chunk_size or 0).numel())
            st = self._staging = torch.empty(cap, dtype=dtype, device=device)
        return st[:numel].view(shape)

    # ---- transfers -----------------------------------------------------------

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.gather(self._tensor_of(memory_obj, reading=False), start, end, **kwargs)
        memory_obj.metadata.fmt = MemoryFormat.KV_BLOB

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.scatter(self._tensor_of(memory_obj, reading=True), start, end, **kwargs)

    def gather(self, blob: torch.Tensor, start: int, end: int, **kwargs: Any) -> None:
        kvcaches, geo, first, signature = self._check_kvcaches(kwargs)
        start, end = self._check_range(start, end)
        slots = self._check_slots(kwargs, start, end, geo, first.device, distinct=False)
        blob = self._check_blob(blob, end - start, first.device)
        if blob.device == first.device:
            gather_paged(kvcaches, self.layout, slots, blob, signature=signature)
        else:  # memory object on the host, buffers on a device: gather there, copy once
            tmp = self._device_blob(end - start, first.dtype, first.device)
            gather_paged(kvcaches, self.layout, slots, tmp, signature=signature)
            blob.copy_(tmp)

    def scatter(self, blob: torch.Tensor, start: int, end: int, **kwargs: Any) -> None:
        self._blob_into(self._bind(kwargs), blob, start, end)

    def to_gpu_source(self, source: ChunkSource, start: int, end: int, **kwargs: Any) -> None:
        """A stored chunk into the buffers: a raw one into host buffers straight from its stored
        bytes, checked as copied (`scatter_paged_source`); otherwise decoded from checked bytes."""
        self._source_into(self._bind(kwargs), source, start, end)

    def target(self, **kwargs: Any) -> "PagedTarget":
        return PagedTarget(self, **kwargs)

    def _bind(self, kwargs: dict[str, Any], *, remembered: bool = True) -> "_Bound":
        """The buffers and the slot mapping of a call's `kwargs`, checked (`remembered`: see
        `_check_kvcaches`)."""
        kvcaches, geo, first, signature = self._check_kvcaches(kwargs, remembered=remembered)
        sm = self._slot_tensor(kwargs)
        if sm.device.type == "cpu" and (sm.dtype != torch.int64 or not sm.is_contiguous()):
            sm = sm.to(torch.int64).contiguous()  # (the native checks and copies take int64)
        return _Bound(kvcaches, geo, first, signature, sm)

    def _blob_into(self, bound: "_Bound", blob: torch.Tensor, start: int, end: int, *,
                   whole_mapping: bool = False) -> None:
        """`scatter` with the buffers and the slot mapping checked already (`bound`). Slots on the
        host for buffers on a device: with `whole_mapping` (a load's target, many chunks) the
        whole mapping is moved once, else this range."""
        start, end = self._check_range(start, end)
        first = bound.first
        slots = self._slots_of(bound.slot_mapping, start, end, bound.geo, bound.slot_mapping.device, distinct=True)
        if first.device != slots.device:
            slots = bound.on_device(first.device)[start:end] if whole_mapping else slots.to(first.device)
        blob = self._check_blob(blob, end - start, first.device)
        if blob.device != first.device:
            tmp = self._device_blob(end - start, first.dtype, first.device)
            tmp.copy_(blob, non_blocking=blob.is_pinned())
            blob = tmp
        scatter_paged(blob, bound.kvcaches, self.layout, slots, signature=bound.signature)

    def _source_into(self, bound: "_Bound", source: ChunkSource, start: int, end: int, *,
                     whole_mapping: bool = False) -> None:
        start, end = self._check_range(start, end)
        if bound.first.device.type != "cpu" or not source.raw:
            return self._blob_into(bound, source.decode(), start, end, whole_mapping=whole_mapping)
        slots = self._slots_of(bound.slot_mapping, start, end, bound.geo, bound.first.device, distinct=True)
        if source.shape != (2, self.num_layers, end - start, self.hidden_dim_size):
            raise ConnectorError(f"{source.what} holds KV of shape {list(source.shape)}, "
                                 f"expected {list(self.get_shape(end - start))}")
        scatter_paged_source(source, bound.kvcaches, self.layout, slots, signature=bound.signature)

    def _sources_into(self, bound: "_Bound", sources: list[ChunkSource], start: int,
                      end: int) -> "list[KvtoolError | None] | None":
        """`_source_into` of whole raw chunks one after the other from `start`, in one native call
        (`PagedTarget.scatter_sources`); None when not taken."""
        start, end = self._check_range(start, end)
        if bound.first.device.type != "cpu" or sum(s.num_tokens for s in sources) != end - start:
            return None
        for source in sources:
            if source.shape != (2, self.num_layers, source.num_tokens, self.hidden_dim_size):
                raise ConnectorError(f"{source.what} holds KV of shape {list(source.shape)}, "
                                     f"expected {list(self.get_shape(source.num_tokens))}")
        slots = self._slots_of(bound.slot_mapping, start, end, bound.geo, bound.first.device, distinct=True)
        return scatter_paged_sources(sources, bound.kvcaches, self.layout, slots, signature=bound.signature)


class _Bound:
    """A call's buffers and slot mapping, checked (`_PagedConnector._bind`)."""

    __slots__ = ("kvcaches", "geo", "first", "signature", "slot_mapping", "_moved")

    def __init__(self, kvcaches: list[LayerKV], geo: PagedGeometry, first: torch.Tensor, signature: tuple | None,
                 slot_mapping: torch.Tensor):
        self.kvcaches, self.geo, self.first, self.signature = kvcaches, geo, first, signature
        self.slot_mapping = slot_mapping  # checked range by range as chunks arrive
        self._moved: torch.Tensor | None = None

    def on_device(self, device: torch.device) -> torch.Tensor:
        """The whole slot mapping on the buffers' device, as int64, moved once."""
        moved = self._moved
        if moved is None or moved.device != device:
            moved = self._moved = self.slot_mapping.to(device=device, dtype=torch.int64)
        return moved


class PagedTarget(ConnectorTarget):
    """A paged connector's buffers as the destination of one load (`_PagedConnector.target`): the
    buffers and the slot mapping are checked when the first chunk arrives, fully, and not again
    for each chunk (~50 us a chunk, an eighth of copying a 5.9 MB one): a target lives for one
    load, and an engine does not reallocate its buffers while a load fills them. This binding is
    the one thing that spares the load its checks (the connector's memory of the buffers it last
    checked serves the calls of LMCache's contract only). Each chunk's slots are still checked
    (in range, distinct)."""

    def __init__(self, connector: "_PagedConnector", **kwargs: Any):
        super().__init__(connector, **kwargs)
        self._bound: _Bound | None = None

    def _bound_once(self) -> _Bound:
        bound = self._bound
        if bound is None:  # (two workers may both bind: the same checks, the same answer)
            bound = self._bound = self.connector._bind(self.kwargs, remembered=False)
        return bound

    def scatter(self, kv: torch.Tensor, start: int, end: int) -> None:
        self.connector._blob_into(self._bound_once(), kv, start, end, whole_mapping=True)

    def scatter_source(self, source: ChunkSource, start: int, end: int) -> None:
        self.connector._source_into(self._bound_once(), source, start, end, whole_mapping=True)

    def takes_source_runs(self) -> bool:
        return True

    def scatter_sources(self, sources: list[ChunkSource], start: int, end: int) -> "list[KvtoolError | None] | None":
        return self.connector._sources_into(self._bound_once(), sources, start, end)


class PagedMemConnectorV2(_PagedConnector):
    """Paged engine buffers addressed by a FULL per-token slot mapping.

    Constructor: ``PagedMemConnectorV2(hidden_dim_size, num_layers,
    use_gpu=False, layout="kv_tuple", num_kv_heads=None, head_dim=None,
    chunk_size=None)``.

    * `layout`: a `PagedLayout` or its name: "flash_attn", "flashinfer",
      "vllm" (0.32, CUDA), "vllm_cpu" (0.32's CPU backend), "vllm_cpu_amx" (its
      bfloat16 pages on AMX CPUs) or "kv_tuple" (see `kvtool.connectors.paged_layout`).
    * `use_gpu`: take the device path: the buffers must be CUDA tensors, and
      a host memory object is staged through a reusable device buffer (sized
      for at least `chunk_size` tokens). The copy itself goes through
      `gather_paged` / `scatter_paged` (the fused kernel for CUDA buffers).
      `use_gpu=False` works on any device (a temporary staging buffer is
      allocated per call when the memory object is on another device).
    * `num_kv_heads`, `head_dim`: optional; when given, the buffers are
      checked against them (otherwise read off the buffers' shape).

    kwargs of `from_gpu` / `to_gpu`:

    * ``kvcaches``: list/tuple over layers of the per-layer buffer(s).
    * ``slot_mapping``: 1-D ints, one slot per token of the WHOLE sequence
      (``slot = block * block_size + offset``); may be longer than `end`.
      Prefix-cached tokens carry -1; `start..end` must not cover any of them.

    Tokens `start..end` are tokens `0..end-start` of the memory object. When
    the memory object's dtype differs from the buffers', values are converted
    (to_gpu rounds to the buffer dtype). `from_gpu` sets the memory object's
    format to KV_BLOB (it must be KV_BLOB or UNDEFINED). `to_gpu` writes only
    the slots of `start..end` and needs them distinct.

    Raises ConnectorError (a ValueError) when: `kvcaches` or `slot_mapping` is
    missing; the buffers do not match the layout, `hidden_dim_size`,
    `num_layers`, or each other; the memory object is not KV_BLOB, has no
    tensor (LMCache: AssertionError), or has the wrong shape / a non-KV dtype /
    a device other than CPU or the buffers'; `slot_mapping` is shorter than
    `end`, holds -1 (or any negative) or an out-of-range slot in `start..end`
    (or, for to_gpu, a repeated slot); `start..end` is not ``0 <= start < end``;
    `use_gpu=True` with non-CUDA buffers.
    """

    def __init__(
        self,
        hidden_dim_size: int,
        num_layers: int,
        use_gpu: bool = False,
        layout: PagedLayout | str = PagedLayout.KV_TUPLE,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        chunk_size: Optional[int] = None,
    ):
        super().__init__(hidden_dim_size, num_layers, layout, use_gpu, num_kv_heads, head_dim, chunk_size)


class PagedMemConnector(_PagedConnector):
    """Paged engine buffers in the V1 layout: per layer a tuple `(K, V)`, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``: LMCache's `VLLMPagedMemGPUConnector`
    (public, for a caller written against it).

    Constructor: ``PagedMemConnector(hidden_dim_size, num_layers,
    num_kv_heads=None, head_dim=None)``. kwargs ``kvcaches`` and
    ``slot_mapping`` (indexed by token position, like `PagedMemConnectorV2`),
    same errors and conversions. This is `PagedMemConnectorV2` with the layout
    fixed to "kv_tuple" and the host path.
    """

    def __init__(
        self,
        hidden_dim_size: int,
        num_layers: int,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
    ):
        super().__init__(hidden_dim_size, num_layers, PagedLayout.KV_TUPLE, False, num_kv_heads, head_dim, None)
