"""Store lookups off vLLM's scheduler thread. vLLM 0.32 lets a connector answer "not known yet"
(None) and asks again at its next step; a lookup runs on a background thread, the scheduler waits
for it a small budget (so a local store answers within the same step) and otherwise goes on."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Generic, TypeVar

Job = TypeVar("Job")
Result = TypeVar("Result")


class Lookups(Generic[Job, Result]):
    """`run(job)` for each request on `workers` threads; `run` must not raise (a failed lookup is
    its own result: a miss)."""

    def __init__(self, run: Callable[[Job], Result], wait_s: float, workers: int = 2):
        self._run = run
        self._wait_s = wait_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtool-lookup")
        self._pending: dict[str, Future] = {}  # request id -> its lookup, until its answer is taken

    def poll(self, req_id: str, job: Callable[[], Job]) -> Result | None:
        """The request's answer, or None while its lookup runs. The first poll starts the lookup
        with `job()` (made here, on the caller's thread); the answer is given once, and a later
        poll starts a new lookup (the store may have changed meanwhile)."""
        future = self._pending.get(req_id)
        if future is None:
            future = self._pending[req_id] = self._pool.submit(self._run, job())
        done, _ = wait([future], timeout=self._wait_s)
        if not done:
            return None
        del self._pending[req_id]
        return future.result()

    def forget(self, req_id: str) -> None:
        """The request finished or was aborted: its lookup's answer is never wanted."""
        future = self._pending.pop(req_id, None)
        if future is not None:
            future.cancel()  # not started yet: never runs; running: its answer is dropped

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()
