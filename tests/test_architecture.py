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

import tomllib

import pytest

from fixtures import write_kv_file

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
VECTORS = REPO / "format-spec" / "vectors"
CONTRACTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with the project's contracts, over the kvtool package found under `root`
    (its report as wide as it needs: a contract's name on one line)."""
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "250"}
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
    assert f"{len(CONTRACTS)} kept, 0 broken" in result.stdout


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


def broken_contracts(report: str) -> dict[str, str]:
    """lint-imports' report of broken contracts: each contract's name -> the lines under it."""
    names = {c["name"] for c in CONTRACTS}
    sections: dict[str, str] = {}
    current = None
    for line in report.split("Broken contracts", 1)[-1].splitlines():
        if line.strip() in names:
            current = line.strip()
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections


# One import per contract that only that contract forbids: (file, line added, contract, the report's line).
BREAKS = [
    ("checksum.py", "from kvtool import fsutil  # noqa", "Each part imports only the parts below it",
     "kvtool.checksum -> kvtool.fsutil"),  # row 6's siblings are independent
    ("cuda_build.py", "from kvtool import pinned  # noqa", "Each part imports only the parts below it",
     "kvtool.cuda_build -> kvtool.pinned"),  # row 5 imports rows 6-7 only
    ("engine/blend.py", "from kvtool.codecs import base  # noqa", "Of row 3, only the format imports the codecs",
     "kvtool.engine.blend -> kvtool.codecs.base"),
    ("pinned.py", "from kvtool.errors import KvtoolError  # noqa", "The pinned buffers import nothing of kvtool's",
     "kvtool.pinned -> kvtool.errors"),
    ("cli/replay.py", "from kvtool.integrations.hf import runs  # noqa",
     "Only the ops (--engine hf) and kvtool.hf import integrations/hf", "kvtool.cli.replay -> kvtool.integrations.hf.runs"),
    ("ops/store.py", "from kvtool.integrations.vllm import keys  # noqa",
     "Only vllm/ imports engine_blocks; nothing imports vllm/ or the proxy",
     "kvtool.ops.store -> kvtool.integrations.vllm.keys"),
    ("engine/loader.py", "import transformers  # noqa", "Only integrations/hf imports transformers",
     "kvtool.engine.loader -> transformers"),
    ("store/buffers.py", "import vllm  # noqa", "Only integrations/vllm imports vLLM", "kvtool.store.buffers -> vllm"),
    ("store/upkeep.py", "import sglang  # noqa", "Only integrations/sglang imports SGLang; nothing imports sglang/",
     "kvtool.store.upkeep -> sglang"),
    ("integrations/disagg_proxy.py", "import torch  # noqa",
     "The proxy imports neither vLLM nor torch nor the rest of kvtool", "kvtool.integrations.disagg_proxy -> torch"),
    ("ops/dump.py", "from kvtool.connectors import paged_torch  # noqa", "paged_copy alone picks the paged copy",
     "kvtool.ops.dump -> kvtool.connectors.paged_torch"),
    ("ops/info.py", "from kvtool.codecs.cachegen import gpu  # noqa", "CacheGenCodec alone picks the GPU or the CPU coder",
     "kvtool.ops.info -> kvtool.codecs.cachegen.gpu"),
    ("format/hashing.py", "import kvtool  # noqa", "Nothing imports kvtool/__init__; native_loader loads the extensions",
     "kvtool.format.hashing -> kvtool"),
]


def test_each_contract_fails_when_broken(tmp_path):
    """One copy of the package, one forbidden import per contract, one run: every contract but the
    loop check reports broken, each for the import added against it."""
    root = copy_of_the_package(tmp_path)
    for file, line, _, _ in BREAKS:
        add_line(root / "kvtool" / file, line)
    result = lint_imports(root)
    assert result.returncode != 0
    broken = broken_contracts(result.stdout)
    assert set(broken) == {c["name"] for c in CONTRACTS if c["type"] != "acyclic_siblings"}, result.stdout
    for _, _, contract, shown in BREAKS:
        assert shown in broken[contract], (contract, broken[contract])


def test_the_table_of_architecture_md_is_the_layers_contract():
    """The parts on each row of ARCHITECTURE.md's table are the layers of the contract, in order,
    and every module directly under kvtool/ is on a row."""
    import grimp

    rows: dict[str, set[str]] = {}
    for line in (REPO / "ARCHITECTURE.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 4 and cells[0][:1].isdigit():
            parts = {p.strip("`").removesuffix("/").removesuffix(".py").replace("/", ".")
                     for p in cells[1].split(", ")}
            rows.setdefault(cells[0], set()).update(parts)
    layers = next(c["layers"] for c in CONTRACTS if c["type"] == "layers")
    assert list(rows.values()) == [{m.strip() for m in layer.split("|")} for layer in layers]
    on_a_row = set().union(*rows.values())
    children = grimp.build_graph("kvtool", cache_dir=None).find_children("kvtool")
    assert {m for m in children if not m.split(".")[-1].startswith("_") or m == "kvtool.__main__"} == on_a_row


def test_only_the_engines_ask_for_transformers_and_on_first_use():
    """`--engine hf` reaches transformers from inside a function: importing every operation loads
    neither integrations/ nor transformers."""
    code = ("import importlib, pkgutil, sys, kvtool.ops\n"
            "for m in pkgutil.iter_modules(kvtool.ops.__path__): importlib.import_module('kvtool.ops.' + m.name)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('kvtool.integrations', 'transformers', 'vllm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_nothing_but_the_cli_and_the_notices_prints_or_exits():
    """One error path: outside cli/ and notices.py no code prints, writes to stdout/stderr or exits
    (the proxy is its own program, with its own main)."""
    import ast

    found = []
    for path in sorted((REPO / "kvtool").rglob("*.py")):
        where = path.relative_to(REPO / "kvtool").as_posix()
        if where.startswith("cli/") or where in ("notices.py", "integrations/disagg_proxy.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called in ("print", "exit", "sys.exit", "os._exit") or called.endswith((".stdout.write", ".stderr.write")):
                    found.append(f"{where}:{node.lineno} {called}")
            elif isinstance(node, ast.Raise) and node.exc is not None and "SystemExit" in ast.unparse(node.exc):
                found.append(f"{where}:{node.lineno} raise SystemExit")
    assert found == []


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
    """`kvtool` and its packages with lazy attributes (engine, format, store) load them on first use."""
    code = ("import sys, kvtool, kvtool.engine, kvtool.format, kvtool.store\n"
            "print('torch' in sys.modules, kvtool.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "0.1.0"]


def test_the_codec_table_imports_a_codec_when_it_is_asked_for():
    code = ("import sys, kvtool.codecs as codecs\n"
            "loaded = lambda: sorted(m for m in sys.modules if m.startswith('kvtool.codecs.') and m != 'kvtool.codecs.base')\n"
            "print(loaded()); codecs.get_codec('raw'); print(loaded())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["[]", "['kvtool.codecs.raw']"], out.stderr


@pytest.mark.parametrize("argv", [["replay", "x.kvc", "--device", "gpu"],
                                  ["capture", "--prompt", "p", "-o", "x.kvc", "--chunk-size", "0"]],
                         ids=lambda a: a[0])
def test_a_usage_error_answers_before_torch_loads(argv):
    """capture and replay make their request (ops/requests.py) before they import the operation."""
    assert modules_after(*argv) == {"code": 2, "torch": False}
