"""Chained prefix hashes and blob checksums (format-spec/container.md, "Hashes").

prefix_hash[-1] = 32 zero bytes
prefix_hash[i]  = SHA-256(prefix_hash[i-1] || u32le(token_ids[start_i:end_i]))

(`chain_hash`; the store's chunk names are the same chain with each chunk's extra keys
appended, store.md §3)
so chunk i's hash names the whole token prefix [0, end_i): two files that share
a prefix share the hashes of the chunks inside it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from ..checksum import crc32  # noqa: F401  (the blobs' checksum, re-exported for the format)

ZERO_HASH = bytes(32)


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    import numpy as np  # (here: the store's names import this module before anything needs numpy)

    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in an unsigned 32-bit integer")
    return arr.astype("<u4").tobytes()


def chain_hash(previous: bytes, chunk_token_ids: Sequence[int] | np.ndarray | bytes, extra: bytes = b"") -> bytes:
    """One link: SHA-256(previous || u32le(tokens) || extra). `extra` is empty in a container;
    the store appends a chunk's extra keys there (store.md §3), so it has no hash of its own."""
    raw = chunk_token_ids if isinstance(chunk_token_ids, bytes) else tokens_to_bytes(chunk_token_ids)
    return hashlib.sha256(previous + raw + extra).digest()


def prefix_hashes(token_ids: Sequence[int] | np.ndarray, chunk_size: int) -> list[str]:
    """Hex prefix hash of every chunk of `token_ids` cut at `chunk_size`."""
    import numpy as np

    arr = np.asarray(token_ids, dtype=np.int64)
    out: list[str] = []
    h = ZERO_HASH
    for start in range(0, len(arr), chunk_size):
        h = chain_hash(h, arr[start:start + chunk_size])
        out.append(h.hex())
    return out


def chunk_ranges(num_tokens: int, chunk_size: int) -> Iterable[tuple[int, int]]:
    for start in range(0, num_tokens, chunk_size):
        yield start, min(start + chunk_size, num_tokens)
