"""Atomic file replacement for outputs that are not containers (dump)."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call `write(fileobj)` on a temp file beside `path`, fsync, rename over `path`."""
    from .format.writer import open_temp_beside

    path = Path(path)
    fd, tmp = open_temp_beside(path)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(fd, 0o666 & ~mask)  # mkstemp's 0600 would hide the result from others
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
