"""`load`: the one entry of the load path. Chunk sources and a destination in, KV in the
destination's buffers out, on the CPU or a GPU, for every codec:

    destination on the CPU        load_chunks: worker threads open, check and copy (raw: straight
                                  from the stored bytes, checked as copied) or decode each chunk
    on a GPU, chunks of a codec   decoded on the GPU in batches (one launch per batch), scattered
    that decodes in device        in order (the codec says so: `decodes_in_device_batches`;
    batches (CacheGen)            CacheGen's does)
    on a GPU, other chunks        load_chunks_staged: pinned buffers filled (and checked) on
                                  worker threads, copied and scattered on a side stream

A container file's chunks (`file_tasks`), the store's objects (`kvtool.store`) and the vLLM
connector all come through here.
"""

from __future__ import annotations

from concurrent.futures import wait
from typing import Sequence

from .. import pinned
from ..chunk_source import ChunkSource
from ..errors import KvtoolError
from .pipeline import ChunkTask, Destination, LoadOutcome, _workers, as_destination, load_chunks
from .staged import load_chunks_staged

#: On a GPU, chunks whose codec decodes in device batches (CacheGen) decode this many at a time (one launch each group), the next group
#: read into pinned memory while one decodes: enough to fill the device, few enough that reading
#: overlaps decoding. H100, 8B geometry, 8,192 tokens (bench_load, one run): groups of 32 29.4 GB/s,
#: 16 32.0, 8 24.5; at 2,048 tokens 18.4 / 20.1 / 19.1.
GPU_DECODE_BATCH = 16


def load(tasks: Sequence[ChunkTask], destination: Destination, *, threads: int | None = None) -> LoadOutcome:
    """Load `tasks` into `destination` (its `device` decides how; module docstring). `threads`:
    the CPU pipeline's workers (default: the usable cores, at most 8)."""
    tasks = list(tasks)
    destination = as_destination(destination)
    device = destination.device
    if device.type != "cuda":
        return load_chunks(tasks, destination, threads=threads)
    if tasks and all(task.codec is not None and task.codec.decodes_in_device_batches for task in tasks):
        return _decode_on_device(tasks, destination, device)
    return load_chunks_staged(tasks, destination, device)


def _decode_on_device(tasks: list[ChunkTask], destination: Destination, device) -> LoadOutcome:
    """Groups of chunks decoded on the GPU in one launch each, scattered in order. Each group's
    payloads are read and checked by the loads' worker threads straight into one pinned buffer,
    at the places the decoder's upload takes them from (no copy on this thread), the next group's
    while this one decodes."""
    groups = [tasks[first:first + GPU_DECODE_BATCH] for first in range(0, len(tasks), GPU_DECODE_BATCH)]
    reading = _GroupRead(groups[0], device)
    done = 0
    try:
        for number, group in enumerate(groups):
            current, reading = reading, None
            try:
                sources, payloads = current.wait()  # (a failure: the group's first chunk is blamed)
                if number + 1 < len(groups):
                    reading = _GroupRead(groups[number + 1], device)
                decoded = ChunkSource.decode_many(sources, device, payloads)
                for task, kv in zip(group, decoded):
                    part = kv[:, :, task.first_row:task.first_row + task.end - task.start]
                    destination.scatter(part.contiguous(), task.start, task.end)
            except KvtoolError as err:  # (which chunk of the group failed is not known: the group's first)
                return LoadOutcome(loaded_tokens=group[0].start, chunks=done, error=err, failed=done)
            finally:
                current.release()
            done += len(group)
    finally:
        if reading is not None:  # a group read past a failure: released unused
            reading.release()
    return LoadOutcome(loaded_tokens=tasks[-1].end, chunks=len(tasks))


class _GroupRead:
    """One group's chunks opened and their payloads read and checked on the loads' worker threads,
    into one pinned buffer (`kvtool.pinned`), each at a 4-byte aligned place, in order."""

    def __init__(self, group: list[ChunkTask], device):
        self.device, self.lease, self.sources, self.error = device, None, [], None
        pool = _workers()
        opening = [pool.submit(_opened, task) for task in group]
        wait(opening)
        for future in opening:
            if future.exception() is None:
                self.sources.append(future.result())
            elif self.error is None:
                self.error = future.exception()
        self.filling = []
        if self.error is not None:
            return
        starts = [0]
        for source in self.sources:
            starts.append(starts[-1] + ((source.length + 3) & ~3))
        self.lease = pinned.take(starts[-1], device)
        view = memoryview(self.lease.buffer.numpy())
        self.filling = [pool.submit(_filled, source, view[a:b]) for source, a, b in zip(self.sources, starts, starts[1:])]

    def wait(self) -> tuple[list[ChunkSource], list[memoryview]]:
        if self.error is not None:
            raise self.error
        wait(self.filling)
        failure = next((f.exception() for f in self.filling if f.exception() is not None), None)
        if failure is not None:
            raise failure
        return self.sources, [f.result() for f in self.filling]

    def release(self) -> None:
        wait(self.filling)
        for source in self.sources:
            source.release()
        if self.lease is not None:
            pinned.give(self.lease)  # (a no-op when the decoder's upload gave it back already)


def _opened(task: ChunkTask) -> ChunkSource:
    """A chunk opened (a worker's part of a GPU decode); every value is to be finite."""
    source = task.open()
    source.scan_values = True  # KV for a model: every value finite too
    return source


def _filled(source: ChunkSource, place: memoryview) -> memoryview:
    """The chunk's payload read and checked into `place` (its length rounded up to 4 bytes: the
    rest zeroed), or wherever its bytes already are, private (a memory tier's own copy)."""
    payload = source.checked_payload(lambda n: place[:n])
    place[source.length:] = bytes(len(place) - source.length)
    return payload


__all__ = ["GPU_DECODE_BATCH", "load"]
