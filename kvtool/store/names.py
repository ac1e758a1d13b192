"""Store keys and names (format-spec/store.md §3): the one place a chunk's name is derived.

A chunk's name is the chain of (parent, tokens, extra keys): the extra keys carry everything that
makes KV differ, or must not be shared, for the same tokens (a namespace, vLLM's cache salt, a
LoRA adapter, multimodal inputs, prompt embeddings). Two requests whose extra keys differ never
share a name, so one tenant never loads another's chunk, and a LoRA request never loads base-model
KV. Every reader and writer calls `chunk_chain` (names) or `link_hash` (one link): nothing else
in kvtool hashes a chain for the store.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import UsageError
from ..format.hashing import ZERO_HASH, chain_hash, tokens_to_bytes
from ..identity import ModelIdentity, canonical_json

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

#: The store version (§9): in every object and in the model and entry keys' inputs.
STORE_VERSION = 2
CHUNK_SUFFIX = ".kvc"
TENSOR_SUFFIX = ".safetensors"
#: What a chunk's extra keys are prefixed with in its link's hash input (§3).
EXTRA_TAG = b"kvtool-extra/2\0"
_CHUNK_NAME = re.compile(r"chunks/([0-9a-f]{32})/([1-9][0-9]{0,4})/([0-9a-f]{2})/([0-9a-f]{64})\.kvc\Z")
_ENTRY_NAME = re.compile(r"entries/([0-9a-f]{32})/([0-9a-f]{64})\.kvc\Z")
_TENSOR_NAME = re.compile(r"tensors/([0-9a-f]{2})/([0-9a-f]{64})\.safetensors\Z")
_PIECE_NAME = re.compile(r"chunks/([0-9a-f]{32})/([1-9][0-9]{0,4})/pieces/([0-9a-f]{2})/([0-9a-f]{64})\.kvc\Z")
_BLOCK_NAME = re.compile(r"chunks/([0-9a-f]{32})/([1-9][0-9]{0,4})/blocks/([0-9a-f]{2})/([0-9a-f]{64})\.kvi\Z")
BLOCK_SUFFIX = ".kvi"
CALIBRATION_SUFFIX = ".kvcal"
_CALIBRATION_NAME = re.compile(r"calibrations/([0-9a-f]{2})/([0-9a-f]{64})\.kvcal\Z")
#: Longest text a namespace, cache salt or adapter name may be (characters).
MAX_KEY_TEXT = 1024
#: Most multimodal inputs one request may carry.
MAX_MM_FEATURES = 4096
_DIGEST = re.compile(r"(sha256:)?[0-9a-f]{64}\Z")


# --- extra keys ---------------------------------------------------------------------------


def _utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (an argument of undecodable bytes holds lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class MultimodalKey:
    """One multimodal input of a request: its content hash and the token positions it fills."""

    identifier: str  # the engine's hash of the input's content (vLLM: mm_features[i].identifier)
    offset: int  # its first placeholder token
    length: int  # how many placeholder tokens

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and self.offset + self.length > start


@dataclass(frozen=True)
class ExtraKeys:
    """What, besides the tokens, decides whose a chunk is (store.md §3, "Extra keys").

    Request-wide keys (`namespace`, `cache_salt`, `adapter`, `adapter_digest`) go into every
    chunk's link; a multimodal input goes into the links of the chunks it overlaps; prompt
    embeddings into each chunk's link as the digest of that chunk's rows. The empty ExtraKeys
    names chunks exactly as a container's `prefix_hash` does (container.md §4)."""

    namespace: str = ""  # the user's own partition of a shared store (`--namespace`)
    #: vLLM's per-request cache_salt (a tenant's secret: recorded as its digest, never shown)
    cache_salt: str = field(default="", repr=False)
    adapter: str = ""  # a LoRA adapter's name
    adapter_digest: str = ""  # "sha256:<hex>" of the adapter's weights, where they are at hand
    multimodal: tuple[MultimodalKey, ...] = ()
    #: prompt embeddings `[T, H]` (a numpy array; rows are the tokens'): not compared, digested per chunk
    prompt_embeds: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for what in ("namespace", "cache_salt", "adapter"):
            value = getattr(self, what)
            if not isinstance(value, str) or len(value) > MAX_KEY_TEXT or "\0" in value or not _utf8(value):
                raise UsageError(f"{what.replace('_', ' ')} must be UTF-8 text of at most {MAX_KEY_TEXT} "
                                 "characters without NUL")
        if self.adapter_digest and not _DIGEST.match(self.adapter_digest):
            raise UsageError("adapter digest must be 'sha256:' and 64 lower-case hex digits")
        if len(self.multimodal) > MAX_MM_FEATURES:
            raise UsageError(f"at most {MAX_MM_FEATURES} multimodal inputs per request")
        for mm in self.multimodal:
            if not (isinstance(mm.identifier, str) and mm.identifier and len(mm.identifier) <= MAX_KEY_TEXT
                    and _utf8(mm.identifier)
                    and isinstance(mm.offset, int) and isinstance(mm.length, int) and mm.offset >= 0 and mm.length > 0):
                raise UsageError("a multimodal input needs an identifier, an offset >= 0 and a length > 0")

    @property
    def empty(self) -> bool:
        return not (self.namespace or self.cache_salt or self.adapter or self.adapter_digest
                    or self.multimodal or self.prompt_embeds is not None)

    def for_chunk(self, start: int, end: int) -> dict[str, Any]:
        """The extra keys of the chunk of tokens [start, end): what its object records (its
        `store.extra`) and what goes into its link's hash; {} for none."""
        doc: dict[str, Any] = {}
        for what in ("namespace", "adapter", "adapter_digest"):
            if getattr(self, what):
                doc[what] = getattr(self, what)
        if self.cache_salt:  # a tenant's secret: objects and messages carry its digest, never the salt
            doc["cache_salt"] = salt_digest(self.cache_salt)
        mm = [[m.identifier, m.offset, m.length] for m in self.multimodal if m.overlaps(start, end)]
        if mm:
            doc["mm"] = sorted(mm)
        if self.prompt_embeds is not None:
            doc["prompt_embeds"] = embeds_digest(self.prompt_embeds, start, end)
        return doc

    def describe(self) -> str:
        """What tells these keys apart, for messages: names, never a salt's value."""
        parts = [f"namespace {self.namespace!r}" if self.namespace else "",
                 "a cache salt" if self.cache_salt else "",
                 f"adapter {self.adapter!r}" if self.adapter else "",
                 f"{len(self.multimodal)} multimodal inputs" if self.multimodal else "",
                 "prompt embeddings" if self.prompt_embeds is not None else ""]
        return ", ".join(p for p in parts if p) or "no extra keys"


