"""`kvtool capture`: run a model on a prompt and write its KV cache to a file."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from ..ops.requests import PromptCaptureRequest  # (torch-free: a usage error answers before torch loads)
from .commands import request_command
from .output import KEPT_AS_STORED, emit, human_bytes, plural, progress, renders

if TYPE_CHECKING:  # only named here: importing it would load torch at start-up
    from ..ops.capture import CaptureResult


def run(request: PromptCaptureRequest, json: bool) -> None:
    with progress("capture", "tokens", enabled=not json) as update:
        from ..ops.capture import run_prompt_capture

        result = run_prompt_capture(request, on_chunk=lambda _index, done, total: update(done, total))
    emit(result, json)


command = request_command(PromptCaptureRequest, run,
                          "Run a model on a prompt through a paged KV buffer and write its KV cache.")


@renders("CaptureResult")
def render(console: Console, r: CaptureResult) -> None:
    t = r.timings  # CaptureTimings' fields and its overhead share, by name
    extras = f" + {', '.join(r.extras)}" if r.extras else ""
    if r.segment:
        extras += f"; a segment (positions from {r.segment['stored_start']}, placeable anywhere)"
    where = f"wrote {r.output}" if r.output else "captured"
    console.print(f"{where}: {r.num_tokens} tokens of {r.model} KV ({r.kv_dtype}) in "
                  f"{plural(r.num_chunks, r.codec + ' chunk')}{extras}, {human_bytes(r.file_bytes)}")
    engine = " with transformers" if r.engine == "hf" else ""
    console.print(f"prefill{engine} on {r.device} {t['prefill_s']:.2f}s ({r.prefill_tokens_per_s:.0f} tokens/s); "
                  f"connector "
                  f"{t['connector_s'] * 1e3:.0f}ms, writer {t['writer_s'] * 1e3:.0f}ms beside the prefill, "
                  f"waited {t['waiting_s'] * 1e3:.0f}ms ({100 * t['overhead_share']:.1f}% of prefill)")
    if r.store:
        s = r.store  # {"store": url, "chunks", "stored", "present"}
        console.print(f"{s['store']}: {s['stored']} of {plural(s['chunks'], 'whole chunk')} stored, "
                      f"{s['present']} already there")
        if s["present"]:
            console.print(KEPT_AS_STORED)
