"""Store objects and their names (format-spec/store.md §2-§5).

A chunk object is a version 1.0 container holding one whole chunk, with one more top-level
manifest key, `store`, that places the chunk in its sequence (its start and its parent's prefix
hash). Any kvtool reader opens it; `check_*` here add the store's own checks, so a damaged,
truncated or foreign object is refused with `ObjectRefused` and never reaches a model.
Lookup-buffer entries are containers too; the tensors of the key/value buffer are safetensors.
"""

from __future__ import annotations

import json
import re
import struct
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..chunk_source import ChunkSource
from ..errors import InputFileError, KvtoolError, NonFiniteValues, ObjectRefused, ObjectUnreadable
from ..format.segment import parse_segment
from ..format.hashing import ZERO_HASH, crc32
from ..format.reader import BytesSource, ContainerReader, PreadFile
from ..format.writer import ContainerWriter
from ..identity import model_fingerprint
from ..format.hashing import chain_hash
from .names import (CHUNK_SUFFIX, STORE_VERSION, TENSOR_SUFFIX, block_name, chunk_name, entry_key,  # noqa: F401
                    entry_name, extra_bytes, link_hash, model_key, parse_name, piece_name, restrict_extra,
                    tensor_name)

if TYPE_CHECKING:
    import torch

#: Objects are containers with blobs aligned to 64 bytes: small for Redis and memory tiers.
OBJECT_ALIGNMENT = 64
#: No object is read past this size (a hostile size never becomes an allocation).
MAX_OBJECT_BYTES = 1 << 30
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


# --- chunk objects (§4.1) -----------------------------------------------------------------


@dataclass
class ChunkObject:
    """A checked chunk object: an open container over its bytes, and where the chunk sits."""

    reader: ContainerReader
    start: int
    parent_hash: str
    prefix_hash: str
    tokens: np.ndarray
    extra: dict[str, Any]  # the chunk's extra keys (store.md §3), {} for none
    payload_checked: bool = False  # its CRC-32C was checked on these bytes: decode need not again
    owned: bool = False  # the bytes are a writable buffer no one else holds (read for us)
    name: str = ""  # the object's name, for messages

    @property
    def codec(self) -> str:
        return self.reader.chunks[0].codec

    def source(self) -> ChunkSource:
        """The chunk as a `ChunkSource` (checks 11-12 run as it is copied or decoded); the object's
        reader is closed when the source is released. A folder's object opened as a file keeps
        its payload in the file, read as it is copied."""
        return self.reader.source(0, what=self.name or "chunk object", private=self.owned,
                                  checked=self.payload_checked, on_release=self.reader.close)

    def check_values(self) -> None:
        """Checks 12-13 without keeping the KV: the payload decodes to the declared shape and
        every value is finite (a raw payload scanned, others decoded on the CPU); an
        ObjectRefused otherwise. For what copies payloads as they are (`store get`)."""
        self.decode()  # (the tensor is dropped at once)

    def decode(self, device: "torch.device | str | None" = None) -> "torch.Tensor":
        """The chunk's KV_BLOB `[2, L, S, C]`; a failure to decode is an ObjectRefused. A raw
        chunk read into a writable buffer of our own (the local backend's) is a view of it,
        not a copy; shared bytes (a memory tier's, Redis') are copied privately and checked."""
        source = self.reader.source(0, what=self.name or "chunk object", private=self.owned,
                                    checked=self.payload_checked)
        source.scan_values = True  # check 13: what the store hands out is finite
        try:
            return source.decode(device)
        except InputFileError:
            raise  # a failed read of an object opened as a file: not damage
        except KvtoolError as err:
            if needs_what_is_not_here(err):  # intact, but this machine lacks what decodes it: never refused
                raise ObjectUnreadable(f"{self.name or 'chunk object'}: {err}") from None
            raise ObjectRefused(str(err) if isinstance(err, NonFiniteValues) else f"chunk does not decode ({err})") from None
        finally:
            source.release()


def needs_what_is_not_here(err: BaseException) -> bool:
    """Whether a chunk failed to decode only for want of something this machine does not have:
    the pca calibration object its parameters name (by its SHA-256). Such an object is intact and
    another machine (or this one, once the object is copied here) decodes it: a load counts it a
    miss and says why (`ObjectUnreadable`), and neither the load nor `fsck` refuses or removes it."""
    from ..errors import DecodeError

    if not isinstance(err, DecodeError):
        return False
    from ..codecs.pca.calibration import CalibrationNotFound

    return isinstance(err, CalibrationNotFound)


