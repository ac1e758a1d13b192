"""Options shared by several commands, declared once as Annotated aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError

try:  # typer 0.28 carries its own click; a type of the installed click's would be wrapped as a function
    from typer._click.types import ParamType
except ImportError:  # pragma: no cover - a typer that uses the installed click
    from click import ParamType


class _Words(ParamType):
    """An argument's words as given, shown in help by its metavar alone (typer adds `<str>` beside
    the metavar of a plain string argument)."""

    name = "text"

    def get_metavar(self, param, ctx) -> str:
        return ""

    def convert(self, value, param, ctx):
        return value


#: click_type of every positional argument
WORDS = _Words()

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.")]
# str, not Path: a Path would turn "https://host/f.kvc" into "https:/host/f.kvc" in messages
InputPath = Annotated[str, typer.Argument(metavar="FILE", help="A kvtool file (.kvc).", show_default=False,
                                          click_type=WORDS)]
OutputPath = Annotated[Path, typer.Option("-o", "--output", metavar="OUT", help="Output path.", show_default=False)]
CodecOpt = Annotated[str, typer.Option("--codec", metavar="CODEC", help="Codec: raw, zstd, cachegen or pca.")]
QualityOpt = Annotated[Optional[str], typer.Option(
    "--quality", metavar="Q", help="pca: 99, 97 (default), 95 or 89 (README: their promises).")]
CalibrationOpt = Annotated[Optional[str], typer.Option(
    "--calibration", metavar="DIGEST", help="pca: the calibration object (default: the model's).")]
EmbedCalibrationOpt = Annotated[bool, typer.Option(
    "--embed-calibration", help="pca: carry it in the file.")]
LevelOpt = Annotated[Optional[int], typer.Option("--level", metavar="N", help="zstd level (default 1: on shuffled KV it beats 3 in ratio and speed).")]
ShuffleOpt = Annotated[Optional[bool], typer.Option(
    "--shuffle", help="zstd: shuffle byte planes before compressing (on by default; --no-shuffle: off).",
    show_default=False)]
# (its own option, out of the help: a --shuffle/--no-shuffle pair takes a column of every line of it)
NoShuffleOpt = Annotated[bool, typer.Option("--no-shuffle", hidden=True)]
BinsOpt = Annotated[Optional[str], typer.Option(
    "--bins", metavar="SPEC", help="cachegen: bins per layer, e.g. 'k:0-10=32,10-=16;v:0-=16' (cachegen.md §2).")]
ModelOpt = Annotated[Optional[Path], typer.Option(
    "--model", metavar="DIR|ID", help=(
        "A Hugging Face model folder, or a Hub id (org/name) in the local cache (nothing is downloaded); "
        "default: the embedded SmolLM2-135M-Instruct."))]
DeviceOpt = Annotated[str, typer.Option(
    "--device", metavar="DEVICE", help="auto (a GPU if torch sees one), cpu, cuda or cuda:N.")]
ModelDtypeOpt = Annotated[str, typer.Option(
    "--model-dtype", metavar="DTYPE", help="The model's weights and arithmetic: fp32, bf16 or fp16.")]
EngineOpt = Annotated[str, typer.Option(
    "--engine", metavar="ENGINE", show_default=False,
    help="kvtool (default), hf (transformers).")]
NoGenerationPromptOpt = Annotated[bool, typer.Option("--no-generation-prompt", help="--chat: open no assistant turn.")]
OtherWeightsOpt = Annotated[bool, typer.Option(
    "--allow-other-weights", help="Accept KV computed with other weights (said in the report).")]
ChunksOpt = Annotated[Optional[str], typer.Option(
    "--chunks", metavar="LIST", help="Chunk indices, e.g. '0-3,7' (default: all).")]
LayersOpt = Annotated[Optional[str], typer.Option(
    "--layers", metavar="LIST", help="Layer indices, e.g. '0,5-9' (default: all).")]
STORE_HELP = "The chunk store: a folder, file://, redis://, redis+cluster://."
StoreOpt = Annotated[str, typer.Option(
    "--store", metavar="URL", help=STORE_HELP, show_default=False)]
NamespaceOpt = Annotated[Optional[str], typer.Option(
    "--namespace", metavar="NAME", help="The store's partition: its chunks are never served to another.",
    show_default=False)]
OptionalStoreOpt = Annotated[Optional[str], typer.Option(
    "--store", metavar="URL", help=STORE_HELP, show_default=False)]


def shuffle_choice(shuffle: bool | None, no_shuffle: bool) -> bool | None:
    """--shuffle / --no-shuffle as one answer (None: neither given, the codec's default)."""
    if shuffle and no_shuffle:
        raise UsageError("--shuffle and --no-shuffle: give one")
    return False if no_shuffle else shuffle
