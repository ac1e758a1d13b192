"""One output object per command: JSON for machines, rich for people."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape

stdout_console = Console(highlight=False)
stderr_console = Console(stderr=True, highlight=False)


def emit(result: dict[str, Any], json_mode: bool, render: Callable[[Console, dict[str, Any]], None]) -> None:
    if json_mode:
        sys.stdout.write(json.dumps(_json_safe(result), indent=2, default=str, allow_nan=False) + "\n")
        sys.stdout.flush()
    else:  # strings come from files and arguments: never let them act as rich markup
        render(stdout_console, _escaped(result))


def _json_safe(value: Any) -> Any:
    """Standard JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escaped(v) for v in value]
    return value


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
