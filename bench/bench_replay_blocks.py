"""Issue 33's workload through kvtool's own engine: phase 1 `kvtool capture --store` of the 4
prompts of `bench_vllm.py --workload blocks` (as text), phase 2 `kvtool replay --store --compare`
of each, for a raw and a cachegen store; the engine's block is 16 tokens.

    PYTHONPATH=. python bench/bench_replay_blocks.py [--dir TMP]   (results: DIR/out.json)
"""
import json, subprocess, sys, os, tempfile
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_vllm as b
from kvtool.engine.default_model import default_model_path
from kvtool.engine.loader import Tokenizer
tok = Tokenizer(default_model_path() / "tokenizer.json")
prompts = b.block_prompts(4)
texts = [tok.decode(p[1:] if p[0] == 1 else p) for p in prompts]
env = {**os.environ, "PYTHONPATH": str(REPO)}
kv = [sys.executable, "-m", "kvtool"]
work = Path(sys.argv[sys.argv.index("--dir") + 1]) if "--dir" in sys.argv else Path(tempfile.mkdtemp(prefix="kvtool-replay-blocks-"))
out = {}
for codec in ("raw", "cachegen"):
    store = str(work / f"store-{codec}")
    subprocess.run(["rm", "-rf", store])
    files = []
    for i, t in enumerate(texts):
        f = str(work / f"p{i}.txt"); open(f, "w").write(t); files.append(f)
        r = subprocess.run(kv + ["capture", "--prompt-file", f, "--store", store, "--codec", codec, "--json"],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout); print(codec, "capture", i, d["num_tokens"], d["store"], flush=True)
    du = subprocess.run(["du", "-sb", store], capture_output=True, text=True).stdout.split()[0]
    rows = []
    for i, f in enumerate(files):
        r = subprocess.run(kv + ["replay", "--store", store, "--prompt-file", f, "--compare", "--continue", "16", "--json"],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        rows.append({k: d.get(k) for k in ("prompt_tokens", "reused_tokens", "codecs", "ttft_s", "ttft_ms", "recompute_ttft_s", "top1_agreement", "identical", "speedup")})
        rows[-1]["all"] = {k: v for k, v in d.items() if not isinstance(v, (list, dict)) or k == "codecs"}
        print(codec, "replay", i, json.dumps(rows[-1]["all"])[:800], flush=True)
    out[codec] = {"bytes": int(du), "rows": rows}
json.dump(out, open(work / "out.json", "w"), indent=1)
print(f"results: {work / 'out.json'}")
