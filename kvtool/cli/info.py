"""`kvtool info`: versions, codecs, and which backends this install uses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from .options import JsonOpt
from .output import emit, renders

if TYPE_CHECKING:
    from ..ops.info import InfoResult

DevicesOpt = Annotated[bool, typer.Option(
    "--devices", help="Also ask torch about CUDA: the kernels' state and where --device auto runs (slower).")]


def command(devices: DevicesOpt = False, json: JsonOpt = False) -> None:
    """Show kvtool's version, supported format versions, codecs and backends."""
    from ..ops.info import info

    emit(info(devices=devices), json)


@renders("InfoResult")
def render(console: Console, r: InfoResult) -> None:
    console.print(f"kvtool {r.kvtool} (torch {r.torch}, {r.threads} threads); writes format "
                  f"{r.writes_format}, reads {', '.join(r.reads_formats)}")
    console.print("codecs     " + ", ".join(f"{c['name']} ({c['id']}, {'lossless' if c['lossless'] else 'lossy'})"
                                         for c in r.codecs))
    for kind in r.layouts:  # what this build reads and writes (container.md 3.2)
        console.print(f"layout     {kind['name']} ({kind['since']}, {kind['holds']}): {', '.join(kind['codecs'])}")
    for name, what in {**r.backends, **r.devices}.items():
        console.print(f"{name:<11}{what}")
    if not r.devices:
        console.print("devices    kvtool info --devices asks torch about CUDA")
    console.print(f"model      default model {'installed' if r.default_model_installed else 'NOT installed'}"
                  f"; cache {r.model_cache}")
