"""The user's documentation as tests read it: README.md and the pages under docs/ it links to.

A section is found by its heading's words at any level, so an example keeps its test when it
moves between README and a docs page."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def section(heading: str) -> str:
    """The text from the heading (`## Title` or `Title`, any level) to the end of its page."""
    title = heading.lstrip("#").strip()
    pattern = re.compile(rf"(?m)^#+ {re.escape(title)}\s*$")
    for page in pages():
        text = page.read_text()
        m = pattern.search(text)
        if m:
            return text[m.start():]
    raise AssertionError(f"no section {title!r} in README.md or docs/")


def first_block(heading: str, language: str) -> str:
    """The first fenced block of `language` in the section."""
    m = re.search(rf"```{language}\n(.*?)```", section(heading), re.S)
    assert m, f"no {language} block in the section {heading!r}"
    return m.group(1)
