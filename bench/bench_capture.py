"""Capture overhead: connector and writer time as a share of prefill time.

    python bench/bench_capture.py [--tokens 1024 2048] [--threads 1] [--device cpu|cuda]

Runs `kvtool.capture.capture` (the code behind `kvtool capture`) on the default
model over offline text (Python stdlib source) with each codec, and splits the
time into prefill (the paged runner), connector (PagedMemConnectorV2.from_gpu:
paged buffer -> KV_BLOB) and writer (encode + CRC-32C + write + fsync/rename).
Goal (capture issue): connector + writer under 10% of prefill with the raw codec.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.ops.capture import capture  # noqa: E402
from kvtool.codecs import codec_names  # noqa: E402
from kvtool.devices import describe, resolve_device  # noqa: E402
from kvtool.engine import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(None, device=resolve_device(args.device))
    ids = model.tokenizer.encode(inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
                                 + inspect.getsource(argparse))
    codecs = [c for c in ("raw", "zstd", "cachegen") if c in codec_names()]
    print(f"# capture overhead, SmolLM2-135M, bf16 KV, 256-token chunks, {args.threads} thread(s), "
          f"model on {describe(model.device)}\n")
    print("| tokens | codec | prefill s | connector ms | writer ms | overhead / prefill | file MB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.tokens:
            for codec in codecs:
                r = capture(model, ids[:n], Path(tmp) / f"{codec}.kvc", codec=codec)
                t = r.timings
                print(f"| {n} | {codec} | {t['prefill_s']:.2f} | {t['connector_s'] * 1e3:.1f} | "
                      f"{t['writer_s'] * 1e3:.1f} | {100 * t['overhead_share']:.2f}% | "
                      f"{r.file_bytes / 1e6:.2f} |", flush=True)


if __name__ == "__main__":
    from kvtool.errors import KvtoolError

    try:
        main()
    except KvtoolError as err:  # a bad --device and the like: one line, not a traceback
        sys.exit(f"bench_capture: {err}")
