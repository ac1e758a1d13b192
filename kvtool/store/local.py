"""The local-directory backend: one file per object, the embedded default (no server).

The folder is the index: an object is stored exactly when its file exists, so a restart loses
nothing and any number of processes share it. Objects appear atomically: written to a locked
temp file beside the target, fsynced, then hard-linked to their name (two writers of one chunk
leave one object; a reader sees the whole file or none). A killed writer leaves only a temp
file, whose lock died with it; `sweep` removes those. The last-access time is the LRU clock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import NotAStore, ObjectRefused, ObjectUnreadable, OutputError, StoreError
from ..format.reader import PreadFile
from ..fsutil import read_at
from .backend import PROBE_TAIL, Backend, ObjectInfo
from .kept import KeptChecks
from .objects import MAX_OBJECT_BYTES

MARKER = "kvtool-store.json"
#: What an object name looks like (format-spec/store.md §3); anything else is refused.
def _is_block_entry(name: str) -> bool:
    """A block index entry (store.md §4.6) is written without fsync: it is a hint that a lookup
    checks against the object it names before anything loads, so one lost or emptied by a power
    failure is a miss (and fsck removes it), never wrong KV; kill -9 cannot tear it (it is still
    written to a temp file and linked into place). At block 16 a chunk has 15 of them, and their
    fsyncs were most of a put's time (bench_store section 5)."""
    return name.endswith(".kvi") and "/blocks/" in name


_NAME = re.compile(r"(chunks|entries|tensors|calibrations)(/[0-9a-z][0-9a-z_-]*)+\.(kvc|kvi|safetensors|kvcal)")
#: What `scan` may report and `delete` may remove: any file in the namespaces that is not hidden
#: (fsck removes foreign files too), never outside them.
_SCANNED = re.compile(r"(chunks|entries|tensors|calibrations)(/[^/.][^/]*)+")
NAMESPACES = ("chunks", "entries", "tensors", "calibrations")


def _fresh_buffer(size: int) -> memoryview:
    """A buffer of our own, not zero-filled first (a bytearray would be: 30% of a read); writable,
    so a raw chunk decodes as a view of it, with no copy."""
    return memoryview(np.empty(size, dtype=np.uint8))


