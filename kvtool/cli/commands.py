"""A command built from its request: each field of an operation's request that carries a `Flag`
(`kvtool.ops.fields`) becomes one typer option or argument, with the field's name, default and
help, so an option is declared once, on its request, and nowhere here.

    command = request_command(InspectRequest, run_inspect, "Show the header, ...")

`run(request, json)` gets the checked request (made before the operation is imported: a usage
error answers before torch loads) and the `--json` switch.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from ..errors import UsageError
from ..ops.fields import Flag, make, options_of
from .options import WORDS, JsonOpt


def parameter(name: str, flag: Flag, default: Any) -> inspect.Parameter:
    """The typer parameter of one request field."""
    kind = bool if flag.negate else flag.kind
    if flag.negate:
        default = False
    if kind is list:  # a repeatable option or several arguments: none given, None
        kind, default = list[str], (None if default == () else default)
    annotation = Optional[kind] if default is None else kind
    if flag.argument:
        info = typer.Argument(metavar=flag.metavar or flag.flags[0], help=flag.help, show_default=False,
                              click_type=WORDS if flag.kind in (str, list) else None)
    else:
        info = typer.Option(*flag.flags, metavar=flag.metavar, help=flag.help, hidden=flag.hidden,
                            show_default=flag.show_default)
    empty = default is dataclasses.MISSING
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                             default=inspect.Parameter.empty if empty else default,
                             annotation=Annotated[annotation, info])


def off_parameter(name: str, flag: Flag) -> inspect.Parameter:
    """The hidden `--no-...` switch of a tri-state bool (`Flag.off`)."""
    return inspect.Parameter(f"no_{name}", inspect.Parameter.KEYWORD_ONLY, default=False,
                             annotation=Annotated[bool, typer.Option(flag.off, hidden=True)])


def signature_of(*request_classes: type) -> tuple[inspect.Signature, dict[str, tuple[Flag, Any]]]:
    """The command's parameters: every option of the requests (one per name, the first class's
    where they share one), the arguments first, then `--json`; and each field's flag and default."""
    flags: dict[str, tuple[Flag, Any]] = {}
    params: list[inspect.Parameter] = []
    for request_class in request_classes:
        for field, flag in options_of(request_class):
            if field.name in flags:
                continue
            flags[field.name] = (flag, field.default)
            params.append(parameter(field.name, flag, field.default))
            if flag.off:
                params.append(off_parameter(field.name, flag))
    params.sort(key=lambda p: not _is_argument(p))  # (stable: arguments in their order, then options)
    params.append(inspect.Parameter("json", inspect.Parameter.KEYWORD_ONLY, default=False,
                                    annotation=JsonOpt))
    return inspect.Signature(params), flags


def _is_argument(p: inspect.Parameter) -> bool:
    return any(isinstance(m, typer.models.ArgumentInfo) for m in getattr(p.annotation, "__metadata__", ()))


def field_values(flags: dict[str, tuple[Flag, Any]], given: dict[str, Any]) -> dict[str, Any]:
    """The command line's values as the request's fields: `--no-x` switches turned round, a
    tri-state's hidden `--no-...` folded into it."""
    values = {}
    for name, (flag, _default) in flags.items():
        value = given[name]
        if flag.negate:
            value = not value
        if flag.off:
            off = given[f"no_{name}"]
            if value and off:
                raise UsageError(f"{flag.name} and {flag.off}: give one")
            value = False if off else value
        values[name] = value
    return values


def foreign_options(request_class: type, values: dict[str, Any],
                    flags: dict[str, tuple[Flag, Any]]) -> list[str]:
    """The options given (not at their default) that `request_class` does not take, as a message
    names them: a setting with a default of its own with its value (`--engine hf`)."""
    own = {field.name for field, _ in options_of(request_class)}
    named = []
    for name, value in values.items():
        flag, default = flags[name]
        if name in own or value == default or (default is None and value in ((), [])):
            continue
        named.append(f"{flag.name} {value}" if isinstance(value, str) and default is not None else flag.name)
    return named


def request_command(request_class: type, run: Callable[[Any, bool], None], doc: str,
                    also: tuple[type, ...] = (),
                    choose: Callable[[dict[str, Any], Callable[[type], list[str]]], type] | None = None
                    ) -> Callable[..., None]:
    """A typer command whose options are `request_class`'s fields (and `also`'s, for a command
    that makes one of several requests: `choose(values, foreign)` says which, `foreign(cls)`
    naming the options given that `cls` does not take); it makes the request and calls
    `run(request, json)`."""
    signature, flags = signature_of(request_class, *also)

    def command(**given: Any) -> None:
        json = given.pop("json")
        values = field_values(flags, given)
        chosen = request_class if choose is None else choose(
            values, lambda cls: foreign_options(cls, values, flags))
        mine = {field.name for field, _ in options_of(chosen)}
        run(make(chosen, {k: v for k, v in values.items() if k in mine}), json)

    command.__signature__ = signature  # typer reads the parameters from here
    command.__doc__ = doc
    command.__name__ = f"{request_class.__name__.removesuffix('Request').lower()}_command"
    return command
