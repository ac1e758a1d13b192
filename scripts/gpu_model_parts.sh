#!/usr/bin/env bash
# Bring the default model (a 98 MB GGUF) to a GPU machine that has no network and takes at
# most 64 MiB of files per call, in parts: the machine keeps /tmp between calls while warm.
#
#   here, once:   scripts/gpu_model_parts.sh split
#                 -> .gpu_model/part-0, part-1 (49 MB each: one, with the wheels, fits a 64 MiB call) and .gpu_model/SHA256 (ignored by git)
#   there, one call per part, carrying that part and the checksum file, e.g. with the device tool:
#                 run("scripts/gpu_model_parts.sh gather", carry=[".gpu_model/part-0", ".gpu_model/SHA256"])
#                 ... then part-1
#   The gather that completes the set joins the parts into $KVTOOL_MODEL_DIR (default
#   /tmp/kvtool-model), checks the SHA-256 and says so; scripts/gpu_check.sh then finds the file
#   there and runs the model's GPU tests and benchmarks (it sets KVTOOL_DEFAULT_GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PARTS=${PARTS:-2}
HERE=.gpu_model
THERE=${KVTOOL_MODEL_DIR:-/tmp/kvtool-model}

case "${1:-}" in
  split)
    src=$(python3 -c "from kvtool.engine.default_model import find_gguf; print(find_gguf())")
    rm -rf "$HERE" && mkdir -p "$HERE"
    size=$(stat -c %s "$src")
    per=$(( (size + PARTS - 1) / PARTS ))
    split -b "$per" -d -a 1 "$src" "$HERE/part-"
    echo "$(sha256sum < "$src" | cut -d' ' -f1)  $NAME" > "$HERE/SHA256"
    grep -qxF "/$HERE/" .git/info/exclude 2>/dev/null || echo "/$HERE/" >> .git/info/exclude
    ls -l "$HERE"
    ;;
  gather)
    mkdir -p "$THERE/parts"
    for p in "$HERE"/part-*; do
      [ -f "$p" ] && cp "$p" "$THERE/parts/" && echo "stored $(basename "$p") in $THERE/parts"
    done
    [ -f "$HERE/SHA256" ] && cp "$HERE/SHA256" "$THERE/"
    have=$(find "$THERE/parts" -name 'part-*' | wc -l)
    if [ "$have" -lt "$PARTS" ]; then
      echo "$have of $PARTS parts here; send the others"
      exit 0
    fi
    cat "$THERE"/parts/part-* > "$THERE/$NAME.tmp" && mv "$THERE/$NAME.tmp" "$THERE/$NAME"
    (cd "$THERE" && sha256sum -c SHA256)
    echo "the default model is at $THERE/$NAME; scripts/gpu_check.sh will use it"
    ;;
  *)
    echo "usage: $0 split|gather" >&2
    exit 2
    ;;
esac
