"""Streaming, atomic container writer.

Sections go in a fixed order, enforced by a state enum (as gguf-py's writer
does): header -> chunks (one by one, as a model produces them) -> extras ->
tokens, manifest, trailer. Bytes go to a sink (sinks.py), in one place
(`_write`); `finish()` commits it. For a path the sink is a temporary file
beside the target, fsynced and renamed over it, so a crash at any point leaves
either the old file or the new one, never a mix.
"""

from __future__ import annotations

import enum
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import codecs
from ..dtypes import dtype_name
from ..errors import UsageError
from ..version import __version__
from . import layout
from .hashing import ZERO_HASH, chain_hash, crc32, tokens_to_bytes
from ..identity import ModelIdentity
from .manifest import LATENT_CODECS, BlobRef, ChunkEntry, ExtraEntry, Manifest, layout_of_model
from .sinks import Sink, open_sink

if TYPE_CHECKING:
    import torch


def check_codec_for_layout(codec: str, kv_layout: str) -> None:
    """UsageError, one line, for a codec a chunk of this layout kind may not use (container.md 3.2:
    cachegen and pca code K and V planes; an mla_latent chunk is raw or zstd)."""
    if kv_layout != layout.KV_BLOB and codec not in LATENT_CODECS:
        raise UsageError(f"codec {codec} codes K and V planes, not the {kv_layout} layout's latent "
                         f"(use {' or '.join(LATENT_CODECS)})")


class WriterState(enum.Enum):
    CHUNKS = 1
    EXTRAS = 2
    FINISHED = 3
    ABORTED = 4


