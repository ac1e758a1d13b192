#!/usr/bin/env python3
"""Blending cached segments (CacheBlend, issue 16): quality and time to first token against a full
prefill, by recompute ratio, on a RAG-like workload.

Workload: excerpts of Python's stdlib documentation (module and class docstrings of json, heapq,
textwrap, argparse, statistics and uuid, each cut at a line to at most --tokens tokens, offline),
each captured alone into a real segment file (`kvtool.ops.capture.capture(segment=True)`, bf16,
raw, 256-token chunks), then a question. Several orders of the documents (--orders). For each
order:

  full      a fresh paged cache and a prefill of the whole prompt (one chunk), timed to the first
            token's logits; its greedy continuation of --answer tokens is the reference answer,
            the logits along it the reference distributions
  blend@r   open and decode every segment file (CRC-checked) + `blend_prefill` at recompute ratio r
            (check layer 1), timed to the first token's logits; then teacher-forced along the
            reference answer. r = 0 is naive reuse (the cached KV moved, only the question computed).

Quality (`kvtool.ops.compare.compare_logits`): top-1 agreement with the full prefill, mean
KL(full || blend) per position, ΔNLL of the reference answer. Every timing runs with --threads
torch threads (default 1: the machine is shared). The files sit in the OS page cache.

    python bench/bench_blend.py              # 6 x 500 tokens, 3 orders, ratios 0,0.05,0.15,0.3,1
    python bench/bench_blend.py --quick      # 4 x 200 tokens, 1 order, ratios 0,0.15,1
    python bench/bench_blend.py --ratios 0,0.15 --selection key-l2   # the plain-K choice, compared
"""

from __future__ import annotations

import argparse
import ast
import datetime
import pathlib
import platform
import shlex
import statistics
import sys
import sysconfig
import tempfile
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))

SOURCES = [("json/__init__.py", None), ("heapq.py", "__about__"), ("textwrap.py", "TextWrapper"),
           ("argparse.py", None), ("statistics.py", None), ("uuid.py", None)]
QUESTION = ("\n\nQuestion: Using the documentation above, explain how a heap differs from a sorted list "
            "and which module would you use to parse command-line options?\nAnswer:")
ORDERS = [[0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 4, 0, 5, 1, 3], [1, 0, 3, 2, 5, 4]]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=6, help="documents (1-6, default 6)")
    ap.add_argument("--tokens", type=int, default=500, help="tokens per document at most (default 500)")
    ap.add_argument("--orders", type=int, default=3, help="orders of the documents (1-4, default 3)")
    ap.add_argument("--ratios", default="0,0.05,0.15,0.3,1", help="recompute ratios")
    ap.add_argument("--check-layer", type=int, default=1)
    ap.add_argument("--answer", type=int, default=32, help="teacher-forced answer tokens (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--selection", choices=["kv-normalised", "key-l2"], default="kv-normalised",
                    help="how tokens are chosen: the engine's (per-head normalised K and V deviation) or, for "
                         "comparison, the plain L2 deviation of K (the first version's)")
    ap.add_argument("--quick", action="store_true", help="4 documents of 200 tokens, 1 order, ratios 0,0.15,1")
    ap.add_argument("--md", default="", help="append the markdown tables to this file ('' = print only)")
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.tokens, args.orders, args.ratios = 4, 200, 1, "0,0.15,1"
    args.ratios = [float(r) for r in args.ratios.split(",")]
    return args


