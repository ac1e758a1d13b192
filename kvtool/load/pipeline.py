"""`load_chunks`: open, check and copy or decode chunks on worker threads, each scattered where it
was read.

    tasks:        ChunkTask(start, end, open) in token order; open() -> the chunk's `ChunkSource`
                  (kvtool.chunk_source: where its bytes are, what they are, how they become KV)
    destination:  a `Destination` (kvtool.destination): scatter(kv [2, L, end - start, C]
                  contiguous, start, end): decoded KV; when it `takes_sources()`,
                  scatter_source(source, start, end): a whole raw chunk straight from its stored
                  bytes, CRC-checked as it is copied (the bytes are read once, not three times);
                  when it `takes_source_runs()`, scatter_sources(sources, start, end): several
                  whole raw chunks, one after the other from `start`, in one native call

Raw whole chunks whose bytes are in a mapping (a container file's, a hot store object's) go
together: opened in order on the calling thread, then copied and checked by one native call that
shares them among the threads (`scatter_sources`); a raw chunk of a mapping or a file that cannot
join a run (part of a chunk, a payload still in its file) loads alone between runs. From a chunk
that needs decoding or was fetched into memory, and in any load into a destination without that
call, chunks go one by one on worker threads: at most `threads` in flight.

The first chunk that fails ends the load: tokens [0, its start) are loaded and reported; chunks
after it may have been scattered already but lie past the loaded prefix (an engine computes
those slots again).
"""

from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..chunk_source import ChunkSource
from ..destination import Destination
from ..devices import host_threads, thread_share
from ..errors import KvtoolError, ShapeMismatch


@dataclass(frozen=True)
class ChunkTask:
    start: int
    end: int  # tokens [start, end) of this chunk are loaded
    open: Callable[[], ChunkSource]  # the chunk (its token 0 is `origin`), opened where it is loaded
    origin: int | None = None  # default: start
    # the chunk's codec (a `kvtool.codecs.Codec`) when known before it is opened (a file's manifest:
    # `ChunkEntry.codec_object`): the load asks it how the chunk loads (`payload_is_tensor_bytes`,
    # `decodes_in_device_batches`), never compares its name
    codec: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.codec, str):  # (what ChunkTask took before: a name, which the load cannot ask)
            warnings.warn("ChunkTask(codec=NAME) is deprecated and ignored: pass the codec itself, "
                          "kvtool.codecs.get_codec(NAME)", DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "codec", None)

    @property
    def first_row(self) -> int:
        return 0 if self.origin is None else self.start - self.origin


def as_destination(destination: Any) -> Destination:
    """`destination` as a `Destination`. An object that only has `device` and `scatter` (what a
    destination had to have before `Destination` was declared) still loads, as a destination of
    decoded KV, with a DeprecationWarning."""
    if isinstance(destination, Destination):
        return destination
    warnings.warn(f"a load's destination ({type(destination).__name__}) that does not subclass "
                  "kvtool.load.Destination is deprecated: subclass it (it gets decoded KV only, through "
                  "scatter)", DeprecationWarning, stacklevel=3)
    return _DecodedOnly(destination)


class _DecodedOnly(Destination):
    """An undeclared destination (`as_destination`): decoded KV through its `scatter`."""

    def __init__(self, destination: Any):
        self.device, self._scatter = destination.device, destination.scatter

    def scatter(self, kv: torch.Tensor, start: int, end: int) -> None:
        self._scatter(kv, start, end)


@dataclass
class LoadOutcome:
    loaded_tokens: int  # tokens [0, loaded_tokens) are in the paged buffers
    chunks: int  # chunks loaded, from the first
    error: KvtoolError | None = None  # why the load stopped early (None: every task loaded)
    failed: int | None = field(default=None)  # index of the task that failed


MAX_LOAD_THREADS = 8
_WORKER_PREFIX = "kvtool-load"
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process it belongs to, the pool)
_pool_lock = threading.Lock()


