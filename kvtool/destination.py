"""`Destination`: where a load (`kvtool.load.load`) puts KV, declared once.

Every destination takes decoded KV (`scatter`). What more it takes it says itself, by answering
the load path's questions; the defaults say "not taken", so a destination that only takes decoded
KV overrides nothing but `scatter`:

    takes_sources()       scatter_source(source, start, end): a whole raw chunk copied straight
                          from its stored bytes, checked as copied (one pass instead of three)
    takes_source_runs()   scatter_sources(sources, start, end): several of them, one after the
                          other, in one call (the native copy shares them among its threads)

The destinations of kvtool: an engine's paged buffers seen through a connector
(`kvtool.connectors.ConnectorTarget`, `connector.target(...)`; the Hugging Face cache and the vLLM
connector's blocks are such buffers), one KV_BLOB tensor (`kvtool.load.BlobTarget`) and a tensor
per chunk (the store's `TensorTarget`). It sits below both the connectors and the load path, which
are siblings: each imports it, neither the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .chunk_source import ChunkSource
    from .errors import KvtoolError


class Destination(ABC):
    """Where a load puts KV (see the module docstring). `device`: where its buffers are (it
    decides the load's path: worker threads on the CPU, pinned buffers and a side stream on a GPU)."""

    device: "torch.device"

    @abstractmethod
    def scatter(self, kv: "torch.Tensor", start: int, end: int) -> None:
        """Decoded KV of tokens [start, end): `[2, L, end - start, C]`, contiguous; valid during
        the call only (it may view a reused buffer: a destination that keeps it copies it)."""

    def takes_sources(self) -> bool:
        """Whether `scatter_source` takes a whole raw chunk from its stored bytes. False (this
        default): every chunk reaches `scatter` decoded, its bytes checked first."""
        return False

    def scatter_source(self, source: "ChunkSource", start: int, end: int) -> None:
        """A whole stored chunk of tokens [start, end), copied from its stored bytes and checked as
        copied (ChecksumMismatch after the copy when they are damaged). Called only when
        `takes_sources()`."""
        raise NotImplementedError(f"{type(self).__name__} takes decoded KV only (takes_sources() is False)")

    def takes_source_runs(self) -> bool:
        """Whether `scatter_sources` may take runs of whole raw chunks in one call. False: this default."""
        return False

    def scatter_sources(self, sources: "list[ChunkSource]", start: int,
                        end: int) -> "list[KvtoolError | None] | None":
        """Whole raw chunks in memory or a mapping, one after the other, tokens [start, end) in all,
        copied and checked as `scatter_source` does each: per chunk None (loaded) or why it is
        refused; None when not taken this time (nothing written: the load goes chunk by chunk).
        Called only when `takes_source_runs()`; this default takes none."""
        return None


__all__ = ["Destination"]
