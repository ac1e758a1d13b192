"""CLI start-up time: wall time of whole `kvtool` processes next to the bare interpreter.

    python bench/bench_startup.py [--repeat 10] [--files A.kvc B.kvc ...] [--json]
        [--python PATH] [--kvtool PATH] [--gguf PATH]

Each command runs once untimed (warm page cache, .pyc written: PYTHONDONTWRITEBYTECODE
is dropped from the children's environment, as on a user's machine), then --repeat
times; the table gives the best and median wall time of the subprocess and the
best minus the best of `python -c pass` (what kvtool adds to the interpreter).
Rows: `python -c pass`, `kvtool --help`, `kvtool --version` ("not available" when
it exits non-zero), three usage errors (each must exit 2: they answer before torch loads), `kvtool inspect F` and `kvtool verify F` for a raw, a zstd
(compressed from the raw one at start) and a cachegen file (default: the small
format-spec vectors; --files names others), and `gguf-dump --no-tensors` of the
default model's GGUF as a peer. --python/--kvtool time another install.
Any other command exiting non-zero is reported and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VECTORS = Path(__file__).resolve().parents[1] / "format-spec" / "vectors"
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
#: Commands that must fail with a usage error (exit 2), timed like the others.
USAGE_ERRORS = (["replay"], ["capture", "--prompt", "a", "--prompt-file", "b", "-o", "x.kvc"],
                ["capture", "--prompt", "a", "--chunk-size", "0", "-o", "x.kvc"])
FIND_GGUF = "from kvtool.engine.default_model import find_gguf; print(find_gguf())"


def run_once(cmd: list[str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       env=ENV)
    return time.perf_counter() - t0, p.returncode, p.stderr.decode(errors="replace")


def time_command(cmd: list[str], repeat: int, expect: int = 0) -> dict:
    """One untimed warm-up run (which must exit `expect`), then `repeat` timed runs."""
    _, rc, err = run_once(cmd)
    if rc != expect:
        return {"rc": rc, "error": (err.strip().splitlines() or [""])[-1]}
    times = []
    for _ in range(repeat):
        t, rc, err = run_once(cmd)
        if rc != expect:
            return {"rc": rc, "error": (err.strip().splitlines() or [""])[-1]}
        times.append(t)
    return {"rc": expect, "best": min(times), "median": statistics.median(times), "times": times}


def find_gguf(python: str, given: str | None) -> tuple[str | None, str]:
    """The GGUF to dump: --gguf, else the default model's as the timed install finds it."""
    if given:
        return given, ""
    p = subprocess.run([python, "-c", FIND_GGUF], capture_output=True, text=True)
    if p.returncode == 0 and p.stdout.strip():
        return p.stdout.strip(), ""
    why = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f"no GGUF: default model not found ({why}); pass --gguf PATH"


def input_files(kvtool: str, given: list[str] | None, tmp: Path) -> list[tuple[str, str]]:
    """(label, path) pairs: --files as given, else the raw and cachegen vectors plus a zstd one."""
    if given:
        return [(Path(f).name, f) for f in given]
    raw, cachegen, zstd = VECTORS / "raw_bf16.kvc", VECTORS / "cachegen_bf16.kvc", tmp / "zstd.kvc"
    cmd = [kvtool, "compress", str(raw), "-o", str(zstd), "--codec", "zstd"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_startup: {' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
    return [("raw", str(raw)), ("zstd", str(zstd)), ("cachegen", str(cachegen))]


def commands(args, files, gguf) -> list[tuple[str, list[str] | None, str]]:
    """(label, argv or None when skipped, reason) in table order."""
    py, kv = args.python, args.kvtool
    rows = [("python -c pass", [py, "-c", "pass"], ""),
            ("kvtool --help", [kv, "--help"], ""), ("kvtool --version", [kv, "--version"], "")]
    rows += [(f"kvtool {verb} {label}", [kv, verb, path], "")
             for verb in ("inspect", "verify") for label, path in files]
    # usage errors (exit 2): answered before torch loads, so as fast as --help
    rows += [(f"kvtool {' '.join(argv)} (usage error)", [kv, *argv], "") for argv in USAGE_ERRORS]
    dump = Path(py).parent / "gguf-dump"
    if gguf[0] is None or not dump.exists():
        rows.append(("gguf-dump --no-tensors", None, gguf[1] or f"{dump} not installed"))
    else:
        rows.append((f"gguf-dump --no-tensors {Path(gguf[0]).name}", [str(dump), "--no-tensors", gguf[0]], ""))
    return rows


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(l.split(":", 1)[1].strip() for l in fh if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine(python: str) -> dict:
    ver = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                         capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": ver, "python_path": python,
            "loadavg_1min": round(os.getloadavg()[0], 2)}


def print_table(results: list[dict], info: dict, repeat: int) -> None:
    print(f"# kvtool bench_startup: subprocess wall time, best and median of {repeat}, after 1 warm-up\n")
    print(f"Machine: {info['cpu']}, {info['cores']} cores, Python {info['python']} ({info['python_path']}), "
          f"1-min load average {info['loadavg_1min']} at start\n")
    print("| command | best s | median s | best - bare interpreter s |")
    print("|---|---:|---:|---:|")
    bare = results[0].get("best")
    for r in results:
        if "best" in r:
            delta = f"{r['best'] - bare:+.3f}" if bare is not None else "-"
            print(f"| `{r['command']}` | {r['best']:.3f} | {r['median']:.3f} | {delta} |")
        else:
            print(f"| `{r['command']}` | {r['note']} | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--kvtool", default=str(Path(sys.executable).parent / "kvtool"))
    ap.add_argument("--files", nargs="+", help="KV files to inspect/verify instead of the vectors")
    ap.add_argument("--gguf", help="GGUF file for the gguf-dump row (default: the default model's)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = ap.parse_args()
    for exe in (args.python, args.kvtool):
        if not os.access(exe, os.X_OK):
            sys.exit(f"bench_startup: {exe} is not an executable (see --python / --kvtool)")
    info = machine(args.python)
    with tempfile.TemporaryDirectory() as tmp:
        files = input_files(args.kvtool, args.files, Path(tmp))
        results, failed = [], []
        for label, cmd, why in commands(args, files, find_gguf(args.python, args.gguf)):
            expect = 2 if label.endswith("(usage error)") else 0
            r = {"command": label, **(time_command(cmd, args.repeat, expect) if cmd else {"note": f"skipped: {why}"})}
            if r.get("rc", 0) != expect:
                r["note"] = f"not available (exit {r['rc']})" if label == "kvtool --version" else \
                    f"FAILED (exit {r['rc']})"
                if label != "kvtool --version":
                    failed.append(f"{' '.join(cmd)}: exit {r['rc']}: {r['error']}")
            results.append(r)
    if args.json:
        print(json.dumps({"machine": info, "repeat": args.repeat, "results": results, "failed": failed}, indent=2))
    else:
        print_table(results, info, args.repeat)
    for f in failed:
        print(f"bench_startup: FAILED: {f}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
