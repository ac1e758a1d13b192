"""kvtool.load.SavePipeline: the save side's background thread keeps order, bounds what waits,
and hands the first error back to the caller (jobs after it do not run)."""

from __future__ import annotations

import threading
import time

import pytest

from kvtool.errors import OutputError
from kvtool.load import SavePipeline


def test_jobs_run_in_order_off_the_callers_thread():
    done, threads = [], set()
    with SavePipeline(max_pending=2) as saving:
        for i in range(20):
            saving.submit(lambda i=i: (time.sleep(0.001), done.append(i), threads.add(threading.get_ident())))
    assert done == list(range(20))
    assert threading.get_ident() not in threads


def test_at_most_max_pending_jobs_wait_or_run():
    gate = threading.Event()
    saving = SavePipeline(max_pending=2)

    def job():
        gate.wait(5)

    saving.submit(job)
    saving.submit(job)
    third = threading.Thread(target=lambda: saving.submit(lambda: None))
    third.start()
    time.sleep(0.2)
    assert third.is_alive()  # the caller blocks: two jobs are in flight
    gate.set()
    third.join(5)
    saving.close()


def test_the_first_error_reaches_the_caller_and_later_jobs_do_not_run():
    ran, gate = [], threading.Event()
    saving = SavePipeline(max_pending=4)

    def fail():
        gate.wait(5)  # both jobs are queued before the first fails
        raise OutputError("out.kvc: cannot write (No space left on device)")

    saving.submit(fail)
    saving.submit(lambda: ran.append("after"))
    gate.set()
    with pytest.raises(OutputError, match="No space left"):
        saving.drain()
    with pytest.raises(OutputError):  # still failed: nothing more is written
        saving.submit(lambda: ran.append("later"))
    assert ran == []
    with pytest.raises(OutputError):
        saving.close()


def test_a_callers_error_is_kept_and_the_queue_finishes():
    done = []
    with pytest.raises(KeyError):
        with SavePipeline() as saving:
            saving.submit(lambda: done.append(1))
            raise KeyError("the caller's own error")
    assert done == [1]
