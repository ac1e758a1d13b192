"""`kvtool replay FILE`: load a KV file into the engine's paged buffer and continue from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from ..errors import UsageError
from ..ops.requests import BlendRequest, ReplayRequest  # (torch-free: a usage error answers before torch loads)
from .commands import request_command
from .output import emit, plural, renders, stages

if TYPE_CHECKING:  # the results are only named here: importing them would load torch at start-up
    from ..ops.blend import BlendReplayResult
    from ..ops.replay import ReplayResult


def which_request(values: dict, foreign) -> type:
    """A blend (`--blend`, `--blend-delimiter`) or a replay, refusing the other's options."""
    if values["files"] or values["delimiter"] is not None:
        given = foreign(BlendRequest)
        if given:
            raise UsageError(f"{given[0]} does not apply to --blend / --blend-delimiter")
        return BlendRequest
    if values["recompute_ratio"] is not None or values["check_layer"] is not None:
        raise UsageError("--recompute-ratio and --check-layer apply to --blend / --blend-delimiter")
    return ReplayRequest


def run(request: ReplayRequest | BlendRequest, json: bool) -> None:
    if isinstance(request, BlendRequest):
        from ..ops.blend import run_blend as operation
    else:
        from ..ops.replay import run_replay as operation
    with stages(enabled=not json) as stage:
        result = operation(request, on_stage=stage)
    emit(result, json)


command = request_command(
    ReplayRequest, run, "Load a KV file into a fresh paged KV buffer, continue from it, and (--compare) check it.",
    also=(BlendRequest,), choose=which_request)


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
