"""`SavePipeline`: the save side's overlap. The caller gathers a chunk (a copy out of the engine's
buffers, on its own thread) and hands the rest (encode, CRC-32C, write) to one background thread,
so the next prefill step or forward pass runs while the chunk is written.

Jobs run in the order submitted (a container's chunks go in order). At most `max_pending` jobs wait
or run: a caller that gets ahead blocks in `submit` (memory stays bounded). The first error is
raised to the caller at its next `submit` or at `drain` (and again at every later call); jobs
after a failed one do not run.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class SavePipeline:
    def __init__(self, max_pending: int = 2, name: str = "kvtool-save"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(max(1, max_pending))
        self._pending: list[Future] = []
        self._failed: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> None:
        """Run `job()` after the jobs before it; raises the error of an earlier job instead."""
        self._raise_failure()
        self._slots.acquire()

        def run() -> Any:
            try:
                if self._failed is None:  # after a failure nothing more is written
                    return job()
            except BaseException as err:  # noqa: BLE001 - handed to the caller, not swallowed
                with self._lock:
                    self._failed = self._failed or err
            finally:
                self._slots.release()

        future = self._pool.submit(run)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [future]

    def drain(self) -> None:
        """Wait for every job; raise the first error."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        self._raise_failure()

    def close(self) -> None:
        """Drain, then stop the thread (also after an error, which is raised)."""
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)

    def _raise_failure(self) -> None:
        with self._lock:
            failed = self._failed  # sticky: after a failure nothing more is written
        if failed is not None:
            raise failed

    def __enter__(self) -> "SavePipeline":
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if exc_type is None:
            self.close()
        else:  # an error of the caller's: finish what is queued quietly, keep the caller's error
            try:
                self.close()
            except BaseException:  # noqa: BLE001
                pass
