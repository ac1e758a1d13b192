"""`kvtool capture`: run a model on a prompt and write its KV cache to a file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from .options import (BinsOpt, CodecOpt, DeviceOpt, EmbedCalibrationOpt, EngineOpt, JsonOpt, LevelOpt, ModelDtypeOpt, ModelOpt,
                      NamespaceOpt, NoGenerationPromptOpt, NoShuffleOpt, OptionalStoreOpt, ShuffleOpt, shuffle_choice)
from .output import KEPT_AS_STORED, emit, human_bytes, plural, progress, renders

if TYPE_CHECKING:  # only named here: importing it would load torch at start-up
    from ..ops.capture import CaptureResult

PromptOpt = Annotated[Optional[str], typer.Option("--prompt", metavar="TEXT", help="Prompt text.")]
PromptFileOpt = Annotated[Optional[Path], typer.Option("--prompt-file", metavar="FILE", help="File with the prompt (UTF-8).")]
TokensOpt = Annotated[Optional[Path], typer.Option(
    "--tokens", metavar="FILE", help="File of token ids (JSON list or whitespace-separated).")]
ChunkSizeOpt = Annotated[int, typer.Option("--chunk-size", metavar="N", help="Tokens per chunk.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="KV dtype: bf16, fp16 or fp32.")]
BlockSizeOpt = Annotated[int, typer.Option("--block-size", metavar="N", help="Tokens per paged-KV block.")]
HiddenOpt = Annotated[bool, typer.Option(
    "--hidden-states", help="Also store the final hidden states (replay then computes nothing for the first new token).")]
ChatOpt = Annotated[bool, typer.Option(
    "--chat", help="The prompt is a user message: apply the model's chat template (as transformers does).")]
SegmentOpt = Annotated[bool, typer.Option(
    "--segment", help="Mark the file a segment, computed alone from position 0, for replay --blend.")]
RoiOpt = Annotated[Optional[str], typer.Option(
    "--roi", metavar="RANGES", help="A roi_mask of token ranges, e.g. '0:16,40:64' ([start, end)).")]
# compress's --quality and --calibration, told shorter (capture's help fits a screen)
QualityOpt = Annotated[Optional[str], typer.Option("--quality", metavar="Q", help="pca: 99, 97 (default), 95 or 89.")]
CalibrationOpt = Annotated[Optional[str], typer.Option(
    "--calibration", metavar="DIGEST", help="pca: default: the model's own.")]


OutputOpt = Annotated[Optional[Path], typer.Option(
    "-o", "--output", metavar="OUT", help="Output path (optional with --store).", show_default=False)]


def command(output: OutputOpt = None, store: OptionalStoreOpt = None, model: ModelOpt = None, prompt: PromptOpt = None,
            prompt_file: PromptFileOpt = None, tokens: TokensOpt = None, chunk_size: ChunkSizeOpt = 256,
            codec: CodecOpt = "raw", level: LevelOpt = None, shuffle: ShuffleOpt = None,
            no_shuffle: NoShuffleOpt = False, bins: BinsOpt = None, quality: QualityOpt = None,
            calibration: CalibrationOpt = None, dtype: DtypeOpt = "bf16", block_size: BlockSizeOpt = 16,
            hidden_states: HiddenOpt = False, roi: RoiOpt = None, device: DeviceOpt = "auto",
            weights_dtype: ModelDtypeOpt = "fp32", chat: ChatOpt = False,
            no_generation_prompt: NoGenerationPromptOpt = False, segment: SegmentOpt = False,
            namespace: NamespaceOpt = None, engine: EngineOpt = "kvtool", embed_calibration: EmbedCalibrationOpt = False,
            json: JsonOpt = False) -> None:
    """Run a model on a prompt through a paged KV buffer and write its KV cache."""
    # the request first, torch-free: a usage error answers at once
    from ..ops.requests import CaptureRequest, PromptCaptureRequest, prompt_metadata

    what = CaptureRequest.from_options(output, codec=codec, level=level, shuffle=shuffle_choice(shuffle, no_shuffle), bins=bins, kv_dtype=dtype,
                                       chunk_size=chunk_size, block_size=block_size, hidden_states=hidden_states,
                                       roi=roi, store=store, segment=segment, namespace=namespace,
                                       quality=quality, calibration=calibration, embed_calibration=embed_calibration,
                                       metadata=prompt_metadata(chat, tokens, not no_generation_prompt))
    request = PromptCaptureRequest(what, prompt=prompt, prompt_file=prompt_file, tokens_file=tokens, chat=chat,
                                   generation_prompt=not no_generation_prompt, model=model, device=device,
                                   model_dtype=weights_dtype, engine=engine)
    with progress("capture", "tokens", enabled=not json) as update:
        from ..ops.capture import run_prompt_capture

        result = run_prompt_capture(request, on_chunk=lambda _index, done, total: update(done, total))
    emit(result, json)


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
