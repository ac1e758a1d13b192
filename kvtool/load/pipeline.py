"""`load_chunks`: decode chunks on worker threads and scatter each where it was decoded.

    tasks:   ChunkTask(start, end, decode) in token order; decode() -> KV_BLOB [2, L, T, C] on the
             CPU with T >= end - start (it reads, checks and decodes one chunk)
    scatter: scatter(kv [2, L, end - start, C] contiguous, start, end): into the paged buffers

A task may also offer `mapped()`: its stored bytes as a zero-copy tensor, not checked yet, with
the `PayloadCheck` that goes with them. When `scatter` takes a `check` keyword it gets those
(`scatter(kv, start, end, check=...)`) and must check while it copies, or copy and check first
(the connectors do: `MemoryObj.from_tensor(kv, check=check)`): the bytes are then read once
instead of three times (pread, CRC, scatter). A scatter without the keyword gets decode()'s
checked tensor.

At most `threads` chunks are in flight, so memory stays at `threads` decoded chunks (each thread
reuses one staging buffer for raw chunks of a file). The first chunk that fails ends the load:
tokens [0, its start) are loaded and reported; chunks after it may have been scattered already
but lie past the loaded prefix (an engine computes those slots again).
"""

from __future__ import annotations

import inspect
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..checksum import PayloadCheck
from ..devices import host_threads, thread_share
from ..errors import KvtoolError, ShapeMismatch


@dataclass(frozen=True)
class ChunkTask:
    start: int
    end: int  # tokens [start, end) of this chunk are loaded
    decode: Callable[[], torch.Tensor]  # the chunk's KV_BLOB; its token 0 is `origin`
    origin: int | None = None  # default: start
    # the whole chunk's stored bytes, unchecked, and their check (tokens [start, end) exactly)
    mapped: Callable[[], tuple[torch.Tensor, PayloadCheck] | None] | None = None

    @property
    def first_row(self) -> int:
        return 0 if self.origin is None else self.start - self.origin


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


def load_chunks(tasks: Sequence[ChunkTask], scatter: Callable[[torch.Tensor, int, int], None], *,
                threads: int | None = None) -> LoadOutcome:
    tasks = list(tasks)
    if not tasks:
        return LoadOutcome(loaded_tokens=0, chunks=0)
    threads = threads or load_threads(len(tasks))
    if threading.current_thread().name.startswith(_WORKER_PREFIX):
        threads = 1  # a load inside a load's worker runs in place: waiting on the pool could deadlock it
    checks = takes_check(scatter)
    share = max(1, host_threads() // threads)  # each worker's native copies take cores / workers

    def run(task: ChunkTask) -> None:
        with thread_share(share):
            mapped = task.mapped() if checks and task.mapped is not None else None
            if mapped is not None:
                try:
                    scatter(mapped[0], task.start, task.end, check=mapped[1])
                finally:
                    if mapped[1] is not None:
                        mapped[1].release()  # (a file's check closes the file)
            else:
                scatter(_as_blob(task.decode(), task.first_row, task.end - task.start), task.start, task.end)

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


_takes_check_seen: "weakref.WeakKeyDictionary[Callable, bool]" = weakref.WeakKeyDictionary()


def takes_check(scatter: Callable) -> bool:
    """Whether `scatter` takes the `check` keyword (stored bytes checked as it copies them).
    Known per function (a bound method's by its function): inspect.signature costs ~8 us, and
    an engine passes the same scatter on every load."""
    function = getattr(scatter, "__func__", scatter)
    try:
        return _takes_check_seen[function]
    except (KeyError, TypeError):  # (TypeError: not weakly referable, e.g. a builtin)
        pass
    try:
        params = inspect.signature(scatter).parameters
    except (TypeError, ValueError):
        return False
    takes = "check" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    try:
        _takes_check_seen[function] = takes
    except TypeError:
        pass
    return takes


_staging = threading.local()
MAX_KEPT_BUFFER = 128 << 20  # a larger chunk or object gets a fresh buffer each time


def thread_buffer(nbytes: int) -> torch.Tensor:
    """This thread's reusable byte buffer (uint8, at least `nbytes`) for one chunk at a time: a raw
    chunk read from a file, or a store object read for a load (a fresh buffer page-faults in as
    long as the read takes). The caller must be done with it before the thread reads the next."""
    if nbytes > MAX_KEPT_BUFFER:
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = getattr(_staging, "buffer", None)
    if buf is None or buf.numel() < nbytes:
        buf = _staging.buffer = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def _staging_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A [shape] `dtype` view of this thread's buffer, for one raw chunk."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    return thread_buffer(nbytes)[:nbytes].view(dtype).view(shape)


def file_tasks(reader, num_tokens: int, *, verify: bool = True) -> list[ChunkTask]:
    """Tasks for a container file's chunks covering tokens [0, num_tokens) (a `ContainerReader`).

    Raw chunks of a local file loaded whole are offered `mapped` (checked as they are scattered
    from the map); otherwise (and for a scatter that does not check) they are read with one pread
    into the thread's staging buffer, checked there and scattered from there: the bytes checked
    are the bytes loaded (scattering from the mapped file after checking it would leave a window
    for a writer to change them). Other codecs decode from the mapped file."""
    from ..dtypes import dtype_from_name

    tasks = []
    for chunk in reader.chunks:
        if chunk.start >= num_tokens:
            break
        end = min(chunk.end, num_tokens)
        if reader.reads_into(chunk.index):
            shape, dtype = tuple(chunk.shape), dtype_from_name(chunk.dtype)

            def decode(index=chunk.index, shape=shape, dtype=dtype):
                return reader.read_chunk_into(index, _staging_buffer(shape, dtype), verify=verify)
        else:
            def decode(index=chunk.index):
                return reader.read_chunk(index, verify=verify)
        mapped = None
        if verify and end == chunk.end and reader.reads_into(chunk.index):
            def mapped(index=chunk.index):
                return reader.mapped_chunk(index)
        tasks.append(ChunkTask(chunk.start, end, decode, mapped=mapped))
    return tasks
