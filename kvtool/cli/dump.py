"""`kvtool dump FILE -o OUT.safetensors|OUT.npy`: export decoded KV (see `kvtool.ops.dump`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from ..ops.file_requests import DumpRequest
from .commands import request_command
from .output import emit, human_bytes, plural, progress, renders

if TYPE_CHECKING:
    from ..ops.dump import DumpResult


def run(request: DumpRequest, json: bool) -> None:
    from ..ops.dump import dump

    with progress("decoding", "chunks", enabled=not json) as update:
        result = dump(request, on_chunk=update)
    emit(result, json)


command = request_command(DumpRequest, run,
                          "Export decoded KV to safetensors (one tensor per layer and K/V) or .npy.")


@renders("DumpResult")
def render(console: Console, r: DumpResult) -> None:
    console.print(f"wrote {r.output} ({r.format}, {human_bytes(r.bytes)}): "
                  f"{plural(r.num_tokens, 'token')} from {plural(len(r.chunks), 'chunk')}, "
                  f"{plural(len(r.layers), 'layer')}")
    if r.sidecar:
        console.print(f"and {r.sidecar}: which layers, chunks, positions and token ids it holds")
