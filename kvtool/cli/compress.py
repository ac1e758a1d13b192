"""`kvtool compress IN -o OUT --codec ...`: re-encode every chunk, one at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from .options import (BinsOpt, CalibrationOpt, CodecOpt, EmbedCalibrationOpt, InputPath, JsonOpt, LevelOpt, NoShuffleOpt, OutputPath,
                      QualityOpt, ShuffleOpt, shuffle_choice)
from .output import emit, human_bytes, human_rate, plural, progress, renders

if TYPE_CHECKING:
    from ..ops.compress import CompressResult


def command(path: InputPath, output: OutputPath, codec: CodecOpt = "zstd", level: LevelOpt = None,
            shuffle: ShuffleOpt = None, no_shuffle: NoShuffleOpt = False, bins: BinsOpt = None,
            quality: QualityOpt = None, calibration: CalibrationOpt = None,
            embed_calibration: EmbedCalibrationOpt = False, json: JsonOpt = False) -> None:
    """Re-encode a KV file with another codec (streaming: one chunk in memory at a time)."""
    from ..ops.compress import compress

    with progress("compressing", "chunks", enabled=not json) as update:
        result = compress(path, output, codec, level=level, shuffle=shuffle_choice(shuffle, no_shuffle), bins=bins,
                          quality=quality, calibration=calibration, embed_calibration=embed_calibration,
                          on_chunk=update)
    emit(result, json)


@renders("CompressResult")
def render(console: Console, r: CompressResult) -> None:
    console.print(f"wrote {r.output}: {plural(r.num_chunks, 'chunk')} as {r.codec}, "
                  f"file {human_bytes(r.input_file_bytes)} -> {human_bytes(r.output_file_bytes)}")
    extras = f", extras {human_bytes(r.extras_bytes)} as they were" if r.extras_bytes else ""
    extras += f", calibration {human_bytes(r.calibration_bytes)} carried" if r.calibration_bytes else ""
    console.print(f"chunks {human_bytes(r.input_bytes)} -> {human_bytes(r.output_bytes)} "
                  f"({r.ratio_vs_decoded:.2f}x vs decoded, {r.bits_per_value:.2f} bits/value){extras}; "
                  f"{r.seconds:.2f}s ({human_rate(r.mb_per_s)})")