NO_EXTRA_KEYS = ExtraKeys()



def salt_digest(salt: str) -> str:
    """What a cache salt is recorded and hashed as: "sha256:" + hex SHA-256 of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()


def embeds_digest(embeds: Any, start: int, end: int) -> str:
    """SHA-256 of rows [start, end) of prompt embeddings: dtype name, shape, then the bytes."""
    if hasattr(embeds, "detach"):  # a torch tensor
        import torch

        rows = embeds[start:end].detach().cpu().contiguous()
        if rows.dtype == torch.bfloat16:
            rows = rows.view(torch.int16)  # numpy has no bfloat16: the same bytes
            kind = "bfloat16"
        else:
            kind = str(rows.dtype).removeprefix("torch.")
        data, shape = rows.numpy().tobytes(), list(rows.shape)
    else:
        import numpy as np

        rows = np.ascontiguousarray(np.asarray(embeds)[start:end])
        kind, data, shape = str(rows.dtype), rows.tobytes(), list(rows.shape)
    head = canonical_json({"dtype": kind, "shape": shape})
    return hashlib.sha256(head + b"\0" + data).hexdigest()


def extra_bytes(extra: dict[str, Any]) -> bytes:
    """What a chunk's extra keys add to its link's hash input: nothing for none."""
    return EXTRA_TAG + canonical_json(extra) if extra else b""


# --- the chain ------------------------------------------------------------------------------


def link_hash(parent: bytes, tokens: Any, extra: dict[str, Any] | None = None) -> bytes:
    """One link of a chunk chain: H[i] = SHA-256(H[i-1] || u32le(tokens) || extra bytes)."""
    return chain_hash(parent, tokens, extra_bytes(extra or {}))


class ChunkLink(NamedTuple):
    """One whole chunk of a sequence as the store names it (a tuple: a lookup makes one a chunk)."""

    start: int
    parent: bytes  # H[i-1]
    prefix_hash: str  # hex H[i]
    extra: dict[str, Any]  # this chunk's extra keys ({} for none)


def chunk_chain(tokens: np.ndarray, chunk_size: int, extra_keys: ExtraKeys = NO_EXTRA_KEYS,
                limit: int | None = None) -> list[ChunkLink]:
    """The links of every whole chunk of `tokens` (up to `limit` tokens), from token 0. `tokens`:
    an int64 array of ids in [0, 2^32) (ModelCache checks them once)."""
    n = len(tokens) if limit is None else min(len(tokens), limit)
    import numpy as np  # (here: a request's checks import this module, not numpy)

    raw = np.asarray(tokens[:n]).astype("<u4").tobytes()  # u32le once: each chunk's is a slice
    chain: list[ChunkLink] = []
    parent, step = ZERO_HASH, 4 * chunk_size
    plain = extra_keys.empty
    if extra_keys.prompt_embeds is not None and len(extra_keys.prompt_embeds) < n:
        raise UsageError(f"prompt embeddings have {len(extra_keys.prompt_embeds)} rows for {n} tokens: one a token")
    for start in range(0, n - chunk_size + 1, chunk_size):
        extra = {} if plain else extra_keys.for_chunk(start, start + chunk_size)
        h = chain_hash(parent, raw[4 * start:4 * start + step], b"" if plain else extra_bytes(extra))
        chain.append(ChunkLink(start, parent, h.hex(), extra))
        parent = h
    return chain


class BlockLink(NamedTuple):
    """The first `tokens` tokens of the chunk position starting at `start` (fewer than a whole
    chunk, a multiple of the block size): P = SHA-256(H[i-1] || u32le(those tokens) || E(their
    extra keys)), computed as a chunk's link is (store.md §3, "Block prefixes")."""

    start: int
    parent: bytes  # H[i-1] of the whole-chunk chain
    tokens: int  # how many tokens from `start`
    prefix_hash: str  # hex P
    extra: dict[str, Any]  # the extra keys of tokens [start, start + tokens)