def encode_chunk(model: dict[str, Any], kv_dtype: str, parent_hash: bytes, start: int, tokens,
                 *, kv: "torch.Tensor | None" = None, payload=None, codec: str = "raw",
                 params: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                 piece_of: int | None = None) -> bytes:
    """One chunk object's bytes, from a KV_BLOB `kv` (encoded with `codec`) or an already
    encoded `payload` (copied as it is: `store put` of a container). `extra`: the chunk's extra
    keys (`ExtraKeys.for_chunk`), recorded in the object and in its prefix hash. With `piece_of`
    (the chunk size S), a piece (§4.5): the first tokens of a chunk position, fewer than S."""
    tokens = np.asarray(tokens, dtype=np.int64)
    prefix = link_hash(parent_hash, tokens, extra).hex()
    extension = {"version": STORE_VERSION, "kind": "chunk" if piece_of is None else "piece", "start": int(start),
                 "parent_hash": parent_hash.hex(), "prefix_hash": prefix}
    if piece_of is not None:
        extension["chunk_size"] = int(piece_of)
    if extra:
        extension["extra"] = extra
    writer = ContainerWriter(None, model, tokens, kv_dtype=kv_dtype, chunk_size=len(tokens),
                             alignment=OBJECT_ALIGNMENT, extensions={"store": extension})
    if payload is not None:
        writer.write_encoded_chunk(payload, codec, params or {})
    else:
        writer.write_chunk(kv, codec=codec, params=params, position=start)  # (pca: the chunk's real positions)
    writer.finish()
    return writer.getvalue()


def open_object(data, name: str) -> ContainerReader:
    """The container reader of an object's bytes, or of an object opened as a file (a
    `PreadFile`: the reader owns it from here); any format error is an ObjectRefused."""
    if isinstance(data, PreadFile):
        source = data
    elif len(data) > MAX_OBJECT_BYTES:
        raise ObjectRefused(f"{name}: {len(data)} bytes, more than an object may hold")
    else:
        source = BytesSource(data, name)
    try:
        return ContainerReader(source)
    except InputFileError:
        raise  # the file could not be read (an I/O error): not a damaged object to refuse
    except KvtoolError as err:
        raise ObjectRefused(str(err)) from None


def check_chunk(data, name: str, *, model: str | None = None, chunk_size: int | None = None,
                prefix_hash: str | None = None, start: int | None = None, extra: dict[str, Any] | None = None,
                verify_payload: bool = True, kind: str = "chunk") -> ChunkObject:
    """Every check of §5 on a chunk object's bytes, against what its name promises; the
    expected model key, chunk size, prefix hash, start and extra keys when the caller knows them.
    `kind` "piece": a piece object (§4.5), whose `chunk_size` is the chunk size of its position."""
    reader = open_object(data, name)
    with _refusing(reader, name):
        obj = _check_chunk(reader, name, model, chunk_size, prefix_hash, start, extra, verify_payload, kind)
    obj.owned = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    obj.name = name
    return obj


@contextmanager
def _refusing(reader: ContainerReader, name: str):
    """A failed check closes the object's reader and is an ObjectRefused naming the object."""
    try:
        yield
    except KvtoolError as err:
        reader.close()
        if isinstance(err, (ObjectRefused, InputFileError)):  # (the latter: a failed read, not damage)
            raise
        raise ObjectRefused(f"{name}: {err}") from None


@dataclass(frozen=True)
class _ChunkFacts:
    """What a chunk object's manifest says, checked: checks 3-6 of §5, which read nothing else."""

    position: int
    parent: str
    prefix: str
    model_key: str
    extra: dict[str, Any]
    extra_bytes: bytes  # what the extra keys add to the prefix hash's input
    chunk_size: int  # the chunk size of its position: the container's (a chunk), store.chunk_size (a piece)
    kind: str  # "chunk" or "piece"


#: The facts of manifests checked already, by manifest: readers of the same manifest bytes share
#: one Manifest (format.reader.parsed_manifest), so a hot prefix's objects are checked once per
#: process for these (~15 us each, mostly recomputing the model's fingerprint); the tokens, the
#: names and the payload are checked on every load.
_facts_seen: "weakref.WeakKeyDictionary[Any, _ChunkFacts]" = weakref.WeakKeyDictionary()