def load_threads(tasks: int) -> int:
    """Worker threads: KVTOOL_THREADS or the usable cores, at most 8, never more than tasks."""
    return max(1, min(host_threads(), MAX_LOAD_THREADS, tasks))


def _workers() -> ThreadPoolExecutor:
    """The loads' worker threads, started once per process (a load of a few chunks would
    otherwise spend as long starting threads as copying); a forked child starts its own."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(max_workers=MAX_LOAD_THREADS, thread_name_prefix=_WORKER_PREFIX))
        return _pool[1]


def _as_blob(kv: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Tokens [first, first + count) of a decoded chunk, contiguous (a view when the chunk is whole)."""
    if first < 0 or first + count > kv.shape[2]:
        raise ShapeMismatch(f"a chunk of {kv.shape[2]} tokens has no tokens [{first}, {first + count})")
    part = kv if (first, count) == (0, kv.shape[2]) else kv[:, :, first:first + count]
    return part if part.is_contiguous() else part.contiguous()


def load_chunks(tasks: Sequence[ChunkTask], destination: Destination, *, threads: int | None = None) -> LoadOutcome:
    """Load `tasks` into a destination on the CPU, several chunks at once (module docstring)."""
    tasks = list(tasks)
    destination = as_destination(destination)
    if not tasks:
        return LoadOutcome(loaded_tokens=0, chunks=0)
    threads = threads or load_threads(len(tasks))
    if threading.current_thread().name.startswith(_WORKER_PREFIX):
        threads = 1  # a load inside a load's worker runs in place: waiting on the pool could deadlock it
    if destination.takes_source_runs() and threads > 1:
        return _load_together(tasks, destination, threads)
    return _load_each(tasks, destination, threads)


