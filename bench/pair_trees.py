"""One benchmark, two revisions of kvtool, in alternating runs on this machine: the "no slower"
check of a change, as ratios (after / before) of each row's median time over the rounds.

    python bench/pair_trees.py --before REV --after REV [--rounds 2] -- bench/bench_load.py --quick

Each revision is checked out into its own worktree under --dir (a temp folder by default), its
native coders built there, and the benchmark script (the AFTER revision's, so both run the same
workload; `--same-script`) or each its own (the default, where the script changed between them) run with PYTHONPATH naming that tree, before and after in turn, so that a machine
getting busier or quieter weighs on both alike. Every markdown table row the benchmark prints is
matched by its text cells; the time column of its table (`ms`, `µs/op`, `s`, or else the inverse
of `GB/s`) gives the ratio. Rows a revision lacks are left out. A ratio below 1 is faster after.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIME_COLUMNS = ("ms", "µs/op", "us/op", "s", "seconds", "ms (median)", "median ms")
NUMBER = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?x?$", re.I)
RATIO_IN_WORDS = re.compile(r"^\d[\d.,]*x\b")  # "0.85x file write+fsync+rename": a figure, not a name


def worktree(rev: str, parent: Path) -> Path:
    path = parent / rev.replace("/", "_")
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                       capture_output=True)
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=path, check=True,
                       capture_output=True)
    return path


def tables(text: str) -> dict[tuple, float]:
    """{(table header, row's text cells): the row's time} for every markdown table in `text`."""
    rows: dict[tuple, float] = {}
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        value = row_time(header, cells)
        if value is not None:  # a row is named by its text, not by its figures (nor a ratio told in words)
            key = (tuple(header), tuple(c for c in cells if not NUMBER.match(c.replace(" ", ""))
                                        and not RATIO_IN_WORDS.match(c)))
            rows.setdefault(key, value)
    return rows


def row_time(header: list[str], cells: list[str]) -> float | None:
    for i, name in enumerate(header):
        if name.lower() in TIME_COLUMNS and i < len(cells) and NUMBER.match(cells[i].replace(",", "")):
            return float(cells[i].replace(",", "").rstrip("x"))
    for i, name in enumerate(header):
        if name.lower().startswith("gb/s") and i < len(cells) and NUMBER.match(cells[i].replace(",", "")):
            value = float(cells[i].replace(",", ""))
            return 1 / value if value > 0 else None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--same-script", action="store_const", const=True,
                    help="run the after revision's script in both trees (default: each revision's own)")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] (the script's path in the repo)")
    args = ap.parse_args()
    bench = [a for a in args.bench if a != "--"]
    parent = args.dir or Path(tempfile.mkdtemp(prefix="kvtool-pair-"))
    trees = {"before": worktree(args.before, parent), "after": worktree(args.after, parent)}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            env = dict(os.environ, PYTHONPATH=str(trees[side]))
            script = trees[side] if args.same_script is None else trees["after"]
            out = subprocess.run([sys.executable, str(script / bench[0]), *bench[1:]], cwd=parent, env=env,
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{side} ({args.__dict__[side]}) round {r + 1} failed:\n{out.stderr[-2000:]}")
            (parent / f"{side}.{r + 1}.out").write_text(out.stdout)  # (kept beside the worktrees)
            runs[side].append(tables(out.stdout))
            print(f"round {r + 1}: {side} done", file=sys.stderr)
    keys = [k for k in runs["after"][0] if all(k in t for side in runs.values() for t in side)]
    print(f"{' '.join(bench)}: after {args.after} / before {args.before}, median of {args.rounds} runs each, "
          f"alternating\n")
    print("| row | before | after | after/before |\n|---|---:|---:|---:|")
    for key in keys:
        before = statistics.median(t[key] for t in runs["before"])
        after = statistics.median(t[key] for t in runs["after"])
        label = " / ".join(key[1])
        print(f"| {label} | {before:.4g} | {after:.4g} | {after / before:.2f} |")


if __name__ == "__main__":
    main()
