"""The JSON manifest: typed view, serialisation, and hostile-input validation.

The schema is format-spec/manifest.schema.json; the checks here are that schema
plus the cross-field rules of format-spec/container.md ("Reader obligations").
Every rejection raises one of the named errors in kvtool.errors.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import codecs
from ..dtypes import ITEMSIZE, KV_DTYPE_NAMES
from ..errors import (
    BlobOutOfBounds,
    BlobOverlap,
    DuplicateField,
    ManifestCorrupt,
    ManifestInvalid,
    MissingField,
    UnsupportedDtype,
)
from . import layout

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
EXTRA_DTYPES = {**ITEMSIZE, "bool": 1}
KNOWN_EXTRAS = {"hidden_states", "roi_mask"}
KNOWN_TOP_LEVEL = ("model", "kv", "sequence", "chunks", "extras", "metadata", "calibrations")
MAX_CALIBRATIONS = 16  # pca calibration objects a file may carry (format-spec/pca.md §3.3)
MAX_CALIBRATION_BYTES = 1 << 30  # one object: an 8B-shaped model's is 134 MB
#: The codecs of an mla_latent chunk (container.md 3.2): the lossless ones. cachegen and pca are
#: defined over K and V planes (pca turns keys back by their positions), not over a latent.
LATENT_CODECS = ("raw", "zstd")


@dataclass(frozen=True)
class BlobRef:
    offset: int
    length: int
    crc32: int

    def to_json(self) -> dict[str, int]:
        return {"offset": self.offset, "length": self.length, "crc32": self.crc32}


@dataclass(frozen=True)
class ChunkEntry:
    index: int
    start: int
    end: int
    prefix_hash: str
    codec: str
    codec_id: int
    codec_params: dict[str, Any]
    blob: BlobRef
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def decoded_bytes(self) -> int:
        return math.prod(self.shape) * EXTRA_DTYPES[self.dtype]

    @property
    def codec_object(self) -> codecs.Codec:
        """The chunk's codec from the codec table (`codec` is its name): what the load path asks
        how the chunk loads. CodecUnavailable when its module cannot load."""
        return codecs.get_codec(self.codec_id)

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "prefix_hash": self.prefix_hash,
                "codec": self.codec, "codec_id": self.codec_id, "codec_params": self.codec_params,
                **self.blob.to_json(), "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class ExtraEntry:
    name: str
    blob: BlobRef
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {**self.blob.to_json(), "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True, eq=False)  # (compared by identity: readers share one, see the docstring)
class Manifest:
    """A container's manifest, checked. Read-only: readers of the same bytes share one
    (reader.parsed_manifest), so neither it nor its dicts and lists are changed after parsing."""

    model: dict[str, Any]
    kv_dtype: str
    num_tokens: int
    chunk_size: int
    tokens: BlobRef
    chunks: list[ChunkEntry]
    extras: dict[str, ExtraEntry] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    # pca calibration objects the file carries, by digest (format-spec/pca.md §3.3)
    calibrations: dict[str, BlobRef] = field(default_factory=dict)
    # Top-level keys this reader does not define, kept as they are: the store's `store` key
    # (format-spec/store.md) or a later minor version's. Written after the known keys.
    extensions: dict[str, Any] = field(default_factory=dict)
    kv_layout: str = layout.KV_BLOB  # container.md section 3.2: kv_blob or mla_latent
    latent: dict[str, int] | None = None  # mla_latent's {"kv_lora_rank", "rope_dim"}

    @property
    def planes(self) -> int:
        """A chunk's leading dimension: 2 (K, V) for kv_blob, 1 (the latent) for mla_latent."""
        return layout.LAYOUT_PLANES[self.kv_layout]

    @property
    def num_layers(self) -> int:
        return self.model["num_layers"]

    @property
    def num_kv_heads(self) -> int:
        return self.model["num_kv_heads"]

    @property
    def head_dim(self) -> int:
        return self.model["head_dim"]

    @property
    def hidden_kv(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "kv": kv_json(self.kv_dtype, self.kv_layout, self.latent),
            "sequence": {"num_tokens": self.num_tokens, "chunk_size": self.chunk_size,
                         "tokens": self.tokens.to_json()},
            "chunks": [c.to_json() for c in self.chunks],
            "extras": {name: e.to_json() for name, e in self.extras.items()},
            "metadata": self.metadata,
            **({"calibrations": {d: b.to_json() for d, b in self.calibrations.items()}} if self.calibrations else {}),
            **{k: v for k, v in self.extensions.items() if k not in KNOWN_TOP_LEVEL},
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode("utf-8")


def kv_json(dtype: str, kv_layout: str, latent: dict[str, int] | None) -> dict[str, Any]:
    kv: dict[str, Any] = {"dtype": dtype, "layout": kv_layout}
    if latent is not None:
        kv["latent"] = dict(latent)
    return kv


def layout_of_model(model: dict[str, Any]) -> tuple[str, dict[str, int] | None]:
    """The layout kind a model's KV takes, from its identity: an MLA model's identity names it
    in `extra` (`kv_layout`, `kv_lora_rank`, `qk_rope_head_dim`), so that its fingerprint, and
    with it every store name, differs from any K/V model's (container.md section 3.2)."""
    extra = model.get("extra") if isinstance(model.get("extra"), dict) else {}
    if extra.get("kv_layout", layout.KV_BLOB) != layout.MLA_LATENT:
        return layout.KV_BLOB, None
    return layout.MLA_LATENT, {"kv_lora_rank": extra.get("kv_lora_rank"), "rope_dim": extra.get("qk_rope_head_dim")}


# --- parsing ------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # (in C; the loop below runs only to name a repeated key)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateField(f"manifest repeats the key {key!r}")
            seen.add(key)
    return out


def _reject_constant(name: str) -> None:
    raise ManifestCorrupt(f"manifest holds the non-JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ManifestCorrupt(f"manifest holds the number {text[:20]}, which is not finite")
    return value


MAX_INT_DIGITS = 40  # no field needs more than 2^64; refuse giant digit strings
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))  # digits to "0", the rest " "
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)