def _chunk_facts(m, name: str, kind: str = "chunk") -> _ChunkFacts:
    facts = _facts_seen.get(m)
    if facts is not None and facts.kind == kind:
        return facts
    ext = _extension(m.extensions, kind, name)
    position, parent, prefix = ext.get("start"), ext.get("parent_hash"), ext.get("prefix_hash")
    if not (isinstance(position, int) and not isinstance(position, bool) and position >= 0):
        raise ObjectRefused(f"{name}: store.start must be a non-negative integer")
    if not (isinstance(parent, str) and _HEX64.match(parent) and isinstance(prefix, str) and _HEX64.match(prefix)):
        raise ObjectRefused(f"{name}: store.parent_hash and store.prefix_hash must be 64 hex digits")
    extra = ext.get("extra", {})
    try:  # recorded only when there are extra keys; readers hash them as writers did (canonical JSON)
        extra_input = extra_bytes(extra) if isinstance(extra, dict) and (extra or "extra" not in ext) else None
    except (TypeError, ValueError):  # not JSON that canonical_json writes (a NaN, a lone surrogate)
        extra_input = None
    if extra_input is None:
        raise ObjectRefused(f"{name}: store.extra must be a non-empty object of extra keys when present")
    if len(m.chunks) != 1 or m.num_tokens != m.chunk_size or m.extras:
        raise ObjectRefused(f"{name}: a chunk object holds exactly one whole chunk and no extras")
    _check_no_rotated_segment(m, name)
    span = m.chunk_size
    if kind == "piece":  # fewer tokens than a whole chunk of its position's chunk size
        span = ext.get("chunk_size")
        if not (type(span) is int and m.num_tokens < span <= 65536):
            raise ObjectRefused(f"{name}: a piece's store.chunk_size must be an integer in ({m.num_tokens}, 65536]")
    if position % span or (position == 0) != (parent == ZERO_HASH.hex()):
        raise ObjectRefused(f"{name}: store.start {position} does not fit chunk size {span} "
                            f"and its parent hash")
    _check_fingerprint(m.model, name)
    facts = _ChunkFacts(position, parent, prefix, model_key(m.model), extra, extra_input, span, kind)
    _facts_seen[m] = facts
    return facts


def _check_chunk(reader: ContainerReader, name: str, model: str | None, chunk_size: int | None,
                 prefix_hash: str | None, start: int | None, extra: dict[str, Any] | None,
                 verify_payload: bool, kind: str = "chunk") -> ChunkObject:
    m = reader.manifest
    facts = _chunk_facts(m, name, kind)
    position, parent, prefix, own = facts.position, facts.parent, facts.prefix, facts.model_key
    tokens = reader.token_ids()  # checks the tokens' CRC-32C
    if chain_hash(bytes.fromhex(parent), tokens, facts.extra_bytes).hex() != prefix:
        raise ObjectRefused(f"{name}: the prefix hash does not match the parent hash, the tokens and the extra keys")
    if extra is not None and extra != facts.extra:  # (the prefix hash differs too: this says why)
        raise ObjectRefused(f"{name}: holds a chunk of other extra keys than asked for (another namespace, "
                            "cache salt, adapter or input)")
    expected = {"model": (model, own), "chunk size": (chunk_size, facts.chunk_size),
                "prefix hash": (prefix_hash, prefix), "start": (start, position)}
    for what, (want, got) in expected.items():
        if want is not None and want != got:
            raise ObjectRefused(f"{name}: holds another {what} than asked for ({got} vs {want})")
    parsed = parse_name(name)
    if parsed is not None and parsed[0] in ("chunk", "piece"):
        g = parsed[1]
        if parsed[0] != kind or (g.group(1), int(g.group(2)), g.group(4)) != (own, facts.chunk_size, prefix):
            raise ObjectRefused(f"{name}: the object's contents do not belong under its name")
    if verify_payload:
        reader.chunk_payload(0)  # checks the payload's CRC-32C
    return ChunkObject(reader=reader, start=position, parent_hash=parent, prefix_hash=prefix, tokens=tokens,
                       extra=facts.extra, payload_checked=verify_payload)


def _check_no_rotated_segment(m, name: str) -> None:
    """Check 5: the store is a prefix cache, so a chunk object marked a segment whose keys were
    rotated for other positions (`segment.stored_start` other than 0), or whose `segment` key does
    not check (segment.md §1), is refused (segment.md §1, "Prefix consumers")."""
    try:
        segment = parse_segment(m.extensions, m.num_tokens)
    except KvtoolError as err:
        raise ObjectRefused(f"{name}: {err}") from None
    if segment is not None and segment.stored_start != 0:
        raise ObjectRefused(f"{name}: a segment whose keys were rotated for positions from {segment.stored_start}: "
                            "not a prefix cache (segment.md §1)")


def _check_fingerprint(model: dict[str, Any], name: str) -> None:
    """The model's fingerprint is recomputed: a forged one would file chunks under another model."""
    if model_fingerprint(model) != model.get("fingerprint"):
        raise ObjectRefused(f"{name}: the model's fingerprint does not match its configuration")


