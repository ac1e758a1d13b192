"""The layering of ARCHITECTURE.md holds over the real import graph, and start-up stays light.

import-linter (over grimp's graph of every import, function-level ones included) checks the
contracts in pyproject.toml; the tests below also show that the check fails when a
violating import is added. Start-up: the commands that only read files never import torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import write_kv_file

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
VECTORS = REPO / "format-spec" / "vectors"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with the project's contracts, over the kvtool package found under `root`."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "kvtool", tmp_path / "kvtool", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_line(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_layers_hold_and_no_package_has_an_import_loop():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    root = copy_of_the_package(tmp_path)
    add_line(root / "kvtool" / "format" / "layout.py", "from kvtool.cli import output  # noqa")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "Each part imports only the parts below it BROKEN" in result.stdout
    assert "kvtool.format.layout -> kvtool.cli.output" in result.stdout


def test_an_import_loop_breaks_the_acyclic_contract(tmp_path):
    root = copy_of_the_package(tmp_path)
    # the GPU coder imports the codec's parameters; parameters importing the GPU coder closes a loop
    add_line(root / "kvtool" / "codecs" / "cachegen" / "params.py", "def _loop():\n    from . import gpu  # noqa")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "No import loops between the modules of any package BROKEN" in result.stdout
    assert "Each part imports only the parts below it KEPT" in result.stdout


# --- start-up: reading files needs no torch -------------------------------------------------

PROBE = """
import json, sys
from kvtool.cli.app import run
try:
    code = run(json.loads(sys.argv[1]))
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def modules_after(*argv: str) -> dict:
    """Run one kvtool command in a fresh interpreter; its exit code and whether torch was imported."""
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps([str(a) for a in argv])],
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stderr.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def zstd_file(tmp_path_factory):
    return write_kv_file(tmp_path_factory.mktemp("startup") / "z.kvc", num_tokens=9, chunk_size=4,
                         codec="zstd").path


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["info"], ["info", "--json"]],
                         ids=lambda a: " ".join(a))
def test_commands_that_read_nothing_never_import_torch(argv):
    assert modules_after(*argv) == {"code": 0, "torch": False}


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("codec", ["raw", "zstd", "cachegen"])
def test_inspect_and_verify_never_import_torch(command, codec, zstd_file):
    from kvtool.codecs.cachegen import native_available

    if codec == "cachegen" and not native_available():
        pytest.skip("without the native coder, CacheGen decodes with the torch reference")
    path = {"raw": VECTORS / "raw_bf16.kvc", "zstd": zstd_file, "cachegen": VECTORS / "cachegen_bf16.kvc"}[codec]
    assert modules_after(command, path) == {"code": 0, "torch": False}
    assert modules_after(command, path, "--json") == {"code": 0, "torch": False}


def test_inspect_stats_and_verify_against_need_no_torch_either(zstd_file, tmp_path):
    assert modules_after("inspect", "--stats", zstd_file) == {"code": 0, "torch": False}
    assert modules_after("verify", zstd_file, "--against", zstd_file) == {"code": 0, "torch": False}


def test_import_kvtool_is_light():
    code = "import sys, kvtool; print('torch' in sys.modules, kvtool.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "0.1.0"]
