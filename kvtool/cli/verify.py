"""`kvtool verify FILE [--against OTHER] [--replay]`: prove a file is intact (exit 0/1/2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console

from .options import DeviceOpt, InputPath, JsonOpt, ModelDtypeOpt, ModelOpt, OtherWeightsOpt
from .output import emit, plural, renders, stages
from .replay import render as render_replay

if TYPE_CHECKING:  # only named here: importing the replay's would load torch at start-up
    from ..ops.replay import ReplayResult
    from ..ops.verify import VerifyReport

AgainstOpt = Annotated[Optional[Path], typer.Option(
    "--against", metavar="FILE", help="Compare decoded KV with this file (e.g. the raw original of a lossy file).")]
AtolOpt = Annotated[float, typer.Option("--atol", metavar="X", help="Allowed absolute error per value.")]
RtolOpt = Annotated[float, typer.Option(
    "--rtol", metavar="X", help="Allowed error relative to the layer's largest reference magnitude.")]
ReplayOpt = Annotated[bool, typer.Option(
    "--replay", help="Also replay the file into the model and compare with a full recompute.")]
ReplayTop1Opt = Annotated[Optional[float], typer.Option("--min-top1", metavar="X", help=(
    "With --replay: minimum top-1 agreement (default: what the file's codec promises: 1.0 lossless, "
    "0.70-0.88 cachegen by its bins)."))]
ReplayKlOpt = Annotated[Optional[float], typer.Option("--max-kl", metavar="X", help="With --replay: maximum mean KL.")]
ReplayContinueOpt = Annotated[int, typer.Option("--continue", metavar="N", help=(
    "With --replay: teacher-forced tokens the agreement is measured over (a promise is judged on 64)."))]


def command(path: InputPath, against: AgainstOpt = None, atol: AtolOpt = 0.0, rtol: RtolOpt = 0.0,
            replay: ReplayOpt = False, model: ModelOpt = None, min_top1: ReplayTop1Opt = None,
            max_kl: ReplayKlOpt = None, continue_tokens: ReplayContinueOpt = 64, device: DeviceOpt = "auto",
            weights_dtype: ModelDtypeOpt = "fp32", allow_other_weights: OtherWeightsOpt = False,
            json: JsonOpt = False) -> None:
    """Check structure, checksums, decoding, finiteness and prefix hashes (exit 1 if any fails)."""
    from ..ops.verify import verify

    with stages(enabled=not json) as stage:  # one live display: the chunks checked, then the replay's stages
        report = verify(path, against=against, atol=atol, rtol=rtol, replay=replay, model=model,
                        min_top1=min_top1, max_kl=max_kl, continue_tokens=continue_tokens, device=device,
                        model_dtype=weights_dtype, allow_other_weights=allow_other_weights, on_stage=stage,
                        on_chunk=lambda done, total: stage(f"checking chunk {done} of {total}"))
    emit(report, json)


@renders("VerifyReport")
def render(console: Console, r: VerifyReport) -> None:
    good = sum(all(v in ("ok", "unchecked") for k, v in c.items() if k != "index") for c in r.chunks)
    console.print(f"[bold]{r.path}[/bold]: {r.num_tokens} tokens, {good}/{r.num_chunks} chunks "
                  f"intact; " + ", ".join(f"{k} {v}" for k, v in r.checks.items()))
    if r.comparison:
        cmp = r.comparison
        console.print(f"against {cmp['against']}: max abs error {cmp['max_abs']:.4g}, "
                      f"max relative {cmp['max_rel']:.4g} (atol {cmp['atol']}, rtol {cmp['rtol']})")
        worst = sorted(cmp["layers"], key=lambda x: -x["max_rel"])[:5]
        for w in worst:
            console.print(f"  layer {w['layer']:>3} {w['kind']}: max abs {w['max_abs']:.4g}, "
                          f"max rel {w['max_rel']:.4g}, rmse {w['rmse']:.4g}"
                          + ("" if w["ok"] else "  [red]over tolerance[/red]"))
    if r.replay:
        render_replay(console, replay_result(r.replay))
        limit = r.replay_threshold
        console.print(f"replay threshold: top-1 >= {limit['min_top1']:.2f} ({limit['why']})")
    for p in r.problems:
        console.print(f"[red]FAIL[/red] {p}")
    if r.problems_omitted:
        console.print(f"[red]FAIL[/red] ... and {plural(r.problems_omitted, 'more problem')} (not listed)")
    console.print("[green]OK[/green]" if r.ok else f"[red]{plural(r.problem_count, 'problem')}[/red]")


def replay_result(replay: dict[str, Any]) -> ReplayResult:
    """The replay's result, which the report keeps as plain data, typed again for its renderer;
    without failures of its own: the report's problems name them."""
    from ..ops.replay import ReplayResult  # verify ran the replay: torch is loaded already

    fields = {f.name for f in dataclasses.fields(ReplayResult)} - {"failures"}
    return ReplayResult(**{k: v for k, v in replay.items() if k in fields})
