"""`kvtool replay FILE`: load a KV file into the engine's paged buffer and continue from it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.text import Text

from .options import DeviceOpt, JsonOpt, ModelDtypeOpt, ModelOpt, OptionalStoreOpt, OtherWeightsOpt
from .output import emit, renders, stages

ContinueOpt = Annotated[int, typer.Option("--continue", metavar="N", help="Tokens to generate (or teacher-force with --compare).")]
SuffixOpt = Annotated[Optional[str], typer.Option("--suffix", metavar="TEXT", help="Text to append after the cached tokens.")]
SuffixFileOpt = Annotated[Optional[Path], typer.Option("--suffix-file", metavar="FILE", help="File with text to append.")]
PromptOpt = Annotated[Optional[str], typer.Option(
    "--prompt", metavar="TEXT", help="A new prompt: reuse the file's chunks whose prefix hashes match, compute the rest.")]
PromptFileOpt = Annotated[Optional[Path], typer.Option("--prompt-file", metavar="FILE", help="A new prompt, from a file.")]
CompareOpt = Annotated[bool, typer.Option("--compare", help="Also run the full recompute and compare.")]
NoHiddenOpt = Annotated[bool, typer.Option(
    "--no-hidden-states", help="Ignore stored hidden states: compute the last cached token (measures the KV alone).")]
ChatOpt = Annotated[bool, typer.Option(
    "--chat", help="The new --prompt is a user message: apply the model's chat template.")]
MinTop1Opt = Annotated[Optional[float], typer.Option(
    "--min-top1", metavar="X", help="Exit 1 if top-1 agreement with the recompute is below this (implies --compare).")]
MaxKlOpt = Annotated[Optional[float], typer.Option(
    "--max-kl", metavar="X", help="Exit 1 if the mean KL divergence exceeds this (implies --compare).")]


PathArg = Annotated[Optional[str], typer.Argument(
    metavar="[FILE]", help="A kvtool file (.kvc); or --store URL with --prompt/--prompt-file.", show_default=False)]
ChunkSizeOpt = Annotated[Optional[int], typer.Option(
    "--chunk-size", metavar="N", help="With --store: the stored chunks' size (default: the one that covers the most).")]


def command(path: PathArg = None, store: OptionalStoreOpt = None, chunk_size: ChunkSizeOpt = None,
            model: ModelOpt = None, continue_tokens: ContinueOpt = 32,
            suffix: SuffixOpt = None, suffix_file: SuffixFileOpt = None, prompt: PromptOpt = None,
            prompt_file: PromptFileOpt = None, compare: CompareOpt = False, min_top1: MinTop1Opt = None,
            max_kl: MaxKlOpt = None, no_hidden_states: NoHiddenOpt = False, device: DeviceOpt = "auto",
            weights_dtype: ModelDtypeOpt = "fp32", chat: ChatOpt = False,
            allow_other_weights: OtherWeightsOpt = False, json: JsonOpt = False) -> None:
    """Load a KV file into a fresh paged KV buffer, continue from it, and (--compare) check it."""
    from ..ops.replay import replay

    with stages(enabled=not json) as stage:
        result = replay(path, model, continue_tokens=continue_tokens, suffix=suffix, suffix_file=suffix_file,
                        prompt=prompt, prompt_file=prompt_file, compare=compare, min_top1=min_top1, max_kl=max_kl,
                        device=device, model_dtype=weights_dtype, use_hidden_states=not no_hidden_states, chat=chat,
                        allow_other_weights=allow_other_weights, store=store, chunk_size=chunk_size,
                        on_stage=stage)
    emit(result, json)


@renders("ReplayResult")
def render(console: Console, r: dict[str, Any]) -> None:
    console.print(f"[bold]{r['file']}[/bold] on {r['model']} ({r['device']}): {r['reused_tokens']} of {r['num_tokens']} tokens "
                  f"from the cache ({r['chunks_loaded']} chunks, {', '.join(r['codecs'])}), "
                  f"{r['computed_tokens']} computed"
                  + ("; the first new token from the stored hidden states" if r.get("first_token_from") == "hidden_states"
                     else ""))
    if r.get("weights", "").startswith("other"):
        console.print(f"[yellow]{r['weights']}[/yellow]")
    line = f"time to first token {r['ttft_cached_s'] * 1e3:.0f} ms with the cache (load {r['load_s'] * 1e3:.0f} ms)"
    if r.get("ttft_recompute_s") is not None:
        line += f" vs {r['ttft_recompute_s'] * 1e3:.0f} ms recomputed: {r['speedup']:.1f}x"
    console.print(line)
    if r.get("top1_agreement") is not None:
        console.print(f"over {r['continue_tokens']} teacher-forced tokens: top-1 agreement {100 * r['top1_agreement']:.1f}%, "
                      f"greedy identical for {r['greedy_identical_tokens']}/{r['continue_tokens']} tokens, "
                      f"KL mean {r['kl_mean']:.3g} max {r['kl_max']:.3g}, ΔNLL {r['delta_nll']:+.4f}")
    # r holds markup-escaped strings; recover the literal text, then print it as plain Text.
    def text(key: str) -> str:
        return Text.from_markup(r[key]).plain

    if r.get("cached_continuation") is None:
        console.print(Text(f"continuation: {text('continuation')!r}"), soft_wrap=True)
        return _failures(console, r)
    agreed, same, total = text("agreed_continuation"), r["greedy_identical_tokens"], r["continue_tokens"]
    if same == total:
        console.print(Text(f"continuation (recompute and cache alike, {total} tokens): {agreed!r}"), soft_wrap=True)
        return _failures(console, r)
    console.print(Text(f"alike for {same} of {total} tokens: {agreed!r}"), soft_wrap=True)
    for label, key in (("then the recompute:", "continuation"), ("then the cache:   ", "cached_continuation")):
        full = text(key)
        console.print(Text(f"{label} {full[len(agreed):] if full.startswith(agreed) else full!r}"), soft_wrap=True)
    _failures(console, r)


def _failures(console: Console, r: dict[str, Any]) -> None:
    for f in r.get("failures", []):
        console.print(f"[red]FAIL[/red] {f}")
