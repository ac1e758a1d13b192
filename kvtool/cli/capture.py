"""`kvtool capture`: run a model on a prompt and write its KV cache to a file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..dtypes import dtype_from_name
from .options import (BinsOpt, CodecOpt, DeviceOpt, JsonOpt, LevelOpt, ModelDtypeOpt, ModelOpt, OutputPath,
                      ShuffleOpt, codec_params, model_dtype)
from .output import emit, human_bytes, stderr_console

PromptOpt = Annotated[Optional[str], typer.Option("--prompt", help="Prompt text.")]
PromptFileOpt = Annotated[Optional[Path], typer.Option("--prompt-file", help="File with the prompt (UTF-8).")]
TokensOpt = Annotated[Optional[Path], typer.Option(
    "--tokens", help="File of token ids (JSON list or whitespace-separated).")]
ChunkSizeOpt = Annotated[int, typer.Option("--chunk-size", help="Tokens per chunk.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="KV dtype: bf16, fp16 or fp32.")]
BlockSizeOpt = Annotated[int, typer.Option("--block-size", help="Tokens per paged-KV block.")]
HiddenOpt = Annotated[bool, typer.Option(
    "--hidden-states", help="Also store the final hidden states (replay then computes nothing for the first new token).")]
RoiOpt = Annotated[Optional[str], typer.Option(
    "--roi", help="Store a roi_mask marking these token ranges, e.g. '0:16,40:64' ([start, end)).")]


def command(output: OutputPath, model: ModelOpt = None, prompt: PromptOpt = None,
            prompt_file: PromptFileOpt = None, tokens: TokensOpt = None, chunk_size: ChunkSizeOpt = 256,
            codec: CodecOpt = "raw", level: LevelOpt = None, shuffle: ShuffleOpt = None,
            bins: BinsOpt = None, dtype: DtypeOpt = "bf16", block_size: BlockSizeOpt = 16,
            hidden_states: HiddenOpt = False, roi: RoiOpt = None, device: DeviceOpt = "auto",
            weights_dtype: ModelDtypeOpt = "fp32", json: JsonOpt = False) -> None:
    """Run a model on a prompt through a paged KV buffer and write its KV cache."""
    from ..capture import capture, parse_roi, read_tokens
    from ..devices import resolve_device
    from ..engine import load_model
    from ..errors import UsageError

    kv_dtype = dtype_from_name(dtype)
    if not 1 <= chunk_size <= 65536 or not 1 <= block_size <= 65536:
        raise UsageError("--chunk-size and --block-size must be in 1..65536")
    ranges = parse_roi(roi) if roi is not None else None  # before the model loads: a typo fails fast
    where = resolve_device(device)
    loaded = load_model(model, dtype=model_dtype(weights_dtype), device=where)
    ids = read_tokens(loaded, prompt, prompt_file, tokens)
    params = codec_params(codec, level=level, shuffle=shuffle, bins=bins)
    num_chunks = -(-len(ids) // chunk_size)
    with Progress(TextColumn("capture"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
                  TimeElapsedColumn(), console=stderr_console, transient=True,
                  disable=json or num_chunks < 2 or not stderr_console.is_terminal) as bar:
        task = bar.add_task("capture", total=len(ids))
        result = capture(loaded, ids, output, chunk_size=chunk_size, codec=codec, params=params,
                         kv_dtype=kv_dtype, block_size=block_size, hidden_states=hidden_states, roi=ranges,
                         on_chunk=lambda _i, end: bar.update(task, completed=end))
    emit(result, json, _render)


def _render(console: Console, r: dict[str, Any]) -> None:
    t = r["timings"]
    extras = f" + {', '.join(r['extras'])}" if r["extras"] else ""
    console.print(f"wrote {r['output']}: {r['num_tokens']} tokens of {r['model']} KV ({r['kv_dtype']}) in "
                  f"{r['num_chunks']} {r['codec']} chunks{extras}, {human_bytes(r['file_bytes'])}")
    console.print(f"prefill on {r['device']} {t['prefill_s']:.2f} s ({r['prefill_tokens_per_s']:.0f} tokens/s); connector "
                  f"{t['connector_s'] * 1e3:.0f} ms, writer {t['writer_s'] * 1e3:.0f} ms "
                  f"({100 * t['overhead_share']:.1f}% of prefill)")
