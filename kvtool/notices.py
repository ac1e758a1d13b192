"""The one way kvtool tells a user something that is not an error: `notice(...)`.

A notice is one line on stderr, said once per key in a process (a fallback
repeated for every chunk is still one line), and silenced by `set_quiet(True)`
(the CLI's `--quiet`). Library code never prints, writes to stderr or warns
by any other way.
"""

from __future__ import annotations

import re
import sys

_said: set[str] = set()
_quiet = False

#: What a terminal acts on rather than shows: the C0 controls but newline and tab (ESC, which
#: starts CSI and OSC sequences; BEL, CR, backspace), DEL, the C1 controls (0x80-0x9f, CSI and
#: OSC among them), and the bidirectional overrides and line separators that reorder or break
#: what is shown.
_TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """`text` as a terminal may show it: every control character written escaped (ESC as
    `\\x1b`, U+202E as `\\u202e`), so a string from a file or a store (a model name, a
    reason) never moves the cursor, clears the screen or retitles the window. For people's
    output only: `--json` keeps the raw value."""
    return _TERMINAL_CONTROLS.sub(_escape_control, text)


def _escape_control(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def notice(message: str, key: str | None = None) -> None:
    """Say `message` on stderr once per `key` (default: the message itself)."""
    key = message if key is None else key
    if _quiet or key in _said:
        return
    _said.add(key)
    sys.stderr.write(f"kvtool: notice: {terminal_safe(message)}\n")
    sys.stderr.flush()


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def is_quiet() -> bool:
    """Whether `--quiet` was given (a command's progress lines keep quiet too)."""
    return _quiet


def forget() -> None:
    """Say every notice again (tests)."""
    _said.clear()
