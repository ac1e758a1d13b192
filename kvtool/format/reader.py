"""Random-access container reader.

Opening reads three ranges — the 64-byte header, the 32-byte trailer, and the
manifest the trailer points to — and validates them completely before any blob
is touched. Each chunk is then one more range, so the same logic serves local
files (mmap, pread) and object storage (range requests).

A chunk leaves the reader one of two ways:

    source(i)                  a `ChunkSource` (kvtool/chunk_source.py): THE way, for tensors.
                               decode(device), copy_into(buffer), checked_payload(), and
                               `ChunkSource.decode_many(sources, device)` for a GPU batch;
                               read_chunk(i) is source(i) decoded, read_range(start, end) the
                               KV of a token range
    chunk_payload(i)           the stored bytes, checked, and their one numpy decode,
    decode_chunk_array(i, p)   without torch (verify, inspect, dump); read_chunk_array(i) is
                               the two composed

A local file may be cut short by another program while it is read. Through a mapping, pages
past the new end fault (SIGBUS, the end of the process); so the reader reads a local file's
bytes with pread, which reads short instead, and refuses them in one line (ChecksumMismatch:
"the file ends inside the payload"). Only one read uses the mapping: a chunk's `ChunkSource`,
copied by the native module behind its fault guard, which turns that SIGBUS into the same
refusal (without the native module, the source reads the file with pread too).
"""

from __future__ import annotations

import functools
import weakref
import mmap
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import codecs
from ..dtypes import NUMPY_STORAGE, dtype_from_name
from ..fsutil import input_error, open_regular_file, read_at
from ..errors import (
    ChecksumMismatch,
    DecodeError,
    FormatError,
    KvtoolError,
    ManifestCorrupt,
    ShapeMismatch,
    TruncatedFile,
    UsageError,
)
from . import layout
from ..chunk_source import ChunkSource
from .hashing import crc32
from .manifest import BlobRef, ChunkEntry, Manifest, parse_manifest
from .segment import SegmentInfo, parse_segment

if TYPE_CHECKING:
    import torch

SUPPORTED_VERSIONS = tuple(f"{major}.x" for major in layout.SUPPORTED_MAJOR_VERSIONS)


class ByteSource(Protocol):
    """Where a reader gets bytes: a local file, or e.g. an object store's range requests."""

    name: str
    size: int

    def read(self, offset: int, length: int) -> memoryview | bytes: ...

    def close(self) -> None: ...


class BytesSource:
    """A ByteSource over bytes already in memory (a download, a fuzzer's input)."""

    def __init__(self, data: bytes, name: str = "<bytes>"):
        # bytes, bytearrays and byte memoryviews are kept as they are (a store object is read
        # without a copy); other buffers are copied
        if isinstance(data, memoryview) and data.format == "B" and data.ndim == 1:
            self.data = data
        else:
            self.data = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        self.name, self.size = name, len(self.data)

    def read(self, offset: int, length: int) -> memoryview:
        return memoryview(self.data)[offset:offset + length]

    def close(self) -> None:
        pass


