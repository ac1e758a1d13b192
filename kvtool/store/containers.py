"""Between containers and the store: a file's whole chunks into the store (`ingest`: `store
put`, `capture --store`), and the longest cached prefix of a sequence out as a container
(`prefix_container`: `store get`, `replay --store`). Payloads are copied as encoded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ModelMismatch, NotAPrefixCache
from ..format import ContainerReader, ContainerWriter
from ..identity import model_fingerprint
from .chunk_store import ChunkStore, PutResult
from .names import NO_EXTRA_KEYS, ExtraKeys


def ingest(reader: ContainerReader, store: ChunkStore, extra_keys: ExtraKeys = NO_EXTRA_KEYS,
           block_size: int | None = None) -> PutResult:
    """Store a container's whole chunks (under `extra_keys`: a namespace), each payload checked
    (CRC-32C) and copied as it is. With `block_size` (dividing the chunk size), also each whole
    chunk's block index entries, and the block-aligned tokens of its last partial chunk as a
    piece (decoded, cut to whole blocks, encoded again in its codec: store.md §7). A
    segment stored at positions other than 0 (format-spec/segment.md) is refused: its chunks are
    not the prefix their hashes name."""
    m = reader.manifest
    segment = reader.segment
    if segment is not None and segment.stored_start != 0:
        raise NotAPrefixCache(f"{reader.path}: a segment whose keys are rotated for positions from {segment.stored_start} "
                         f"is not a prefix cache of its tokens: not stored (format-spec/segment.md §1)")
    if model_fingerprint(m.model) != m.model["fingerprint"]:
        raise ModelMismatch(f"{reader.path}: its model fingerprint does not match the model it describes "
                            f"(forged or damaged): not stored")
    if block_size is not None and m.chunk_size % block_size:
        block_size = None  # (blocks that do not divide the chunk size: whole chunks only)
    cache = store.for_model(m.model, m.chunk_size, extra_keys, block_size)
    whole = [c for c in m.chunks if c.num_tokens == m.chunk_size]
    payloads = [(reader.chunk_payload(c.index), c.codec, c.codec_params) for c in whole]
    tokens = reader.token_ids()
    result = cache.put_encoded(tokens, payloads, m.kv_dtype)
    last = m.chunks[-1] if m.chunks else None
    if cache.block_size < m.chunk_size and last is not None and last.num_tokens >= cache.block_size \
            and last.num_tokens < m.chunk_size:
        kv = reader.read_chunk(last.index)
        piece = cache.put_sequence(tokens, kv, codec=last.codec, params=last.codec_params, start=last.start)
        result.pieces, result.block_entries = piece.pieces, result.block_entries + piece.block_entries
        result.stored_bytes += piece.stored_bytes
    return result


def prefix_container(store: ChunkStore, identity, token_ids: list[int], chunk_size: int | None,
                     output: str | Path | None, refused: list[str] | None = None,
                     extra_keys: ExtraKeys = NO_EXTRA_KEYS, block_size: int | None = None) -> tuple[int, list[str], Any]:
    """Write the longest cached prefix of `token_ids` as a container (in memory when `output`
    is None): (cached tokens, codecs, the writer). `chunk_size` None: the stored chunk size that
    covers the most of the tokens; with `block_size`, the prefix goes on past the whole chunks to
    the longest stored block prefix (the container's last chunk, shorter). Payloads are copied as
    stored; chunks of another KV dtype than the first, and a block prefix that is a part of a
    longer object, are decoded and written raw in the first's dtype."""
    cache = store.best_cache(identity, token_ids, chunk_size, extra_keys, block_size)
    chunk_size = cache.chunk_size
    found = list(cache.checked_objects(token_ids, refused=refused))
    if not found:
        return 0, [], None
    n = found[-1][1]
    first = found[0][2].reader
    writer = ContainerWriter(output, first.model, list(token_ids)[:n], kv_dtype=first.manifest.kv_dtype,
                             chunk_size=chunk_size)
    codecs_used = []
    try:
        for start, end, obj, _size in found:
            chunk = obj.reader.chunks[0]
            if chunk.dtype == writer.kv_dtype_name and end - start == obj.reader.manifest.num_tokens:
                writer.write_encoded_chunk(obj.reader.chunk_payload(0, verify=False), chunk.codec, chunk.codec_params)
                codecs_used.append(chunk.codec)
            else:
                kv = obj.decode()[:, :, :end - start]
                if kv.dtype != first.kv_dtype:
                    kv = kv.to(first.kv_dtype)
                writer.write_chunk(kv.contiguous(), codec="raw")
                codecs_used.append("raw")
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return n, codecs_used, writer


