"""The user documentation's examples (README and docs/) run as they stand (on the default model).

They run in subprocesses, each with a time limit that catches a hang, never a slow run: a limit
of minutes that a whole example must meet trips on a busy 2-core machine (the blend example took
more than 600 s there), so each command of a shell example has its own limit, and a limit is
an hour for the slowest command seen here (a few minutes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from user_docs import first_block

REPO = Path(__file__).resolve().parents[1]
#: Seconds one example (or one command of a shell example) may take: a hang, not a slow machine.
HANG_S = 3600


def python_example(heading: str) -> str:
    """The first Python block after a heading of README or a docs page."""
    return first_block(heading, "python")


def run_example(heading: str, cwd: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", python_example(heading)], cwd=cwd, capture_output=True,
                         text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.model
def test_readme_python_api_example_runs(tmp_path, default_model):
    lines = run_example("## Python API", tmp_path)
    assert re.fullmatch(r"\d+ chunks, \d+ bytes", lines[0])
    assert re.fullmatch(r"\d+ tokens; chunk 0: \(2, 30, 64, 192\) torch.bfloat16", lines[1])
    assert lines[2].startswith("intact: True | bits/value: ")
    assert re.match(r"top-1 agreement (0\.\d\d|1\.00); continuation '", lines[3])
    assert (tmp_path / "notes.kvc").is_file() and (tmp_path / "copy.kvc").is_file()


@pytest.mark.model
def test_readme_store_example_runs(tmp_path, default_model):
    lines = run_example("## The chunk store", tmp_path)
    m = re.fullmatch(r"cached: (\d+) of (\d+) tokens", lines[0])
    assert m and int(m.group(1)) > 0 and int(m.group(1)) % 64 == 0
    assert lines[1] == f"loaded {m.group(1)} tokens as (2, 30, {m.group(1)}, 192)"
    assert lines[2] == "selected: torch.Size([30, 80, 3, 64])"
    assert (tmp_path / "kvstore" / "kvtool-store.json").is_file()


@pytest.mark.model
def test_readme_blend_commands_run(tmp_path, default_model):
    block = first_block("Blending cached segments", "bash")
    script = re.sub(r"^kvtool ", f"{sys.executable} -m kvtool ", block, flags=re.M)
    for folder in ("demo", "format-spec"):  # the documents it blends, from the repository's root
        (tmp_path / folder).symlink_to(REPO / folder)
    printed = []
    for command in script.splitlines():  # one at a time: each its own limit, a failure names its command
        out = subprocess.run(["bash", "-e", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                             timeout=HANG_S)
        assert out.returncode == 0, f"{command}\n{out.stderr}"
        printed.append(out.stdout)
    flat = " ".join("".join(printed).split())
    assert "a segment (positions from 0, placeable anywhere)" in flat
    assert "blend of 2 segments and the question" in flat and "naive: top-1 agreement" in flat
    assert flat.count("recompute ratio 0.15 at check layer 1") == 2
    assert (tmp_path / "prompt.txt").read_text().count(" # # ") == 2


@pytest.mark.model
def test_readme_transformers_example_runs(tmp_path, default_model):
    pytest.importorskip("transformers")
    lines = run_example("## Hugging Face transformers", tmp_path)
    assert re.fullmatch(r"'.+' \| as without the cache: True", lines[0])
    assert re.fullmatch(r"\d+ tokens saved; continued: '.+'", lines[1])
    assert (tmp_path / "story.kvc").is_file() and (tmp_path / "blocks.kvc").is_file()
