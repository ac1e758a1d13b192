"""`kvtool verify FILE [--against OTHER] [--replay]`: prove a file is intact (exit 0/1/2)."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

from rich.console import Console

from ..ops.file_requests import VerifyRequest
from .commands import request_command
from .output import emit, plural, renders, stages
from .replay import render as render_replay

if TYPE_CHECKING:  # only named here: importing the replay's would load torch at start-up
    from ..ops.replay import ReplayResult
    from ..ops.verify import VerifyReport


def run(request: VerifyRequest, json: bool) -> None:
    from ..ops.verify import verify

    with stages(enabled=not json) as stage:  # one live display: the chunks checked, then the replay's stages
        report = verify(request, on_stage=stage, on_chunk=lambda done, total: stage(f"checking chunk {done} of {total}"))
    emit(report, json)


command = request_command(VerifyRequest, run, (
    "Check structure, checksums, decoding, finiteness and prefix hashes (exit 1 if any fails)."))


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
    for p in grouped_problems(r.problems):
        console.print(f"[red]FAIL[/red] {p}")
    if r.problems_omitted:
        console.print(f"[red]FAIL[/red] ... and {plural(r.problems_omitted, 'more problem')} (not listed)")
    console.print("[green]OK[/green]" if r.ok else f"[red]{plural(r.problem_count, 'problem')}[/red]")


def grouped_problems(problems: list[str]) -> list[str]:
    """Problems that say the same of several chunks (a pca file without its calibration: every
    chunk) as one line naming them all, 'chunks 0-3: ...', in the order first met; `--json` keeps
    the list as it is."""
    by_text: dict[str, list[int]] = {}
    lines: list[str | tuple[str]] = []
    for problem in problems:
        m = re.fullmatch(r"chunk (\d+): (.*)", problem, re.S)
        if m is None:
            lines.append(problem)
            continue
        if m.group(2) not in by_text:
            by_text[m.group(2)] = []
            lines.append((m.group(2),))
        by_text[m.group(2)].append(int(m.group(1)))
    return [line if isinstance(line, str) else f"{_chunks(by_text[line[0]])}: {line[0]}" for line in lines]


def _chunks(indices: list[int]) -> str:
    """'chunk 3', 'chunks 0-3', 'chunks 0-2, 5'."""
    if len(indices) == 1:
        return f"chunk {indices[0]}"
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "chunks " + ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def replay_result(replay: dict[str, Any]) -> ReplayResult:
    """The replay's result, which the report keeps as plain data, typed again for its renderer;
    without failures of its own: the report's problems name them."""
    from ..ops.replay import ReplayResult  # verify ran the replay: torch is loaded already

    fields = {f.name for f in dataclasses.fields(ReplayResult)} - {"failures"}
    return ReplayResult(**{k: v for k, v in replay.items() if k in fields})