class MappedFile:
    """A local file, memory-mapped copy-on-write (nothing written through the mapping reaches the
    file). Only a chunk's `ChunkSource` reads the mapping, copying from it behind the native fault
    guard; every other read is a pread (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.name = str(path)
        self._file = open_regular_file(path, "a kvtool file")
        self.size = os.fstat(self._file.fileno()).st_size
        self._map = None
        self.view = memoryview(b"")
        if self.size:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
            self.view = memoryview(self._map)

    def read(self, offset: int, length: int) -> memoryview:
        return self.view[offset: offset + length]

    def read_copy(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) as a copy, read with pread: opening reads three small
        ranges, and a first touch of a fresh map's page costs more than the read (a page fault,
        with the pages around it mapped too: measured ~20 us each here)."""
        length = max(0, min(length, self.size - offset))  # as a slice of the map would be
        out = bytearray(length)
        if length:
            self.read_into(offset, memoryview(out))
        return bytes(out)

    def read_into(self, offset: int, out: memoryview) -> None:
        """Copy bytes straight from the file into `out` (one pread: no page faults on the map)."""
        if self.read_at(offset, out) < out.nbytes:
            raise TruncatedFile(f"{self.name}: file ended while reading")

    def read_at(self, offset: int, out: memoryview) -> int:
        """pread into `out`: how many bytes came (fewer where the file ends first, as when another
        program cut it short since it was opened; a mapping would fault there instead)."""
        try:
            return read_at(self._file.fileno(), out, offset)
        except OSError as err:
            raise input_error(self.name, err) from None

    def read_private(self, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) in a fresh buffer of their own (writable, not zeroed
        first: pread fills it), read with pread; fewer where the file ends first."""
        length = max(0, min(length, self.size - offset))
        out = memoryview(np.empty(length, dtype=np.uint8)).cast("B")
        return out[:self.read_at(offset, out)] if length else out

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        try:
            self.view.release()
        except BufferError:  # a chunk source not yet released still views the map
            pass
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
        self._file.close()


class PreadFile:
    """A local file read with pread from an open descriptor this source owns: for files another
    program may truncate while they are read (a shared store's objects), where a plain mapping
    would turn that into SIGBUS instead of a short read, which the reader refuses. (The native
    checked scatter may map its payload: behind a guard that makes that SIGBUS a refusal.)"""

    def __init__(self, fd: int, name: str):
        self.fd, self.name = fd, name
        st = os.fstat(fd)
        self.size, self.mtime_ns, self.regular = st.st_size, st.st_mtime_ns, stat.S_ISREG(st.st_mode)
        self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # which file, as of when

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length), fewer where the file ends first (as a slice would,
        or shrunk since it was opened). A failed read is an InputFileError, not a format error."""
        out = bytearray(max(0, min(length, self.size - offset)))
        try:
            done = read_at(self.fd, memoryview(out), offset)
        except OSError as err:
            raise input_error(self.name, err) from None
        return bytes(out[:done]) if done < len(out) else bytes(out)

    read_copy = read

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


#: Manifests of at most this many bytes are kept, parsed, for the next reader of the same bytes
#: (MANIFESTS_KEPT of them, the least recently used dropped first). A store load opens one object
#: per chunk, and the same hot prefix again and again: parsing and checking a chunk object's 1 KB
#: manifest cost ~30 us of the ~80 us it takes to open one, as long as copying 1 MB of its KV.
MANIFEST_KEPT_BYTES = 16 << 10
MANIFESTS_KEPT = 512


@functools.lru_cache(maxsize=MANIFESTS_KEPT)
def _parsed_manifest_kept(raw: bytes, data_end: int, alignment: int, minor: int) -> Manifest:
    return parse_manifest(raw, data_end=data_end, alignment=alignment, minor=minor)


def parsed_manifest(raw: bytes, data_end: int, alignment: int, minor: int = layout.VERSION_MINOR) -> Manifest:
    """`parse_manifest`, every check of it, as of these exact bytes: the same bytes (and blobs'
    end and alignment) parse to the same Manifest, so a small one is parsed once and shared by
    the readers that open it (a Manifest is read-only: frozen, and nothing changes its dicts). A
    manifest that fails its checks is not kept: it fails them again each time."""
    if len(raw) > MANIFEST_KEPT_BYTES:
        return parse_manifest(raw, data_end=data_end, alignment=alignment, minor=minor)
    return _parsed_manifest_kept(raw, data_end, alignment, minor)


class ContainerReader:
    """Opens a container from a path (mmap) or any ByteSource.

    Opening reads exactly three ranges (header, trailer, manifest); each chunk,
    the token ids and each extra is then one more range."""

    def __init__(self, source: str | os.PathLike | ByteSource):
        if isinstance(source, (str, os.PathLike)):
            source = MappedFile(source)
        self._source = source
        self._calibration_source: int | None = None
        # A local path, or the source's own name (e.g. a URL, which Path would mangle).
        self.path: Path | str = Path(source.name) if isinstance(source, MappedFile) else source.name
        try:
            self._open()
        except FormatError as err:
            self.close()
            raise type(err)(f"{self.path}: {err}") from None
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        self.file_size = self._source.size
        if self.file_size == 0:
            raise TruncatedFile("file is empty")  # __init__ puts the path before every format error
        read = getattr(self._source, "read_copy", self._source.read)
        self.header = layout.Header.unpack(bytes(read(0, layout.HEADER_SIZE)))
        self.trailer = layout.Trailer.unpack(
            bytes(read(max(0, self.file_size - layout.TRAILER_SIZE), layout.TRAILER_SIZE)), self.file_size)
        raw = read(self.trailer.manifest_offset, self.trailer.manifest_length)
        if crc32(raw) != self.trailer.manifest_crc32:
            raise ManifestCorrupt("manifest checksum mismatch (the file is corrupt)")
        self.manifest: Manifest = parsed_manifest(bytes(raw), self.trailer.manifest_offset, self.header.alignment,
                                                   self.header.minor)
        if self.manifest.calibrations:  # pca's decoder may take them from here while the file is open
            from ..codecs.pca import calibration

            this = weakref.ref(self)
            self._calibration_source = calibration.add_source(
                f"the file {self.path}", lambda digest: (r := this()) and r.calibration_bytes(digest))
            weakref.finalize(self, calibration.remove_source, self._calibration_source)  # (one never closed)

    # --- metadata ---------------------------------------------------------------

    @property
    def model(self) -> dict[str, Any]:
        return self.manifest.model

    @property
    def fingerprint(self) -> str:
        return self.manifest.model["fingerprint"]

    @property
    def chunks(self) -> list[ChunkEntry]:
        return self.manifest.chunks

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def kv_dtype(self) -> "torch.dtype":
        return dtype_from_name(self.manifest.kv_dtype)

    @property
    def version(self) -> str:
        return f"{self.header.major}.{self.header.minor}"

    @property
    def segment(self) -> SegmentInfo | None:
        """The file's `segment` key (format-spec/segment.md), checked; None: not a segment."""
        try:
            return parse_segment(self.manifest.extensions, self.manifest.num_tokens)
        except FormatError as err:
            raise type(err)(f"{self.path}: {err}") from None

    # --- blobs ------------------------------------------------------------------

    def blob_bytes(self, blob: BlobRef, *, verify: bool = True, what: str = "blob") -> memoryview:
        """A blob's stored bytes (checked unless `verify=False`): from a local file a private copy
        read with pread, never the mapping (see the module docstring); from memory a view."""
        data = self._stored(blob, what)
        if verify and crc32(data) != blob.crc32:
            raise ChecksumMismatch(f"{what}: CRC-32C mismatch (stored bytes are corrupt)")
        return data

    def blob_ok(self, blob: BlobRef) -> bool:
        """Whether the blob's stored bytes are intact (bytes cut off the end of the file are not)."""
        try:
            return crc32(self._stored(blob, "blob")) == blob.crc32
        except ChecksumMismatch:
            return False

    def _stored(self, blob: BlobRef, what: str) -> memoryview:
        """The blob's bytes as the source holds them now; all of them, or ChecksumMismatch."""
        if isinstance(self._source, MappedFile):
            data = self._source.read_private(blob.offset, blob.length)
        else:
            data = memoryview(self._source.read(blob.offset, blob.length))
        if data.nbytes != blob.length:
            raise cut_short(what)
        return data

    def _private(self, data: memoryview) -> bool:
        """Whether `data` (from `_stored`) is a buffer of its own: a local file's pread copy, which
        an array may view instead of copying (memory a caller handed in is copied first)."""
        return isinstance(self._source, MappedFile) and not data.readonly

    def token_ids(self, *, verify: bool = True) -> np.ndarray:
        data = self.blob_bytes(self.manifest.tokens, verify=verify, what="token ids")
        return np.frombuffer(data, dtype="<u4").astype(np.int64)

    def chunk_payload(self, index: int, *, verify: bool = True) -> memoryview:
        """Chunk `index`'s stored bytes (see `blob_bytes`)."""
        chunk = self._chunk(index)
        return self.blob_bytes(chunk.blob, verify=verify, what=f"chunk {index}")

    def read_chunk_array(self, index: int, *, verify: bool = True) -> np.ndarray:
        """`decode_chunk_array` of `chunk_payload(index)`: chunk `index` as a numpy KV_BLOB,
        without torch."""
        return self.decode_chunk_array(index, self.chunk_payload(index, verify=verify))

    def decode_chunk_array(self, index: int, payload: memoryview) -> np.ndarray:
        """The one numpy decode: chunk `index`'s stored bytes `payload` (`chunk_payload`, checked
        there) decoded on the CPU into a numpy KV_BLOB `[2, L, T, C]`, without torch (bfloat16 as
        its bit patterns: `kvtool.dtypes.NUMPY_STORAGE`). verify reads each chunk once, to check
        and to decode it. A raw chunk's private copy is viewed, not copied again."""
        chunk = self._chunk(index)
        storage = NUMPY_STORAGE[chunk.dtype]
        if self._is_tensor_bytes(chunk) and self._private(payload) \
                and payload.nbytes == chunk.decoded_bytes:  # (another length: the codec names the error)
            return np.frombuffer(payload, dtype=storage).reshape(chunk.shape)
        with self.failures_named(chunk):
            array = codecs.get_codec(chunk.codec_id).decode_array(payload, chunk.shape, chunk.dtype,
                                                                  chunk.codec_params)
        if tuple(array.shape) != chunk.shape or array.dtype != storage:
            raise ShapeMismatch(f"chunk {index} decoded to {list(array.shape)} {array.dtype}, "
                                f"declared {list(chunk.shape)} {chunk.dtype}")
        return array

    def source(self, index: int, *, what: str | None = None, private: bool = False,
               checked: bool = False, on_release=None, pread: bool = False) -> ChunkSource:
        """Chunk `index` as a `ChunkSource` (where its bytes are, what they are, how they become
        KV, checked as they go): the one way a chunk leaves a container as KV (decode, copy_into,
        checked_payload; `ChunkSource.decode_many` for several on a GPU). A local file's
        payload is its mapping; an open file's (`PreadFile`, a store object) stays in the file,
        read as it is copied (the source owns a copy of the descriptor); bytes in memory are
        viewed (`private`: a buffer no one else holds, decoded without a copy). `pread`: a local
        file's payload is read with pread, not mapped (for a decode into memory of its own: the
        mapped pages would be resident beside it, twice a raw chunk's size in all)."""
        chunk = self._chunk(index)
        blob = chunk.blob
        kind = dict(what=what or f"chunk {index}", codec=chunk.codec, dtype=chunk.dtype, shape=chunk.shape,
                    length=blob.length, crc32c=blob.crc32, raw=self._is_tensor_bytes(chunk),
                    decode=self._decoder(chunk), batch=self._batch(chunk), on_release=on_release)
        if isinstance(self._source, PreadFile):
            if blob.offset + blob.length > self._source.size:
                raise TruncatedFile(f"{self.path}: chunk {index} lies past the end of the file")
            return ChunkSource(**kind, fd=os.dup(self._source.fd), offset=blob.offset)
        if isinstance(self._source, MappedFile) and (pread or not _guarded_copies()):
            # the mapping is read only behind the native fault guard; without it, read with pread
            return ChunkSource(**kind, fd=os.dup(self._source.fileno()), offset=blob.offset, checked=checked)
        data = memoryview(self._source.read(blob.offset, blob.length))
        if data.nbytes != blob.length:
            raise TruncatedFile(f"{self.path}: chunk {index} lies past the end of the file")
        mapped = isinstance(self._source, MappedFile)
        return ChunkSource(**kind, data=data, mapped=mapped, private=private and not mapped, checked=checked)

    def _decoder(self, chunk: ChunkEntry):
        """How chunk `chunk`'s checked payload becomes its KV_BLOB tensor (on a device)."""
        def decode(payload: memoryview, device) -> "torch.Tensor":
            import torch

            codec = codecs.get_codec(chunk.codec_id)
            dtype = dtype_from_name(chunk.dtype)
            target = torch.device("cpu" if device is None else device)
            with self.failures_named(chunk):
                if target.type == "cpu":
                    tensor = codec.decode(payload, chunk.shape, dtype, chunk.codec_params)
                else:
                    tensor = codec.decode_to(payload, chunk.shape, dtype, chunk.codec_params, target)
            if tuple(tensor.shape) != chunk.shape or tensor.dtype != dtype:
                raise ShapeMismatch(f"chunk {chunk.index} decoded to {list(tensor.shape)} {tensor.dtype}, "
                                    f"declared {list(chunk.shape)} {chunk.dtype}")
            return tensor
        return decode

    @staticmethod
    def _batch(chunk: ChunkEntry):
        """(key, decode_batch): chunks of one codec, dtype and parameters decode together on a GPU."""
        codec = codecs.get_codec(chunk.codec_id)

        def decode_batch(payloads, shapes, device):
            return codec.decode_batch_to(payloads, shapes, dtype_from_name(chunk.dtype), chunk.codec_params, device)

        return (chunk.codec_id, chunk.dtype, repr(sorted(chunk.codec_params.items()))), decode_batch

    def read_chunk(self, index: int, *, verify: bool = True,
                   device: "torch.device | str | None" = None) -> "torch.Tensor":
        """Decode chunk `index` into a new KV_BLOB tensor `[2, L, T, C]` (on `device`, default the
        CPU; CacheGen chunks then decode on the GPU, to the same values): its `source` decoded."""
        with self.source(index, checked=not verify, pread=True) as source:  # (memory: `source`)
            return source.decode(device)

    @contextmanager
    def failures_named(self, chunk: ChunkEntry):
        """A codec's failure, named by the file's chunk (the codec knows only its payload)."""
        index = chunk.index
        try:
            yield
        except DecodeError as err:
            text = str(err)
            raise type(err)(text if text.startswith(f"chunk {index}:") else f"chunk {index}: {text}") from None
        except KvtoolError:
            raise
        except (ValueError, RuntimeError, OverflowError, IndexError) as err:
            raise DecodeError(f"chunk {index}: {chunk.codec} payload does not decode ({err})") from None

    def read_extra_array(self, name: str, *, verify: bool = True) -> np.ndarray:
        """An extra as a numpy array (bool, or a KV dtype's numpy storage), without torch."""
        extra = self._extra(name)
        return self.decode_extra_array(name, self.blob_bytes(extra.blob, verify=verify, what=f"extra {name}"))

    def decode_extra_array(self, name: str, data: memoryview) -> np.ndarray:
        """`read_extra_array` of the extra's bytes already read (`blob_bytes`)."""
        extra = self._extra(name)
        if extra.dtype == "bool":  # bytes other than 0 and 1 are not booleans
            raw = np.frombuffer(data, dtype=np.uint8)
            if bool((raw > 1).any()):
                raise DecodeError(f"extra {name}: bool bytes must be 0 or 1")
            return (raw == 1).reshape(extra.shape)
        own = data if self._private(data) else bytearray(data)
        return np.frombuffer(own, dtype=NUMPY_STORAGE[extra.dtype]).reshape(extra.shape)

    def _extra(self, name: str):
        extra = self.manifest.extras.get(name)
        if extra is None:
            raise UsageError(f"{self.path} has no extra named {name!r}")
        return extra

    def read_extra(self, name: str, *, verify: bool = True) -> "torch.Tensor":
        """An extra as a CPU tensor of its dtype."""
        import torch

        array = self.read_extra_array(name, verify=verify)
        if array.dtype == np.bool_:
            return torch.from_numpy(array)
        return torch.from_numpy(array).view(dtype_from_name(self.manifest.extras[name].dtype))

    def read_range(self, start: int, end: int, *, verify: bool = True) -> "torch.Tensor":
        """KV_BLOB for tokens [start, end), decoding only the chunks it touches."""
        import torch

        if not 0 <= start < end <= self.num_tokens:
            raise UsageError(f"token range [{start}, {end}) is outside [0, {self.num_tokens})")
        size = self.manifest.chunk_size
        parts = []
        for i in range(start // size, (end - 1) // size + 1):
            c = self.chunks[i]
            parts.append(self.read_chunk(i, verify=verify)[:, :, max(start, c.start) - c.start:
                                                            min(end, c.end) - c.start])
        return torch.cat(parts, dim=2)

    def nonzero_padding(self) -> list[tuple[int, int]]:
        """The ranges of `[64, manifest_offset)` that no blob covers and that hold a non-zero
        byte: each `(start, end)` of such a gap (the spec requires zeros there). Read a window
        at a time (a hostile file's gap may be most of it); ChecksumMismatch where it is gone."""
        m = self.manifest
        blobs = sorted([(c.blob.offset, c.blob.offset + c.blob.length) for c in m.chunks]
                       + [(e.blob.offset, e.blob.offset + e.blob.length) for e in m.extras.values()]
                       + [(b.offset, b.offset + b.length) for b in m.calibrations.values()]
                       + [(m.tokens.offset, m.tokens.offset + m.tokens.length)])
        bad, position = [], layout.HEADER_SIZE
        for start, end in blobs + [(self.trailer.manifest_offset, self.trailer.manifest_offset)]:
            if start > position and not self._zeros(position, start):
                bad.append((position, start))
            position = max(position, end)
        return bad

    PADDING_WINDOW = 1 << 20

    def _zeros(self, start: int, end: int) -> bool:
        """Whether bytes [start, end) are all zero."""
        for at in range(start, end, self.PADDING_WINDOW):
            size = min(self.PADDING_WINDOW, end - at)
            window = self._stored(BlobRef(at, size, 0), f"padding [{start}, {end})")
            if np.frombuffer(window, dtype=np.uint8).any():
                return False
        return True

    @staticmethod
    def _is_tensor_bytes(chunk: ChunkEntry) -> bool:
        return codecs.get_codec(chunk.codec_id).payload_is_tensor_bytes

    def _chunk(self, index: int) -> ChunkEntry:
        if not 0 <= index < len(self.chunks):
            raise UsageError(f"chunk {index} does not exist (the file has {len(self.chunks)})")
        return self.chunks[index]

    # --- lifetime ---------------------------------------------------------------

    def calibration_bytes(self, digest: str) -> bytes | None:
        """The pca calibration object `digest` the file carries (its CRC-32C checked), or None."""
        blob = self.manifest.calibrations.get(digest)
        if blob is None:
            return None
        return bytes(self.blob_bytes(blob, what=f"calibration {digest[:16]}..."))

    def close(self) -> None:
        if self._calibration_source is not None:
            from ..codecs.pca import calibration

            calibration.remove_source(self._calibration_source)
            self._calibration_source = None
        self._source.close()

    def __enter__(self) -> "ContainerReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_container(path: str | os.PathLike) -> ContainerReader:
    return ContainerReader(path)


def cut_short(what: str) -> ChecksumMismatch:
    """Stored bytes the file no longer holds: another program cut it short after it was opened
    (the words of `ChunkSource.truncated`, so every read of a cut file says the same)."""
    return ChecksumMismatch(f"{what}: the file ends inside the payload (stored bytes are damaged)")


def _guarded_copies() -> bool:
    """Whether the native one-pass copy, with its fault guard, copies mapped chunks (built, and
    not turned off): a mapped `ChunkSource` is safe to hand out only then."""
    from ..chunk_source import _native  # (the chunk source's own switch: one answer for both)

    return _native() is not None
