"""`load`: the one entry of the load path. Chunk sources and a destination in, KV in the
destination's buffers out, on the CPU or a GPU, for every codec:

    destination on the CPU        load_chunks: worker threads open, check and copy (raw: straight
                                  from the stored bytes, checked as copied) or decode each chunk
    on a GPU, CacheGen chunks     decoded on the GPU in batches (one launch per batch), scattered
    on a GPU, other chunks        load_chunks_staged: pinned buffers filled (and checked) on
                                  worker threads, copied and scattered on a side stream

A container file's chunks (`file_tasks`), the store's objects (`kvtool.store`) and the vLLM
connector all come through here.
"""

from __future__ import annotations

from typing import Sequence

from ..chunk_source import ChunkSource
from ..errors import KvtoolError
from .pipeline import ChunkTask, Destination, LoadOutcome, _workers, load_chunks
from .staged import load_chunks_staged

#: On a GPU, CacheGen chunks decode this many at a time (one launch each group): enough to fill
#: the device, few enough that the decoded group stays small next to the paged buffers.
GPU_DECODE_BATCH = 32


def load(tasks: Sequence[ChunkTask], destination: Destination, *, threads: int | None = None) -> LoadOutcome:
    """Load `tasks` into `destination` (its `device` decides how; module docstring). `threads`:
    the CPU pipeline's workers (default: the usable cores, at most 8)."""
    tasks = list(tasks)
    device = destination.device
    if device.type != "cuda":
        return load_chunks(tasks, destination, threads=threads)
    if tasks and all(task.codec == "cachegen" for task in tasks):
        return _decode_on_device(tasks, destination, device)
    return load_chunks_staged(tasks, destination, device)


def _decode_on_device(tasks: list[ChunkTask], destination: Destination, device) -> LoadOutcome:
    """Groups of chunks decoded on the GPU in one launch each, scattered in order; the next
    group is read and checked on the loads' worker threads while this one decodes."""
    groups = [tasks[first:first + GPU_DECODE_BATCH] for first in range(0, len(tasks), GPU_DECODE_BATCH)]
    pool = _workers()
    reading = [pool.submit(_opened, task) for task in groups[0]]
    done = 0
    try:
        for number, group in enumerate(groups):
            opened, reading = reading, []
            failure = next((f.exception() for f in opened if f.exception() is not None), None)
            if failure is None and number + 1 < len(groups):
                reading = [pool.submit(_opened, task) for task in groups[number + 1]]
            sources = [f.result() for f in opened if f.exception() is None]
            try:
                if failure is not None:
                    raise failure
                decoded = ChunkSource.decode_many([s for s, _ in sources], device, [p for _, p in sources])
                for task, kv in zip(group, decoded):
                    part = kv[:, :, task.first_row:task.first_row + task.end - task.start]
                    destination.scatter(part.contiguous(), task.start, task.end)
            except KvtoolError as err:  # (which chunk of the group failed is not known: the group's first)
                return LoadOutcome(loaded_tokens=group[0].start, chunks=done, error=err, failed=done)
            finally:
                for source, _ in sources:
                    source.release()
            done += len(group)
    finally:
        for future in reading:  # a group read past a failure: released unused
            if future.exception() is None:
                future.result()[0].release()
    return LoadOutcome(loaded_tokens=tasks[-1].end, chunks=len(tasks))


def _opened(task: ChunkTask) -> tuple[ChunkSource, memoryview]:
    """A chunk opened, its payload read and checked (a worker's part of a GPU decode)."""
    source = task.open()
    source.scan_values = True  # KV for a model: every value finite too
    try:
        return source, source.checked_payload()
    except BaseException:
        source.release()
        raise


__all__ = ["GPU_DECODE_BATCH", "load"]
