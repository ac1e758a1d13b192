"""README's Python API example runs as it stands (on the default model)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def python_api_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.model
def test_readme_python_api_example_runs(tmp_path, default_model):
    out = subprocess.run([sys.executable, "-c", python_api_example()], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"\d+ chunks, \d+ bytes", lines[0])
    assert re.fullmatch(r"\d+ tokens; chunk 0: \(2, 30, 64, 192\) torch.bfloat16", lines[1])
    assert lines[2].startswith("intact: True | bits/value: ")
    assert re.match(r"top-1 agreement (0\.\d\d|1\.00); continuation '", lines[3])
    assert (tmp_path / "notes.kvc").is_file() and (tmp_path / "copy.kvc").is_file()
