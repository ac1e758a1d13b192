"""`ChunkSource`: one stored chunk, where its bytes are, and how they become KV, checked as they go.

Every producer of stored chunks makes one per chunk (a container file's reader, a store object,
whatever backend or tier it came from) and the one load path (`kvtool.load`) consumes them:

    where the bytes are        memory (an object read, a memory tier's copy), a mapped file,
                               or an open file read as they are copied (a store object)
    what they are              codec, KV dtype, shape [2, L, T, C], stored length, CRC-32C
    how they become KV         decode(device): checked, then decoded by the chunk's codec
                               copy_into(buffer): a raw chunk copied and checked in one pass
                               (connectors scatter a raw chunk straight from `data` or the
                               file, checked as copied: `kvtool.connectors.paged_native`)

The bytes are checked once, and the bytes checked are the bytes used: a mapped or shared payload
is never checked in place and then copied (another process could change it in between); it is
checked as it is copied, or copied privately and checked there.

Checked means the CRC-32C matches (the bytes are what was written), and, for what hands KV to a
model (`scan_values`: the load path, the store), that every value is finite (a NaN written with a
valid CRC is refused as `verify` refuses it, NonFiniteValues). A raw chunk's values are scanned
in the same pass as its CRC (the native copy); a decoded chunk's once it is decoded.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .checksum import crc32
from .dtypes import dtype_from_name, itemsize
from .errors import ChecksumMismatch, InputFileError, KvtoolError, NonFiniteValues
from .fsutil import read_at
from .native_loader import NativeExtension

if TYPE_CHECKING:
    import torch

#: decode(payload, device) -> KV_BLOB: the codec's decoding of a chunk's checked payload.
Decoder = Callable[[memoryview, "torch.device | None"], "torch.Tensor"]
#: decode_batch(payloads, shapes, device) -> KV_BLOBs: several chunks of one codec and parameters.
BatchDecoder = Callable[[list, list, "torch.device"], "list[torch.Tensor]"]


class ChunkSource:
    """One stored chunk (see the module docstring). Exactly one of `data` (the stored bytes in
    memory or a mapping) and `fd` (an open file this source owns, the bytes at `offset`) says
    where the payload is. `release()` lets go of what holds it."""

    __slots__ = ("what", "codec", "dtype", "shape", "length", "crc32c", "raw", "data", "fd", "offset",
                 "mapped", "private", "checked", "scan_values", "batch_key", "_decode", "_decode_batch", "_on_release")

    def __init__(self, *, what: str, codec: str, dtype: str, shape: tuple[int, ...], length: int, crc32c: int,
                 raw: bool, decode: Decoder, data: memoryview | None = None, fd: int = -1, offset: int = 0,
                 mapped: bool = False, private: bool = False, checked: bool = False,
                 batch: "tuple[Any, BatchDecoder] | None" = None, on_release: Callable[[], None] | None = None):
        self.what = what  # names it in errors: "chunk 3", a store object's name
        self.codec = codec
        self.dtype = dtype  # the KV dtype's name: "bf16", "fp16", "fp32"
        self.shape = tuple(shape)
        self.length = length
        self.crc32c = crc32c
        # a raw chunk whose payload is exactly the tensor's bytes: copied, never decoded
        self.raw = raw and length > 0 and length == math.prod(self.shape) * itemsize(dtype)
        self.data = data
        self.fd = fd
        self.offset = offset
        self.mapped = mapped  # `data` is a file's mapping: copies from it run behind the fault guard
        self.private = private  # `data` is a writable buffer no one else holds
        self.checked = checked  # the CRC-32C was checked on `data` already
        # every value checked finite too (check 13 of store.md): what hands KV to a model (the
        # load path, the store) turns it on; tools that move bits as they are (compress, dump) do not
        self.scan_values = False
        self._decode = decode
        # chunks of one batch key decode together on a GPU (one launch: what fills a GPU)
        self.batch_key, self._decode_batch = batch if batch is not None else (None, None)
        self._on_release = on_release

    def __repr__(self) -> str:
        where = "a file" if self.in_file else ("a mapping" if self.mapped else "memory")
        return f"ChunkSource({self.what!r}, {self.codec}, {self.length} bytes in {where})"

    @classmethod
    def from_tensor(cls, kv: "torch.Tensor", what: str = "KV") -> "ChunkSource":
        """A KV_BLOB tensor held in memory as a raw, checked chunk (a private copy of it): KV
        computed in this process, handed to the load path like stored KV."""
        import torch

        from .dtypes import dtype_name

        blob = kv.detach().to("cpu", copy=True).contiguous()
        data = memoryview(blob.view(-1).view(torch.uint8).numpy())  # (keeps `blob` alive)

        def decode(payload: memoryview, device) -> "torch.Tensor":
            return torch.frombuffer(payload, dtype=blob.dtype).view(blob.shape).to(device or "cpu")

        return cls(what=what, codec="raw", dtype=dtype_name(blob.dtype), shape=tuple(blob.shape), length=data.nbytes,
                   crc32c=crc32(data), raw=True, decode=decode, data=data, private=True, checked=True)

    def reopened(self, fd: int, on_release: Callable[[], None] | None = None) -> "ChunkSource":
        """The same chunk, described as this source describes it, in another open descriptor of
        the same file (which the new source owns): a store object opened again, whose checks ran
        on an earlier opening (kvtool.store.loading). The payload is checked as it is copied."""
        if self.data is not None:
            raise ValueError("reopened: not a chunk in a file")  # a bug, not bad input
        return ChunkSource(what=self.what, codec=self.codec, dtype=self.dtype, shape=self.shape, length=self.length,
                           crc32c=self.crc32c, raw=self.raw, decode=self._decode, fd=fd, offset=self.offset,
                           batch=None if self.batch_key is None else (self.batch_key, self._decode_batch),
                           on_release=on_release)

    def mapped_as(self, data: memoryview) -> "ChunkSource":
        """The same chunk read from `data`, a mapping of its file kept between loads (kvtool.store.
        loading): copies from it run behind the fault guard, and check its CRC-32C as they go."""
        return ChunkSource(what=self.what, codec=self.codec, dtype=self.dtype, shape=self.shape, length=self.length,
                           crc32c=self.crc32c, raw=self.raw, decode=self._decode, data=data, mapped=True,
                           batch=None if self.batch_key is None else (self.batch_key, self._decode_batch))

    @property
    def in_file(self) -> bool:
        """The payload is still in an open file (read as it is copied)."""
        return self.data is None and self.fd >= 0

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    # --- the bytes --------------------------------------------------------------------

    def payload(self, buffer: memoryview | None = None) -> memoryview:
        """The stored bytes, NOT checked: `data`, or read from the file into `buffer` (at least
        `length` bytes; a fresh one when None)."""
        if not self.in_file:
            return self.data
        out = memoryview(buffer if buffer is not None else bytearray(self.length)).cast("B")[:self.length]
        try:
            done = read_at(self.fd, out, self.offset)
        except OSError as err:
            raise self.read_failed(err) from None
        if done < self.length:
            raise self.truncated()
        return out

    def checked_payload(self, buffer: "Callable[[int], memoryview] | None" = None) -> memoryview:
        """The stored bytes, checked (a raw chunk's values too): the bytes themselves when private
        (ours alone), else a private copy checked as it is made (what is checked is what is used:
        a mapping or a shared buffer could change after a check in place), in `buffer(length)`
        when given (a load's reused staging buffer: no fresh pages to fault in), else in a fresh one."""
        crc, bad = None, None
        if self.private:
            data = self.data
        elif self.in_file:
            data = self.payload(None if buffer is None else buffer(self.length))  # read: private
        else:
            data, crc, bad = self._private_copy(buffer)
        if crc is None and not self.checked:
            crc, bad = self._crc_and_values(data)
        if not self.checked and crc != self.crc32c:
            raise self.mismatch()
        self._check_values(data, bad)
        return data

    def _crc_and_values(self, data: memoryview) -> tuple[int, int | None]:
        """The CRC-32C of bytes of our own and, when asked for, whether any value is not finite:
        one native pass over them (`checked`), else the CRC alone (the scan follows)."""
        native, kind = _native(), self._finite_kind()
        if native is not None and hasattr(native, "checked"):
            return native.checked(data, kind) if kind else (native.checked(data)[0], None)
        return crc32(data), None

    def _private_copy(self, buffer=None) -> tuple[memoryview, int | None, int | None]:
        """`data` copied into `buffer(length)` (or a fresh buffer), with its CRC-32C and count of
        values that are not finite when the copy computed them (the native one-pass copy, behind
        the fault guard for a mapping)."""
        out = memoryview(_fresh(self.length) if buffer is None else buffer(self.length)).cast("B")[:self.length]
        native = _native()
        if native is None:
            out[:] = self.data
            return out, None, None
        kind = self._finite_kind()
        try:
            result = native.copy_checked(out, self.data, kind)
        except EOFError:
            raise self.truncated() from None
        return (out, result, None) if isinstance(result, int) else (out, *result)

    def copy_into(self, out: memoryview) -> None:
        """The payload copied into `out` (`length` bytes, writable) and checked in the same pass
        (the native one-pass copy where it is built, behind the fault guard for a mapping): a
        raw chunk into a pinned staging buffer. Raises ChecksumMismatch, or NonFiniteValues,
        after the copy."""
        target = memoryview(out).cast("B")[:self.length]
        bad = None
        if self.in_file:
            self.payload(target)
            crc, bad = self._crc_and_values(target)
        else:
            native, kind = _native(), self._finite_kind()
            if native is not None:
                try:
                    crc = native.copy_checked(target, self.data, kind)
                except EOFError:
                    raise self.truncated() from None
                if not isinstance(crc, int):
                    crc, bad = crc
            else:
                target[:] = self.data
                crc = crc32(target)
        if not self.checked and crc != self.crc32c:
            raise self.mismatch()
        self._check_values(target, bad)

    # --- the values -----------------------------------------------------------------------

    def _finite_kind(self) -> int:
        """The native scan's code for this chunk's raw values (0: not scanned: not asked for, not
        raw, or a dtype without NaN)."""
        return _FINITE_KINDS.get(self.dtype, 0) if self.scan_values and self.raw else 0

    def _check_values(self, data: memoryview, bad: int | None = None) -> None:
        """A raw payload's values all finite (`bad`: the count a checked copy found already)."""
        if bad is None and self._finite_kind():
            bad = nonfinite_count(data, self.dtype)
        self.refuse_nonfinite(bad)

    def refuse_nonfinite(self, bad: int | None) -> None:
        if bad:  # (a stored chunk's CRC-32C is valid: written so; a tensor's, `from_tensor`, is ours)
            how = "" if self.checked else " (written so: its CRC-32C is valid)"
            raise NonFiniteValues(f"{self.what}: holds NaN or infinite values{how}; never loaded")

    def check_decoded(self, kv: "torch.Tensor") -> "torch.Tensor":
        """A decoded chunk's values all finite (on its device); `kv` back."""
        if self.scan_values and not self.raw:
            if kv.device.type == "cpu" and kv.is_contiguous():
                import torch

                from .dtypes import dtype_name

                bad = nonfinite_count(memoryview(kv.view(-1).view(torch.uint8).numpy()), dtype_name(kv.dtype))
            else:
                import torch

                bad = int((~torch.isfinite(kv)).sum())
            self.refuse_nonfinite(bad)
        return kv

    # --- as KV --------------------------------------------------------------------------

    def decode(self, device: "torch.device | str | None" = None, *,
               buffer: "Callable[[int], memoryview] | None" = None) -> "torch.Tensor":
        """The chunk's KV_BLOB `[2, L, T, C]` (on `device`; CacheGen decodes on a GPU there),
        from checked bytes. A raw chunk in a private buffer is a view of it, not a copy; one
        copied privately goes to `buffer(length)` when given (the tensor then views it: valid
        until the caller reuses the buffer)."""
        import torch

        target = None if device is None else torch.device(device)
        if self.raw and (target is None or target.type == "cpu"):
            return self.tensor(self.checked_payload(buffer))
        return self.check_decoded(self._decode(self.checked_payload(), target))

    @staticmethod
    def decode_many(sources: "list[ChunkSource]", device: "torch.device | str",
                    payloads: "list[memoryview] | None" = None) -> "list[torch.Tensor]":
        """`decode(device)` of each source; on a GPU, sources of one batch key decode in one
        launch (to the same values). A batch that fails is decoded one by one, so the error names
        its chunk. `payloads`: the sources' `checked_payload()`s, when the caller has them
        (read and checked on other threads meanwhile)."""
        import torch

        target = torch.device(device)
        first = sources[0] if sources else None
        if target.type == "cuda" and len(sources) > 1 and first.batch_key is not None \
                and all(s.batch_key == first.batch_key for s in sources):
            payloads = payloads or [s.checked_payload() for s in sources]
            try:
                decoded = first._decode_batch(payloads, [s.shape for s in sources], target)
            except (KvtoolError, ValueError, RuntimeError, OverflowError, IndexError):
                pass  # decoded one by one below: the error then names its chunk
            else:
                if any(s.scan_values for s in sources):  # one reduction per chunk, one sync for the batch
                    for s, bad in zip(sources, nonfinite_flags(decoded)):
                        if s.scan_values:
                            s.refuse_nonfinite(bad)
                return decoded
        return [s.decode(target) for s in sources]

    def tensor(self, data: memoryview) -> "torch.Tensor":
        """A raw chunk's bytes `data` as its KV_BLOB tensor (a view: no copy, no check). Shared
        bytes are only ever read through it (torch warns of a view over read-only memory)."""
        import torch

        if not memoryview(data).readonly:
            return torch.frombuffer(data, dtype=dtype_from_name(self.dtype)).view(self.shape)
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(data, dtype=dtype_from_name(self.dtype)).view(self.shape)

    # --- failures and lifetime ----------------------------------------------------------

    def mismatch(self) -> ChecksumMismatch:
        return ChecksumMismatch(f"{self.what}: CRC-32C mismatch (stored bytes are corrupt)")

    def truncated(self) -> ChecksumMismatch:
        """The payload's file ended before it did (cut short by another program meanwhile)."""
        return ChecksumMismatch(f"{self.what}: the file ends inside the payload (stored bytes are damaged)")

    def read_failed(self, err: OSError) -> InputFileError:
        return InputFileError(f"{self.what}: cannot read ({err.strerror or err})")

    def release(self) -> None:
        """Let go of what holds the bytes (closes an owned file or the reader it came from)."""
        fd, self.fd = self.fd, -1
        if fd >= 0 and self.data is None:
            os.close(fd)
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()

    def __enter__(self) -> "ChunkSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def nonfinite_flags(tensors: "list[torch.Tensor]") -> list[bool]:
    """Whether each tensor holds a NaN or an infinity, with one synchronisation for all: each
    tensor's largest magnitude (one reduction pass, the infinity norm) is NaN or infinite exactly
    when one of its values is, since the maximum propagates NaN. Four elementwise passes and a sum
    a chunk took 4.4 ms of an 8B model's 8,192-token CacheGen load on an H100; this takes one."""
    import torch

    if not tensors:
        return []
    peaks = torch.stack([torch.linalg.vector_norm(t.reshape(-1), ord=float("inf")) for t in tensors])
    return (~torch.isfinite(peaks)).tolist()


#: The native scan's codes of the KV dtypes that can hold NaN or infinity.
_FINITE_KINDS = {"bf16": 1, "bfloat16": 1, "fp16": 2, "float16": 2, "fp32": 3, "float32": 3}


def nonfinite_count(data: memoryview, dtype: str) -> int:
    """How many values of the raw KV bytes `data` (of KV dtype `dtype`) are NaN or infinite: a
    value is exactly when all its exponent bits are set (native scan, else numpy)."""
    kind = _FINITE_KINDS.get(dtype, 0)
    if not kind:
        return 0
    native = _native()
    if native is not None and hasattr(native, "nonfinite"):
        return native.nonfinite(data, kind)
    import numpy as np

    width, mask = (np.uint32, 0x7F800000) if kind == 3 else (np.uint16, 0x7F80 if kind == 1 else 0x7C00)
    values = np.frombuffer(data, dtype=width)
    return int(np.count_nonzero((values & mask) == mask))


def _fresh(nbytes: int) -> memoryview:
    """A new writable buffer of `nbytes`, not zeroed (it is overwritten whole at once)."""
    import torch

    return memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())


#: the extension connectors/paged_native.py copies with, loaded the one way (`native_loader`)
_PAGED_NATIVE = NativeExtension("_paged_native", "KVTOOL_PAGED_NATIVE", "paged copy", "the torch path")


def _native():
    """kvtool._paged_native (its one-pass checked copy), or None where it was not built or is
    turned off (KVTOOL_PAGED_NATIVE=0, as for the connectors' native copies)."""
    return _PAGED_NATIVE.module()


__all__ = ["BatchDecoder", "ChunkSource", "Decoder", "nonfinite_count"]
