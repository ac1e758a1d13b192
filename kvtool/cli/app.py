"""The `kvtool` Typer app and the one place where errors become messages and exit codes.

Command modules import only typer, rich and their options at start-up; each imports
its operation when it runs, so `kvtool --help` and `kvtool inspect` never load torch.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from typing import Annotated

import typer

from ..errors import Interrupted, KvtoolError, OutOfMemory, OutputError, UsageError
from ..notices import terminal_safe
from ..version import __version__
from . import calibrate, capture, compress, dump, info, inspect, replay, store, verify
from .output import emit

app = typer.Typer(
    name="kvtool",
    help="Capture, compress, inspect, verify and replay LLM KV caches.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
for _name, _module in (("capture", capture), ("compress", compress), ("inspect", inspect), ("verify", verify),
                       ("replay", replay), ("dump", dump), ("info", info), ("calibrate", calibrate)):
    app.command(_name)(_module.command)
app.add_typer(store.app, name="store")


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"kvtool {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def main_options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print kvtool's version and exit.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No notices on stderr (errors still show).")] = False,
) -> None:
    """Capture, compress, inspect, verify and replay LLM KV caches."""
    from ..notices import set_quiet

    set_quiet(quiet)


def _fail(err: KvtoolError, json_mode: bool) -> int:
    """The report an error carries (a failed verify or replay) first, then one line on stderr."""
    report = getattr(err, "report", None)
    if report is not None:
        emit(report, json_mode)
    message = str(err)
    sys.stderr.write(f"kvtool: error: {terminal_safe(message)}\n")  # (--json keeps it raw)
    if json_mode and report is None:
        sys.stdout.write(json.dumps({"ok": False, "error": {"type": type(err).__name__, "message": message,
                                                            "exit_code": err.exit_code}}) + "\n")
    return err.exit_code


def _unwind_on_termination() -> None:
    """SIGTERM and SIGHUP (timeout, a closed terminal, a container stop) unwind the stack like
    Ctrl-C, so a writer still removes its temp file and the old output stays as it was."""
    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                signal.signal(sig, interrupt)


def _out_of_memory_types() -> tuple[type[BaseException], ...]:
    """Python's MemoryError (numpy's too) and, once torch is loaded, its OutOfMemoryError (a
    device allocation). Sizes that come from files are checked before they are allocated."""
    torch = sys.modules.get("torch")
    found = {getattr(torch, "OutOfMemoryError", None), getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)}
    return (MemoryError, *sorted((t for t in found if isinstance(t, type)), key=str))


def run(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code; never lets a known error escape as a traceback."""
    if argv is None:  # the real command line (not a test calling run([...]))
        _unwind_on_termination()
    argv = list(sys.argv[1:] if argv is None else argv)
    json_mode = "--json" in argv
    try:
        result = app(args=argv, prog_name="kvtool", standalone_mode=False)
    except KvtoolError as err:
        return _fail(err, json_mode)
    except typer.Exit as err:
        if err.exit_code == 130:  # the parser's way of reporting Ctrl-C (and SIGTERM, above)
            return _fail(Interrupted("interrupted"), json_mode)
        return err.exit_code
    except (typer.Abort, KeyboardInterrupt):
        return _fail(Interrupted("interrupted"), json_mode)
    except typer.TyperException as err:  # bad options: the parser's message, exit 2
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        if not message:  # no arguments at all: help was already printed
            return 2
        return _fail(UsageError(message), json_mode)
    except OSError as err:  # a disk that fills or fails mid-write: name the file when known
        where = f"{err.filename}: " if getattr(err, "filename", None) else ""
        return _fail(OutputError(f"{where}{err.strerror or err}"), json_mode)
    except _out_of_memory_types() as err:
        detail = str(err).splitlines()[0][:120] if str(err) else ""
        return _fail(OutOfMemory(f"out of memory ({detail})" if detail else "out of memory"), json_mode)
    if result == 130:  # the parser turned Ctrl-C (or SIGTERM, above) into this code; no command returns it
        return _fail(Interrupted("interrupted"), json_mode)
    return result if isinstance(result, int) else 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
