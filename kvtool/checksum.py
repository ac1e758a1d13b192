"""CRC-32C, the checksum of every stored blob (format-spec/container.md), and `PayloadCheck`:
stored bytes handed on *before* they are checked, with what is needed to check them.

Loading a raw chunk straight from a memory-mapped file saves a copy, but checking the map and
then copying from it would leave a window for another process to change the bytes in between.
So the check travels with the bytes: whoever copies them out of the payload checks them as it
copies (the native scatter does, `kvtool._paged_native.scatter_checked`) or first takes a
private copy and checks that (`PayloadCheck.verified`). Either way the bytes used are the bytes
checked. A `FilePayloadCheck` holds bytes still in a file that kvtool opened but has not read (a
store object): the native scatter reads them a window at a time, or maps large ones behind a
fault guard (a file truncated under the copy is then refused rather than ending the process),
and checks them as it copies.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ChecksumMismatch, InputFileError
from .fsutil import read_at

if TYPE_CHECKING:
    import torch


def _load_crc32c():
    """The `crc32c` package's C function. The package's __init__ reads its own version through
    importlib.metadata, 60 ms at every start of every command; its extension module alone
    holds the function, so load that (the package as usual if its layout ever differs)."""
    try:
        spec = importlib.util.find_spec("crc32c")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(folder).glob("_crc32c.*")):
                if not any(path.name.endswith(x) for x in importlib.machinery.EXTENSION_SUFFIXES):
                    continue
                loader = importlib.machinery.ExtensionFileLoader("crc32c._crc32c", str(path))
                module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
                loader.exec_module(module)
                return module.crc32c
    except (ImportError, OSError, AttributeError):
        pass
    import crc32c

    return crc32c.crc32c


_crc32c = _load_crc32c()


def crc32(data) -> int:
    """CRC-32C (Castagnoli), hardware-accelerated: ~11 GB/s here vs ~1.3 GB/s for zlib's CRC-32."""
    return _crc32c(data)


@dataclass(frozen=True)
class PayloadCheck:
    """Stored bytes that are not checked yet: `payload` (e.g. a chunk's bytes in a mapped file)
    must have CRC-32C `crc32c`; `what` names them in the error ("chunk 3")."""

    payload: memoryview
    crc32c: int
    what: str

    def mismatch(self) -> ChecksumMismatch:
        return ChecksumMismatch(f"{self.what}: CRC-32C mismatch (stored bytes are corrupt)")

    def truncated(self) -> ChecksumMismatch:
        """The payload's file ended before it did (cut short by another program meanwhile)."""
        return ChecksumMismatch(f"{self.what}: the file ends inside the payload (stored bytes are damaged)")

    def verified(self, view: "torch.Tensor") -> "torch.Tensor":
        """`view` (a tensor over part of the payload) taken from a private, checked copy of the
        payload: one copy, then the check on the copy. Raises ChecksumMismatch."""
        import numpy as np
        import torch

        base = np.frombuffer(self.payload, dtype=np.uint8)
        offset = view.data_ptr() - base.ctypes.data
        if offset < 0 or offset + view.numel() * view.element_size() > base.nbytes or not view.is_contiguous():
            raise ValueError("PayloadCheck.verified: the tensor is not a contiguous view of the payload")
        private = bytearray(self.payload)
        if crc32(private) != self.crc32c:
            raise self.mismatch()
        return torch.frombuffer(private, dtype=torch.uint8)[offset:offset + view.numel() * view.element_size()] \
            .view(view.dtype).view(view.shape)

    def release(self) -> None:
        """Let go of what the payload holds (nothing here; a file's check closes its file)."""


class FilePayloadCheck(PayloadCheck):
    """A payload still in a file: `length` bytes at `offset` of the open file `fd` (this check owns
    it: `release()` closes it), CRC-32C `crc32c`. The native checked scatter maps it behind a
    fault guard (16 MiB and more) or reads it a window at a time
    (`kvtool._paged_native.scatter_checked_file`); anything else that asks for `payload`
    gets it read into `buffer` (`length` bytes, the tensor handed on with this check views it)
    on first use, and checks that private copy."""

    def __init__(self, fd: int, offset: int, length: int, buffer: memoryview, crc32c: int, what: str):
        object.__setattr__(self, "fd", fd)  # (PayloadCheck is frozen)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "length", length)
        object.__setattr__(self, "buffer", buffer)
        object.__setattr__(self, "crc32c", crc32c)
        object.__setattr__(self, "what", what)
        object.__setattr__(self, "filled", False)

    # the dataclass's own would read the file (they look at `payload`)
    __eq__, __hash__ = object.__eq__, object.__hash__

    def __repr__(self) -> str:
        return f"FilePayloadCheck({self.what!r}, fd={self.fd}, offset={self.offset}, length={self.length})"

    @property
    def payload(self) -> memoryview:  # type: ignore[override]
        if not self.filled:
            self.read_into(self.buffer)
            object.__setattr__(self, "filled", True)
        return self.buffer

    def read_into(self, out: memoryview) -> None:
        """The payload's bytes, read into `out` (`length` bytes), not checked."""
        try:
            done = read_at(self.fd, memoryview(out).cast("B")[:self.length], self.offset)
        except OSError as err:
            raise self.read_failed(err) from None
        if done < self.length:
            raise self.truncated()

    def read_checked_into(self, out: memoryview) -> None:
        """The payload read into the private buffer `out`, then checked there."""
        self.read_into(out)
        if crc32(memoryview(out).cast("B")[:self.length]) != self.crc32c:
            raise self.mismatch()

    def read_failed(self, err: OSError) -> InputFileError:
        return InputFileError(f"{self.what}: cannot read ({err.strerror or err})")

    def release(self) -> None:
        fd = self.fd
        if fd >= 0:
            object.__setattr__(self, "fd", -1)
            os.close(fd)
