"""`kvtool compress IN -o OUT --codec ...`: re-encode every chunk, one at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from ..ops.file_requests import CompressRequest
from .commands import request_command
from .output import emit, human_bytes, human_rate, plural, progress, renders

if TYPE_CHECKING:
    from ..ops.compress import CompressResult


def run(request: CompressRequest, json: bool) -> None:
    from ..ops.compress import compress

    with progress("compressing", "chunks", enabled=not json) as update:
        result = compress(request, on_chunk=update)
    emit(result, json)


command = request_command(CompressRequest, run,
                          "Re-encode a KV file with another codec (streaming: one chunk in memory at a time).")


@renders("CompressResult")
def render(console: Console, r: CompressResult) -> None:
    console.print(f"wrote {r.output}: {plural(r.num_chunks, 'chunk')} as {r.codec}, "
                  f"file {human_bytes(r.input_file_bytes)} -> {human_bytes(r.output_file_bytes)}")
    extras = f", extras {human_bytes(r.extras_bytes)} as they were" if r.extras_bytes else ""
    extras += f", calibration {human_bytes(r.calibration_bytes)} carried" if r.calibration_bytes else ""
    console.print(f"chunks {human_bytes(r.input_bytes)} -> {human_bytes(r.output_bytes)} "
                  f"({r.ratio_vs_decoded:.2f}x vs decoded, {r.bits_per_value:.2f} bits/value){extras}; "
                  f"{r.seconds:.2f}s ({human_rate(r.mb_per_s)})")
    if r.chunks_relaid:  # (pca's bitstream versions: the same coefficients, never decoded to values)
        console.print(f"{plural(r.chunks_relaid, 'chunk')} re-laid in the new layout, not decoded: no second rounding")
