"""The connector contract (after LMCache's `GPUConnectorInterface`) and shared checks.

A connector moves the KV of tokens `start..end` of a sequence between an
inference engine's KV buffers and a KV_BLOB:

* `from_gpu(memory_obj, start, end, **kwargs)`: engine buffers -> memory object (LMCache's contract).
* `to_gpu(memory_obj, start, end, **kwargs)`:   memory object -> engine buffers (LMCache's contract).
* `gather(blob, start, end, **kwargs)` / `scatter(blob, start, end, **kwargs)`: the same with the
  KV_BLOB tensor itself, what kvtool uses inside (no `MemoryObj` made to be unwrapped again).
* `to_gpu_source(source, start, end, **kwargs)`: a stored chunk (`ChunkSource`) -> engine
  buffers, checked as it is copied.
* `get_shape(num_tokens)`: the KV_BLOB shape for `num_tokens` tokens.

Every documented failure raises `ConnectorError`, a `ValueError` (as the
contract says) that is also a `KvtoolError`, so the CLI reports it in one line.
Where LMCache's contract raises AssertionError for a memory object without a
tensor, we raise `ConnectorError` too.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from ..destination import Destination
from ..errors import ConnectorError
from .memory import MemoryFormat, MemoryObj

if TYPE_CHECKING:
    from ..chunk_source import ChunkSource

#: dtypes a KV_BLOB memory object may have (the kvtool file format's KV dtypes).
BLOB_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GPUConnectorInterface(ABC):
    """Moves KV between engine buffers and KV_BLOB memory objects.

    `hidden_dim_size` is `num_kv_heads * head_dim`; `num_layers` the number of
    attention layers the engine buffers hold (and the blob's second dim)."""

    def __init__(self, hidden_dim_size: int, num_layers: int):
        for name, v in (("hidden_dim_size", hidden_dim_size), ("num_layers", num_layers)):
            if not _is_int(v) or v < 1:
                raise ConnectorError(f"{name} must be a positive int, got {v!r}")
        self.hidden_dim_size = int(hidden_dim_size)
        self.num_layers = int(num_layers)

    @abstractmethod
    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy the KV of tokens `start..end` from the engine buffers into `memory_obj`."""

    @abstractmethod
    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy `memory_obj` into the engine buffers at tokens `start..end`."""

    def gather(self, blob: torch.Tensor, start: int, end: int, **kwargs: Any) -> None:
        """`from_gpu` into a KV_BLOB tensor: the KV of tokens `start..end` from the engine buffers
        into `blob` (`get_shape(end - start)`, contiguous, a KV dtype, on the CPU or the buffers'
        device). kvtool's connectors take the tensor as it is; this default, for a connector that
        implements only LMCache's contract, hands it to `from_gpu` in a `MemoryObj`."""
        self.from_gpu(MemoryObj.from_tensor(blob), start, end, **kwargs)

    def scatter(self, blob: torch.Tensor, start: int, end: int, **kwargs: Any) -> None:
        """`to_gpu` from a KV_BLOB tensor: `blob` into the engine buffers at tokens `start..end`
        (same rules as `gather`). This default hands it to `to_gpu` in a `MemoryObj`."""
        self.to_gpu(MemoryObj.from_tensor(blob), start, end, **kwargs)

    def to_gpu_source(self, source: "ChunkSource", start: int, end: int, **kwargs: Any) -> None:
        """Copy a stored chunk (`kvtool.chunk_source.ChunkSource`, tokens `start..end` exactly)
        into the engine buffers, from checked bytes. Here: decoded (checked first), then `scatter`;
        the paged and nested connectors copy a raw chunk straight from its stored bytes instead,
        checking them as they copy (one pass)."""
        self.scatter(source.decode(), start, end, **kwargs)

    def target(self, **kwargs: Any) -> "ConnectorTarget":
        """The engine buffers these transfer keywords name (`kvcaches=`, `slot_mapping=`) as the
        destination of a load (`kvtool.load.load`)."""
        return ConnectorTarget(self, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        """KV_BLOB shape: `[2, num_layers, num_tokens, hidden_dim_size]`."""
        if not _is_int(num_tokens) or num_tokens < 0:
            raise ConnectorError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return torch.Size([2, self.num_layers, int(num_tokens), self.hidden_dim_size])

    def allocate(
        self,
        num_tokens: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        *,
        pin_memory: bool = False,
    ) -> MemoryObj:
        """A new KV_BLOB memory object sized for `num_tokens` tokens."""
        return MemoryObj.allocate(self.get_shape(num_tokens), dtype, device, pin_memory=pin_memory)

    # ---- checks shared by the concrete connectors --------------------------

    @staticmethod
    def _check_range(start: Any, end: Any, limit: int | None = None) -> tuple[int, int]:
        """`0 <= start < end` (and `end <= limit` when known)."""
        if not _is_int(start) or not _is_int(end):
            raise ConnectorError(f"start and end must be ints, got {start!r}, {end!r}")
        start, end = int(start), int(end)
        if start < 0 or end <= start:
            raise ConnectorError(f"invalid token range start={start}, end={end} (need 0 <= start < end)")
        if limit is not None and end > limit:
            raise ConnectorError(f"token range end={end} is past the {limit} tokens the buffers hold")
        return start, end

    @staticmethod
    def _require_kwarg(kwargs: dict[str, Any], name: str) -> Any:
        value = kwargs.get(name)
        if value is None:
            raise ConnectorError(f"'{name}' must be provided in kwargs")
        return value

    @staticmethod
    def _tensor_of(memory_obj: MemoryObj, *, reading: bool) -> torch.Tensor:
        """The tensor of a `MemoryObj` handed to `to_gpu` (`reading`: its format must be KV_BLOB)
        or `from_gpu` (KV_BLOB or UNDEFINED): LMCache's contract, at its surface only; the tensor
        itself is checked by `gather` / `scatter` (`_check_blob`)."""
        if not isinstance(memory_obj, MemoryObj):
            raise ConnectorError(f"expected a MemoryObj, got {type(memory_obj).__name__}")
        fmt = memory_obj.metadata.fmt
        allowed = (MemoryFormat.KV_BLOB,) if reading else (MemoryFormat.KV_BLOB, MemoryFormat.UNDEFINED)
        if fmt not in allowed:
            raise ConnectorError(f"memory object must be in KV_BLOB format, got {fmt.name}")
        t = memory_obj.tensor
        if t is None:
            raise ConnectorError("memory object has no tensor")
        if not isinstance(t, torch.Tensor):
            raise ConnectorError(f"memory object tensor is a {type(t).__name__}, not a torch.Tensor")
        return t

    def _check_blob(self, t: Any, num_tokens: int, buffer_device: torch.device) -> torch.Tensor:
        """`t` checked as the KV_BLOB of a transfer of `num_tokens` tokens: a contiguous tensor of
        shape `get_shape(num_tokens)`, of a KV dtype (it may differ from the buffers' dtype: values
        are converted), on the CPU or on the buffers' device."""
        if not isinstance(t, torch.Tensor):
            raise ConnectorError(f"the KV_BLOB is a {type(t).__name__}, not a torch.Tensor")
        want = self.get_shape(num_tokens)
        if t.shape != want:
            raise ConnectorError(f"the KV_BLOB has shape {tuple(t.shape)}, expected {tuple(want)}")
        if t.dtype not in BLOB_DTYPES:
            raise ConnectorError(f"the KV_BLOB's dtype {t.dtype} is not one of bfloat16, float16, float32")
        if t.device.type != "cpu" and t.device != buffer_device:
            raise ConnectorError(
                f"the KV_BLOB is on {t.device}; it must be on the CPU or on the buffers' device {buffer_device}"
            )
        if not t.is_contiguous():
            raise ConnectorError("the KV_BLOB must be contiguous")
        return t


def _is_int(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


class ConnectorTarget(Destination):
    """An engine's buffers, seen through a connector, as a load's destination (`kvtool.load`):
    decoded KV goes through `to_gpu`; a whole stored chunk through `to_gpu_source`, which copies a
    raw chunk straight from its stored bytes, checked as it copies. Tokens [start, end) of a load
    go to the slots of [start, end)."""

    def __init__(self, connector: GPUConnectorInterface, **kwargs: Any):
        self.connector = connector
        self.kwargs = kwargs
        self.device = _device_of(kwargs.get("kvcaches"))

    def scatter(self, kv: torch.Tensor, start: int, end: int) -> None:
        self.connector.scatter(kv, start, end, **self.kwargs)

    def takes_sources(self) -> bool:
        return True

    def scatter_source(self, source: "ChunkSource", start: int, end: int) -> None:
        self.connector.to_gpu_source(source, start, end, **self.kwargs)


def _device_of(buffers: Any) -> torch.device:
    """The device of an engine's buffers (a tensor, or nested lists and tuples of them)."""
    while isinstance(buffers, (list, tuple)) and buffers:
        buffers = buffers[0]
    return buffers.device if isinstance(buffers, torch.Tensor) else torch.device("cpu")
