"""`ConnectorTarget`: an engine's KV buffers, seen through a connector, as the destination of a load
(`kvtool.load.load`). Decoded KV goes through `to_gpu`; a whole stored chunk through
`to_gpu_source`, which copies a raw chunk straight from its stored bytes, checked as it copies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .base import GPUConnectorInterface
from .memory import MemoryObj

if TYPE_CHECKING:
    from ..chunk_source import ChunkSource


class ConnectorTarget:
    """`connector`'s engine buffers with the keyword arguments its transfers take (`kvcaches=`,
    `slot_mapping=`): tokens [start, end) of a load go to the slots of [start, end)."""

    def __init__(self, connector: GPUConnectorInterface, **kwargs: Any):
        self.connector = connector
        self.kwargs = kwargs
        self.device = _device_of(kwargs.get("kvcaches"))

    def scatter(self, kv: torch.Tensor, start: int, end: int) -> None:
        self.connector.to_gpu(MemoryObj.from_tensor(kv), start, end, **self.kwargs)

    def scatter_source(self, source: "ChunkSource", start: int, end: int) -> None:
        self.connector.to_gpu_source(source, start, end, **self.kwargs)


def _device_of(buffers: Any) -> torch.device:
    """The device of an engine's buffers (a tensor, or nested lists and tuples of them)."""
    while isinstance(buffers, (list, tuple)) and buffers:
        buffers = buffers[0]
    return buffers.device if isinstance(buffers, torch.Tensor) else torch.device("cpu")
