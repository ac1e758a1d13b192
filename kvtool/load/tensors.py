"""`load_blob`: chunks loaded into one KV_BLOB tensor, through the one load path.

For what takes KV as a tensor, not into an engine's paged buffers: a blended replay's segment
(`ops.blend`), placed at new positions before the model sees it. Its chunks are opened, checked
(CRC-32C, decode, every value finite) and scattered by `load`, as a replay's are: the checks are
the load path's, not written again here.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..destination import Destination
from .path import load
from .pipeline import ChunkTask


class BlobTarget(Destination):
    """A load's destination that is one KV_BLOB `[2, L, T, C]` on the CPU, allocated up front (the
    pipeline's threads scatter into it at once: each writes its own tokens). It takes decoded KV
    only (`Destination`'s defaults): a raw chunk is checked in the thread's reused buffer, then
    copied in."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype):
        self.device = torch.device("cpu")
        self.kv = torch.empty(shape, dtype=dtype)

    def scatter(self, kv: torch.Tensor, start: int, end: int) -> None:
        self.kv[:, :, start:end].copy_(kv)  # (kv may view a load's reused buffer: copied now)


def load_blob(tasks: Sequence[ChunkTask], shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """The KV_BLOB of `shape` that `tasks` cover from token 0, loaded through `load`; the first
    chunk refused (ChecksumMismatch, DecodeError, NonFiniteValues, ...) is raised, named."""
    target = BlobTarget(shape, dtype)
    outcome = load(tasks, target)
    if outcome.error is not None:
        raise outcome.error
    return target.kv


__all__ = ["BlobTarget", "load_blob"]