def _extension(extensions: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    ext = extensions.get("store")
    if not isinstance(ext, dict):
        raise ObjectRefused(f"{name}: not a store object (no 'store' key in its manifest)")
    if ext.get("version") == 1 and type(ext.get("version")) is int:  # store.md §9: never served
        raise ObjectRefused(f"{name}: written under store version 1, whose names ignore extra keys (salt, "
                            "adapter, namespace): never served")
    if type(ext.get("version")) is not int or ext.get("version") != STORE_VERSION:  # not true, not 2.0
        raise ObjectRefused(f"{name}: store object version {ext.get('version')!r} is not {STORE_VERSION}")
    if ext.get("kind") != kind:
        raise ObjectRefused(f"{name}: a {ext.get('kind')!r} object where a {kind} was expected")
    return ext


# --- block index entries (§4.6) ----------------------------------------------------------

#: A block index entry is a few hundred bytes of JSON; anything larger is not one.
MAX_BLOCK_ENTRY_BYTES = 4096


def encode_block_entry(tokens: int, target: str) -> bytes:
    """A block index entry: the object (`target`, a chunk or piece name) whose first `tokens`
    tokens are the block prefix the entry's name hashes."""
    doc = {"version": STORE_VERSION, "kind": "block", "tokens": int(tokens), "target": target}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def check_block_entry(data, name: str) -> tuple[int, str]:
    """(tokens, target) of a block index entry, checked as far as it can be alone: its JSON, its
    version, a target of the same model and chunk size that holds more tokens than it names. That
    the target's first tokens are the ones hashed into the name is checked on the target itself
    (`check_serves`, and `fsck`)."""
    if len(data) > MAX_BLOCK_ENTRY_BYTES:
        raise ObjectRefused(f"{name}: {len(data)} bytes is not a block index entry")
    try:
        doc = json.loads(bytes(data))
    except ValueError:
        raise ObjectRefused(f"{name}: a block index entry is JSON") from None
    if not isinstance(doc, dict) or type(doc.get("version")) is not int or doc.get("version") != STORE_VERSION \
            or doc.get("kind") != "block":
        raise ObjectRefused(f"{name}: not a block index entry of store version {STORE_VERSION}")
    tokens, target = doc.get("tokens"), doc.get("target")
    own, parsed = parse_name(name), parse_name(target) if isinstance(target, str) else None
    if not (type(tokens) is int and tokens > 0 and own is not None and own[0] == "block" and parsed is not None
            and parsed[0] in ("chunk", "piece") and parsed[1].group(1, 2) == own[1].group(1, 2)
            and tokens < int(own[1].group(2))):
        raise ObjectRefused(f"{name}: a block index entry must name a chunk or piece of its model and chunk size, "
                            "and fewer tokens than a chunk")
    return tokens, target


def check_serves(obj: ChunkObject, name: str, parent: str, tokens: np.ndarray, extra: dict[str, Any]) -> None:
    """A checked chunk or piece object serves a request's block prefix (its first `len(tokens)`
    tokens): same parent, those tokens first, and the same extra keys for them (`restrict_extra`
    of what the object records). ObjectRefused (as a foreign object) otherwise."""
    m = len(tokens)
    if obj.parent_hash != parent or len(obj.tokens) < m or not np.array_equal(obj.tokens[:m], tokens):
        raise ObjectRefused(f"{name}: does not begin with the {m} tokens asked for after that parent")
    if restrict_extra(obj.extra, obj.start, obj.start + m) != extra:
        raise ObjectRefused(f"{name}: holds a chunk of other extra keys than asked for (another namespace, "
                            "cache salt, adapter or input)")


# --- lookup-buffer entries (§4.2) -------------------------------------------------------


def encode_entry(model: dict[str, Any], kv_dtype: str, tokens: np.ndarray, roi: np.ndarray,
                 kv: "torch.Tensor", hidden: "torch.Tensor | None", chunk_size: int,
                 key_shape: list[int] | None = None) -> bytes:
    """A lookup-buffer entry: the request's tokens, its KV `[2, L, N, C]` (raw), the roi mask
    and the hidden states; `key_shape` is the shape the caller's key tensor had."""
    import torch

    key = entry_key(model_key(model), tokens, roi)
    ext = {"version": STORE_VERSION, "kind": "entry", "key": key}
    if key_shape is not None:
        ext["key_shape"] = [int(d) for d in key_shape]
    writer = ContainerWriter(None, model, tokens, kv_dtype=kv_dtype, chunk_size=chunk_size,
                             alignment=OBJECT_ALIGNMENT, extensions={"store": ext})
    for s, e in writer.chunk_ranges():
        writer.write_chunk(kv[:, :, s:e], codec="raw")
    writer.write_extra("roi_mask", torch.from_numpy(roi.astype(bool)))
    if hidden is not None:
        writer.write_extra("hidden_states", hidden)
    writer.finish()
    return writer.getvalue()


def check_entry(data, name: str, model: str | None = None) -> ContainerReader:
    """A lookup-buffer entry's checks: a container, of this model, whose key matches its tokens
    and roi, every blob's CRC-32C intact."""
    reader = open_object(data, name)
    with _refusing(reader, name):
        m = reader.manifest
        ext = _extension(m.extensions, "entry", name)
        _check_fingerprint(m.model, name)
        own = model_key(m.model)
        if model is not None and own != model:
            raise ObjectRefused(f"{name}: holds another model's entry")
        if "roi_mask" not in m.extras:
            raise ObjectRefused(f"{name}: an entry without its roi mask")
        tokens, roi = reader.token_ids(), reader.read_extra_array("roi_mask")
        key = entry_key(own, tokens, roi)
        if ext.get("key") != key:
            raise ObjectRefused(f"{name}: the entry's key does not match its tokens and roi")
        parsed = parse_name(name)
        if parsed is not None and parsed[0] == "entry" and (parsed[1].group(1), parsed[1].group(2)) != (own, key):
            raise ObjectRefused(f"{name}: the entry's contents do not belong under its name")
        for chunk in m.chunks:
            reader.chunk_payload(chunk.index)
        for extra in m.extras:
            reader.read_extra_array(extra)
    return reader


# --- key/value tensors (§4.3) -----------------------------------------------------------


def encode_tensor(key: str, value: "torch.Tensor") -> bytes:
    """A safetensors file of one tensor, `value`, whose metadata names the key and the
    CRC-32C of the data section."""
    from safetensors.torch import save

    tensor = value.detach().cpu().contiguous()
    plain = save({"value": tensor})
    (header_len,) = struct.unpack_from("<Q", plain, 0)
    crc = crc32(memoryview(plain)[8 + header_len:])
    # the CRC covers the data; the shape and dtype are repeated so a damaged header is caught too
    meta = {"kvtool.store": str(STORE_VERSION), "kind": "tensor", "key": key, "crc32c": f"{crc:08x}",
            "shape": json.dumps(list(tensor.shape)), "dtype": str(tensor.dtype).removeprefix("torch.")}
    return save({"value": tensor}, metadata=meta)


def check_tensor(data, name: str, key: str | None = None) -> "torch.Tensor":
    """The tensor of a key/value object, after §5's checks (header bounds, key, CRC-32C)."""
    from safetensors.torch import load

    if len(data) > MAX_OBJECT_BYTES or len(data) < 8:
        raise ObjectRefused(f"{name}: {len(data)} bytes is not a tensor object")
    (header_len,) = struct.unpack_from("<Q", data, 0)
    if header_len > min(len(data) - 8, 1 << 20):
        raise ObjectRefused(f"{name}: its header length {header_len} is out of bounds")
    try:
        meta = json.loads(bytes(data[8:8 + header_len])).get("__metadata__") or {}
        if not isinstance(meta, dict) or meta.get("kvtool.store") != str(STORE_VERSION) or meta.get("kind") != "tensor":
            raise ObjectRefused(f"{name}: not a store tensor object")
        if key is not None and meta.get("key") != key:
            raise ObjectRefused(f"{name}: holds the tensor of another key")
        if meta.get("crc32c") != f"{crc32(memoryview(data)[8 + header_len:]):08x}":
            raise ObjectRefused(f"{name}: CRC-32C mismatch (stored bytes are corrupt)")
        parsed = parse_name(name)
        if parsed is not None and parsed[0] == "tensor" and tensor_name(str(meta.get("key"))) != name:
            raise ObjectRefused(f"{name}: the tensor's key does not belong under its name")
        tensors = load(bytes(data))
    except ObjectRefused:
        raise
    except Exception as err:  # safetensors raises its own SafetensorError, json ValueError
        raise ObjectRefused(f"{name}: not a readable safetensors object ({type(err).__name__})") from None
    if set(tensors) != {"value"}:
        raise ObjectRefused(f"{name}: a tensor object holds exactly one tensor, 'value'")
    value = tensors["value"]
    if meta.get("shape") != json.dumps(list(value.shape)) or meta.get("dtype") != str(value.dtype).removeprefix("torch."):
        raise ObjectRefused(f"{name}: the tensor's header does not match its recorded shape and dtype")
    return value
