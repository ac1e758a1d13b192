"""`kvtool replay FILE`: load a KV file into the engine's paged buffer and continue from it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.text import Text

from .options import DeviceOpt, InputPath, JsonOpt, ModelDtypeOpt, ModelOpt, model_dtype
from .output import emit

ContinueOpt = Annotated[int, typer.Option("--continue", help="Tokens to generate (or teacher-force with --compare).")]
SuffixOpt = Annotated[Optional[str], typer.Option("--suffix", help="Text to append after the cached tokens.")]
SuffixFileOpt = Annotated[Optional[Path], typer.Option("--suffix-file", help="File with text to append.")]
PromptOpt = Annotated[Optional[str], typer.Option(
    "--prompt", help="A new prompt: reuse the file's chunks whose prefix hashes match, compute the rest.")]
PromptFileOpt = Annotated[Optional[Path], typer.Option("--prompt-file", help="A new prompt, from a file.")]
CompareOpt = Annotated[bool, typer.Option("--compare", help="Also run the full recompute and compare.")]
NoHiddenOpt = Annotated[bool, typer.Option(
    "--no-hidden-states", help="Ignore stored hidden states: compute the last cached token (measures the KV alone).")]
MinTop1Opt = Annotated[Optional[float], typer.Option(
    "--min-top1", help="Exit 1 if top-1 agreement with the recompute is below this (implies --compare).")]
MaxKlOpt = Annotated[Optional[float], typer.Option(
    "--max-kl", help="Exit 1 if the mean KL divergence exceeds this (implies --compare).")]


def command(path: InputPath, model: ModelOpt = None, continue_tokens: ContinueOpt = 32,
            suffix: SuffixOpt = None, suffix_file: SuffixFileOpt = None, prompt: PromptOpt = None,
            prompt_file: PromptFileOpt = None, compare: CompareOpt = False, min_top1: MinTop1Opt = None,
            max_kl: MaxKlOpt = None, no_hidden_states: NoHiddenOpt = False, device: DeviceOpt = "auto",
            weights_dtype: ModelDtypeOpt = "fp32", json: JsonOpt = False) -> int:
    """Load a KV file into a fresh paged KV buffer, continue from it, and (--compare) check it."""
    result = run_replay(path, model, continue_tokens=continue_tokens, suffix=suffix, suffix_file=suffix_file,
                        prompt=prompt, prompt_file=prompt_file, compare=compare, min_top1=min_top1,
                        max_kl=max_kl, device=device, weights_dtype=weights_dtype,
                        use_hidden_states=not no_hidden_states)
    emit(result, json, render)
    if result["failures"]:
        sys.stderr.write(f"kvtool: error: replay below threshold: {'; '.join(result['failures'])}\n")
    return 0 if result["ok"] else 1


def run_replay(path: Path, model_path: Path | None, *, continue_tokens: int = 32, suffix: str | None = None,
               suffix_file: Path | None = None, prompt: str | None = None, prompt_file: Path | None = None,
               compare: bool = False, min_top1: float | None = None,
               max_kl: float | None = None, device: str = "auto", weights_dtype: str = "fp32",
               use_hidden_states: bool = True) -> dict[str, Any]:
    from ..capture import check_text, read_text_file
    from ..devices import resolve_device
    from ..engine import load_model
    from ..errors import UsageError
    from ..format import ContainerReader
    from ..replay import check_model, plan_reuse, replay

    if sum(x is not None for x in (suffix, suffix_file, prompt, prompt_file)) > 1:
        raise UsageError("give at most one of --suffix, --suffix-file, --prompt, --prompt-file")
    if min_top1 is not None and not 0 <= min_top1 <= 1:
        raise UsageError(f"--min-top1 {min_top1}: expected a fraction in [0, 1]")
    if max_kl is not None and not 0 <= max_kl < float("inf"):
        raise UsageError(f"--max-kl {max_kl}: expected a finite number >= 0")
    compare = compare or min_top1 is not None or max_kl is not None
    where = resolve_device(device)
    dtype = model_dtype(weights_dtype)
    with ContainerReader(path) as reader:
        model = load_model(model_path, dtype=dtype, device=where)
        check_model(reader, model)
        if suffix_file is not None:
            suffix = read_text_file(suffix_file)
        if prompt_file is not None:
            prompt = read_text_file(prompt_file)
        plan = plan_reuse(reader,
                          new_tokens=model.tokenizer.encode(check_text(prompt, "--prompt")) if prompt is not None
                          else None,
                          suffix_tokens=model.tokenizer.encode(check_text(suffix, "--suffix")) if suffix is not None
                          else None,
                          use_hidden_states=use_hidden_states)
        result = replay(reader, model, plan, continue_tokens=continue_tokens, compare=compare)
    failures = []
    if min_top1 is not None and not result["top1_agreement"] >= min_top1:  # (NaN fails too)
        failures.append(f"top-1 agreement {result['top1_agreement']:.3f} < {min_top1}")
    if max_kl is not None and not result["kl_mean"] <= max_kl:
        failures.append(f"mean KL {result['kl_mean']:.3g} > {max_kl}")
    result["thresholds"] = {"min_top1": min_top1, "max_kl": max_kl}
    result["failures"] = failures
    result["ok"] = not failures
    return result


def render(console: Console, r: dict[str, Any]) -> None:
    console.print(f"[bold]{r['file']}[/bold] on {r['model']} ({r['device']}): {r['reused_tokens']} of {r['num_tokens']} tokens "
                  f"from the cache ({r['chunks_loaded']} chunks, {', '.join(r['codecs'])}), "
                  f"{r['computed_tokens']} computed"
                  + ("; the first new token from the stored hidden states" if r.get("first_token_from") == "hidden_states"
                     else ""))
    line = f"time to first token {r['ttft_cached_s'] * 1e3:.0f} ms with the cache (load {r['load_s'] * 1e3:.0f} ms)"
    if "ttft_recompute_s" in r:
        line += f" vs {r['ttft_recompute_s'] * 1e3:.0f} ms recomputed: {r['speedup']:.1f}x"
    console.print(line)
    if "top1_agreement" in r:
        console.print(f"over {r['continue']} teacher-forced tokens: top-1 agreement {100 * r['top1_agreement']:.1f}%, "
                      f"greedy identical for {r['greedy_identical_tokens']}/{r['continue']} tokens, "
                      f"KL mean {r['kl_mean']:.3g} max {r['kl_max']:.3g}, ΔNLL {r['delta_nll']:+.4f}")
    # r holds markup-escaped strings; recover the literal text, then print it as plain Text.
    continuation = Text.from_markup(r["continuation"]).plain
    console.print(Text(f"continuation: {continuation!r}"), soft_wrap=True)
    for f in r.get("failures", []):
        console.print(f"[red]FAIL[/red] {f}")