def _load_each(tasks: list[ChunkTask], destination: Destination, threads: int) -> LoadOutcome:
    """`load_chunks` chunk by chunk: on `threads` threads, each chunk opened, checked and copied
    (`scatter_source`, when the destination takes it) or decoded (`scatter`) where it was read."""
    share = max(1, host_threads() // threads)  # each worker's native copies take cores / workers
    copies_sources = destination.takes_sources()

    def run(task: ChunkTask) -> None:
        with thread_share(share), task.open() as source:
            source.scan_values = True  # KV for a model: every value finite too
            if copies_sources and source.raw and task.first_row == 0 and task.end - task.start == source.num_tokens:
                destination.scatter_source(source, task.start, task.end)  # checked as copied
            else:  # (the scatter is done with the KV before this thread decodes the next chunk)
                destination.scatter(_as_blob(source.decode(buffer=thread_buffer), task.first_row,
                                             task.end - task.start), task.start, task.end)

    if threads == 1:  # no pool: the same steps in order
        for i, task in enumerate(tasks):
            try:
                run(task)
            except KvtoolError as err:
                return LoadOutcome(loaded_tokens=task.start, chunks=i, error=err, failed=i)
        return LoadOutcome(loaded_tokens=tasks[-1].end, chunks=len(tasks))

    done = _run_shared(tasks, run, threads)
    for i, task in enumerate(tasks):
        err = done.get(i)
        if i not in done or err is not None:
            if err is not None and not isinstance(err, KvtoolError):
                raise err  # a bug, not bad input: never swallowed
            return LoadOutcome(loaded_tokens=task.start, chunks=i, error=err, failed=i)
    return LoadOutcome(loaded_tokens=tasks[-1].end, chunks=len(tasks))


#: Chunks in one native call at most (a longer prefix takes several calls).
TOGETHER_CHUNKS = 64


def _together(source: ChunkSource, task: ChunkTask, start: int) -> bool:
    """Whether the chunk can go in a native call with the chunks before it (which end at `start`):
    raw, whole, next in line, its bytes in a mapping (a file's, a kept store object's: nothing
    held in memory for it, however many go together)."""
    return source.raw and source.mapped and source.data is not None and task.start == start \
        and task.first_row == 0 and task.end - task.start == source.num_tokens


def _open_run(tasks: list[ChunkTask], first: int,
              size: int) -> tuple[list[ChunkSource], ChunkSource | None, KvtoolError | None]:
    """Up to `size` chunks from tasks[first] on that can go together, opened in order; then the
    chunk after them when it is open but cannot join (second), or why it failed to open
    (third). A chunk of a known codec other than raw is not opened here."""
    sources: list[ChunkSource] = []
    try:
        for task in tasks[first:first + size]:
            if task.codec is not None and not task.codec.payload_is_tensor_bytes:
                break  # a chunk to decode: opened by the worker that decodes it
            try:
                source = task.open()
            except KvtoolError as err:
                return sources, None, err
            source.scan_values = True  # KV for a model: every value finite too
            if not _together(source, task, task.start if not sources else tasks[first + len(sources) - 1].end):
                return sources, source, None
            sources.append(source)
    except BaseException:  # a bug or an interrupt: nothing left open, raised as it is
        for source in sources:
            source.release()
        raise
    return sources, None, None


def _load_together(tasks: list[ChunkTask], destination: Destination, threads: int) -> LoadOutcome:
    """`load_chunks` with runs of raw chunks in mappings opened in order on this thread and
    copied and checked by one native call each (`scatter_sources`). (Copying a first run on a
    worker while this thread opened the rest measured slower on two cores, 0.70x a plain copy
    instead of 0.85x at 2,048 tokens: the opening thread takes a core from the copy's threads,
    and the call waits for its slowest part.) A raw chunk of a mapping or a file that cannot join
    a run (part of a chunk, a payload still in its file) loads alone between runs; from a chunk
    that needs decoding or was fetched into memory, or a run the destination does not take, the
    rest go chunk by chunk, on worker threads. No chunk is opened twice."""
    first = 0
    while first < len(tasks):
        sources, odd, failure = _open_run(tasks, first, TOGETHER_CHUNKS)
        if sources:
            try:
                refusals = destination.scatter_sources(sources, tasks[first].start,
                                                       tasks[first + len(sources) - 1].end)
            except KvtoolError:  # refused as a whole (a bad slot mapping): chunk by chunk, the error names its chunk
                refusals = None
            except BaseException:
                _release(sources + [odd])
                raise
            if refusals is None:  # not taken: the rest chunk by chunk, those open as they are
                return _chunk_by_chunk(tasks, first, destination, threads, sources + [odd])
            _release(sources)
            if len(refusals) != len(sources):
                _release([odd])
                raise ValueError("scatter_sources: one answer a chunk")  # a bug, not bad input
            refused = next((i for i, refusal in enumerate(refusals) if refusal is not None), None)
            if refused is not None:
                _release([odd])
                return LoadOutcome(loaded_tokens=tasks[first + refused].start, chunks=first + refused,
                                   error=refusals[refused], failed=first + refused)
            first += len(sources)
        if failure is not None:
            return LoadOutcome(loaded_tokens=tasks[first].start, chunks=first, error=failure, failed=first)
        if first == len(tasks):
            break
        if odd is None or not odd.raw or not (odd.mapped or odd.in_file):
            # another codec (decoded), or bytes fetched into memory (a network backend's: the next
            # fetch overlaps this copy): chunk by chunk on the workers
            return _chunk_by_chunk(tasks, first, destination, threads, [odd])
        outcome = _load_each([_opened_task(tasks[first], odd)], destination, threads=1)
        if outcome.error is not None:
            return LoadOutcome(loaded_tokens=outcome.loaded_tokens, chunks=first, error=outcome.error, failed=first)
        first += 1
    return LoadOutcome(loaded_tokens=tasks[-1].end, chunks=len(tasks))


def _release(sources: "list[ChunkSource | None]") -> None:
    for source in sources:
        if source is not None:
            source.release()


def _opened_task(task: ChunkTask, source: ChunkSource) -> ChunkTask:
    """`task` with its chunk open already."""
    return ChunkTask(task.start, task.end, lambda: source, origin=task.origin, codec=task.codec)


def _chunk_by_chunk(tasks: list[ChunkTask], first: int, destination: Destination, threads: int,
                    opened: "list[ChunkSource | None]") -> LoadOutcome:
    """tasks[first:] loaded chunk by chunk (tasks before them loaded already); `opened`: the
    sources of the first of them, open already (None past the last one open). Whatever of them
    the load does not reach is released."""
    opened = [source for source in opened if source is not None]
    rest = [_opened_task(task, source) for task, source in zip(tasks[first:], opened)] + tasks[first + len(opened):]
    try:
        outcome = _load_each(rest, destination, threads=threads)
    finally:
        _release(opened)  # (released twice does nothing)
    return LoadOutcome(loaded_tokens=outcome.loaded_tokens, chunks=first + outcome.chunks, error=outcome.error,
                       failed=None if outcome.failed is None else first + outcome.failed)


def _run_shared(tasks: list[ChunkTask], run: Callable[[ChunkTask], None], threads: int) -> dict[int, BaseException | None]:
    """Run tasks on `threads` threads (this one and threads - 1 of the pool), each taking the next
    task in order until none is left or one has failed (nothing new starts past a failure; tasks
    in flight finish). Returns {index: None, or what it raised} for the tasks that ran. The
    threads take tasks themselves: handing each task over through a future cost ~60 us (two
    thread wake-ups), as long as scattering a small chunk."""
    done: dict[int, BaseException | None] = {}
    lock = threading.Lock()
    following = [0]  # the next task to take
    stop = [False]

    def take_and_run() -> None:
        while True:
            with lock:
                if stop[0] or following[0] >= len(tasks):
                    return
                index = following[0]
                following[0] += 1
            try:
                run(tasks[index])
                done[index] = None
            except BaseException as err:  # recorded for the caller, who re-raises what is not bad input
                done[index] = err
                stop[0] = True

    helpers = [_workers().submit(take_and_run) for _ in range(threads - 1)]
    try:
        take_and_run()
    finally:
        stop[0] = True  # (this thread took the last task, or was interrupted: no more start)
        wait(helpers)
    return done


_staging = threading.local()
MAX_KEPT_BUFFER = 128 << 20  # a larger chunk gets a fresh buffer each time


def thread_buffer(nbytes: int) -> memoryview:
    """This thread's reusable byte buffer (at least `nbytes`) for one chunk at a time: a raw chunk
    copied privately to be checked and scattered (a fresh buffer page-faults in as long as the
    copy takes). The caller must be done with it before the thread decodes the next chunk."""
    if nbytes > MAX_KEPT_BUFFER:
        return memoryview(bytearray(nbytes))
    buf = getattr(_staging, "buffer", None)
    if buf is None or len(buf) < nbytes:
        buf = _staging.buffer = memoryview(bytearray(nbytes))
    return buf


def file_tasks(reader, num_tokens: int, *, named: bool = False) -> list[ChunkTask]:
    """Tasks for a container file's chunks covering tokens [0, num_tokens) (a `ContainerReader`):
    each chunk's `ChunkSource` (a local file's raw chunks are scattered straight from the mapping,
    behind the fault guard, checked as copied; other codecs decode from checked bytes). `named`:
    a refusal names the file too (one of several, as a blend's segments are)."""
    tasks = []
    for chunk in reader.chunks:
        if chunk.start >= num_tokens:
            break
        what = f"{reader.path}: chunk {chunk.index}" if named else None
        tasks.append(ChunkTask(chunk.start, min(chunk.end, num_tokens),
                               lambda index=chunk.index, what=what: reader.source(index, what=what),
                               codec=_codec_of(chunk)))
    return tasks


def _codec_of(chunk) -> Any:
    """A manifest entry's codec, or None when its module cannot load (opening the chunk says why,
    as that chunk's refusal)."""
    try:
        return chunk.codec_object
    except KvtoolError:
        return None
