"""Memory objects: the host-side (or device-side) tensor a connector fills or drains.

A `MemoryObj` is a thin holder of one tensor plus metadata. The connectors in
this package only produce and consume the `KV_BLOB` format:

    KV_BLOB = [2, num_layers, num_tokens, num_kv_heads * head_dim]

K first (index 0), then V (index 1); contiguous; one of the KV dtypes
(bfloat16, float16, float32). That is exactly the canonical per-chunk layout
kvtool's file format stores, so a filled memory object can be handed to a codec
as is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch



class MemoryFormat(enum.Enum):
    """What the bytes of a memory object mean."""

    #: Nothing written yet / not known. `from_gpu` accepts it and sets KV_BLOB.
    UNDEFINED = 0
    #: `[2, num_layers, num_tokens, num_kv_heads * head_dim]`, K then V.
    KV_BLOB = 1
    #: Opaque encoded bytes (a codec's payload); connectors refuse it.
    BINARY = 2


@dataclass
class MemoryObjMetadata:
    """Metadata carried next to the tensor.

    `fmt` is the only field the connectors read or write. `extra` is free-form
    (e.g. a chunk key, the token range) and is never interpreted here."""

    fmt: MemoryFormat = MemoryFormat.UNDEFINED
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class MemoryObj:
    """A tensor plus its `MemoryObjMetadata`.

    `tensor` may be None (a released object); every connector then raises
    ValueError (where LMCache's contract speaks of an AssertionError)."""

    tensor: Optional[torch.Tensor]
    metadata: MemoryObjMetadata = field(default_factory=MemoryObjMetadata)

    @classmethod
    def allocate(
        cls,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        *,
        pin_memory: bool = False,
        fmt: MemoryFormat = MemoryFormat.KV_BLOB,
    ) -> "MemoryObj":
        """A new, uninitialised, contiguous memory object."""
        t = torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=pin_memory)
        return cls(t, MemoryObjMetadata(fmt=fmt))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> "MemoryObj":
        """Wrap an existing tensor (no copy)."""
        return cls(tensor, MemoryObjMetadata(fmt=fmt))

    @property
    def fmt(self) -> MemoryFormat:
        return self.metadata.fmt

    @property
    def shape(self) -> Optional[torch.Size]:
        return None if self.tensor is None else self.tensor.shape

    @property
    def dtype(self) -> Optional[torch.dtype]:
        return None if self.tensor is None else self.tensor.dtype

    @property
    def device(self) -> Optional[torch.device]:
        return None if self.tensor is None else self.tensor.device
