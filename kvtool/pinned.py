"""Pinned host buffers for uploads to a GPU, kept between uses: allocating (and zeroing) pinned
memory costs about as much as copying into it, so a load reuses what the last one used.

    take(nbytes, device)     a `Lease` of a pinned uint8 buffer of at least `nbytes`, free to fill
                             (the GPU has finished reading it: the event it came back with is waited on)
    give(lease, event)       back to the pool once the copy that reads it is queued (`event`: its event)
    holding(address)         the lease whose buffer holds that host address, if any: payloads read
                             straight into one need not be copied into another before an upload

Nothing here imports anything of kvtool's: the load path and the GPU codecs share it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Buffers kept per device (each the largest a use asked for).
KEEP = 2

_kept: "dict[object, list[tuple[torch.Tensor, object]]]" = {}
_taken: "dict[int, Lease]" = {}  # address -> the lease of a buffer taken and not given back
_lock = threading.Lock()


class Lease:
    """A pinned buffer taken from the pool, until it is given back (once: a second give is a no-op)."""

    __slots__ = ("buffer", "device", "given")

    def __init__(self, buffer: "torch.Tensor", device: object):
        self.buffer, self.device, self.given = buffer, device, False


def take(nbytes: int, device: "torch.device") -> Lease:
    import torch

    with _lock:
        kept = _kept.get(device) or []
        entry = kept.pop() if kept else None
    buffer = None
    if entry is not None:
        buffer, event = entry
        if event is not None:
            event.synchronize()  # the GPU has read what it held
        if buffer.numel() < nbytes:
            buffer = None
    if buffer is None:
        # (pinned for a GPU; plain memory otherwise: the same steps run on the CPU in tests)
        buffer = torch.empty(max(nbytes, 4), dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")
    lease = Lease(buffer, device)
    with _lock:
        _taken[buffer.data_ptr()] = lease
    return lease


def give(lease: Lease, event: object | None = None) -> None:
    """Back to the pool; `event`: recorded after the copy that reads the buffer was queued."""
    with _lock:
        if lease.given:
            return
        lease.given = True
        if _taken.get(lease.buffer.data_ptr()) is lease:
            del _taken[lease.buffer.data_ptr()]
        kept = _kept.setdefault(lease.device, [])
        if len(kept) < KEEP:
            kept.append((lease.buffer, event))


def holding(address: int) -> Lease | None:
    """The lease of the taken buffer whose bytes include host `address` (None: not one of ours)."""
    with _lock:
        for start, lease in _taken.items():
            if start <= address < start + lease.buffer.numel():
                return lease
    return None
