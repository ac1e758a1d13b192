"""The vLLM connector's isolation tests' helpers (tests/test_vllm_connector.py, test_vllm_mla.py,
test_vllm_hybrid.py): a random peft LoRA adapter of a model folder (peft starts lora_B at zero, so the
adapter would change nothing: it is drawn nonzero, large enough to change the greedy output), and
the connector's own lookup in another namespace (a namespace is an engine's setting, not a
request's: asked of the store an engine filled, no second engine is started for it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def random_lora(model: Path, target_modules: list[str], folder: Path, scale: float = 0.5) -> Path:
    """A rank-8 adapter of `model` on `target_modules`, its lora_B drawn N(0, scale), seeded."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        if os.environ.get("CI") == "true":
            raise RuntimeError("CI must run the LoRA tests: peft did not install (make test)")
        pytest.skip("peft is not installed (make test installs it)")
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    adapted = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=target_modules, lora_dropout=0.0,
                                              task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, weights in adapted.named_parameters():
            if "lora_B" in name:
                weights.normal_(0.0, scale)
    adapted.save_pretrained(folder)
    return folder


def served_groups(log: str, layers: int) -> list:
    """The KV cache groups a connector served, as its worker logged them ("KV cache groups: group 0
    (sliding window 256, layers 0,2); ..."); without that line, one group of every layer."""
    import re

    from kvtool.integrations.vllm.groups import KVGroup

    line = re.search(r"KV cache groups: (.*)", log)
    if line is None:
        return [KVGroup(0, (), tuple(range(layers)))]
    groups = []
    for described in line[1].split("; "):
        shape = r"group (\d+) \((?:sliding window (\d+)|full attention), layers ([\d,]+)\)"
        index, window, numbers = re.fullmatch(shape, described).groups()
        numbers = tuple(int(n) for n in numbers.split(","))
        groups.append(KVGroup(int(index), tuple(f"model.layers.{n}.self_attn.attn" for n in numbers), numbers,
                              int(window) if window else None))
    return groups


def engine_config(model: Path, store: Path, namespace: str = "", **engine):
    """vLLM's config of an engine serving `model` with kvtool's connector on `store` in `namespace`
    (`engine`: the job's other vLLM settings, as scripts/vllm_serve.py passes them), as vLLM builds it
    before it starts: no model loaded, no engine started."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # as an engine's job has it (vllm_engines)
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    extra = {"store": str(store), "codec": "raw", **({"namespace": namespace} if namespace else {})}
    transfer = KVTransferConfig(kv_connector="KVToolConnector", kv_connector_module_path="kvtool.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    return EngineArgs(model=str(model), dtype="float32", max_model_len=4096, enforce_eager=True,
                      kv_transfer_config=transfer, **engine).create_engine_config()


def connector_lookup(vllm_config, groups: list, tokens: list[int], lora: Path | None = None,
                     cache_salt: str | None = None) -> int:
    """The tokens the connector of `vllm_config`, serving `groups`, would tell vLLM to load for a
    request of `tokens`: its own scheduler side (its settings, keys, identities and lookup) asked
    about a real vLLM Request, as vLLM's scheduler asks it."""
    import time

    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    from kvtool.integrations.vllm.config import read_config
    from kvtool.integrations.vllm.scheduler import SchedulerSide

    side = SchedulerSide(read_config(vllm_config), vllm_config, groups)
    adapter = LoRARequest(lora.name, 1, str(lora)) if lora is not None else None
    request = Request("lookup", list(tokens), SamplingParams(max_tokens=1), None, lora_request=adapter,
                      cache_salt=cache_salt)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            answer, _ = side.matched_tokens(request, 0)
            if answer is not None:
                return answer
        raise AssertionError("the connector's lookup did not answer")
    finally:
        side.shutdown()
