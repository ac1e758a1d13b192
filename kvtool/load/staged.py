"""`load_chunks_staged`: the load path into buffers on a GPU.

    worker threads            the caller's thread                  a side stream on the GPU
    ──────────────            ───────────────────                  ────────────────────────
    chunk i: read + check ──► in order: copy staging i → GPU ────► H2D copy i, scatter i
      into staging (i % n)      (non-blocking), scatter it,        (overlapping the reads of
                                record event (i % n)                i+1.. on the host)

Host side: each of `staging` pinned buffers (kept between loads) holds one chunk. A whole raw chunk is copied from
its stored bytes into its pinned buffer and CRC-checked in the same pass (`ChunkSource.copy_into`:
the native one-pass copy, behind the fault guard for a mapping; a store object's file is read
straight into the buffer); other chunks are decoded on the CPU from checked bytes and copied in. A buffer is refilled only once the event recorded
after its last host-to-device copy has completed, so at most `staging` chunks are in flight.

Device side: the host-to-device copies and the scatters run on one side stream, in chunk order;
the caller's stream waits for it at the end. So reading and checking chunk i+1.. on the host
overlaps copying and scattering chunk i on the GPU.

The failure rule is `load_chunks`': the first chunk that fails ends the load at its start.

Without CUDA (device "cpu": the tests) the same steps run with ordinary buffers, no stream and
synchronous copies, so the ordering, the buffer reuse and the failure rule are tested everywhere.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Sequence

import torch

from ..devices import host_threads, thread_share
from ..dtypes import dtype_from_name
from ..errors import KvtoolError
from .pipeline import _WORKER_PREFIX, ChunkTask, Destination, LoadOutcome, _as_blob, _workers, load_threads, thread_buffer

#: Pinned buffers kept between loads, per device: allocating pinned memory costs about as much as
#: copying it (an 8B model's 32 MiB chunk: ~5 ms), so a load that allocated its own spent a third
#: of its time there (measured on an H200: 3 fresh buffers a load, 15 GB/s).
_POOL: dict[torch.device, list[tuple[torch.Tensor, "torch.cuda.Event | None"]]] = {}
_POOL_LOCK = threading.Lock()
POOL_KEEP = 16  # buffers kept per device at most


class _Staging:
    """The pinned host buffers and the events that say when each may be refilled."""

    def __init__(self, count: int, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.events: list[torch.cuda.Event | None] = [None] * count
        if self.cuda:  # buffers an earlier load left, with the events of their last copies
            with _POOL_LOCK:
                kept = _POOL.get(device, [])
                for slot in range(min(count, len(kept))):
                    self.buffers[slot], self.events[slot] = kept.pop()

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Buffer `slot`, at least `nbytes`, once its last copy to the device is done."""
        event = self.events[slot]
        if event is not None:
            event.synchronize()  # releases the GIL while it waits
        buf = self.buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        return buf[:nbytes]

    def copied(self, slot: int, stream) -> None:
        if self.cuda:
            event = self.events[slot] = torch.cuda.Event()
            event.record(stream)

    def give_back(self) -> None:
        """The buffers to the pool for the next load (its first use of one waits for the copy
        recorded here: nothing is overwritten while the GPU still reads it)."""
        if not self.cuda:
            return
        with _POOL_LOCK:
            kept = _POOL.setdefault(self.device, [])
            for buf, event in zip(self.buffers, self.events):
                if buf is not None and len(kept) < POOL_KEEP:
                    kept.append((buf, event))


def _fill(task: ChunkTask, slot: int, staging: _Staging, share: int) -> torch.Tensor:
    """Chunk `task` in staging buffer `slot`, as a KV_BLOB of its tokens [start, end) (its native
    copies and coders on `share` threads: the others fill other buffers meanwhile)."""
    with thread_share(share), task.open() as source:
        source.scan_values = True  # KV for a model: every value finite too
        if source.raw and task.first_row == 0 and task.end - task.start == source.num_tokens:
            buf = staging.buffer(slot, source.length)
            source.copy_into(memoryview(buf.numpy()))  # copied and checked in one pass
            return buf.view(dtype_from_name(source.dtype)).view(source.shape)
        kv = _as_blob(source.decode(buffer=thread_buffer), task.first_row, task.end - task.start)
    buf = staging.buffer(slot, kv.numel() * kv.element_size())
    out = buf.view(kv.dtype).view(kv.shape)
    out.copy_(kv)
    return out


def load_chunks_staged(tasks: Sequence[ChunkTask], destination: Destination, device: torch.device | str, *,
                       staging: int | None = None, threads: int | None = None) -> LoadOutcome:
    """Load `tasks` into a destination on `device`: `destination.scatter(kv_on_device, start,
    end)` runs on a side stream, in chunk order (see the module docstring). `threads` read and
    check chunks at once (default: the usable cores, at most 8: one thread reads and checks a
    raw chunk at ~6 GB/s, a GPU takes 50); `staging` buffers (default threads + 1) hold them."""
    tasks = list(tasks)
    device = torch.device(device)
    if not tasks:
        return LoadOutcome(loaded_tokens=0, chunks=0)
    threads = max(1, threads or load_threads(len(tasks)))
    staging = max(1, staging or min(threads + 1, len(tasks)))
    threads = min(threads, staging)
    share = max(1, host_threads() // threads)
    slots = _Staging(staging, device)
    stream = torch.cuda.Stream(device) if slots.cuda else None
    nested = threading.current_thread().name.startswith(_WORKER_PREFIX)
    private = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtool-stage") if nested else None
    pool = private or _workers()  # the loads' shared threads (no start-up per load), unless inside one
    outcome: LoadOutcome | None = None
    filling: dict[int, Future] = {}
    try:
        def start(i: int) -> None:
            if i < len(tasks):
                filling[i] = pool.submit(_fill, tasks[i], i % staging, slots, share)

        for i in range(min(staging, len(tasks))):
            start(i)
        for i, task in enumerate(tasks):
            try:
                host = filling.pop(i).result()
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    kv = host.to(device, non_blocking=True) if slots.cuda else host
                    slots.copied(i % staging, stream)  # the staging buffer is free once this copy is done
                    destination.scatter(kv, task.start, task.end)
            except KvtoolError as err:
                outcome = LoadOutcome(loaded_tokens=task.start, chunks=i, error=err, failed=i)
                break
            start(i + staging)  # on the CPU the scatter was synchronous: the buffer is free already
    finally:
        for future in filling.values():  # chunks read past a failure: never scattered
            future.cancel()
        for future in filling.values():  # ... but a fill under way still writes its buffer
            if not future.cancelled():
                future.exception()
        if private is not None:
            private.shutdown(wait=True)
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
        slots.give_back()
    return outcome or LoadOutcome(loaded_tokens=tasks[-1].end, chunks=len(tasks))
