"""`kvtool compress IN -o OUT --codec ...`: re-encode every chunk, one at a time."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import Progress

from ..format import ContainerReader, ContainerWriter
from .options import BinsOpt, CodecOpt, InputPath, JsonOpt, LevelOpt, OutputPath, ShuffleOpt, codec_params
from .output import emit, human_bytes, stderr_console


def compress_command(path: InputPath, output: OutputPath, codec: CodecOpt = "zstd",
                     level: LevelOpt = None, shuffle: ShuffleOpt = None, bins: BinsOpt = None,
                     json: JsonOpt = False) -> None:
    """Re-encode a KV file with another codec (streaming: one chunk in memory at a time)."""
    with ContainerReader(path) as reader:
        result = compress_file(reader, output, codec,
                               codec_params(codec, level=level, shuffle=shuffle, bins=bins),
                               progress=not json)
    emit(result, json, _render)


def compress_file(reader: ContainerReader, output, codec: str, params: dict[str, Any], *,
                  progress: bool = False) -> dict[str, Any]:
    m = reader.manifest
    started = time.perf_counter()
    copied = 0
    with ContainerWriter(output, m.model, reader.token_ids(), kv_dtype=reader.kv_dtype,
                         chunk_size=m.chunk_size, alignment=reader.header.alignment,
                         metadata=_provenance(m.metadata, reader.path)) as writer, \
            Progress(console=stderr_console, transient=True,
                     disable=not progress or len(m.chunks) < 4 or not stderr_console.is_terminal) as bar:
        task = bar.add_task("compressing", total=len(m.chunks))
        for c in m.chunks:
            if c.codec == codec and c.codec_params == params:  # already in the target encoding
                writer.write_encoded_chunk(reader.chunk_payload(c.index), c.codec, c.codec_params)
                copied += 1
            else:
                writer.write_chunk(reader.read_chunk(c.index), codec, params)
            bar.advance(task)
        for name in m.extras:
            writer.write_extra(name, reader.read_extra(name))
    seconds = time.perf_counter() - started
    stored_in = sum(c.blob.length for c in m.chunks)
    stored_out = sum(c.blob.length for c in writer.chunks)
    decoded = sum(c.decoded_bytes for c in m.chunks)
    values = m.num_tokens * 2 * m.num_layers * m.hidden_kv
    return {"input": str(reader.path), "output": str(output), "codec": codec, "codec_params": params,
            "num_chunks": len(m.chunks), "chunks_copied": copied,
            "input_bytes": stored_in, "output_bytes": stored_out, "decoded_bytes": decoded,
            "ratio_vs_decoded": decoded / max(stored_out, 1),
            "bits_per_value": 8 * stored_out / values, "seconds": seconds,
            "mb_per_s": decoded / 1e6 / max(seconds, 1e-9)}


def _provenance(metadata: dict[str, str], source) -> dict[str, str]:
    """Keep the source's metadata, but this file's creator and time are the writer's own."""
    kept = {k: v for k, v in metadata.items() if k not in ("created_by", "created_at")}
    for key in ("created_by", "created_at"):
        if key in metadata:
            kept[f"source_{key}"] = metadata[key]
    return {**kept, "compressed_from": str(source)}


def _render(console: Console, r: dict[str, Any]) -> None:
    console.print(f"wrote {r['output']}: {r['num_chunks']} chunks as {r['codec']}, "
                  f"{human_bytes(r['input_bytes'])} -> {human_bytes(r['output_bytes'])} "
                  f"({r['ratio_vs_decoded']:.2f}x vs decoded, {r['bits_per_value']:.2f} bits/value) "
                  f"in {r['seconds']:.2f} s ({r['mb_per_s']:.0f} MB/s)")