def block_links(tokens: np.ndarray, start: int, parent: bytes, chunk_size: int, block_size: int,
                extra_keys: ExtraKeys = NO_EXTRA_KEYS, limit: int | None = None) -> list[BlockLink]:
    """The block prefixes of the chunk position at `start` (a multiple of `chunk_size`): every
    multiple of `block_size` tokens short of a whole chunk that `tokens` (up to `limit`) reach,
    shortest first. None when the block size is the chunk size (whole chunks only), or for a
    request with prompt embeddings (their digest covers a chunk's rows; a part of it cannot be
    told apart from the object alone, so such requests share whole chunks only)."""
    n = len(tokens) if limit is None else min(len(tokens), limit)
    if block_size >= chunk_size or extra_keys.prompt_embeds is not None:
        return []
    import numpy as np

    top = min(chunk_size - 1, n - start) // block_size * block_size
    raw = np.asarray(tokens[start:start + max(top, 0)]).astype("<u4").tobytes()
    links = []
    for m in range(block_size, top + 1, block_size):
        extra = {} if extra_keys.empty else extra_keys.for_chunk(start, start + m)
        h = chain_hash(parent, raw[:4 * m], extra_bytes(extra))
        links.append(BlockLink(start, parent, m, h.hex(), extra))
    return links


