"""`kvtool replay FILE`: load a KV file into the engine's paged buffer and continue from it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from ..errors import UsageError
from .options import (WORDS, DeviceOpt, EngineOpt, JsonOpt, ModelDtypeOpt, ModelOpt, NamespaceOpt,
                      NoGenerationPromptOpt, OptionalStoreOpt, OtherWeightsOpt)
from .output import emit, plural, renders, stages

if TYPE_CHECKING:  # the results are only named here: importing them would load torch at start-up
    from ..ops.blend import BlendReplayResult
    from ..ops.replay import ReplayResult

ContinueOpt = Annotated[int, typer.Option("--continue", metavar="N", help=(
    "Tokens to generate (they stop at end of sequence)."))]
SuffixOpt = Annotated[Optional[str], typer.Option("--suffix", metavar="TEXT", help="Text after the cached tokens.")]
SuffixFileOpt = Annotated[Optional[Path], typer.Option("--suffix-file", metavar="FILE", help="File with text to append.")]
PromptOpt = Annotated[Optional[str], typer.Option(
    "--prompt", metavar="TEXT", help="A new prompt: reuse the chunks of its cached prefix, compute the rest.")]
PromptFileOpt = Annotated[Optional[Path], typer.Option("--prompt-file", metavar="FILE", help="A new prompt, from a file.")]
CompareOpt = Annotated[bool, typer.Option("--compare", help="Also recompute in full, and compare.")]
NoHiddenOpt = Annotated[bool, typer.Option(
    "--no-hidden-states", help="Ignore stored hidden states (measures the KV alone).")]
ChatOpt = Annotated[bool, typer.Option("--chat", help="--prompt in the chat template.")]
MinTop1Opt = Annotated[Optional[float], typer.Option(
    "--min-top1", metavar="X", help="Exit 1 below this top-1 agreement (implies --compare).")]
MaxKlOpt = Annotated[Optional[float], typer.Option(
    "--max-kl", metavar="X", help="Exit 1 above this mean KL divergence (implies --compare).")]


PathArg = Annotated[Optional[str], typer.Argument(
    click_type=WORDS, metavar="[FILE]", help="A kvtool file (.kvc); or --store URL with --prompt/--prompt-file.",
    show_default=False)]
ChunkSizeOpt = Annotated[Optional[int], typer.Option(
    "--chunk-size", metavar="N", help="With --store: the chunk size (default: the one covering most).")]
BlendOpt = Annotated[Optional[list[str]], typer.Option(
    "--blend", metavar="SEG.kvc", help=(
        "A cached segment to blend (CacheBlend), once each in prompt order, before the question "
        "(--prompt/--prompt-file)."), show_default=False)]
BlendDelimiterOpt = Annotated[Optional[str], typer.Option(
    "--blend-delimiter", metavar="TEXT", help=(
        "Blend a prompt split at TEXT (LMCache's: ' # # '): segments, then the question last."))]
RecomputeRatioOpt = Annotated[Optional[float], typer.Option(
    "--recompute-ratio", metavar="X", help="--blend: share of cached tokens recomputed (default 0.15).")]
CheckLayerOpt = Annotated[Optional[int], typer.Option(
    "--check-layer", metavar="N", help="--blend: layer choosing what to recompute (default 1).")]


def command(path: PathArg = None, store: OptionalStoreOpt = None, chunk_size: ChunkSizeOpt = None,
            model: ModelOpt = None, continue_tokens: ContinueOpt = 32,
            suffix: SuffixOpt = None, suffix_file: SuffixFileOpt = None, prompt: PromptOpt = None,
            prompt_file: PromptFileOpt = None, compare: CompareOpt = False, min_top1: MinTop1Opt = None,
            max_kl: MaxKlOpt = None, no_hidden_states: NoHiddenOpt = False, device: DeviceOpt = "auto",
            weights_dtype: ModelDtypeOpt = "fp32", chat: ChatOpt = False,
            no_generation_prompt: NoGenerationPromptOpt = False,
            allow_other_weights: OtherWeightsOpt = False, blend: BlendOpt = None,
            blend_delimiter: BlendDelimiterOpt = None, recompute_ratio: RecomputeRatioOpt = None,
            check_layer: CheckLayerOpt = None, namespace: NamespaceOpt = None, engine: EngineOpt = "kvtool",
            json: JsonOpt = False) -> None:
    """Load a KV file into a fresh paged KV buffer, continue from it, and (--compare) check it."""
    if blend or blend_delimiter is not None:
        given = [name for name, value in (("FILE", path), ("--suffix", suffix), ("--suffix-file", suffix_file),
                                          ("--chat", chat or None), ("--no-hidden-states", no_hidden_states or None),
                                          ("--no-generation-prompt", no_generation_prompt or None),
                                          ("--engine hf", engine if engine == "hf" else None))
                 if value is not None]
        if given:
            raise UsageError(f"{given[0]} does not apply to --blend / --blend-delimiter")
        from ..ops.requests import BlendRequest  # (checked before torch loads: a usage error answers at once)

        request = BlendRequest(files=tuple(blend or ()), model=model, prompt=prompt, prompt_file=prompt_file,
                               delimiter=blend_delimiter, store=store, chunk_size=chunk_size,
                               recompute_ratio=recompute_ratio, check_layer=check_layer,
                               continue_tokens=continue_tokens, compare=compare, min_top1=min_top1, max_kl=max_kl,
                               device=device, model_dtype=weights_dtype, allow_other_weights=allow_other_weights,
                               namespace=namespace)
        from ..ops.blend import run_blend

        with stages(enabled=not json) as stage:
            result = run_blend(request, on_stage=stage)
        emit(result, json)
        return
    if recompute_ratio is not None or check_layer is not None:
        raise UsageError("--recompute-ratio and --check-layer apply to --blend / --blend-delimiter")
    from ..ops.requests import ReplayRequest  # (checked before torch loads: a usage error answers at once)

    request = ReplayRequest(path=path, model=model, continue_tokens=continue_tokens, suffix=suffix,
                            suffix_file=suffix_file, prompt=prompt, prompt_file=prompt_file, compare=compare,
                            min_top1=min_top1, max_kl=max_kl, device=device, model_dtype=weights_dtype,
                            use_hidden_states=not no_hidden_states, chat=chat,
                            generation_prompt=not no_generation_prompt, allow_other_weights=allow_other_weights,
                            store=store, chunk_size=chunk_size, namespace=namespace, engine=engine)
    from ..ops.replay import run_replay

    with stages(enabled=not json) as stage:
        result = run_replay(request, on_stage=stage)
    emit(result, json)


@renders("ReplayResult")
def render(console: Console, r: ReplayResult) -> None:
    engine = ", transformers" if r.engine == "hf" else ""
    if r.reused_tokens:
        reuse = (f"{r.reused_tokens} of {r.num_tokens} tokens from the cache ({plural(r.chunks_loaded, 'chunk')}, "
                 f"{', '.join(r.codecs)}), {r.computed_tokens} computed")
    else:  # a cache that shares nothing with the prompt: said, not shown as an empty load
        reuse = f"nothing from the cache (it shares no tokens with the prompt): all {r.num_tokens} tokens computed"
    console.print(f"[bold]{r.file}[/bold] on {r.model} ({r.device}{engine}): {reuse}"
                  + ("; the first new token from the stored hidden states" if r.first_token_from == "hidden_states"
                     else ""))
    if r.weights.startswith("other"):
        console.print(f"[yellow]{r.weights}[/yellow]")
    if r.reused_tokens:
        line = f"time to first token {r.ttft_cached_s * 1e3:.0f}ms with the cache (load {r.load_s * 1e3:.0f}ms)"
    else:
        line = f"time to first token {r.ttft_cached_s * 1e3:.0f}ms, nothing loaded"
    if r.ttft_recompute_s is not None:
        line += f" vs {r.ttft_recompute_s * 1e3:.0f}ms recomputed: {r.speedup:.1f}x"
    console.print(line)
    if r.top1_agreement is not None:
        console.print(f"over {plural(r.continue_tokens, 'teacher-forced token')}{too_few(r.continue_tokens)}: top-1 "
                      f"agreement {100 * r.top1_agreement:.1f}%, greedy identical for "
                      f"{r.greedy_identical_tokens}/{plural(r.continue_tokens, 'token')}, "
                      f"KL mean {r.kl_mean:.3g} max {r.kl_max:.3g}, ΔNLL {r.delta_nll:+.4f}")
    if r.cached_continuation is None:
        console.print(Text(f"continuation: {plain(r.continuation)!r}"), soft_wrap=True)
        return _failures(console, r.failures)
    agreed, same, total = plain(r.agreed_continuation), r.greedy_identical_tokens, r.continue_tokens
    if same == total:
        console.print(Text(f"continuation (recompute and cache alike, {total} tokens): {agreed!r}"), soft_wrap=True)
        return _failures(console, r.failures)
    console.print(Text(f"alike for {same} of {total} tokens: {agreed!r}"), soft_wrap=True)
    for label, continued in (("then the recompute:", r.continuation), ("then the cache:   ", r.cached_continuation)):
        full = plain(continued)
        console.print(Text(f"{label} {full[len(agreed):] if full.startswith(agreed) else full!r}"), soft_wrap=True)
    _failures(console, r.failures)


#: fewer teacher-forced tokens than this say little of a cache's quality (a promise is judged on 64)
JUDGED_ON_AT_LEAST = 8


def too_few(tokens: int) -> str:
    """' (too few to judge)' where the measure ran over so few tokens that its figures say little
    (a model that ended its answer at once)."""
    return f" (too few to judge: {JUDGED_ON_AT_LEAST} at least)" if tokens < JUDGED_ON_AT_LEAST else ""


def plain(escaped_text: str) -> str:
    """The literal text of a string the renderer got markup-escaped, to print as plain `Text`."""
    return Text.from_markup(escaped_text).plain


def _failures(console: Console, failures: list[str]) -> None:
    for f in failures:
        console.print(f"[red]FAIL[/red] {f}")


@renders("BlendReplayResult")
def render_blend(console: Console, r: BlendReplayResult) -> None:
    sources: dict[str, int] = {}
    for seg in r.segments:
        sources[seg.source] = sources.get(seg.source, 0) + seg.cached_tokens
    found = ", ".join(f"{cached} from {plain(src)}" for src, cached in sources.items() if cached)
    console.print(Text(f"blend of {len(r.segments)} segment{'s' if len(r.segments) != 1 else ''} and the "
                       f"question on {plain(r.model)} ({r.device}): {r.num_tokens} tokens, "
                       f"{r.cached_tokens} cached ({found or 'none'})"))
    console.print(f"recompute ratio {r.recompute_ratio:g} at check layer {r.check_layer}: "
                  f"{r.recomputed_cached} cached tokens recomputed + {r.computed_tokens - r.recomputed_cached} "
                  f"uncached computed" + (f"; the first {r.prefix_tokens} tokens an exact prefix"
                                          if r.prefix_tokens else ""))
    line = f"time to first token {r.ttft_blend_s * 1e3:.0f}ms (load {r.load_s * 1e3:.0f}ms)"
    if r.ttft_full_s is not None:
        line += (f" vs full prefill {r.ttft_full_s * 1e3:.0f}ms: {r.speedup:.1f}x; naive reuse "
                 f"{r.ttft_naive_s * 1e3:.0f}ms")
    console.print(line)
    if r.blend is not None:
        console.print(f"over {plural(r.continue_tokens, 'teacher-forced token')}{too_few(r.continue_tokens)} of the "
                      "full prefill's answer:")
        for label, m in (("blend", r.blend), ("naive", r.naive)):  # compare_logits' measures, by name
            console.print(f"  {label}: top-1 agreement {100 * m['top1_agreement']:.1f}%, greedy identical for "
                          f"{m['greedy_identical_tokens']}/{r.continue_tokens}, KL mean {m['kl_mean']:.3g} "
                          f"max {m['kl_max']:.3g}, ΔNLL {m['delta_nll']:+.4f}")
    if r.blend_continuation is None:
        console.print(Text(f"continuation: {plain(r.continuation)!r}"), soft_wrap=True)
    else:
        console.print(Text(f"full prefill's continuation: {plain(r.continuation)!r}"), soft_wrap=True)
        console.print(Text(f"the blend's own:             {plain(r.blend_continuation)!r}"), soft_wrap=True)
    _failures(console, r.failures)
