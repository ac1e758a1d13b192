"""`inspect`: what a file holds, without decoding it (unless `stats`), and without torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import codecs
from ..dtypes import to_float64
from ..errors import ChecksumMismatch
from ..format import ContainerReader
from ..format.hashing import crc32
from .file_requests import InspectRequest
from .result import Result
from .windows import kv_windows

#: The chunk table lists at most this many chunks (the first ones) unless all are asked for
#: (`all_chunks`); totals cover every chunk. 250,000 rows took 15 minutes to render and 1.1 GB
#: (format-spec/container.md §5, output limits).
MAX_LISTED_CHUNKS = 1000


@dataclass
class FileSummary(Result):
    path: str
    file_size: int
    format_version: str
    alignment: int
    model: dict[str, Any]
    kv_dtype: str
    num_tokens: int
    chunk_size: int
    num_chunks: int
    tokens_checksum: str
    chunks: list[dict[str, Any]]
    totals: dict[str, Any]
    extras: dict[str, Any]
    metadata: dict[str, str]
    stats: list[dict[str, Any]] | None = field(default=None)
    kv_layout: str = "kv_blob"  # the chunks' layout kind (container.md 3.2): kv_blob or mla_latent
    latent: dict[str, int] | None = None  # mla_latent: kv_lora_rank and rope_dim
    chunks_omitted: int = 0  # chunks past the first MAX_LISTED_CHUNKS, not in `chunks` (in the totals)
    #: pca calibration objects the file carries (pca.md §3.3): digest, stored bytes, and their cost
    #: spread over the file's KV values (bits/value, on top of the chunks')
    calibrations: list[dict[str, Any]] = field(default_factory=list)
    _unused: int = 0  # chunks past the first MAX_LISTED_CHUNKS, not in `chunks` (in the totals)


def inspect(path: str | Path | InspectRequest, *, on_chunk: Callable[[int, int], None] | None = None,
            **options: Any) -> FileSummary:
    """Header, model identity, chunk table and totals of a KV file (an `InspectRequest`, or its
    fields); `stats` decodes every chunk for per-layer K/V statistics. The table lists the first
    MAX_LISTED_CHUNKS chunks, or every one with `all_chunks`."""
    request = path if isinstance(path, InspectRequest) else InspectRequest(path, **options)
    path, stats, all_chunks = request.path, request.stats, request.all_chunks
    with ContainerReader(path) as reader:
        summary = summarize(reader, all_chunks=all_chunks)
        if stats:
            summary.stats = layer_stats(reader, on_chunk=on_chunk)
    return summary


def summarize(reader: ContainerReader, *, all_chunks: bool = False) -> FileSummary:
    m = reader.manifest
    values_per_token = m.planes * m.num_layers * m.hidden_kv
    listed = len(m.chunks) if all_chunks else min(len(m.chunks), MAX_LISTED_CHUNKS)
    rows, bad = [], 0
    for c in m.chunks:
        payload = _intact_payload(reader, c)  # read once (pread: a file cut short is refused, not a SIGBUS)
        bad += payload is None
        if c.index >= listed:  # counted in the totals, not listed
            continue
        row = {"index": c.index, "start": c.start, "end": c.end, "codec": c.codec,
               "stored_bytes": c.blob.length, "decoded_bytes": c.decoded_bytes,
               "ratio": c.decoded_bytes / max(c.blob.length, 1),
               "bits_per_value": 8 * c.blob.length / (c.num_tokens * values_per_token),
               "checksum": "ok" if payload is not None else "BAD",
               "prefix_hash": c.prefix_hash, "codec_params": c.codec_params}
        if payload is not None:
            details = codecs.get_codec(c.codec_id).payload_stats(payload, c.shape, c.codec_params)
            if details is not None:
                row["codec_stats"] = details
        rows.append(row)
    stored = sum(c.blob.length for c in m.chunks)
    decoded = sum(c.decoded_bytes for c in m.chunks)
    return FileSummary(
        path=str(reader.path), file_size=reader.file_size, format_version=reader.version,
        alignment=reader.header.alignment, model=m.model, kv_dtype=m.kv_dtype, num_tokens=m.num_tokens,
        chunk_size=m.chunk_size, num_chunks=len(m.chunks),
        tokens_checksum="ok" if reader.blob_ok(m.tokens) else "BAD", chunks=rows,
        totals={"stored_bytes": stored, "decoded_bytes": decoded, "ratio": decoded / max(stored, 1),
                "bits_per_value": 8 * stored / (m.num_tokens * values_per_token),
                "file_bits_per_value": 8 * reader.file_size / (m.num_tokens * values_per_token),
                "bad_checksums": bad},
        extras={name: {"shape": list(e.shape), "dtype": e.dtype, "stored_bytes": e.blob.length}
                for name, e in m.extras.items()},
        metadata=m.metadata, chunks_omitted=len(m.chunks) - listed,
        calibrations=[{"digest": d, "stored_bytes": b.length,
                       "bits_per_value": 8 * b.length / (m.num_tokens * values_per_token),
                       "checksum": "ok" if reader.blob_ok(b) else "BAD"} for d, b in m.calibrations.items()],
        kv_layout=m.kv_layout, latent=m.latent)


def _intact_payload(reader: ContainerReader, chunk) -> memoryview | None:
    """The chunk's stored bytes when they are all there and match their CRC-32C, else None."""
    try:
        payload = reader.chunk_payload(chunk.index, verify=False)
    except ChecksumMismatch:  # the file ends inside it
        return None
    return payload if crc32(payload) == chunk.blob.crc32 else None


