"""Options shared by several commands, declared once as Annotated aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import UsageError

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.")]
InputPath = Annotated[Path, typer.Argument(help="A kvtool file (.kvc).", show_default=False)]
OutputPath = Annotated[Path, typer.Option("-o", "--output", help="Output path.", show_default=False)]
CodecOpt = Annotated[str, typer.Option("--codec", help="Chunk codec: raw, zstd or cachegen.")]
LevelOpt = Annotated[Optional[int], typer.Option("--level", help="zstd level (default 1: on shuffled KV it beats 3 in ratio and speed).")]
ShuffleOpt = Annotated[Optional[bool], typer.Option(
    "--shuffle/--no-shuffle", help="zstd: byte-plane shuffle before compression (default on).")]
BinsOpt = Annotated[Optional[str], typer.Option(
    "--bins", help="cachegen: per-layer bins, e.g. 'k:0-10=32,10-=16;v:0-2=32,2-=16'.")]
ModelOpt = Annotated[Optional[Path], typer.Option(
    "--model", help="Local Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct).")]
DeviceOpt = Annotated[str, typer.Option(
    "--device", help="Where the model runs: auto (the GPU if torch sees one), cpu, cuda or cuda:N.")]
ModelDtypeOpt = Annotated[str, typer.Option(
    "--model-dtype", help="Weights and arithmetic of the model: fp32, bf16 or fp16 (bf16 for big models on a GPU).")]
ChunksOpt = Annotated[Optional[str], typer.Option(
    "--chunks", help="Chunk indices, e.g. '0-3,7' (default: all).")]
LayersOpt = Annotated[Optional[str], typer.Option(
    "--layers", help="Layer indices, e.g. '0,5-9' (default: all).")]


def model_dtype(name: str):
    """--model-dtype -> torch dtype (a usage error, not a file error, when unknown)."""
    from ..dtypes import dtype_from_name
    from ..errors import UnsupportedDtype

    try:
        return dtype_from_name(name)
    except UnsupportedDtype:
        raise UsageError(f"--model-dtype {name!r}: expected fp32, bf16 or fp16") from None


def codec_params(codec: str, *, level: int | None = None, shuffle: bool | None = None,
                 bins: str | None = None) -> dict[str, Any]:
    """Turn command-line codec options into codec parameters (validated by the codec)."""
    from .. import codecs

    impl = codecs.get_codec(codec)
    params = impl.default_params()
    if level is not None or shuffle is not None:
        if codec != "zstd":
            raise UsageError("--level and --shuffle apply to the zstd codec only")
        if level is not None:
            params["level"] = level
        if shuffle is not None:
            params["shuffle"] = "byteplane" if shuffle else "none"
    if bins is not None:
        if codec != "cachegen":
            raise UsageError("--bins applies to the cachegen codec only")
        params["bins"] = bins  # resolved against the model's layer count when a chunk is encoded
    return impl.validate_params(params)


def parse_index_set(spec: str | None, upper: int, what: str) -> list[int]:
    """'0-3,7,9-' -> sorted unique indices below `upper`."""
    if spec is None:
        return list(range(upper))
    chosen: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo = int(lo_s) if lo_s else 0
                hi = int(hi_s) if hi_s else upper - 1
            else:
                lo = hi = int(part)
        except ValueError:
            raise UsageError(f"--{what}: cannot read {part!r} (use e.g. '0-3,7')") from None
        if lo < 0 or hi >= upper or lo > hi:
            raise UsageError(f"--{what}: {part!r} is outside 0..{upper - 1}")
        chosen.update(range(lo, hi + 1))
    return sorted(chosen)
