"""Options shared by several commands, declared once as Annotated aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.")]
# str, not Path: a Path would turn "https://host/f.kvc" into "https:/host/f.kvc" in messages
InputPath = Annotated[str, typer.Argument(metavar="FILE", help="A kvtool file (.kvc).", show_default=False)]
OutputPath = Annotated[Path, typer.Option("-o", "--output", metavar="OUT", help="Output path.", show_default=False)]
CodecOpt = Annotated[str, typer.Option("--codec", metavar="CODEC", help="Chunk codec: raw, zstd or cachegen.")]
LevelOpt = Annotated[Optional[int], typer.Option("--level", metavar="N", help="zstd level (default 1: on shuffled KV it beats 3 in ratio and speed).")]
ShuffleOpt = Annotated[Optional[bool], typer.Option(
    "--shuffle/--no-shuffle", help="zstd: byte-plane shuffle before compression (default on).")]
BinsOpt = Annotated[Optional[str], typer.Option(
    "--bins", metavar="SPEC", help="cachegen: per-layer bins, e.g. 'k:0-10=32,10-=16;v:0-2=32,2-=16'.")]
ModelOpt = Annotated[Optional[Path], typer.Option(
    "--model", metavar="DIR|ID", help=(
        "A local Hugging Face model folder, or a Hub id (org/name) already in the local Hugging Face cache: "
        "nothing is downloaded (default: the embedded SmolLM2-135M-Instruct)."))]
DeviceOpt = Annotated[str, typer.Option(
    "--device", metavar="DEVICE", help="Where the model runs: auto (the GPU if torch sees one), cpu, cuda or cuda:N.")]
ModelDtypeOpt = Annotated[str, typer.Option(
    "--model-dtype", metavar="DTYPE", help="Weights and arithmetic of the model: fp32, bf16 or fp16 (bf16 for big models on a GPU).")]
OtherWeightsOpt = Annotated[bool, typer.Option(
    "--allow-other-weights", help="Replay a file computed with other weights than the model's (recorded in the report).")]
ChunksOpt = Annotated[Optional[str], typer.Option(
    "--chunks", metavar="LIST", help="Chunk indices, e.g. '0-3,7' (default: all).")]
LayersOpt = Annotated[Optional[str], typer.Option(
    "--layers", metavar="LIST", help="Layer indices, e.g. '0,5-9' (default: all).")]
StoreOpt = Annotated[str, typer.Option(
    "--store", metavar="URL", help="The chunk store: a folder, file://PATH or redis://HOST:PORT/DB.", show_default=False)]
NamespaceOpt = Annotated[Optional[str], typer.Option(
    "--namespace", metavar="NAME", help="The store's partition to use: chunks stored under one namespace are never served to another.",
    show_default=False)]
OptionalStoreOpt = Annotated[Optional[str], typer.Option(
    "--store", metavar="URL", help="The chunk store: a folder, file://PATH or redis://HOST:PORT/DB.", show_default=False)]
