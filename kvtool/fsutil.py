"""Files, written once for every part of kvtool: the cache root, input files opened with
one clear error, and atomic outputs (temp file beside the target, fsync, rename)."""

from __future__ import annotations

import fcntl
import glob
import os
import re
import stat
import tempfile
from pathlib import Path

from .errors import InputFileError, OutputError
from .notices import notice

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def cache_root() -> Path:
    """kvtool's cache root: $KVTOOL_CACHE, else $XDG_CACHE_HOME/kvtool, else ~/.cache/kvtool."""
    env = os.environ.get("KVTOOL_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "kvtool"
    return Path.home() / ".cache" / "kvtool"


# --- inputs -------------------------------------------------------------------------


def read_at(fd: int, out: memoryview, offset: int) -> int:
    """Read into `out` from byte `offset` of the open file `fd` (pread, so any thread may share
    the descriptor); returns how many bytes came, fewer than `out` holds only where the file
    ends first. OSError as the system raises it."""
    out = memoryview(out).cast("B")
    done = 0
    while done < out.nbytes:
        n = os.preadv(fd, [out[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def input_error(path: str | os.PathLike, err: OSError, what: str = "a file") -> InputFileError:
    """The one-line error for an input that cannot be opened or read."""
    if isinstance(err, FileNotFoundError):
        return InputFileError(f"{path}: no such file")
    if isinstance(err, IsADirectoryError):
        return InputFileError(f"{path}: is a directory, not {what}")
    return InputFileError(f"{path}: cannot read ({err.strerror or err})")


def open_regular_file(path: str | os.PathLike, what: str = "a file"):
    """`open(path, "rb")` of a regular file; a FIFO or a device (which would block open() or
    never end) and every OSError are an InputFileError naming the path."""
    if isinstance(path, str) and _URL.match(path):
        raise InputFileError(f"{path}: a URL; kvtool reads local files (download it first)")
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise InputFileError(f"{path}: not a regular file")
        return open(path, "rb")
    except OSError as err:
        raise input_error(path, err, what) from None


def read_text_file(path: str | os.PathLike) -> str:
    """A UTF-8 text file's contents; InputFileError when it is missing, unreadable or not text."""
    with open_regular_file(path, "a text file") as f:
        try:
            data = f.read()
        except OSError as err:
            raise input_error(path, err) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError(f"{path}: not UTF-8 text") from None


# --- outputs ------------------------------------------------------------------------


def open_temp_beside(path: Path) -> tuple[int, str]:
    """A new temporary file in `path`'s directory, readable as the umask allows (mkstemp's
    0600 would hide the result from others), or an OutputError that names `path`.

    The temp file is named `.NAME.XXXXXXXX.tmp` and locked (flock) while its writer lives;
    the lock dies with the writer, even by SIGKILL. Temp files of that naming whose lock
    can be taken are left-overs of a killed writer: they are removed first."""
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; give a file name")
    if path.is_symlink():  # the rename would replace the link, not write where it points
        raise OutputError(f"{path}: is a symbolic link; give the file it points to")
    if path.exists() and not path.is_file():  # a device, FIFO or socket: never replace it
        raise OutputError(f"{path}: is not a regular file")
    try:
        if not path.parent.exists():
            path.parent.mkdir(parents=True)
            notice(f"created the folder {path.parent} for {path.name}")
        remove_stale_temps(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise OutputError(f"{path}: cannot write here ({err.strerror})") from None
    try:  # a signal (SIGTERM unwinds like Ctrl-C) may land here: leave no temp file behind
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until the writer closes the file or dies
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(fd, 0o666 & ~mask)
    except BaseException as err:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OutputError(f"{path}: cannot write here ({err.strerror})") from None
        raise
    return fd, tmp


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove `.NAME.*.tmp` files beside `path` whose writer is gone (their lock is free)."""
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        try:
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it
            os.close(fd)
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
        finally:
            os.close(fd)
    return removed


def replace_atomically(tmp: str | os.PathLike, path: Path) -> None:
    """Rename the finished temp file over `path` and make the rename durable."""
    try:
        os.replace(tmp, path)
    except OSError as err:
        raise OutputError(f"{path}: cannot write ({err.strerror})") from None
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call `write(fileobj)` on a temp file beside `path`, fsync, rename over `path`."""
    path = Path(path)
    fd, tmp = open_temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        replace_atomically(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