class LocalBackend(Backend):
    reads_in_place = True

    def __init__(self, root: str | os.PathLike, *, max_bytes: int | None = None, create: bool = True):
        self.root = Path(root).expanduser()
        self.url = f"file://{self.root.absolute()}"
        self._root = str(self.root)
        self.max_bytes = max_bytes
        self._real_root: str | None = None  # the folder as the kernel names it (a link to it resolved)
        self.kept = KeptChecks()  # this folder's checked objects, kept between loads
        self._open(create)
        self._bytes: int | None = None
        if max_bytes is not None:  # the cap needs the total: rebuilt from the folder now
            self._bytes = sum(o.size for o in self.scan())

    def _open(self, create: bool) -> None:
        marker = self.root / MARKER
        try:
            if marker.is_file():
                try:
                    doc = json.loads(marker.read_text())
                except ValueError:  # not JSON (nor UTF-8): not our marker
                    doc = None
                if not (isinstance(doc, dict) and doc.get("format") == "kvtool-store"):
                    raise NotAStore(f"{self.root}: {MARKER} is not a kvtool store marker")
                if doc.get("version") != 1:
                    raise StoreError(f"{self.root}: store version {doc.get('version')!r}; this kvtool reads 1")
                return
            if self.root.exists() and (not self.root.is_dir()
                                       or any(not _marker_temp(p.name) for p in self.root.iterdir())):
                if marker.is_file():  # another process made the folder a store meanwhile
                    return self._open(create)
                raise NotAStore(f"{self.root}: not a kvtool store (no {MARKER}); give an empty or new folder")
            if not create:
                raise NotAStore(f"{self.root}: no such store")
            self.root.mkdir(parents=True, exist_ok=True)
            folder = os.open(self._root, _FOLDER_FLAGS & ~os.O_NOFOLLOW)  # the root may be a link: the user named it
            try:
                self._write_new(folder, MARKER, json.dumps({"format": "kvtool-store", "version": 1}).encode() + b"\n")
            finally:
                os.close(folder)
        except (OSError, ValueError) as err:
            raise StoreError(f"{self.root}: cannot open the store ({getattr(err, 'strerror', None) or err})") from None

    def _path(self, name: str, pattern: re.Pattern = _NAME) -> str:
        """The object's file (a str: faster than pathlib on the hot path); names outside the
        three namespaces, or with a part that is empty, `.`/`..` or hidden, never touch a file."""
        if not pattern.fullmatch(name):
            raise StoreError(f"{name!r}: not an object name of this store")
        return f"{self._root}/{name}"

    # --- reads -----------------------------------------------------------------------

    def get(self, name: str) -> memoryview | None:
        """The object's bytes in a writable buffer no one else holds (a memoryview)."""
        source = self._open_file(name)
        return None if source is None else self._read_whole(source, _fresh_buffer)

    def _read_whole(self, source: PreadFile, buffer) -> memoryview:
        """An object opened with `open`, read whole into `buffer(size)` and closed."""
        try:
            data = buffer(source.size)[:source.size]
            done = read_at(source.fd, data, 0)  # objects never shrink; one that did is refused by the checks
        except OSError as err:
            raise self._refusal(source.name, self._path(source.name), err) from None
        finally:
            source.close()
        return data[:done]

    def open(self, name: str) -> PreadFile | None:
        """The object as an open file, for a load (Backend.open); None when it is not stored."""
        return self._open_file(name)

    def _open_file(self, name: str) -> PreadFile | None:
        """The object opened (a regular file of at most MAX_OBJECT_BYTES inside the store), its
        use recorded on the LRU clock; None when it is not stored. Whatever else is at its name is
        an ObjectRefused (a miss with a notice; `fsck` removes it): a link (never followed), a
        folder, a FIFO (opened without blocking), a file we may not read, one reached through a
        link to a folder outside the store."""
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            raise self._refusal(name, path, err) from None
        try:
            source = PreadFile(fd, name)
            if not source.regular:  # (a folder opens, then fails every read)
                raise ObjectRefused(f"{name}: not a regular file (fsck removes it)")
            if not self._inside(fd):
                raise ObjectRefused(f"{name}: reached through a link out of the store (never read; fsck removes it)")
            if source.size > MAX_OBJECT_BYTES:
                raise ObjectRefused(f"{name}: {source.size} bytes, more than an object may hold")
            try:  # the LRU clock; a store shared by several users may not let us set it
                os.utime(fd, ns=(time.time_ns(), source.mtime_ns))
            except OSError:
                pass
        except BaseException as err:
            os.close(fd)
            if isinstance(err, OSError):
                raise self._refusal(name, path, err) from None
            raise
        return source

    def file_state(self, name: str) -> tuple[tuple[int, int, int, int], int] | None:
        """Which file `name` holds now, without opening it: ((device, inode, size, modification
        time), its last use on the LRU clock) of the regular file there (a link not followed),
        None for anything else or nothing. `kvtool.store.loading` serves a file it checked and
        mapped earlier from its kept mapping while the name still holds that very file."""
        try:
            st = os.lstat(self._path(name))
        except (OSError, ValueError):
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), st.st_atime_ns

    @staticmethod
    def _refusal(name: str, path: str, err: OSError) -> ObjectRefused | ObjectUnreadable:
        """One object that cannot be opened or read, alone: a link at its name is refused (not
        an object: fsck removes it); one we may not read, or whose read fails, is unreadable (a
        miss with a notice; fsck reports it and leaves it: its bytes may be intact)."""
        if err.errno == errno.ELOOP:
            return ObjectRefused(f"{name}: a symbolic link, not an object (never followed; fsck removes it)")
        return ObjectUnreadable(f"{path}: cannot read ({err.strerror or err})")

    def _inside(self, fd: int) -> bool:
        """Whether the open file lies under the store's folder as the kernel resolved it (a
        folder on the way may be a link elsewhere); True where /proc cannot say."""
        if self._real_root is None:
            self._real_root = os.path.realpath(self._root)
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return True
        return where.startswith(self._real_root + "/")

    def probe_many(self, names) -> list[tuple[int, bytes | None] | None]:
        """Each object's length and last bytes, read without a use on the LRU clock (no utime):
        an open, an fstat and one pread; anything but a regular file inside the store is None."""
        return [self._probe(name) for name in names]

    def _probe(self, name: str) -> tuple[int, bytes | None] | None:
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError:  # there, but not ours to read: its load says so (a miss, not damage)
            return (self._size(name), None) if self.exists(name) else None
        except (OSError, ValueError):
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not self._inside(fd):
                return None
            tail = min(st.st_size, PROBE_TAIL)
            return st.st_size, os.pread(fd, tail, st.st_size - tail)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _size(self, name: str) -> int:
        try:
            return os.lstat(self._path(name)).st_size
        except OSError:
            return 0

    def exists(self, name: str) -> bool:
        """A regular file at the name, not followed if a link: anything else is not an object
        (it is never counted as present, so a put replaces it or says why not)."""
        try:
            return stat.S_ISREG(os.lstat(self._path(name)).st_mode)
        except (OSError, ValueError):
            return False

    def children(self, prefix: str) -> set[str]:
        if not _SCANNED.fullmatch(prefix.rstrip("/")):
            return set()
        try:
            return {e.name for e in os.scandir(f"{self._root}/{prefix}") if not e.name.startswith(".")}
        except OSError:
            return set()

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for namespace in NAMESPACES:
            if prefix and not (namespace.startswith(prefix) or prefix.startswith(namespace)):
                continue
            yield from self._scan_dir(self.root / namespace, namespace, prefix)

    def _scan_dir(self, directory: Path, rel: str, prefix: str) -> Iterator[ObjectInfo]:
        """Every entry that is or takes an object's place: regular files, and, so that `fsck`
        sees and removes them, links, FIFOs and other special files, and folders at a name an
        object would have (never entered). Links are never followed."""
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return
        for entry in entries:
            name = f"{rel}/{entry.name}"
            if entry.name.startswith("."):  # temp files of writers
                continue
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:  # removed meanwhile
                continue
            if is_dir and not _NAME.fullmatch(name):
                if name.startswith(prefix) or prefix.startswith(name):
                    yield from self._scan_dir(Path(entry.path), name, prefix)
            elif name.startswith(prefix):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # removed meanwhile
                    continue
                regular = stat.S_ISREG(st.st_mode)
                yield ObjectInfo(name, st.st_size if regular else 0, st.st_atime)

    # --- writes ----------------------------------------------------------------------

    def put(self, name: str, data: bytes, *, replace: bool = False) -> bool:
        path = self._path(name)
        folder, leaf = self._folder_of(name, create=True)
        try:
            try:
                mode = os.stat(leaf, dir_fd=folder, follow_symlinks=False).st_mode
            except OSError:
                mode = None
            if mode is not None and not stat.S_ISREG(mode):  # a link, FIFO or folder is not an object
                if stat.S_ISDIR(mode):
                    raise ObjectRefused(f"{name}: a folder is where the object goes (not stored; fsck removes it)")
                replace = True  # the object takes its place, atomically (a rename, never followed)
            elif mode is not None and not replace:
                return False
            if not self._write_new(folder, leaf, data, replace=replace, durable=not _is_block_entry(name), path=path):
                return False
        finally:
            os.close(folder)
        if self._bytes is not None:
            self._bytes += len(data)
            if self._bytes > self.max_bytes:
                removed = self.evict(self.max_bytes * 9 // 10)  # some room, so not every put evicts
                self._bytes = sum(o.size for o in self.scan())
                del removed
        return True

    def _folder_of(self, name: str, *, create: bool) -> tuple[int, str]:
        """The folder holding `name`'s file, opened (an fd the caller closes), and the file's name
        in it. Each folder on the way is opened relative to the one before, a link never followed,
        so nothing is written or removed outside the store (the rule reads keep with O_NOFOLLOW and
        `_inside`); `create` makes the missing ones. Something other than a folder on the way (a
        link, a file) is an ObjectRefused; FileNotFoundError when one is missing and not created."""
        *folders, leaf = name.split("/")
        try:
            fd = os.open(self._root, _FOLDER_FLAGS & ~os.O_NOFOLLOW)  # the root may be a link: the user named it
        except OSError as err:
            raise OutputError(f"{self._root}: cannot open the store ({err.strerror})") from None
        for depth, folder in enumerate(folders):  # (each step closes the folder before, even when it fails)
            fd = self._enter(fd, folder, create, "/".join(folders[:depth + 1]))
        return fd, leaf

    def _enter(self, parent: int, folder: str, create: bool, where: str) -> int:
        """`folder` in `parent` opened (a link not followed), made first when missing and
        `create`; `parent` is closed."""
        try:
            try:
                fd = os.open(folder, _FOLDER_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(folder, dir_fd=parent)  # (mkdir never follows a link at its name either)
                except FileExistsError:  # another writer made it meanwhile
                    pass
                fd = os.open(folder, _FOLDER_FLAGS, dir_fd=parent)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ObjectRefused(f"{where}: a link or a file where a folder of the store goes "
                                    "(never followed: nothing written through it)") from None
            if isinstance(err, FileNotFoundError):
                raise
            raise OutputError(f"{self._root}/{where}: cannot write to the store ({err.strerror})") from None
        finally:
            os.close(parent)
        return fd

    def _write_new(self, folder: int, leaf: str, data, replace: bool = False, durable: bool = True,
                   path: str | None = None) -> bool:
        """Write `leaf` in the open `folder` atomically, unless it appears meanwhile (False) and
        `replace` is off. `durable`: fsync the file and its folder (not for block index entries:
        see `_is_block_entry`). `path` names it in messages."""
        path = path or f"{self._root}/{leaf}"
        fd, tmp = _new_temp(folder, leaf, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until closed or the writer dies: sweep sees it
            os.fchmod(fd, 0o644)
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
            created = True
            if replace:  # rename over the old object, atomically (a link there is replaced, never followed)
                os.replace(tmp, leaf, src_dir_fd=folder, dst_dir_fd=folder)
            else:
                try:  # fails when another writer got there first: one object stays
                    os.link(tmp, leaf, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
                except FileExistsError:
                    created = False
                except OSError:  # a file system without hard links: rename (equal contents)
                    os.replace(tmp, leaf, src_dir_fd=folder, dst_dir_fd=folder)
        except OSError as err:
            raise OutputError(f"{path}: cannot write to the store ({err.strerror})") from None
        finally:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=folder)
            except FileNotFoundError:
                pass
        if created and durable:
            try:
                os.fsync(folder)
            except OSError:
                pass
        return created

    def delete(self, name: str) -> bool:
        """Remove what is at `name`: an object, or a link (not what it points to), a FIFO, or a
        folder in an object's place (with what it holds, links never followed). Reached through
        a link (or a file) on the way, it is not in the store: nothing is removed (False)."""
        path = self._path(name, _SCANNED)
        try:
            folder, leaf = self._folder_of(name, create=False)
        except (FileNotFoundError, ObjectRefused):
            return False
        try:
            if stat.S_ISDIR(os.stat(leaf, dir_fd=folder, follow_symlinks=False).st_mode):
                shutil.rmtree(leaf, dir_fd=folder)  # (fd-based: never follows a link inside)
            else:
                os.unlink(leaf, dir_fd=folder)
        except FileNotFoundError:
            return False
        except OSError as err:
            raise StoreError(f"{path}: cannot remove ({err.strerror})") from None
        finally:
            os.close(folder)
        return True

    def sweep(self) -> int:
        """Remove temp files whose writer is gone (their lock is free); folders walked by fd,
        never through a link (a namespace that is a link is not walked at all)."""
        removed = 0
        root = os.open(self._root, _FOLDER_FLAGS & ~os.O_NOFOLLOW)
        try:
            for namespace in NAMESPACES:
                for _directory, _dirs, files, folder in _folders(namespace, root):
                    for file in files:
                        if file.startswith(".") and file.endswith(".tmp"):
                            removed += _remove_if_unlocked(file, folder)
        finally:
            os.close(root)
        return removed


def _folders(top: str, root: int):
    """os.fwalk of `top` in the open `root`, links never followed; nothing when `top` is missing
    (fwalk would raise) or is not a folder."""
    try:
        if not stat.S_ISDIR(os.stat(top, dir_fd=root, follow_symlinks=False).st_mode):
            return
    except OSError:
        return
    yield from os.fwalk(top, dir_fd=root, follow_symlinks=False)


#: How a folder of the store is opened on the way to a write: never through a link at its name,
#: never blocking on something that is not a folder.
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: How many fresh temp names a writer tries before it gives up (tempfile's TMP_MAX is 10000).
_TEMP_TRIES = 100


def _temp_name(leaf: str) -> str:
    """A fresh temp file name beside `leaf`: hidden, so scans skip it, and `.tmp`, so sweep sees it."""
    return f".{leaf}.{secrets.token_hex(6)}.tmp"


def _new_temp(folder: int, leaf: str, path: str) -> tuple[int, str]:
    """A new temp file in `folder`, created exclusively (O_EXCL never follows a link at its
    name: whatever is there, a fresh name is tried)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_TEMP_TRIES):
        tmp = _temp_name(leaf)
        try:
            return os.open(tmp, flags, 0o600, dir_fd=folder), tmp
        except FileExistsError:
            continue
        except OSError as err:
            raise OutputError(f"{path}: cannot write to the store ({err.strerror})") from None
    raise OutputError(f"{path}: cannot write to the store (no free temp file name)")


def _marker_temp(name: str) -> bool:
    """The temp file of another process writing the marker of a new store (it is new still)."""
    return name.startswith(f".{MARKER}.") and name.endswith(".tmp")


#: A temp file younger than this is never swept: its writer may not have locked it yet.
STALE_TEMP_SECONDS = 60


def _remove_if_unlocked(file: str, folder: int) -> int:
    """Remove the temp file `file` of the open `folder` when it is stale and unlocked."""
    try:
        if time.time() - os.stat(file, dir_fd=folder, follow_symlinks=False).st_mtime < STALE_TEMP_SECONDS:
            return 0
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a live writer holds it
        os.close(fd)
        return 0
    try:
        os.unlink(file, dir_fd=folder)
        return 1
    except OSError:
        return 0
    finally:
        os.close(fd)
