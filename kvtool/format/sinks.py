"""Where a container's bytes go: a sink that takes them in order and then makes them visible
all at once (`commit`) or leaves nothing behind (`abort`).

`ContainerWriter` writes to a `Sink`: a `FileSink` for a path (a temp file beside the target,
fsynced and renamed over it, so the old file stays until the rename and a crash never leaves a
damaged target), a `MemorySink` for `None` (the chunk store's objects), or any object with the
three methods below (a store backend or a network stream, later).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..errors import OutputError, UsageError
from ..fsutil import open_temp_beside, replace_atomically


@runtime_checkable
class Sink(Protocol):
    """The writer calls `write` for each piece, in order, then exactly one of `commit` (the
    container is complete) or `abort` (it never will be; may come after a failed commit).

    `write` consumes or copies its bytes before it returns (the writer may reuse them). A sink's
    failures are `KvtoolError`s in one line that name the output (`OutputError`)."""

    def write(self, data: bytes | memoryview) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class MemorySink:
    """The container in memory: `getvalue()` gives its bytes."""

    path = None

    def __init__(self) -> None:
        self._buffer = io.BytesIO()

    def write(self, data: bytes | memoryview) -> None:
        self._buffer.write(data)

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        self._buffer.close()

    def getvalue(self) -> bytes:
        return self._buffer.getvalue()


class FileSink:
    """A file written atomically: bytes go to a locked temp file beside `path`
    (`.NAME.XXXXXXXX.tmp`); `commit()` fsyncs it and renames it over `path`; `abort()`, or the
    sink dropped before its commit, removes it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._tmp: Path | None = None
        fd, tmp = open_temp_beside(self.path)
        try:  # a signal (SIGTERM unwinds like Ctrl-C) may land here: leave no temp file behind
            self._tmp = Path(tmp)
            self._file = os.fdopen(fd, "wb")
        except BaseException:
            self._tmp = None
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            raise

    def write(self, data: bytes | memoryview) -> None:
        """A full disk or an I/O error names the output, not the temp file."""
        try:
            self._file.write(data)
        except OSError as err:
            raise OutputError(f"{self.path}: cannot write ({err.strerror})") from None

    def commit(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:  # a full disk surfaces here as often as in write()
            raise OutputError(f"{self.path}: cannot write ({err.strerror})") from None
        self._file.close()
        replace_atomically(self._tmp, self.path)
        self._tmp = None

    def abort(self) -> None:
        if self._tmp is None:  # committed, or aborted already
            return
        try:
            self._file.close()
        finally:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None

    def __del__(self) -> None:  # dropped without commit() or abort(): leave no temp file
        if getattr(self, "_tmp", None) is not None:
            self.abort()


def open_sink(target: str | os.PathLike | Sink | None) -> Sink:
    """The sink for a writer's target: memory for None, a `FileSink` for a path, a sink as is."""
    if target is None:
        return MemorySink()
    if isinstance(target, (str, os.PathLike)):
        return FileSink(target)
    if isinstance(target, Sink):
        return target
    raise UsageError(f"a container goes to a path, None (memory) or a Sink, not {type(target).__name__}")
