"""`compress`: re-encode every chunk of a file with another codec, one chunk in memory at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import codecs
from ..format import ContainerReader, ContainerWriter
from ..format.writer import check_codec_for_layout
from .file_requests import CompressRequest
from .result import Result


@dataclass
class CompressResult(Result):
    input: str
    output: str
    codec: str
    codec_params: dict[str, Any]
    num_chunks: int
    chunks_copied: int
    chunks_relaid: int  # in another layout of the same codec, not decoded (pca's bitstream versions)
    input_bytes: int  # the chunks' stored bytes
    output_bytes: int
    input_file_bytes: int  # whole files: chunks, extras, token ids, manifest
    output_file_bytes: int
    extras_bytes: int
    calibration_bytes: int  # pca calibration objects carried in the output (--embed-calibration)
    decoded_bytes: int
    ratio_vs_decoded: float
    bits_per_value: float
    seconds: float
    mb_per_s: float


def compress(path: str | Path | CompressRequest, output: str | Path | None = None, codec: str = "zstd", *,
             on_chunk: Callable[[int, int], None] | None = None, **options: Any) -> CompressResult:
    """`kvtool compress`: a `CompressRequest`, or its fields (options as the command line gives them)."""
    request = path if isinstance(path, CompressRequest) else CompressRequest(path, output, codec, **options)
    with ContainerReader(request.path) as reader:
        check_codec_for_layout(request.codec, reader.manifest.kv_layout)  # before pca looks for a calibration
        params = request.params_for(reader.manifest.model["fingerprint"])  # (pca: the file's model's calibration)
        return compress_file(reader, request.output, request.codec, params, on_chunk=on_chunk,
                             embed_calibration=request.embed_calibration)


def compress_file(reader: ContainerReader, output: str | Path, codec: str, params: dict[str, Any], *,
                  on_chunk: Callable[[int, int], None] | None = None,
                  embed_calibration: bool = False, relay: bool = True) -> CompressResult:
    """Write every chunk of an open file to `output` with `codec`; chunks already in that
    encoding are copied as they are; with `relay`, chunks the codec can move to the target's
    layout without decoding them (pca's bitstream versions: `Codec.relays`) are re-laid, so
    nothing is rounded twice (slower than a decode and encode: the numpy reference does it).
    `on_chunk(done, total)` reports progress."""
    m = reader.manifest
    reader.kv_dtype  # imports torch (the chunks are tensors) before the clock starts
    started = time.perf_counter()
    copied = relaid = 0
    impl = codecs.get_codec(codec)
    at_position = getattr(impl, "needs_position", False)  # (pca: params record the chunk's start)
    with ContainerWriter(output, m.model, reader.token_ids(), kv_dtype=m.kv_dtype, chunk_size=m.chunk_size,
                         alignment=reader.header.alignment,
                         metadata=_provenance(m.metadata, reader.path)) as writer:
        for c in m.chunks:
            # (normalised, as the manifest's are: parameters given in part still find a chunk in them)
            target = impl.validate_params(dict(params, position=c.start) if at_position else params)
            if c.codec == codec and c.codec_params == target:  # already in the target encoding (never coded twice)
                writer.write_encoded_chunk(reader.chunk_payload(c.index), c.codec, c.codec_params)
                copied += 1
            elif relay and c.codec == codec and impl.relays(c.codec_params, target):
                # the same content in another layout (pca's versions): never decoded, never rounded twice
                with reader.failures_named(c):  # (a failure named by its chunk, as a decode's is)
                    payload = impl.relay(reader.chunk_payload(c.index), c.shape, c.dtype, c.codec_params, target)
                writer.write_encoded_chunk(payload, codec, target)
                relaid += 1
            else:
                writer.write_chunk(reader.read_chunk(c.index), codec, params)
            if on_chunk is not None:
                on_chunk(c.index + 1, len(m.chunks))
        for name in m.extras:
            writer.write_extra(name, reader.read_extra(name))
        if embed_calibration:  # (pca.md §3.3: the calibration objects its chunks name, carried)
            writer.embed_pca_calibrations()
    seconds = time.perf_counter() - started
    stored_in = sum(c.blob.length for c in m.chunks)
    stored_out = sum(c.blob.length for c in writer.chunks)
    decoded = sum(c.decoded_bytes for c in m.chunks)
    values = m.num_tokens * m.planes * m.num_layers * m.hidden_kv
    return CompressResult(
        input=str(reader.path), output=str(output), codec=codec, codec_params=params, num_chunks=len(m.chunks),
        chunks_copied=copied, chunks_relaid=relaid, input_bytes=stored_in, output_bytes=stored_out, input_file_bytes=reader.file_size,
        output_file_bytes=Path(output).stat().st_size, extras_bytes=sum(e.blob.length for e in m.extras.values()),
        calibration_bytes=sum(b.length for b in writer.calibrations.values()),
        decoded_bytes=decoded,
        ratio_vs_decoded=decoded / max(stored_out, 1), bits_per_value=8 * stored_out / values, seconds=seconds,
        mb_per_s=decoded / 1e6 / max(seconds, 1e-9))


def _provenance(metadata: dict[str, str], source) -> dict[str, str]:
    """Keep the source's metadata, but this file's creator and time are the writer's own."""
    kept = {k: v for k, v in metadata.items() if k not in ("created_by", "created_at")}
    for key in ("created_by", "created_at"):
        if key in metadata:
            kept[f"source_{key}"] = metadata[key]
    return {**kept, "compressed_from": str(source)}
