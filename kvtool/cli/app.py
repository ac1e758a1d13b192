"""The `kvtool` Typer app and the one place where errors become exit codes."""

from __future__ import annotations

import json
import signal
import sys
import threading

import typer

from ..errors import KvtoolError
from . import compress, dump, inspect, verify

app = typer.Typer(
    name="kvtool",
    help="Capture, compress, inspect, verify and replay LLM KV caches.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command("inspect")(inspect.inspect_command)
app.command("dump")(dump.dump_command)
app.command("verify")(verify.verify_command)
app.command("compress")(compress.compress_command)

for _name in ("capture", "replay", "info"):  # commands that land with later modules
    try:
        _module = __import__(f"kvtool.cli.{_name}", fromlist=["command"])
    except ImportError:
        continue
    app.command(_name)(_module.command)


def _fail(message: str, code: int, kind: str, json_mode: bool) -> int:
    sys.stderr.write(f"kvtool: error: {message}\n")
    if json_mode:
        sys.stdout.write(json.dumps({"ok": False, "error": {"type": kind, "message": message,
                                                            "exit_code": code}}) + "\n")
    return code


def _unwind_on_termination() -> None:
    """SIGTERM and SIGHUP (timeout, a closed terminal, a container stop) unwind the stack like
    Ctrl-C, so a writer still removes its temp file and the old output stays as it was."""
    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                signal.signal(sig, interrupt)


def run(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code; never lets a known error escape as a traceback."""
    if argv is None:  # the real command line (not a test calling run([...]))
        _unwind_on_termination()
    argv = list(sys.argv[1:] if argv is None else argv)
    json_mode = "--json" in argv
    try:
        result = app(args=argv, prog_name="kvtool", standalone_mode=False)
    except KvtoolError as err:
        return _fail(str(err), err.exit_code, type(err).__name__, json_mode)
    except typer.Exit as err:
        if err.exit_code == 130:  # the parser's way of reporting Ctrl-C (and SIGTERM, above)
            return _fail("interrupted", 130, "Interrupted", json_mode)
        return err.exit_code
    except typer.Abort:
        return _fail("interrupted", 130, "Interrupted", json_mode)
    except typer.TyperException as err:  # bad options: the parser's message, exit 2
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        if not message:  # no arguments at all: help was already printed
            return 2
        return _fail(message, 2, "UsageError", json_mode)
    except KeyboardInterrupt:
        return _fail("interrupted", 130, "Interrupted", json_mode)
    except MemoryError:
        return _fail("out of memory", 2, "MemoryError", json_mode)
    except RuntimeError as err:  # torch reports failed allocations as RuntimeError
        if "allocate" not in str(err):
            raise
        return _fail(f"out of memory ({str(err).splitlines()[0][:120]})", 2, "MemoryError", json_mode)
    except OSError as err:
        where = f"{err.filename}: " if getattr(err, "filename", None) else ""
        return _fail(f"{where}{err.strerror or err}", 2, "OSError", json_mode)
    if result == 130:  # the parser turned Ctrl-C (or SIGTERM, above) into this code; no command returns it
        return _fail("interrupted", 130, "Interrupted", json_mode)
    return result if isinstance(result, int) else 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