@np.errstate(invalid="ignore", over="ignore", divide="ignore")  # NaN/inf KV: reported as such, not warned
def layer_stats(reader: ContainerReader, on_chunk: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Per layer and K/V (an mla_latent file: its latent): min, max, mean, std, and channels far
    above the median max-abs."""
    m = reader.manifest
    shape = (m.planes, m.num_layers)
    count = 0
    total = np.zeros(shape)
    total_sq = np.zeros(shape)
    lo = np.full(shape, np.inf)
    hi = np.full(shape, -np.inf)
    chan_absmax = np.zeros((m.planes, m.num_layers, m.hidden_kv))
    for c in m.chunks:
        kv = reader.read_chunk_array(c.index)  # [2, L, T, C], or [1, L, T, C] for a latent
        count += kv.shape[2] * kv.shape[3]
        for layers, tokens in kv_windows(kv.shape):  # float64 a window at a time, not the chunk (8x it)
            part = to_float64(kv[:, layers, tokens], c.dtype)  # NaN/inf stay as they are
            total[:, layers] += part.sum(axis=(2, 3))
            total_sq[:, layers] += (part * part).sum(axis=(2, 3))
            lo[:, layers] = np.minimum(lo[:, layers], part.min(axis=(2, 3)))
            hi[:, layers] = np.maximum(hi[:, layers], part.max(axis=(2, 3)))
            chan_absmax[:, layers] = np.maximum(chan_absmax[:, layers], np.abs(part).max(axis=2))
        del kv  # (not held while the next chunk decodes)
        if on_chunk is not None:
            on_chunk(c.index + 1, len(m.chunks))
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean * mean, 0))
    lower_median = np.sort(chan_absmax, axis=2)[:, :, (m.hidden_kv - 1) // 2]  # the lower middle value
    median = np.maximum(lower_median, 1e-30)  # [2, L]
    out = []
    names = ("K", "V") if m.planes == 2 else ("latent",)
    for kind in range(m.planes):
        for layer in range(m.num_layers):
            ratio = chan_absmax[kind, layer] / median[kind, layer]
            top = np.argsort(-ratio, kind="stable")[:3]
            out.append({"kind": names[kind], "layer": layer,
                        "min": float(lo[kind, layer]), "max": float(hi[kind, layer]),
                        "mean": float(mean[kind, layer]), "std": float(std[kind, layer]),
                        "outlier_channels": [{"channel": int(c), "absmax_over_median": float(ratio[c])}
                                             for c in top if ratio[c] >= 4.0]})
    return out