def _has_long_digit_run(raw: bytes) -> bool:
    """Whether `raw` holds more than MAX_INT_DIGITS ASCII digits in a row (JSON numbers are ASCII:
    a longer integer needs such a run). A translate and a search, in C: a regex took 20x longer."""
    return _LONG_RUN in raw.translate(_DIGITS_AS_ZERO)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ManifestCorrupt(f"manifest holds an integer of {len(text)} digits")
    return int(text)


MAX_JSON_DEPTH = 64


def _check_strings(obj: Any, depth: int = 0, strings: bool = True) -> None:
    """Reject lone UTF-16 surrogates (valid JSON escapes that no UTF-8 output can hold) and
    nesting deeper than MAX_JSON_DEPTH (the spec's limit; deeper input may also fail to parse).
    `strings=False`: the text has no \\u escape, so no string can hold one; only the depth is
    checked. Scalars are looked at in their container's loop, not a call each (a manifest holds
    thousands: this walk was most of opening a file)."""
    if depth > MAX_JSON_DEPTH:
        raise ManifestCorrupt(f"manifest JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(obj, dict):
        values: Any = obj.values()
        if strings:
            for key in obj:
                _check_string(key)
    elif isinstance(obj, list):
        values = obj
    else:
        if strings and isinstance(obj, str):
            _check_string(obj)
        return
    if obj and depth + 1 > MAX_JSON_DEPTH:  # its keys and values lie one level deeper
        raise ManifestCorrupt(f"manifest JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    for value in values:
        if isinstance(value, (dict, list)):
            _check_strings(value, depth + 1, strings)
        elif strings and isinstance(value, str):
            _check_string(value)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ManifestCorrupt("manifest holds a string with a lone surrogate escape") from None


# A valid manifest spends far more than 16 bytes on each object and array (a chunk entry: ~300
# bytes for 4 of them); a hostile one of 20 million `{}` would take 30x its size in memory and 20 s
# to parse. The spec's limit (container.md section 5), checked before parsing.
BYTES_PER_CONTAINER = 16


def container_budget(size: int) -> int:
    return size // BYTES_PER_CONTAINER + 64


def _check_structure(raw: bytes, text: str) -> None:
    """At most `container_budget(len)` objects and arrays and MAX_JSON_SEPARATORS `,` and `:`
    (what bounds the number of values, so the parse's memory); inside strings none of them
    count. Checked before parsing: a manifest of 5 million keys took 1.2 GB to parse."""
    budget, separators = container_budget(len(text)), layout.MAX_JSON_SEPARATORS
    if (text.count("{") + text.count("[") <= budget  # upper bounds, in C: the usual case ends here
            and raw.count(b",") + raw.count(b":") <= separators):
        return
    count, found = outside_strings(raw)
    if count > budget:
        raise ManifestCorrupt(f"manifest holds {count} JSON objects and arrays in {len(text)} bytes; "
                              f"the format allows {budget}")
    if found > separators:
        raise ManifestCorrupt(f"manifest holds {found} JSON values (',' and ':' outside strings); "
                              f"the format allows {separators}")


_SCAN_BLOCK = 1 << 20  # bytes scanned at a time: the scan's memory stays a few MB


def outside_strings(raw: bytes) -> tuple[int, int]:
    """(`{` and `[`, `,` and `:`) outside the JSON strings of UTF-8 `raw`, in numpy a block at a
    time (a manifest of 5 million keys, 65 MB: 0.9 s here; a regex removing its strings took 3 s).
    A quote ends or starts a string unless an odd run of backslashes precedes it. None of these
    bytes occurs inside a multi-byte UTF-8 character."""
    data = np.frombuffer(raw, dtype=np.uint8)
    inside, last_plain = 0, -1  # a string open where the block starts; the last byte not a backslash
    containers = separators = 0
    for start in range(0, data.size, _SCAN_BLOCK):
        block = data[start:start + _SCAN_BLOCK]
        backslash = block == 0x5C
        quotes = _unescaped(np.flatnonzero(block == 0x22), backslash, start, last_plain)
        marks = np.flatnonzero((block == 0x2C) | (block == 0x3A) | (block == 0x7B) | (block == 0x5B))
        kept = block[marks[(np.searchsorted(quotes, marks) + inside) % 2 == 0]]
        brackets = int(np.count_nonzero((kept == 0x7B) | (kept == 0x5B)))
        containers, separators = containers + brackets, separators + kept.size - brackets
        inside = (inside + quotes.size) % 2
        if not backslash[-1]:
            last_plain = start + block.size - 1
        elif not backslash.all():
            last_plain = start + block.size - 1 - int(np.argmin(backslash[::-1]))
    return containers, separators


def _unescaped(quotes: np.ndarray, backslash: np.ndarray, start: int, last_plain: int) -> np.ndarray:
    """The quotes of a block (positions in it) that an even run of backslashes precedes."""
    if not quotes.size or (not backslash.any() and last_plain == start - 1):
        return quotes  # no backslash in the block or carried into it: every quote counts
    plain = np.flatnonzero(~backslash)
    before = np.searchsorted(plain, quotes) - 1  # each quote's last plain byte in the block
    last = np.where(before >= 0, plain[np.maximum(before, 0)] + start, last_plain)
    return quotes[(quotes + start - 1 - last) % 2 == 0]


def load_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestCorrupt("manifest is not valid UTF-8") from None
    _check_structure(raw, text)
    # An integer of more digits is a run of more digits in the text: without such a run, ints
    # parse in C instead of a Python call each (most of a manifest's numbers; a third of its parse).
    bounded = _bounded_int if _has_long_digit_run(raw) else None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant,
                         parse_float=_finite_float, parse_int=bounded)
    except json.JSONDecodeError as err:
        raise ManifestCorrupt(f"manifest is not valid JSON ({err.msg} at byte {err.pos})") from None
    except RecursionError:
        raise ManifestCorrupt("manifest JSON is nested too deeply") from None
    except ValueError as err:  # a number Python refuses to convert
        raise ManifestCorrupt(f"manifest holds an unreadable number ({err})") from None
    _check_strings(doc, strings="\\u" in text)
    return doc


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if type(obj) is dict:  # the usual case, decided by two lookups (a manifest has ~13 per chunk)
        value = obj.get(key, _get)
        if type(value) is kind:  # exactly: a bool is never an int here
            return value
    if not isinstance(obj, dict):
        raise ManifestInvalid(f"manifest: {where} must be an object")
    if key not in obj:
        raise MissingField(f"manifest: {where} lacks the required key {key!r}")
    value = obj[key]
    if kind is int or kind == (int,):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if not ok:
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ManifestInvalid(f"manifest: {where}.{key} must be of type {names}")
    return value


def _int(obj: Any, key: str, where: str, lo: int, hi: int) -> int:
    value = _get(obj, key, int, where)
    if not lo <= value <= hi:
        raise ManifestInvalid(f"manifest: {where}.{key} = {value} is outside [{lo}, {hi}]")
    return value


def _blob(obj: Any, where: str) -> BlobRef:
    return BlobRef(offset=_int(obj, "offset", where, 0, 2**63 - 1),
                   length=_int(obj, "length", where, 0, 2**63 - 1),
                   crc32=_int(obj, "crc32", where, 0, 0xFFFFFFFF))


def _shape(obj: Any, where: str) -> tuple[int, ...]:
    dims = _get(obj, "shape", list, where)
    if not dims or len(dims) > 8 or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in dims):
        raise ManifestInvalid(f"manifest: {where}.shape must be 1-8 non-negative integers")
    return tuple(dims)


