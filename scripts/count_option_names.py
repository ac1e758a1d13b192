"""How many places in kvtool/ name an option, in each of its spellings (issue 47: one name per
concept, declared once). Counts `--model-dtype` and `--codec`:

    python scripts/count_option_names.py [--list]

It reads kvtool/'s Python as tokens (comments and prose in strings do not count): a place is an
identifier spelled as the option (`model_dtype`, `weights_dtype`, `ModelDtypeOpt`, a request's
`.weights`, ...) or a string that is exactly its flag (`"--model-dtype"`). Each is sorted by what
it does there: `declared` (a flag, a parameter or field with its annotation, an alias, a `def`:
where a name, type, default or help is written), `passed` (a keyword argument handing the value
on: `model_dtype=...`) or `read` (anything else). `--codec`'s bare word `codec` counts only in
cli/ and ops/, where it is the option; below them it is a chunk's codec, another thing.
"""

from __future__ import annotations

import io
import sys
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvtool"

#: concept -> {spelling: the folders of kvtool/ it counts in (None: all)}; a spelling starting with
#: "--" is a flag (a string token), ".name" an attribute of a request, anything else an identifier
CONCEPTS = {
    "--model-dtype": {"--model-dtype": None, "ModelDtypeOpt": None, "weights_dtype": ("cli", "ops"),
                      "model_dtype": ("cli", "ops"), ".weights": ("ops",), "torch_model_dtype": None},
    "--codec": {"--codec": None, "CodecOpt": None, "GetCodecOpt": None, "codec": ("cli", "ops")},
}
REQUESTS = {"request", "prompt", "self", "what", "options"}  # the owners of a request's `.weights`


def places(path: Path, spellings: dict) -> list[tuple[str, str, int]]:
    """(spelling, kind, line) of every place `path` names one of `spellings`."""
    part = path.relative_to(ROOT).parts[0]
    wanted = {s for s, folders in spellings.items() if folders is None or part in folders}
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]
    found = []
    for i, tok in enumerate(tokens):
        before = tokens[i - 1].string if i else ""
        after = tokens[i + 1].string if i + 1 < len(tokens) else ""
        if tok.type == tokenize.STRING and tok.string.strip("\"'") in wanted and tok.string.strip("\"'").startswith("--"):
            found.append((tok.string.strip("\"'"), "declared", tok.start[0]))
        elif tok.type == tokenize.NAME and before == "." and "." + tok.string in wanted:
            if i >= 2 and tokens[i - 2].string in REQUESTS:
                found.append(("." + tok.string, "read", tok.start[0]))
        elif tok.type == tokenize.NAME and before == "def" and "." + tok.string in wanted and part == "ops":
            found.append(("." + tok.string, "declared", tok.start[0]))  # the request's property
        elif tok.type == tokenize.NAME and tok.string in wanted and before != ".":
            kind = ("declared" if after == ":" or before in ("def", "class") or tok.string.endswith("Opt")
                    else "passed" if after == "=" else "read")
            found.append((tok.string, kind, tok.start[0]))
    return found


def count(concept: str) -> tuple[Counter, list[str]]:
    counts: Counter = Counter()
    listed = []
    for path in sorted(ROOT.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for spelling, kind, number in places(path, CONCEPTS[concept]):
            counts[(spelling, kind)] += 1
            listed.append(f"{path.relative_to(ROOT.parent)}:{number}: [{spelling}, {kind}] {lines[number - 1].strip()}")
    return counts, listed


def main(argv: list[str]) -> int:
    for concept in CONCEPTS:
        counts, places = count(concept)
        total = sum(counts.values())
        spellings = sorted({s for s, _ in counts})
        by_kind = Counter()
        for (_, kind), n in counts.items():
            by_kind[kind] += n
        print(f"{concept}: {total} places, {len(spellings)} spellings "
              f"({', '.join(f'{k} {by_kind[k]}' for k in ('declared', 'passed', 'read'))})")
        for spelling in spellings:
            line = ", ".join(f"{k} {counts[(spelling, k)]}" for k in ("declared", "passed", "read")
                             if counts[(spelling, k)])
            print(f"  {spelling}: {line}")
        if "--list" in argv:
            print("\n".join("    " + p for p in places))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
