"""What the commands share that is no request's option: the words of a positional argument, and
`--json`. An operation's options are declared once, on its request (`kvtool.ops.fields`), and
`commands.py` makes them typer's."""

from __future__ import annotations

from typing import Annotated

import typer

try:  # typer 0.28 carries its own click; a type of the installed click's would be wrapped as a function
    from typer._click.types import ParamType
except ImportError:  # pragma: no cover - a typer that uses the installed click
    from click import ParamType


class _Words(ParamType):
    """An argument's words as given, shown in help by its metavar alone (typer adds `<str>` beside
    the metavar of a plain string argument)."""

    name = "text"

    def get_metavar(self, param, ctx) -> str:
        return ""

    def convert(self, value, param, ctx):
        return value


#: click_type of every positional argument
WORDS = _Words()

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.")]
