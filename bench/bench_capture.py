"""Capture overhead: connector and writer time as a share of prefill time; capture through transformers.

    python bench/bench_capture.py [--tokens 1024 2048] [--threads 1] [--device cpu|cuda]
                                  [--model-dtype fp32|bf16] [--hf-rounds 3]

Runs `kvtool.capture.capture` (the code behind `kvtool capture`) on the default
model over offline text (Python stdlib source) with each codec, and splits the
time into prefill (the paged runner), connector (PagedMemConnectorV2.from_gpu:
paged buffer -> KV_BLOB) and writer (encode + CRC-32C + write + fsync/rename).
Goal (capture issue): connector + writer under 10% of prefill with the raw codec.

Then the same tokens captured by both engines, side by side (HF issue): kvtool's
paged runner and transformers (`capture --engine hf`: the default model's converted
folder loaded by `load_hf_model`, its DynamicCache gathered by the same connector
and written by the same writer), raw codec, in `--hf-rounds` paired rounds whose
order alternates; each engine's best and median capture time, tokens/s, and
transformers' time over kvtool's (of the bests, and the median of the rounds'
own ratios). `--hf-rounds 0` leaves these rows out (without transformers they are
left out too).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.ops.capture import capture  # noqa: E402
from kvtool.codecs import codec_names  # noqa: E402
from kvtool.devices import describe, resolve_device  # noqa: E402
from kvtool.dtypes import dtype_from_name  # noqa: E402
from kvtool.engine import load_model  # noqa: E402
from kvtool.format import ContainerReader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, auto")
    ap.add_argument("--model-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="the weights' dtype, in both engines (default fp32)")
    ap.add_argument("--hf-rounds", type=int, default=3,
                    help="paired rounds of kvtool's engine vs transformers per token count (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = dtype_from_name(args.model_dtype)
    model = load_model(None, dtype=dtype, device=resolve_device(args.device))
    ids = model.tokenizer.encode(inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
                                 + inspect.getsource(argparse))
    with tempfile.TemporaryDirectory() as tmp:
        codec_rows(model, ids, args, Path(tmp))
        if args.hf_rounds > 0:
            engine_rows(model, ids, args, Path(tmp))


def codec_rows(model, ids: list[int], args, tmp: Path) -> None:
    """kvtool's engine with each codec: prefill, connector and writer time."""
    codecs = [c for c in ("raw", "zstd", "cachegen") if c in codec_names()]
    print(f"# capture overhead, SmolLM2-135M, {args.model_dtype} weights, bf16 KV, 256-token chunks, "
          f"{args.threads} thread(s), model on {describe(model.device)}\n")
    print("| tokens | codec | prefill s | connector ms | writer ms | overhead / prefill | file MB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in args.tokens:
        for codec in codecs:
            r = capture(model, ids[:n], tmp / f"{codec}.kvc", codec=codec)
            t = r.timings
            print(f"| {n} | {codec} | {t['prefill_s']:.2f} | {t['connector_s'] * 1e3:.1f} | "
                  f"{t['writer_s'] * 1e3:.1f} | {100 * t['overhead_share']:.2f}% | "
                  f"{r.file_bytes / 1e6:.2f} |", flush=True)


def engine_rows(model, ids: list[int], args, tmp: Path) -> None:
    """The same tokens captured by kvtool's engine and by transformers (`--engine hf`), raw codec,
    in paired rounds of alternating order: time, tokens/s, and the ratio of the two."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the default model's folder is local
    try:
        from kvtool.integrations.hf.models import load_hf_model
    except ImportError as err:
        print(f"\n(transformers rows left out: {err}; pip install 'kvtool[model]')")
        return
    hf = load_hf_model(None, dtype=model.dtype, device=model.device)  # what `capture --engine hf` loads
    engines = {"kvtool": model, "hf": hf}
    import transformers

    print(f"\n# capture by engine: kvtool's paged runner vs transformers {transformers.__version__} "
          f"(--engine hf, attn {hf.model.config._attn_implementation}), the same token ids, raw codec, "
          f"{args.model_dtype} weights, bf16 KV, {args.hf_rounds} paired rounds (order alternating), "
          f"{args.threads} thread(s), model on {describe(model.device)}; identity fingerprints "
          f"{'equal' if hf.identity.fingerprint() == model.identity.fingerprint() else 'DIFFER'}\n")
    print("| tokens | engine | capture s best | median | tokens/s (best) | prefill s | connector ms | "
          "overhead / prefill | time ÷ kvtool's: best / paired median | KV max abs diff / max abs |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for name, m in engines.items():  # warm-up: each engine's first capture allocates
        capture(m, ids[:256], tmp / f"warm-{name}.kvc")
    for n in args.tokens:
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        best: dict[str, dict] = {}
        for round_ in range(args.hf_rounds):
            for name in (list(engines) if round_ % 2 == 0 else list(reversed(engines))):
                t0 = time.perf_counter()
                r = capture(engines[name], ids[:n], tmp / f"{name}.kvc")
                s = time.perf_counter() - t0
                if not seconds[name] or s < min(seconds[name]):
                    best[name] = r.timings
                seconds[name].append(s)
        paired = statistics.median(h / k for h, k in zip(seconds["hf"], seconds["kvtool"]))
        diff = kv_max_diff(tmp / "kvtool.kvc", tmp / "hf.kvc")
        for name in engines:
            s, t = seconds[name], best[name]
            ratio = "1.00x" if name == "kvtool" else \
                f"{min(s) / min(seconds['kvtool']):.2f}x / {paired:.2f}x"
            print(f"| {n} | {name} | {min(s):.2f} | {statistics.median(s):.2f} | {n / min(s):.0f} | "
                  f"{t['prefill_s']:.2f} | {t['connector_s'] * 1e3:.1f} | {100 * t['overhead_share']:.2f}% | "
                  f"{ratio} | {'' if name == 'kvtool' else f'{diff[0]:.3g} / {diff[1]:.3g}'} |", flush=True)


def kv_max_diff(a: Path, b: Path) -> tuple[float, float]:
    """The largest |difference| between two files' KV (same tokens, same chunks), and the largest
    |value| of the first (the scale of a bf16 step there), as float32."""
    diff = scale = 0.0
    with ContainerReader(a) as fa, ContainerReader(b) as fb:
        if fa.token_ids().tolist() != fb.token_ids().tolist():
            raise SystemExit("bench_capture: the two engines' files hold different tokens")
        for i in range(len(fa.chunks)):
            ka, kb = fa.read_chunk(i).float(), fb.read_chunk(i).float()
            diff, scale = max(diff, float((ka - kb).abs().max())), max(scale, float(ka.abs().max()))
    return diff, scale


if __name__ == "__main__":
    from kvtool.errors import KvtoolError

    try:
        main()
    except KvtoolError as err:  # a bad --device and the like: one line, not a traceback
        sys.exit(f"bench_capture: {err}")