def restrict_extra(extra: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """The extra keys a chunk's object records (`extra`, of its tokens) as they apply to its
    tokens [start, end) only: the request-wide keys, and the multimodal inputs overlapping them.
    A prompt-embeddings digest stays (it covers all the object's rows): a part of such an
    object never matches a request's part, so it is never served by block."""
    doc = {k: v for k, v in extra.items() if k != "mm"}
    mm = [m for m in extra.get("mm", []) if isinstance(m, list) and len(m) == 3
          and isinstance(m[1], int) and isinstance(m[2], int) and m[1] < end and m[1] + m[2] > start]
    if mm:
        doc["mm"] = mm
    return doc


# --- keys and names -------------------------------------------------------------------------


def model_key(model: ModelIdentity | dict[str, Any]) -> str:
    """32 hex digits naming a model in the store: its fingerprint and, when known, its weights
    digest (a fine-tune's chunks never mix with its base model's)."""
    if isinstance(model, ModelIdentity):
        fingerprint, digest = model.fingerprint(), model.weights_digest
    else:
        fingerprint, digest = model["fingerprint"], model.get("weights_digest")
    text = f"kvtool-store/{STORE_VERSION}\0".encode() + fingerprint.encode() + b"\0" + (digest or "").encode()
    return hashlib.sha256(text).hexdigest()[:32]


def chunk_name(model: str, chunk_size: int, prefix_hash: str) -> str:
    return f"chunks/{model}/{chunk_size}/{prefix_hash[:2]}/{prefix_hash}{CHUNK_SUFFIX}"


def piece_name(model: str, chunk_size: int, prefix_hash: str) -> str:
    """A piece: the first tokens of a chunk position, fewer than a whole chunk (a prompt's tail)."""
    return f"chunks/{model}/{chunk_size}/pieces/{prefix_hash[:2]}/{prefix_hash}{CHUNK_SUFFIX}"


def block_name(model: str, chunk_size: int, prefix_hash: str) -> str:
    """A block index entry: names the chunk or piece object whose first tokens hash to it."""
    return f"chunks/{model}/{chunk_size}/blocks/{prefix_hash[:2]}/{prefix_hash}{BLOCK_SUFFIX}"


def entry_name(model: str, key: str) -> str:
    return f"entries/{model}/{key}{CHUNK_SUFFIX}"


def calibration_name(digest: str) -> str:
    """A pca calibration object (§4.7), named by the SHA-256 of its bytes, as pca chunks name it."""
    return f"calibrations/{digest[:2]}/{digest}{CALIBRATION_SUFFIX}"


def tensor_name(key: str) -> str:
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return f"tensors/{digest[:2]}/{digest}{TENSOR_SUFFIX}"


def entry_key(model: str, tokens: "np.ndarray | Sequence[int]", roi: np.ndarray) -> str:
    """A lookup-buffer entry's key: the model, the token ids and the roi mask (§3)."""
    import numpy as np

    data = (b"kvtool-entry/1\0" + model.encode() + tokens_to_bytes(tokens)
            + np.asarray(roi).astype(bool).astype(np.uint8).tobytes())
    return hashlib.sha256(data).hexdigest()


def parse_name(name: str) -> tuple[str, re.Match] | None:
    """("chunk" | "piece" | "block" | "entry" | "tensor" | "calibration", match) for a well-formed object name, else
    None. A chunk's, piece's, block entry's or tensor's fan-out folder must be its hash's first two
    hex digits: one in another folder is not a name this store gives (a foreign file)."""
    for kind, pattern in (("chunk", _CHUNK_NAME), ("piece", _PIECE_NAME), ("block", _BLOCK_NAME),
                          ("entry", _ENTRY_NAME), ("tensor", _TENSOR_NAME), ("calibration", _CALIBRATION_NAME)):
        m = pattern.match(name)
        if m:
            if (kind in ("chunk", "piece", "block") and m.group(3) != m.group(4)[:2]) or (
                    kind in ("tensor", "calibration") and m.group(1) != m.group(2)[:2]):
                return None
            return kind, m
    return None


__all__ = ["BlockLink", "block_links", "block_name", "calibration_name", "piece_name", "restrict_extra", "ChunkLink", "ExtraKeys", "MultimodalKey", "NO_EXTRA_KEYS", "STORE_VERSION", "chunk_chain",
           "chunk_name", "embeds_digest", "entry_key", "entry_name", "extra_bytes", "link_hash", "model_key",
           "parse_name", "salt_digest", "tensor_name"]
