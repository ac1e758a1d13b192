"""The one way kvtool tells a user something that is not an error: `notice(...)`.

A notice is one line on stderr, said once per key in a process (a fallback
repeated for every chunk is still one line), and silenced by `set_quiet(True)`
(the CLI's `--quiet`). Library code never prints, writes to stderr or warns
by any other way.
"""

from __future__ import annotations

import sys

_said: set[str] = set()
_quiet = False


def notice(message: str, key: str | None = None) -> None:
    """Say `message` on stderr once per `key` (default: the message itself)."""
    key = message if key is None else key
    if _quiet or key in _said:
        return
    _said.add(key)
    sys.stderr.write(f"kvtool: notice: {message}\n")
    sys.stderr.flush()


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def forget() -> None:
    """Say every notice again (tests)."""
    _said.clear()
