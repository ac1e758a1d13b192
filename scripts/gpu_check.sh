#!/usr/bin/env bash
# The one command for a CUDA machine: build kvtool's CUDA kernels, run the GPU
# tests (tests/test_cuda.py: kernels vs the CPU paths, byte for byte; the staged
# load path; vLLM's block copies; RoPE re-encoding) and the GPU benchmarks
# (bench/bench_cuda.py, bench/bench_load.py), and print the results.
#
#   scripts/gpu_check.sh                        # everything
#   SECTIONS="tests load" scripts/gpu_check.sh  # some of: tests cuda load model big
#   PYTEST_ARGS="-k paged" BENCH_ARGS="--quick" scripts/gpu_check.sh
#
# Sections: tests (the GPU tests), cuda (bench_cuda: the kernels), load (bench_load: files and
# the store into paged GPU buffers), model (the default model on the GPU: capture overhead, time
# to first token), big (a random-weight model of Llama-3-8B's shape made here by
# scripts/gpu_random_model.py: capture -> replay at 8,000 tokens, raw and cachegen, against the
# recompute). SKIP_TESTS=1 / SKIP_BENCH=1 still drop the tests / every benchmark.
#
# Logs and the benchmark's JSON go to $OUT (or $KVTOOL_GPU_CHECK_OUT, default
# /tmp/kvtool-gpu-check). Exit status: non-zero if a test failed or the build failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-${KVTOOL_GPU_CHECK_OUT:-/tmp/kvtool-gpu-check}}
mkdir -p "$OUTDIR"
status=0
SECTIONS=${SECTIONS:-tests cuda load model big}
[ -n "${SKIP_TESTS:-}" ] && SECTIONS=${SECTIONS//tests/}
[ -n "${SKIP_BENCH:-}" ] && SECTIONS=$(for s in $SECTIONS; do [ "$s" = tests ] && echo tests; done)
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
echo "sections: $SECTIONS"

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
(command -v nvcc >/dev/null && nvcc --version | tail -1) || echo "nvcc: not on PATH"
$PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"

# Wheels for dependencies a bare GPU image may lack (zstandard, crc32c), if shipped alongside.
if [ -d .gpu_wheels ] && ls .gpu_wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps .gpu_wheels/*.whl >"$OUTDIR/pip.log" 2>&1 || echo "pip install of .gpu_wheels failed (see pip.log)"
fi

# The default model, if scripts/gpu_model_parts.sh brought it here in parts.
if [ -z "${KVTOOL_DEFAULT_GGUF:-}" ] && [ -f "${KVTOOL_MODEL_DIR:-/tmp/kvtool-model}/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  export KVTOOL_DEFAULT_GGUF="${KVTOOL_MODEL_DIR:-/tmp/kvtool-model}/SmolLM2-135M-Instruct.Q4_1.gguf"
  echo "default model: $KVTOOL_DEFAULT_GGUF"
fi

# kvtool's native CPU CacheGen coder for this Python: the CPU side of the byte comparisons.
if ! $PY -c "import kvtool._cachegen_native" 2>/dev/null; then
  if $PY setup.py build_ext --inplace >"$OUTDIR/build_ext.log" 2>&1; then
    echo "native CPU coder: built for this Python"
  else
    echo "native CPU coder: build failed (see build_ext.log); CPU bytes come from the Python reference"
  fi
fi

echo "== CUDA backend (builds the kernels on first use)"
t0=$(date +%s)
$PY -c "from kvtool import cuda_build as k; print(k.backend_status(build=True))" || status=1
echo "(build/load took $(( $(date +%s) - t0 )) s)"

if want tests; then
  echo "== GPU tests: kernels vs the CPU paths, the staged load path, vLLM's block copies, RoPE re-encoding"
  # shellcheck disable=SC2086
  $PY -m pytest -q -p no:cacheprovider -rfEs tests/test_cuda.py tests/test_devices.py tests/test_load.py \
    tests/test_engine_blocks.py tests/test_blend.py ${PYTEST_ARGS:-} >"$OUTDIR/pytest.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  grep -E "^(FAILED|ERROR)|Error|error:|assert" "$OUTDIR/pytest.log" | head -40
  tail -3 "$OUTDIR/pytest.log"
fi

if want cuda; then
  echo "== GPU benchmark: bench/bench_cuda.py"
  REAL=()
  # real KV for the CacheGen decoders, when the default model is here: ~2.5k tokens of stdlib source
  $PY -c 'import inspect; print(open(inspect.__file__).read()[:9000])' >"$OUTDIR/real_prompt.txt"
  if $PY -c "import sys; from kvtool.engine.default_model import default_model_installed as ok; sys.exit(not ok())" 2>/dev/null \
     && $PY -m kvtool capture --prompt-file "$OUTDIR/real_prompt.txt" --dtype bf16 \
          -o "$OUTDIR/real.kvc" >"$OUTDIR/real_capture.log" 2>&1; then
    REAL=(--real "$OUTDIR/real.kvc")
  else
    echo "(no real KV: the default model is not here or the capture failed; synthetic chunks only)"
  fi
  # shellcheck disable=SC2086
  $PY bench/bench_cuda.py "${REAL[@]}" --json "$OUTDIR/bench_cuda.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUTDIR/bench.log" || status=1
fi

if want load; then
  echo "== loading KV into paged buffers, CPU and GPU: bench/bench_load.py"
  # shellcheck disable=SC2086
  $PY bench/bench_load.py --json "$OUTDIR/bench_load.json" ${LOAD_ARGS:-} 2>&1 | tee "$OUTDIR/bench_load.log" || status=1
fi

if want model; then
  echo "== the model on the GPU: capture overhead and time to first token (bench/bench_capture.py, bench/bench_ttft.py)"
  if ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "skipped: torch sees no CUDA device"
  elif $PY -c "import sys; from kvtool.engine.default_model import default_model_installed as ok; sys.exit(not ok())"; then
    $PY bench/bench_capture.py --device cuda --tokens 2048 8000 2>&1 | tee "$OUTDIR/bench_capture.log" || status=1
    $PY bench/bench_ttft.py --device cuda --lengths 1024,2048,4096,8000 --md "$OUTDIR/ttft_gpu.md" 2>&1 \
      | tee "$OUTDIR/bench_ttft.log" || status=1
  else
    echo "skipped: the default model is not here (scripts/gpu_model_parts.sh brings it in parts)"
  fi
fi

if want big; then
  echo "== an 8B-shaped model (random weights) on the GPU: capture -> replay at 8,000 tokens"
  BIG=${BIG_MODEL_DIR:-/tmp/kvtool-llama8b}
  TOK=""
  for d in .gpu_model/tokenizer "${XDG_CACHE_HOME:-$HOME/.cache}/kvtool/models/SmolLM2-135M-Instruct"; do
    [ -f "$d/tokenizer.json" ] && TOK=$d && break
  done
  if [ -z "$TOK" ]; then
    echo "skipped: no tokenizer.json (carry one in .gpu_model/tokenizer/)"
  elif [ -f "$BIG/model.safetensors.index.json" ] || $PY scripts/gpu_random_model.py "$BIG" --tokenizer "$TOK" --tokens 8000; then
    for codec in raw cachegen; do
      $PY -m kvtool capture --model "$BIG" --model-dtype bf16 --device cuda --codec "$codec" \
        --prompt-file "$BIG/prompt.txt" -o "$BIG/ctx_$codec.kvc" --json >"$OUTDIR/big_capture_$codec.json" || status=1
      $PY -m kvtool replay "$BIG/ctx_$codec.kvc" --model "$BIG" --model-dtype bf16 --device cuda --compare \
        --json >"$OUTDIR/big_replay_$codec.json" || status=1
      # a second process: what a replay costs once the kernels are built and the decoder chosen
      $PY -m kvtool replay "$BIG/ctx_$codec.kvc" --model "$BIG" --model-dtype bf16 --device cuda \
        --json >"$OUTDIR/big_replay2_$codec.json" || status=1
      $PY -c "import json, sys; r = json.load(open(sys.argv[1])); print(f'  again: load {r[\"load_s\"]:.3f} s, first token {r[\"ttft_cached_s\"]:.3f} s')" \
        "$OUTDIR/big_replay2_$codec.json" || true
      $PY - "$codec" "$OUTDIR/big_capture_$codec.json" "$OUTDIR/big_replay_$codec.json" <<'PY'
import json, sys
codec, c, r = sys.argv[1], *(json.load(open(p)) if open(p).read().strip() else {} for p in sys.argv[2:])
print(f"{codec}: {c.get('num_tokens')} tokens, {c.get('file_bytes', 0) / 2**20:.0f} MiB file, prefill "
      f"{c.get('seconds', 0):.2f} s | replay: load {r.get('load_s')} s, first token {r.get('ttft_cached_s')} s "
      f"vs recompute {r.get('ttft_recompute_s')} s (x{r.get('speedup')}), top-1 {r.get('top1_agreement')}")
PY
    done
  else
    echo "the random-weight model could not be made"; status=1
  fi
fi

echo "== done (status $status; logs in $OUTDIR)"
exit $status
