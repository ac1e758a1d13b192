"""One result object per command, rendered for people (rich) or machines (`--json`).

Each command module registers the renderer of its result type; the funnel in `app.py`
uses the same registry to show the report an error carries (a failed `verify`). A renderer
takes the typed result itself (its fields by attribute), its strings made literal for rich.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..notices import is_quiet, terminal_safe

stdout_console = Console(highlight=False)
stderr_console = Console(stderr=True, highlight=False)
# Into a pipe or a file, lines are never cut to a width (COLUMNS describes a terminal): a path, a
# digest or an object's name stays whole on one line, to be copied or read by another program.
_WHOLE_LINES = 1 << 16


def result_console() -> Console:
    """The console a result is rendered on: the terminal's width on a terminal; whole lines elsewhere."""
    if stdout_console.is_terminal:
        return stdout_console
    return Console(highlight=False, width=_WHOLE_LINES, soft_wrap=True)

Renderer = Callable[[Console, Any], None]  # (console, a result of the type it renders, escaped)
_RENDERERS: dict[str, Renderer] = {}


def renders(result_type: str) -> Callable[[Renderer], Renderer]:
    """Register the human renderer of a result class (by its name: no import of the class)."""
    def register(render: Renderer) -> Renderer:
        _RENDERERS[result_type] = render
        return render
    return register


def emit(result, json_mode: bool) -> None:
    """Print a result: one JSON object (with `ok`) or its registered human rendering."""
    if json_mode:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2, default=str, allow_nan=False) + "\n")
        sys.stdout.flush()
    else:  # strings come from files and arguments: never let them act as rich markup
        _RENDERERS[type(result).__name__](result_console(), escaped(result))


def escaped(value: Any) -> Any:
    """Strings from files and arguments made literal for rich (no markup) and safe for a terminal
    (control characters written escaped, `notices.terminal_safe`): a result comes back as a copy
    of the same type, each field escaped (nested results, dicts and lists too). `--json` prints
    the result itself, its raw values."""
    if isinstance(value, str):
        return escape(terminal_safe(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        literal = copy.copy(value)  # the same type: its properties (`ok`, totals) still answer
        for f in dataclasses.fields(value):
            object.__setattr__(literal, f.name, escaped(getattr(value, f.name)))  # (frozen ones too)
        return literal
    if isinstance(value, dict):
        return {escaped(k) if isinstance(k, str) else k: escaped(v) for k, v in value.items()}  # (keys: extras' names)
    if isinstance(value, (list, tuple)):
        return [escaped(v) for v in value]
    return value


@contextmanager
def progress(label: str, unit: str, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on a terminal's stderr, or nothing (not a terminal, `--json`): yields
    `update(done, total)`."""
    if not enabled or not stderr_console.is_terminal:
        yield lambda done, total: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(label), BarColumn(), TextColumn("{task.fields[count]}"),
                  TimeElapsedColumn(), console=stderr_console, transient=True) as bar:
        # until the total is known (a model loading, a prompt being read) it says so, not "0/None"
        task = bar.add_task(label, total=None, count="starting")

        def update(done: int, total: int) -> None:  # total 0: not known yet
            bar.update(task, completed=done, total=total or None,
                       count=f"{done}/{total} {unit}" if total else "starting")
        yield update


def plural(n: int, word: str) -> str:
    """'1 chunk', '2 chunks'."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def human_rate(mb_per_s: float) -> str:
    """Three significant digits: a slow level-19 zstd is '2.31MB/s', not '0MB/s'. A value and its
    unit are one word, so a line wrapped at the terminal's width never parts them."""
    return f"{mb_per_s:.3g}MB/s" if mb_per_s < 1000 else f"{mb_per_s:.0f}MB/s"


@contextmanager
def stages(enabled: bool) -> Iterator[Callable[[str], None]]:
    """A spinner on a terminal's stderr saying what a long operation is doing, or nothing
    (not a terminal, `--json`): yields `stage(text)`."""
    if not enabled or not stderr_console.is_terminal:
        yield lambda text: None
        return
    with stderr_console.status("starting") as status:
        yield lambda text: status.update(text)


@contextmanager
def stage_progress(command: str, names: tuple[str, ...], enabled: bool = True) -> Iterator[Callable[[str, int, int], None]]:
    """What a long command of several stages is doing, on stderr: a bar per stage on a terminal;
    otherwise (a pipe, a file, a CI log) one whole line as each stage starts, with the time so
    far. Nothing when not `enabled` or under `--quiet`. Yields `update(stage, done, total)`
    (`stage` one of `names`; total 0: a stage of one step)."""
    if not enabled or is_quiet():
        yield lambda stage, done, total: None
        return
    started = time.monotonic()
    if not stderr_console.is_terminal:
        said: set[str] = set()

        def line(stage: str, done: int, total: int) -> None:
            if stage in said:
                return
            said.add(stage)
            minutes, seconds = divmod(int(time.monotonic() - started), 60)
            steps = f" ({total} steps)" if total else ""
            sys.stderr.write(f"kvtool {command}: [{minutes}:{seconds:02d}] {names.index(stage) + 1}/{len(names)} "
                             f"{terminal_safe(stage)}{steps}\n")
            sys.stderr.flush()
        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=stderr_console, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                for earlier in tasks.values():  # a stage starts when the one before it is over
                    bar.update(earlier, completed=bar.tasks[earlier].total or 1, total=bar.tasks[earlier].total or 1)
                    bar.stop_task(earlier)
                tasks[stage] = bar.add_task(f"{names.index(stage) + 1}/{len(names)} {escape(stage)}", total=total or 1)
            bar.update(tasks[stage], completed=done, total=total or 1)
        yield update


def human_bytes(n: float) -> str:
    """'512B', '22.5MiB': one word (see `human_rate`)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


#: Why a put in another codec stores nothing new, and what to do (a chunk is one object, whatever
#: its codec: its name says whose tokens' KV it is, not how it is encoded). Said by `store put`
#: and `capture --store`.
KEPT_AS_STORED = ("chunks already there are kept as stored, whatever their codec (one object per chunk): "
                  "`kvtool store get --codec` writes them in another; `kvtool store rm` them to store anew")