class ContainerWriter:
    """Write one token sequence's KV cache, chunk by chunk.

    >>> with ContainerWriter(path, identity, token_ids, kv_dtype=torch.bfloat16) as w:
    ...     for start, end in w.chunk_ranges():
    ...         w.write_chunk(kv_blob_for(start, end), codec="zstd")
    ... # leaving the block calls finish(); an exception aborts instead
    """

    def __init__(self, path: str | os.PathLike | Sink | None, identity: ModelIdentity | dict[str, Any],
                 token_ids, *, kv_dtype: "torch.dtype | str" = "bfloat16", chunk_size: int = 256,
                 alignment: int = layout.DEFAULT_ALIGNMENT, metadata: dict[str, str] | None = None,
                 extensions: dict[str, Any] | None = None):
        """`path=None` writes into memory (`getvalue()` after `finish()`): the chunk store's
        objects; a `Sink` is written, then committed by `finish()` or aborted (a writer that
        refuses its arguments never touches it). `extensions` are further top-level manifest
        keys (format-spec/store.md)."""
        if isinstance(identity, ModelIdentity):
            model = {**identity.to_dict(), "fingerprint": identity.fingerprint()}
        else:  # a manifest's model object, copied from another file (compress)
            model = dict(identity)
            if "fingerprint" not in model:
                raise UsageError("model identity lacks a fingerprint")
        self.model = model
        try:
            self.tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        except (OverflowError, ValueError, TypeError):
            raise UsageError("token ids must be integers in [0, 2^32)") from None
        if self.tokens.size and (self.tokens.min() < 0 or self.tokens.max() > 0xFFFFFFFF):
            raise UsageError("token ids must be integers in [0, 2^32)")
        if not 1 <= len(self.tokens) <= layout.MAX_TOKENS:
            raise UsageError(f"a KV file holds 1 to {layout.MAX_TOKENS} tokens, got {len(self.tokens)}")
        if not 1 <= chunk_size <= layout.MAX_CHUNK_SIZE:
            raise UsageError(f"chunk size must be in [1, {layout.MAX_CHUNK_SIZE}], got {chunk_size}")
        if not (layout.MIN_ALIGNMENT <= alignment <= layout.MAX_ALIGNMENT) or alignment & (alignment - 1):
            raise UsageError(f"alignment must be a power of two in [{layout.MIN_ALIGNMENT}, "
                             f"{layout.MAX_ALIGNMENT}], got {alignment}")
        self.kv_dtype_name = dtype_name(kv_dtype)
        self.chunk_size = chunk_size
        self.alignment = alignment
        self.metadata = {"created_by": f"kvtool {__version__}",
                         "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         **(metadata or {})}
        self.num_tokens = len(self.tokens)
        self.num_chunks = -(-self.num_tokens // chunk_size)
        if self.num_chunks > layout.MAX_CHUNKS:  # refused now, not after every chunk is written
            raise UsageError(f"{self.num_tokens} tokens in chunks of {chunk_size} make {self.num_chunks} chunks; "
                             f"a file holds at most {layout.MAX_CHUNKS} (a larger --chunk-size)")
        self.hidden_kv = model["num_kv_heads"] * model["head_dim"]
        # An MLA model's identity names its latent layout (manifest.layout_of_model): the file
        # is then an mla_latent file, one plane per chunk, of the version that brought the kind.
        self.kv_layout, self.latent = layout_of_model(model)
        self.planes = layout.LAYOUT_PLANES[self.kv_layout]
        self.chunks: list[ChunkEntry] = []
        self.extras: dict[str, ExtraEntry] = {}
        self.calibrations: dict[str, BlobRef] = {}  # pca calibration objects carried, by digest
        self._prev_hash = ZERO_HASH
        self.extensions = dict(extensions or {})
        self._sink = open_sink(path)  # until the state is set, a FileSink dropped cleans up itself
        self.path = getattr(self._sink, "path", None)
        self._pos = 0
        self.state = WriterState.CHUNKS
        self.minor = layout.LAYOUT_MINOR[self.kv_layout]
        self._write(layout.Header(minor=self.minor, alignment=alignment).pack())
        self._pos = layout.HEADER_SIZE

    # --- sections, in order ------------------------------------------------

    def chunk_ranges(self) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk_size, self.num_tokens))
                for s in range(0, self.num_tokens, self.chunk_size)]

    @property
    def kv_dtype(self) -> "torch.dtype":
        from ..dtypes import dtype_from_name

        return dtype_from_name(self.kv_dtype_name)

    def write_chunk(self, kv: "torch.Tensor", codec: str = "raw",
                    params: dict[str, Any] | None = None, *, position: int | None = None) -> ChunkEntry:
        """Encode and append the next chunk, a KV_BLOB `[2, L, T, C]`. `position`: its first
        token's position in its sequence, for a codec that needs it (`needs_position`); by
        default its start in this container (a store object's chunk sits at its `store.start`)."""
        self._expect(WriterState.CHUNKS, "write_chunk")
        index = len(self.chunks)
        if index >= self.num_chunks:
            raise UsageError(f"all {self.num_chunks} chunks are already written")
        start, end = index * self.chunk_size, min((index + 1) * self.chunk_size, self.num_tokens)
        shape = (self.planes, self.model["num_layers"], end - start, self.hidden_kv)
        if tuple(kv.shape) != shape:
            raise UsageError(f"chunk {index} has shape {list(kv.shape)}, expected {list(shape)}")
        impl = self._codec(codec)
        kv = kv.detach().to(dtype=self.kv_dtype).contiguous()  # the codec encodes it where it is, or copies
        params = impl.validate_params(params if params is not None else impl.default_params())
        if getattr(impl, "needs_position", False):  # a codec that turns keys back by their positions
            params = dict(params, position=start if position is None else int(position))
        payload, recorded = impl.encode(kv, params)
        return self._append_chunk(payload, impl, recorded)

    def write_encoded_chunk(self, payload, codec: str, params: dict[str, Any]) -> ChunkEntry:
        """Append an already-encoded payload (used by `compress` to copy chunks as they are)."""
        self._expect(WriterState.CHUNKS, "write_encoded_chunk")
        if len(self.chunks) >= self.num_chunks:
            raise UsageError(f"all {self.num_chunks} chunks are already written")
        return self._append_chunk(payload, self._codec(codec), params)

    def _codec(self, codec: str | int) -> codecs.Codec:
        """The codec table's entry; for an mla_latent file only the codecs its chunks may use."""
        impl = codecs.get_codec(codec)
        check_codec_for_layout(impl.name, self.kv_layout)
        return impl

    def _append_chunk(self, payload, impl: codecs.Codec, params: dict[str, Any]) -> ChunkEntry:
        index = len(self.chunks)
        start, end = index * self.chunk_size, min((index + 1) * self.chunk_size, self.num_tokens)
        self._prev_hash = chain_hash(self._prev_hash, self.tokens[start:end])
        entry = ChunkEntry(index=index, start=start, end=end, prefix_hash=self._prev_hash.hex(),
                           codec=impl.name, codec_id=impl.codec_id, codec_params=params,
                           blob=self._append_blob(payload),
                           shape=(self.planes, self.model["num_layers"], end - start, self.hidden_kv),
                           dtype=self.kv_dtype_name)
        self.chunks.append(entry)
        return entry

    def write_extra(self, name: str, tensor: "torch.Tensor") -> None:
        """Append a per-sequence extra: `hidden_states [T, hidden]` or `roi_mask [T]` (bool)."""
        if self.state is WriterState.CHUNKS:
            self._require_all_chunks()
            self.state = WriterState.EXTRAS
        self._expect(WriterState.EXTRAS, "write_extra")
        if name in self.extras:
            raise UsageError(f"extra {name!r} written twice")
        import torch

        tensor = tensor.detach().cpu().contiguous()
        hidden = self.model.get("hidden_size")
        if name == "hidden_states" and (tensor.dim() != 2 or tensor.shape[0] != self.num_tokens
                                        or (isinstance(hidden, int) and tensor.shape[1] != hidden)):
            raise UsageError(f"hidden_states must be [{self.num_tokens}, {hidden}], got {list(tensor.shape)}")
        if name == "roi_mask" and tuple(tensor.shape) != (self.num_tokens,):
            raise UsageError(f"roi_mask must be [{self.num_tokens}], got {list(tensor.shape)}")
        if name == "roi_mask":
            tensor = tensor.to(torch.bool)
            dtype = "bool"
        else:
            dtype = dtype_name(tensor.dtype)
        raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        self.extras[name] = ExtraEntry(name=name, blob=self._append_blob(raw),
                                       shape=tuple(tensor.shape), dtype=dtype)

    def write_calibration(self, digest: str, data: bytes) -> None:
        """Carry a pca calibration object (its bytes, which hash to `digest`) in the file, so that a
        reader without it decodes the chunks that name it (format-spec/pca.md §3.3)."""
        import hashlib

        if self.state not in (WriterState.CHUNKS, WriterState.EXTRAS):
            raise UsageError("write_calibration after finish")
        if hashlib.sha256(data).hexdigest() != digest:
            raise UsageError(f"calibration {digest[:16]}...: the bytes given hash otherwise")
        if digest not in self.calibrations:
            self.calibrations[digest] = self._append_blob(data)

    def embed_pca_calibrations(self) -> None:
        """Carry the calibration object of every pca chunk written so far (format-spec/pca.md §3.3):
        a reader without it decodes the file, at the object's cost in bits (`inspect` states it)."""
        from ..codecs.pca.calibration import object_bytes

        for digest in sorted({c.codec_params["calibration"] for c in self.chunks if c.codec == "pca"}):
            self.write_calibration(digest, object_bytes(digest))

    def finish(self) -> Manifest:
        """Write tokens, manifest and trailer, and commit the sink (a file: fsync, rename over
        the target)."""
        try:
            return self._finish()
        except BaseException:
            self.abort()
            raise

    def _finish(self) -> Manifest:
        if self.state is WriterState.CHUNKS:
            self._require_all_chunks()
            self.state = WriterState.EXTRAS
        self._expect(WriterState.EXTRAS, "finish")
        tokens = self._append_blob(tokens_to_bytes(self.tokens))
        manifest = Manifest(model=self.model, kv_dtype=self.kv_dtype_name,
                            num_tokens=self.num_tokens, chunk_size=self.chunk_size, tokens=tokens,
                            chunks=self.chunks, extras=self.extras, metadata=self.metadata,
                            calibrations=self.calibrations, extensions=self.extensions,
                            kv_layout=self.kv_layout, latent=self.latent)
        # Validate what we are about to write with the reader's own rules.
        from .manifest import parse_manifest

        raw = manifest.to_bytes()
        manifest_offset = layout.align_up(self._pos, layout.MANIFEST_ALIGNMENT)
        parse_manifest(raw, data_end=manifest_offset, alignment=self.alignment, minor=self.minor)
        self._pad_to(manifest_offset)
        self._write(raw)
        self._write(layout.Trailer(manifest_offset, len(raw), crc32(raw)).pack())
        self._sink.commit()
        self.state = WriterState.FINISHED
        return manifest

    def getvalue(self) -> bytes:
        """The finished container's bytes, for a writer made with `path=None`."""
        getvalue = getattr(self._sink, "getvalue", None)
        if getvalue is None or self.state is not WriterState.FINISHED:
            raise UsageError("getvalue() is for a finished in-memory writer")
        return getvalue()

    def abort(self) -> None:
        if self.state in (WriterState.FINISHED, WriterState.ABORTED):
            return
        self.state = WriterState.ABORTED
        self._sink.abort()

    def __enter__(self) -> "ContainerWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()

    def __del__(self) -> None:  # a writer dropped without finish() leaves no temp file
        if getattr(self, "state", None) in (WriterState.CHUNKS, WriterState.EXTRAS):
            self.abort()

    # --- internals ---------------------------------------------------------

    def _expect(self, state: WriterState, what: str) -> None:
        if self.state is not state:
            raise UsageError(f"{what}() is not allowed after the writer reached {self.state.name}")

    def _require_all_chunks(self) -> None:
        if len(self.chunks) != self.num_chunks:
            raise UsageError(f"only {len(self.chunks)} of {self.num_chunks} chunks were written")

    def _write(self, data) -> None:
        """The one place bytes leave the writer: to the sink, in order."""
        self._sink.write(data)

    def _pad_to(self, offset: int) -> None:
        if offset > self._pos:
            self._write(bytes(offset - self._pos))
            self._pos = offset

    def _append_blob(self, payload) -> BlobRef:
        self._pad_to(layout.align_up(self._pos, self.alignment))
        view = memoryview(payload).cast("B")
        ref = BlobRef(offset=self._pos, length=view.nbytes, crc32=crc32(view))
        self._write(view)
        self._pos += view.nbytes
        return ref
