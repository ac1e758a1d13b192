"""`kvtool verify FILE [--against OTHER]`: prove a file is intact (exit 0/1/2)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import torch
import typer
from rich.console import Console

from ..errors import DataError, KvtoolError, ModelMismatch, UsageError
from ..format import ContainerReader
from ..format.hashing import prefix_hashes
from ..format.identity import model_fingerprint
from .options import DeviceOpt, InputPath, JsonOpt, ModelDtypeOpt, ModelOpt, model_dtype
from .output import emit

AgainstOpt = Annotated[Optional[Path], typer.Option(
    "--against", help="Compare decoded KV with this file (e.g. the raw original of a lossy file).")]
AtolOpt = Annotated[float, typer.Option("--atol", help="Allowed absolute error per value.")]
RtolOpt = Annotated[float, typer.Option(
    "--rtol", help="Allowed error relative to the layer's largest reference magnitude.")]
ReplayOpt = Annotated[bool, typer.Option(
    "--replay", help="Also replay the file into the model and compare with a full recompute.")]
ReplayTop1Opt = Annotated[float, typer.Option("--min-top1", help="With --replay: minimum top-1 agreement.")]
ReplayKlOpt = Annotated[Optional[float], typer.Option("--max-kl", help="With --replay: maximum mean KL.")]
ReplayContinueOpt = Annotated[int, typer.Option("--continue", help="With --replay: teacher-forced tokens.")]


def verify_command(path: InputPath, against: AgainstOpt = None, atol: AtolOpt = 0.0,
                   rtol: RtolOpt = 0.0, replay: ReplayOpt = False, model: ModelOpt = None,
                   min_top1: ReplayTop1Opt = 0.9, max_kl: ReplayKlOpt = None,
                   continue_tokens: ReplayContinueOpt = 16, device: DeviceOpt = "auto",
                   weights_dtype: ModelDtypeOpt = "fp32", json: JsonOpt = False) -> int:
    """Check structure, checksums, decoding, finiteness and prefix hashes (exit 1 if any fails)."""
    from ..devices import resolve_device

    resolve_device(device)  # a bad option is an error with or without --replay / --against
    model_dtype(weights_dtype)
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if not 0 <= value < float("inf"):
            raise UsageError(f"{name} {value}: expected a finite number >= 0")
    if not 0 <= min_top1 <= 1:
        raise UsageError(f"--min-top1 {min_top1}: expected a fraction in [0, 1]")
    if max_kl is not None and not 0 <= max_kl < float("inf"):
        raise UsageError(f"--max-kl {max_kl}: expected a finite number >= 0")
    if continue_tokens < 1:
        raise UsageError("--continue must be at least 1")
    with ContainerReader(path) as reader:
        result = verify_file(reader)
        if against is not None and not result["problems"]:  # a damaged file is not compared
            with ContainerReader(against) as other:
                try:
                    result["comparison"] = compare_files(reader, other, atol=atol, rtol=rtol)
                except DataError as err:  # the reference itself is damaged
                    result["problems"].append(f"{against}: {err}")
            if "comparison" in result and not result["comparison"]["ok"]:
                result["problems"].append(f"decoded KV differs from {against} beyond tolerance")
    if replay and not result["problems"]:
        from .replay import run_replay

        result["replay"] = run_replay(path, model, continue_tokens=continue_tokens, compare=True,
                                      min_top1=min_top1, max_kl=max_kl, device=device,
                                      weights_dtype=weights_dtype)
        result["problems"] += [f"replay: {f}" for f in result["replay"]["failures"]]
    result["ok"] = not result["problems"]
    emit(result, json, _render)
    if not result["ok"]:
        more = f" (and {len(result['problems']) - 1} more)" if len(result["problems"]) > 1 else ""
        sys.stderr.write(f"kvtool: error: verify failed: {result['problems'][0]}{more}\n")
    return 0 if result["ok"] else 1


def verify_file(reader: ContainerReader) -> dict[str, Any]:
    """Run every check; collect problems instead of stopping at the first one."""
    m = reader.manifest
    problems: list[str] = []
    checks = {"structure": "ok"}
    tokens = None
    try:
        tokens = reader.token_ids()
        checks["token_ids"] = "ok"
        vocab = m.model.get("vocab_size")
        if isinstance(vocab, int) and tokens.size and int(tokens.max()) >= vocab:
            checks["token_ids"] = "BAD"
            problems.append(f"token id {int(tokens.max())} is outside the model's vocabulary [0, {vocab})")
    except KvtoolError as err:
        checks["token_ids"] = "BAD"
        problems.append(str(err))
    if model_fingerprint({k: v for k, v in m.model.items() if k != "fingerprint"}) == m.model["fingerprint"]:
        checks["fingerprint"] = "ok"
    else:
        checks["fingerprint"] = "BAD"
        problems.append("model fingerprint does not match the recorded model identity")
    expected_hashes = prefix_hashes(tokens, m.chunk_size) if tokens is not None else None
    chunk_checks = []
    for c in m.chunks:
        status = {"index": c.index, "checksum": "ok", "decode": "ok", "finite": "ok", "prefix_hash": "ok"}
        if expected_hashes is not None and expected_hashes[c.index] != c.prefix_hash:
            status["prefix_hash"] = "BAD"
            problems.append(f"chunk {c.index}: prefix hash does not match the token ids")
        elif expected_hashes is None:
            status["prefix_hash"] = "unchecked"
        if not reader.blob_ok(c.blob):
            status.update(checksum="BAD", decode="skipped", finite="skipped")
            problems.append(f"chunk {c.index}: CRC-32C mismatch (stored bytes are corrupt)")
        else:
            try:
                kv = reader.read_chunk(c.index, verify=False)
                bad = int((~torch.isfinite(kv)).sum())
                if bad:
                    status["finite"] = "BAD"
                    problems.append(f"chunk {c.index}: {bad} non-finite value(s)")
            except KvtoolError as err:
                status.update(decode="BAD", finite="skipped")
                problems.append(str(err))
        chunk_checks.append(status)
    for name, e in m.extras.items():
        if not reader.blob_ok(e.blob):
            checks[f"extra:{name}"] = "BAD"
            problems.append(f"extra {name}: CRC-32C mismatch")
            continue
        try:
            t = reader.read_extra(name, verify=False)  # roi_mask: bytes other than 0/1 are a DecodeError
            bad = 0 if t.dtype == torch.bool else int((~torch.isfinite(t)).sum())
        except KvtoolError as err:
            checks[f"extra:{name}"] = "BAD"
            problems.append(f"extra {name}: {err}")
            continue
        checks[f"extra:{name}"] = "BAD" if bad else "ok"
        if bad:
            problems.append(f"extra {name}: {bad} non-finite value(s)")
    return {"path": str(reader.path), "num_chunks": len(m.chunks), "num_tokens": m.num_tokens,
            "checks": checks, "chunks": chunk_checks, "problems": problems}


def compare_files(reader: ContainerReader, other: ContainerReader, *, atol: float,
                  rtol: float) -> dict[str, Any]:
    """Per-layer max abs / relative error of `reader` against the reference `other`."""
    a, b = reader.manifest, other.manifest
    if (a.num_layers, a.hidden_kv) != (b.num_layers, b.hidden_kv):
        raise ModelMismatch(f"cannot compare: {reader.path} has {a.num_layers} layers x {a.hidden_kv} "
                            f"channels, {other.path} has {b.num_layers} x {b.hidden_kv}")
    if a.num_tokens != b.num_tokens or not np.array_equal(reader.token_ids(), other.token_ids()):
        raise ModelMismatch(f"cannot compare: {reader.path} and {other.path} hold different token sequences")
    max_abs = torch.zeros(2, a.num_layers, dtype=torch.float64)
    ref_max = torch.zeros(2, a.num_layers, dtype=torch.float64)
    sq_err = torch.zeros(2, a.num_layers, dtype=torch.float64)
    for start in range(0, a.num_tokens, a.chunk_size):
        end = min(start + a.chunk_size, a.num_tokens)
        x = reader.read_range(start, end).to(torch.float64)
        y = other.read_range(start, end).to(torch.float64)  # [2, L, T, C]
        err = (x - y).abs()
        max_abs = torch.maximum(max_abs, err.amax(dim=(2, 3)))
        ref_max = torch.maximum(ref_max, y.abs().amax(dim=(2, 3)))
        sq_err += (err * err).sum(dim=(2, 3))
    rmse = (sq_err / (a.num_tokens * a.hidden_kv)).sqrt()
    rel = max_abs / ref_max.clamp_min(1e-30)
    within = max_abs <= atol + rtol * ref_max
    layers = [{"kind": "KV"[k], "layer": l, "max_abs": max_abs[k, l].item(), "max_rel": rel[k, l].item(),
               "rmse": rmse[k, l].item(), "ok": bool(within[k, l])}
              for l in range(a.num_layers) for k in range(2)]
    return {"against": str(other.path), "atol": atol, "rtol": rtol, "ok": bool(within.all()),
            "max_abs": max_abs.max().item(), "max_rel": rel.max().item(), "layers": layers}


def _render(console: Console, r: dict[str, Any]) -> None:
    good = sum(all(v in ("ok", "unchecked") for k, v in c.items() if k != "index") for c in r["chunks"])
    console.print(f"[bold]{r['path']}[/bold]: {r['num_tokens']} tokens, {good}/{r['num_chunks']} chunks "
                  f"intact; " + ", ".join(f"{k} {v}" for k, v in r["checks"].items()))
    if "comparison" in r:
        cmp = r["comparison"]
        console.print(f"against {cmp['against']}: max abs error {cmp['max_abs']:.4g}, "
                      f"max relative {cmp['max_rel']:.4g} (atol {cmp['atol']}, rtol {cmp['rtol']})")
        worst = sorted(cmp["layers"], key=lambda x: -x["max_rel"])[:5]
        for w in worst:
            console.print(f"  layer {w['layer']:>3} {w['kind']}: max abs {w['max_abs']:.4g}, "
                          f"max rel {w['max_rel']:.4g}, rmse {w['rmse']:.4g}"
                          + ("" if w["ok"] else "  [red]over tolerance[/red]"))
    if "replay" in r:
        from .replay import render as render_replay

        render_replay(console, {**r["replay"], "failures": []})
    for p in r["problems"]:
        console.print(f"[red]FAIL[/red] {p}")
    console.print("[green]OK[/green]" if r["ok"] else f"[red]{len(r['problems'])} problem(s)[/red]")