def parse_manifest(raw: bytes, *, data_end: int, alignment: int, minor: int = layout.VERSION_MINOR) -> Manifest:
    """Parse and validate; `data_end` is where blobs must end (the manifest offset), `minor` the
    header's minor version (a layout kind needs the version that brought it)."""
    doc = load_json(raw)
    if not isinstance(doc, dict):
        raise ManifestInvalid("manifest: the top level must be a JSON object")
    _check_free_form(doc)

    model = _get(doc, "model", dict, "manifest")
    _get(model, "name", str, "model")
    _get(model, "architecture", str, "model")
    num_layers = _int(model, "num_layers", "model", 1, layout.MAX_LAYERS)
    num_kv_heads = _int(model, "num_kv_heads", "model", 1, layout.MAX_KV_HEADS)
    head_dim = _int(model, "head_dim", "model", 1, layout.MAX_HEAD_DIM)
    if "hidden_size" in model:  # optional; when given, hidden_states must be this wide (§3.5)
        _int(model, "hidden_size", "model", 1, layout.MAX_KV_HEADS * layout.MAX_HEAD_DIM)
    _get(model, "rope", dict, "model")
    fingerprint = _get(model, "fingerprint", str, "model")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", fingerprint):
        raise ManifestInvalid("manifest: model.fingerprint must be 'sha256:' and 64 hex digits")
    if "weights_digest" in model and not (isinstance(model["weights_digest"], str)
                                          and re.fullmatch(r"sha256:[0-9a-f]{64}", model["weights_digest"])):
        raise ManifestInvalid("manifest: model.weights_digest must be 'sha256:' and 64 hex digits")

    kv = _get(doc, "kv", dict, "manifest")
    kv_dtype = _get(kv, "dtype", str, "kv")
    if kv_dtype not in ITEMSIZE:
        raise UnsupportedDtype(f"manifest: KV dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPE_NAMES)}")
    kv_layout, latent = _kv_layout(kv, num_kv_heads, head_dim, minor)

    seq = _get(doc, "sequence", dict, "manifest")
    num_tokens = _int(seq, "num_tokens", "sequence", 1, layout.MAX_TOKENS)
    chunk_size = _int(seq, "chunk_size", "sequence", 1, layout.MAX_CHUNK_SIZE)
    tokens = _blob(_get(seq, "tokens", dict, "sequence"), "sequence.tokens")
    if tokens.length != 4 * num_tokens:
        raise ManifestInvalid(
            f"manifest: token blob holds {tokens.length} bytes, expected 4 x {num_tokens}")

    expected_chunks = -(-num_tokens // chunk_size)
    if expected_chunks > layout.MAX_CHUNKS:
        raise ManifestInvalid(f"manifest: {num_tokens} tokens at chunk size {chunk_size} are "
                              f"{expected_chunks} chunks; a file holds at most {layout.MAX_CHUNKS}")
    raw_chunks = _get(doc, "chunks", list, "manifest")
    if len(raw_chunks) != expected_chunks:
        raise ManifestInvalid(f"manifest: {len(raw_chunks)} chunks listed, but {num_tokens} tokens "
                              f"at chunk size {chunk_size} need {expected_chunks}")
    hidden_kv = num_kv_heads * head_dim
    first = _first_position(doc)
    planes = layout.LAYOUT_PLANES[kv_layout]
    chunks = [_chunk(i, c, chunk_size, num_tokens, num_layers, hidden_kv, kv_dtype, first, planes)
              for i, c in enumerate(raw_chunks)]

    extras: dict[str, ExtraEntry] = {}
    for name, entry in _get(doc, "extras", dict, "manifest").items() if "extras" in doc else ():
        extras[name] = _extra(name, entry, num_tokens, model.get("hidden_size"))

    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ManifestInvalid("manifest: metadata must be an object of strings")

    calibrations = _calibrations(doc)
    blobs = [("tokens", tokens)] + [(f"chunk {c.index}", c.blob) for c in chunks] + \
        [(f"extra {e.name}", e.blob) for e in extras.values()] + \
        [(f"calibration {d[:16]}...", b) for d, b in calibrations.items()]
    _check_blob_placement(blobs, data_end=data_end, alignment=alignment)
    return Manifest(model=model, kv_dtype=kv_dtype, num_tokens=num_tokens, chunk_size=chunk_size,
                    tokens=tokens, chunks=chunks, extras=extras, metadata=metadata, calibrations=calibrations,
                    extensions={k: v for k, v in doc.items() if k not in KNOWN_TOP_LEVEL},
                    kv_layout=kv_layout, latent=latent)


def _kv_layout(kv: dict[str, Any], num_kv_heads: int, head_dim: int, minor: int) -> tuple[str, dict[str, int] | None]:
    """kv.layout and, for mla_latent, kv.latent, checked against the model (container.md 3.2)."""
    name = _get(kv, "layout", str, "kv")
    if name not in layout.LAYOUT_MINOR:
        known = ", ".join(sorted(layout.LAYOUT_MINOR))
        raise ManifestInvalid(f"manifest: kv.layout {name[:40]!r} is not a layout kind of format version "
                              f"{layout.VERSION_MAJOR}.{layout.VERSION_MINOR} ({known}); the file is version "
                              f"{layout.VERSION_MAJOR}.{minor}: a newer kvtool may read it")
    if layout.LAYOUT_MINOR[name] > minor:
        raise ManifestInvalid(f"manifest: kv.layout {name!r} needs format version {layout.VERSION_MAJOR}."
                              f"{layout.LAYOUT_MINOR[name]}; the file says {layout.VERSION_MAJOR}.{minor}")
    if name == layout.KV_BLOB:
        if "latent" in kv:
            raise ManifestInvalid("manifest: kv.latent belongs to the mla_latent layout, not kv_blob")
        return name, None
    latent = _get(kv, "latent", dict, "kv")
    if set(latent) != {"kv_lora_rank", "rope_dim"}:
        raise ManifestInvalid("manifest: kv.latent must hold exactly kv_lora_rank and rope_dim")
    rank = _int(latent, "kv_lora_rank", "kv.latent", 1, layout.MAX_HEAD_DIM)
    rope = _int(latent, "rope_dim", "kv.latent", 0, layout.MAX_HEAD_DIM)
    if rope % 2:
        raise ManifestInvalid(f"manifest: kv.latent.rope_dim {rope} must be even (RoPE turns pairs)")
    if (num_kv_heads, head_dim) != (1, rank + rope):
        raise ManifestInvalid(f"manifest: an mla_latent file's model has 1 KV head of kv_lora_rank + rope_dim = "
                              f"{rank + rope} channels, not {num_kv_heads} x {head_dim}")
    return name, {"kv_lora_rank": rank, "rope_dim": rope}


def _calibrations(doc: dict[str, Any]) -> dict[str, BlobRef]:
    """`calibrations`: {digest: blob} of the pca calibration objects the file carries (pca.md §3.3):
    at most MAX_CALIBRATIONS, each named by 64 lower-case hex digits, at most MAX_CALIBRATION_BYTES."""
    if "calibrations" not in doc:
        return {}
    entries = _get(doc, "calibrations", dict, "manifest")
    if len(entries) > MAX_CALIBRATIONS:
        raise ManifestInvalid(f"manifest: calibrations lists {len(entries)} objects, at most {MAX_CALIBRATIONS}")
    out = {}
    for digest, entry in entries.items():
        if not _HEX64.match(digest):
            raise ManifestInvalid("manifest: a calibrations key must be a SHA-256 digest (64 lower-case hex digits)")
        if not isinstance(entry, dict):
            raise ManifestInvalid(f"manifest: calibrations.{digest[:16]}... must be an object")
        blob = _blob(entry, f"calibrations.{digest[:16]}...")
        if not 0 < blob.length <= MAX_CALIBRATION_BYTES:
            raise ManifestInvalid(f"manifest: calibrations.{digest[:16]}... holds {blob.length} bytes "
                                  f"(1 to {MAX_CALIBRATION_BYTES})")
        out[digest] = blob
    return out


def _check_free_form(doc: dict[str, Any]) -> None:
    """At most MAX_FREE_FORM_VALUES values in what the format leaves open: `model` (its rope and
    extra facts), `metadata` and the top-level keys this version does not define (the schema
    checks the rest, whose size the chunk count bounds)."""
    parts = [value for key, value in doc.items() if key not in KNOWN_TOP_LEVEL or key in ("model", "metadata")]
    found = _count_values(parts, layout.MAX_FREE_FORM_VALUES)
    if found > layout.MAX_FREE_FORM_VALUES:
        raise ManifestInvalid(f"manifest: model, metadata and unknown top-level keys hold more than "
                              f"{layout.MAX_FREE_FORM_VALUES} JSON values, the format's limit")


def _count_values(parts: list[Any], limit: int) -> int:
    """The values inside `parts` (object members and array elements, at any depth), counted
    until there are more than `limit`: a walk as long as the limit, whatever the manifest holds."""
    found, stack = 0, list(parts)
    while stack and found <= limit:
        value = stack.pop()
        if isinstance(value, (dict, list)):
            found += len(value)
            if found <= limit:
                stack.extend(v for v in (value.values() if isinstance(value, dict) else value)
                             if isinstance(v, (dict, list)))
    return found


def _first_position(doc: dict[str, Any]) -> int:
    """The position of the file's token 0 in its sequence: a store object's `store.start`
    (store.md §4; a chunk object holds one chunk from there), else 0. One that is not a
    non-negative integer counts as 0 here: the store refuses that object on its own."""
    ext = doc.get("store")
    start = ext.get("start") if isinstance(ext, dict) else None
    return start if type(start) is int and start >= 0 else 0


def _chunk(i: int, c: Any, chunk_size: int, num_tokens: int, num_layers: int, hidden_kv: int,
           kv_dtype: str, first: int = 0, planes: int = 2) -> ChunkEntry:
    where = f"chunks[{i}]"
    start = _int(c, "start", where, 0, layout.MAX_TOKENS)
    end = _int(c, "end", where, 0, layout.MAX_TOKENS)
    if (start, end) != (i * chunk_size, min((i + 1) * chunk_size, num_tokens)):
        raise ManifestInvalid(f"manifest: {where} covers [{start}, {end}), expected "
                              f"[{i * chunk_size}, {min((i + 1) * chunk_size, num_tokens)})")
    prefix_hash = _get(c, "prefix_hash", str, where)
    if not _HEX64.match(prefix_hash):
        raise ManifestInvalid(f"manifest: {where}.prefix_hash must be 64 lower-case hex digits")
    name = _get(c, "codec", str, where)
    codec_id = _int(c, "codec_id", where, 0, 2**63 - 1)
    codec = codecs.get_codec(codec_id)
    if codec.name != name:
        raise ManifestInvalid(f"manifest: {where} names codec {name!r} but id {codec_id} is "
                              f"{codec.name!r}")
    if planes != 2 and codec.name not in LATENT_CODECS:
        raise ManifestInvalid(f"manifest: {where} is coded with {name!r}, which codes K and V, not an "
                              f"mla_latent chunk (its codecs: {', '.join(LATENT_CODECS)})")
    params = codec.validate_params(_get(c, "codec_params", dict, where))
    codec.check_position(params, first + start)  # (pca: its keys are turned by their positions)
    shape = _shape(c, where)
    if shape != (planes, num_layers, end - start, hidden_kv):
        raise ManifestInvalid(f"manifest: {where}.shape {list(shape)} is not "
                              f"[{planes}, {num_layers}, {end - start}, {hidden_kv}]")
    dtype = _get(c, "dtype", str, where)
    if dtype not in ITEMSIZE:
        raise UnsupportedDtype(f"manifest: {where}.dtype {dtype!r} is not one of {', '.join(KV_DTYPE_NAMES)}")
    if dtype != kv_dtype:
        raise ManifestInvalid(f"manifest: {where}.dtype {dtype!r} differs from the file's {kv_dtype!r}")
    entry = ChunkEntry(index=i, start=start, end=end, prefix_hash=prefix_hash, codec=name,
                       codec_id=codec_id, codec_params=params, blob=_blob(c, where), shape=shape,
                       dtype=dtype)
    expansion = max(layout.MAX_EXPANSION, codec.max_expansion(end - start, ITEMSIZE[dtype]))
    limit = min(layout.MAX_CHUNK_DECODED_BYTES, entry.blob.length * expansion + layout.EXPANSION_SLACK)
    if entry.decoded_bytes > limit:
        raise ManifestInvalid(f"manifest: {where} claims {entry.decoded_bytes} decoded bytes from "
                              f"{entry.blob.length} stored bytes, beyond the format's limit")
    return entry


def _extra(name: str, e: Any, num_tokens: int, hidden_size: Any = None) -> ExtraEntry:
    where = f"extras.{name}"
    if name not in KNOWN_EXTRAS:
        raise ManifestInvalid(f"manifest: unknown extra {name!r} (known: {', '.join(sorted(KNOWN_EXTRAS))})")
    shape = _shape(e, where)
    dtype = _get(e, "dtype", str, where)
    if dtype not in EXTRA_DTYPES:
        raise UnsupportedDtype(f"manifest: {where}.dtype {dtype!r} is not supported")
    if name == "roi_mask" and (shape != (num_tokens,) or dtype != "bool"):
        raise ManifestInvalid(f"manifest: {where} must be bool of shape [{num_tokens}]")
    if name == "hidden_states" and (len(shape) != 2 or shape[0] != num_tokens or dtype == "bool"):
        raise ManifestInvalid(f"manifest: {where} must be a float tensor of shape [{num_tokens}, hidden]")
    if name == "hidden_states" and hidden_size is not None and shape[1] != hidden_size:
        raise ManifestInvalid(f"manifest: {where} is {list(shape)}, but model.hidden_size is {hidden_size}")
    blob = _blob(e, where)
    if blob.length != math.prod(shape) * EXTRA_DTYPES[dtype]:
        raise ManifestInvalid(f"manifest: {where} holds {blob.length} bytes, not the "
                              f"{math.prod(shape) * EXTRA_DTYPES[dtype]} its shape needs")
    return ExtraEntry(name=name, blob=blob, shape=shape, dtype=dtype)


def _check_blob_placement(blobs: list[tuple[str, BlobRef]], *, data_end: int, alignment: int) -> None:
    for what, b in blobs:
        if b.offset < layout.HEADER_SIZE or b.offset + b.length > data_end:
            raise BlobOutOfBounds(f"{what}: bytes [{b.offset}, {b.offset + b.length}) lie outside "
                                  f"the data region [{layout.HEADER_SIZE}, {data_end})")
        if b.offset % alignment:
            raise BlobOverlap(f"{what}: offset {b.offset} is not a multiple of the alignment {alignment}")
    ordered = sorted((wb for wb in blobs if wb[1].length), key=lambda wb: wb[1].offset)  # empty blobs hold no byte
    for (what_a, a), (what_b, b) in zip(ordered, ordered[1:]):
        if a.offset + a.length > b.offset:
            raise BlobOverlap(f"{what_a} and {what_b} overlap at byte {b.offset}")