def docstring(path: pathlib.Path, name: str | None) -> str:
    tree = ast.parse(path.read_text())
    if name is None:
        return ast.get_docstring(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return ast.get_docstring(node)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return node.value.value
    raise LookupError(f"{name} not in {path}")


def excerpts(tokenizer, count: int, tokens: int) -> list[str]:
    """The first `count` documents, each its docstring's leading lines within `tokens` tokens."""
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = []
    for rel, name in SOURCES[:count]:
        kept = ""
        for line in docstring(lib / rel, name).splitlines(keepends=True):
            if len(tokenizer.encode(f"Document ({rel}):\n{kept}{line}\n")) > tokens:
                break
            kept += line
        out.append(f"Document ({rel}):\n{kept}\n")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from kvtool.engine import PagedKVCache, Runner, load_model
    import kvtool.engine.blend as blend_module
    from kvtool.engine.blend import blend_prefill
    from kvtool.ops.blend import segment_from_file
    from kvtool.ops.capture import capture
    from kvtool.ops.compare import compare_logits

    if args.selection == "key-l2":  # the first version's choice, for comparison
        blend_module.kv_deviation = lambda k, v, old_k, old_v, cached: (k.float() - old_k).flatten(1).norm(dim=1)
    started = time.perf_counter()
    model = load_model(None)
    tok = model.tokenizer
    texts = excerpts(tok, args.docs, args.tokens)
    question = tok.encode(QUESTION)
    kv_dtype = torch.bfloat16

    def fresh(n):
        cache = PagedKVCache.for_tokens(model.config, n + args.answer, kv_dtype=kv_dtype, shuffle_seed=1)
        return Runner(model, cache), cache.new_sequence()

    def forced_logits(runner, seq, n, first, answer):
        rest = runner.prefill(seq, answer[:-1], start_pos=n, logits="all")
        return torch.cat([first[None], rest])

    warm, wseq = fresh(8)
    warm.prefill(wseq, [0] * 8, logits="last")  # one-time costs out of the timings
    rows = []  # (order index, ratio, metrics, ttft, load)
    fulls = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, text in enumerate(texts):
            path = pathlib.Path(tmp) / f"doc{i}.kvc"
            capture(model, tok.encode(text), path, kv_dtype=kv_dtype, segment=True)
            paths.append(path)
        doc_tokens = [len(tok.encode(t)) for t in texts]
        orders = [[i for i in o if i < args.docs] for o in ORDERS[:args.orders]]
        for oi, order in enumerate(orders):
            prompt = [t for i in order for t in tok.encode(texts[i])] + question
            n = len(prompt)
            runner, seq = fresh(n)
            t0 = time.perf_counter()
            first = runner.prefill(seq, prompt, prefill_chunk=n, logits="last")[0]
            ttft_full = time.perf_counter() - t0
            ref, answer = [first], [int(first.argmax())]
            while len(answer) < args.answer:
                ref.append(runner.decode_step(seq, answer[-1]))
                answer.append(int(ref[-1].argmax()))
            ref = torch.stack(ref)
            fulls.append((n, ttft_full, tok.decode(answer)))
            print(f"order {oi} {order}: {n} tokens, full prefill {ttft_full:.2f} s; answer {tok.decode(answer)!r}",
                  flush=True)
            for ratio in args.ratios:
                runner, seq = fresh(n)
                t0 = time.perf_counter()
                segments = [segment_from_file(paths[i], model) for i in order]
                load = time.perf_counter() - t0
                result = blend_prefill(runner, seq, segments, question, recompute_ratio=ratio,
                                       check_layer=args.check_layer)
                ttft = time.perf_counter() - t0
                m = compare_logits(ref, forced_logits(runner, seq, n, result.logits, answer), answer)
                rows.append((oi, ratio, m, ttft, load, ttft_full))
                print(f"  ratio {ratio:.2f}: TTFT {ttft:.2f} s (load {load * 1e3:.0f} ms, {ttft_full / ttft:.1f}x), "
                      f"top-1 {m['top1_agreement']:.3f}, KL {m['kl_mean']:.4f}, ΔNLL {m['delta_nll']:+.4f}",
                      flush=True)
    elapsed = time.perf_counter() - started

    lines = []
    ratios = args.ratios
    naive_kl = {oi: r[2]["kl_mean"] for r in rows for oi in [r[0]] if r[1] == 0.0}
    given = list(argv) if argv is not None else sys.argv[1:]
    lines.append(f"Command: `{shlex.join(['python', 'bench/bench_blend.py', *given])}`")
    lines.append("")
    lines.append(f"{len(texts)} documents of {min(doc_tokens)}-{max(doc_tokens)} tokens + a {len(question)}-token "
                 f"question = {fulls[0][0]} tokens; {len(orders)} order(s); check layer {args.check_layer}; "
                 f"{args.answer}-token teacher-forced answer (the full prefill's greedy one); bf16 KV; "
                 f"selection {args.selection}; "
                 f"{args.threads} torch thread(s). Means over the orders.")
    lines.append("")
    lines.append("| recompute ratio | top-1 agreement | KL mean (nats) | KL / naive's | ΔNLL | TTFT (s) [load] | "
                 "speedup vs full |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|")
    full_mean = statistics.mean(f[1] for f in fulls)
    for ratio in ratios:
        sel = [r for r in rows if r[1] == ratio]
        kl = statistics.mean(r[2]["kl_mean"] for r in sel)
        rel = statistics.mean(r[2]["kl_mean"] / naive_kl[r[0]] for r in sel) if naive_kl else float("nan")
        lines.append(f"| {ratio:.0%} | {statistics.mean(r[2]['top1_agreement'] for r in sel):.3f} | {kl:.4f} | "
                     f"{rel:.3f} | {statistics.mean(r[2]['delta_nll'] for r in sel):+.4f} | "
                     f"{statistics.mean(r[3] for r in sel):.2f} [{statistics.mean(r[4] for r in sel):.2f}] | "
                     f"{statistics.mean(r[5] / r[3] for r in sel):.1f}x |")
    lines.append(f"| full prefill | 1 | 0 | 0 | 0 | {full_mean:.2f} | 1x |")
    lines.append("")
    lines.append("Per order (KL mean at each ratio; TTFT full prefill):")
    lines.append("")
    lines.append("| order | tokens | " + " | ".join(f"KL@{r:.0%}" for r in ratios) + " | full TTFT (s) |")
    lines.append("|---|---:|" + "---:|" * len(ratios) + "---:|")
    for oi, order in enumerate(orders):
        kls = [next(r[2]["kl_mean"] for r in rows if r[0] == oi and r[1] == ratio) for ratio in ratios]
        lines.append(f"| {order} | {fulls[oi][0]} | " + " | ".join(f"{k:.4f}" for k in kls) + f" | {fulls[oi][1]:.2f} |")
    lines.append("")
    lines.append("```")
    lines.append("mean KL vs full prefill (each # is 1/40 of the largest) and TTFT (each = is 1/40 of full prefill's)")
    top = max(statistics.mean(r[2]["kl_mean"] for r in rows if r[1] == ratio) for ratio in ratios) or 1.0
    for ratio in ratios:
        sel = [r for r in rows if r[1] == ratio]
        kl = statistics.mean(r[2]["kl_mean"] for r in sel)
        t = statistics.mean(r[3] for r in sel)
        lines.append(f"{ratio:>5.0%} KL   {'#' * round(40 * kl / top):<40} {kl:.4f}")
        lines.append(f"      TTFT {'=' * round(40 * t / full_mean):<40} {t:.2f} s")
    lines.append(f" full TTFT {'=' * 40} {full_mean:.2f} s")
    lines.append("```")
    lines.append("")
    if 0.15 in ratios and 0.0 in ratios:
        kl15 = statistics.mean(r[2]["kl_mean"] for r in rows if r[1] == 0.15)
        kl0 = statistics.mean(r[2]["kl_mean"] for r in rows if r[1] == 0.0)
        speed = statistics.mean(r[5] / r[3] for r in rows if r[1] == 0.15)
        lines.append(f"Goal \"at 15% recompute mean KL <= 1/5 of naive reuse's\": mean KL {kl15:.4f} vs "
                     f"{kl0:.4f} = **{kl15 / kl0:.3f}** of naive: **{'met' if kl15 <= kl0 / 5 else 'missed'}**.")
        lines.append(f"Goal \"TTFT >= 3x faster than full prefill at >= 3k tokens on the CPU\": {speed:.1f}x at "
                     f"{fulls[0][0]} tokens: **{'met' if speed >= 3 and fulls[0][0] >= 3000 else 'missed'}**"
                     + ("" if fulls[0][0] >= 3000 else " (fewer than 3k tokens: not the goal's workload)") + ".")
        lines.append("")
    lines.append(f"Machine: {platform.machine()} {platform.processor() or ''}, Python {platform.python_version()}, "
                 f"torch {torch.__version__}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
                 f"run time {elapsed / 60:.1f} min.")
    text = "\n".join(lines)
    print()
    print(text)
    if args.md:
        with open(args.md, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
