"""`kvtool inspect FILE`: what a file holds, without decoding it (unless --stats)."""

from __future__ import annotations

from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from ..format import ContainerReader
from .options import InputPath, JsonOpt
from .output import emit, human_bytes

StatsOpt = Annotated[bool, typer.Option("--stats", help="Decode and show per-layer K/V statistics.")]


def inspect_command(path: InputPath, stats: StatsOpt = False, json: JsonOpt = False) -> None:
    """Show the header, model identity, chunk table and totals of a KV file."""
    with ContainerReader(path) as reader:
        result = describe(reader)
        if stats:
            result["stats"] = layer_stats(reader)
    emit(result, json, _render)


def describe(reader: ContainerReader) -> dict[str, Any]:
    m = reader.manifest
    values_per_token = 2 * m.num_layers * m.hidden_kv
    rows = []
    for c in m.chunks:
        row = {"index": c.index, "start": c.start, "end": c.end, "codec": c.codec,
               "stored_bytes": c.blob.length, "decoded_bytes": c.decoded_bytes,
               "ratio": c.decoded_bytes / max(c.blob.length, 1),
               "bits_per_value": 8 * c.blob.length / (c.num_tokens * values_per_token),
               "checksum": "ok" if reader.blob_ok(c.blob) else "BAD",
               "prefix_hash": c.prefix_hash, "codec_params": c.codec_params}
        details = _payload_stats(c.codec)
        if details is not None and row["checksum"] == "ok":
            row["codec_stats"] = details(reader.chunk_payload(c.index, verify=False), c.shape,
                                         c.codec_params)
        rows.append(row)
    stored = sum(c.blob.length for c in m.chunks)
    decoded = sum(c.decoded_bytes for c in m.chunks)
    return {
        "path": str(reader.path), "file_size": reader.file_size,
        "format_version": reader.version, "alignment": reader.header.alignment,
        "model": m.model, "kv_dtype": m.kv_dtype, "num_tokens": m.num_tokens,
        "chunk_size": m.chunk_size, "num_chunks": len(m.chunks),
        "tokens_checksum": "ok" if reader.blob_ok(m.tokens) else "BAD",
        "chunks": rows,
        "totals": {"stored_bytes": stored, "decoded_bytes": decoded,
                   "ratio": decoded / max(stored, 1),
                   "bits_per_value": 8 * stored / (m.num_tokens * values_per_token),
                   "file_bits_per_value": 8 * reader.file_size / (m.num_tokens * values_per_token),
                   "bad_checksums": sum(r["checksum"] == "BAD" for r in rows)},
        "extras": {name: {"shape": list(e.shape), "dtype": e.dtype, "stored_bytes": e.blob.length}
                   for name, e in m.extras.items()},
        "metadata": m.metadata,
    }


def _payload_stats(codec: str):
    """A codec's per-payload breakdown of bits/value, where it offers one."""
    if codec == "cachegen":
        from ..codecs.cachegen import cachegen_payload_stats

        return cachegen_payload_stats
    return None


def layer_stats(reader: ContainerReader) -> list[dict[str, Any]]:
    """Per layer and K/V: min, max, mean, std, and channels far above the median max-abs."""
    m = reader.manifest
    shape = (2, m.num_layers)
    count = 0
    total = torch.zeros(shape, dtype=torch.float64)
    total_sq = torch.zeros(shape, dtype=torch.float64)
    lo = torch.full(shape, float("inf"), dtype=torch.float64)
    hi = torch.full(shape, float("-inf"), dtype=torch.float64)
    chan_absmax = torch.zeros(2, m.num_layers, m.hidden_kv, dtype=torch.float64)
    for i in range(len(m.chunks)):
        kv = reader.read_chunk(i).to(torch.float64)  # [2, L, T, C]
        count += kv.shape[2] * kv.shape[3]
        total += kv.sum(dim=(2, 3))
        total_sq += (kv * kv).sum(dim=(2, 3))
        lo = torch.minimum(lo, kv.amin(dim=(2, 3)))
        hi = torch.maximum(hi, kv.amax(dim=(2, 3)))
        chan_absmax = torch.maximum(chan_absmax, kv.abs().amax(dim=2))
    mean = total / count
    std = (total_sq / count - mean * mean).clamp_min(0).sqrt()
    median = chan_absmax.median(dim=2).values.clamp_min(1e-30)  # [2, L]
    out = []
    for kind in range(2):
        for layer in range(m.num_layers):
            ratio = chan_absmax[kind, layer] / median[kind, layer]
            top = torch.argsort(ratio, descending=True)[:3]
            out.append({"kind": "K" if kind == 0 else "V", "layer": layer,
                        "min": lo[kind, layer].item(), "max": hi[kind, layer].item(),
                        "mean": mean[kind, layer].item(), "std": std[kind, layer].item(),
                        "outlier_channels": [{"channel": int(c), "absmax_over_median": ratio[c].item()}
                                             for c in top if ratio[c] >= 4.0]})
    return out


def _render(console: Console, r: dict[str, Any]) -> None:
    model = r["model"]
    console.print(f"[bold]{r['path']}[/bold]  kvtool format {r['format_version']}, "
                  f"{human_bytes(r['file_size'])}, blob alignment {r['alignment']}")
    console.print(f"model  {model['name']} ({model['architecture']}), {model['num_layers']} layers, "
                  f"{model['num_kv_heads']} KV heads x {model['head_dim']}, rope {model.get('rope')}")
    console.print(f"       fingerprint {model['fingerprint']}")
    console.print(f"KV     {r['kv_dtype']}, {r['num_tokens']} tokens in {r['num_chunks']} chunks of "
                  f"{r['chunk_size']}; token ids checksum {r['tokens_checksum']}")
    table = Table(show_edge=False, header_style="bold")
    for col in ("#", "tokens", "codec", "stored", "ratio", "bits/value", "checksum", "prefix hash"):
        table.add_column(col, justify="right" if col in ("#", "stored", "ratio", "bits/value") else "left")
    for c in r["chunks"]:
        table.add_row(str(c["index"]), f"{c['start']}-{c['end']}", c["codec"],
                      human_bytes(c["stored_bytes"]), f"{c['ratio']:.2f}x",
                      f"{c['bits_per_value']:.2f}",
                      "[green]ok[/green]" if c["checksum"] == "ok" else "[red]BAD[/red]",
                      c["prefix_hash"][:16])
    console.print(table)
    t = r["totals"]
    console.print(f"total  {human_bytes(t['stored_bytes'])} stored for {human_bytes(t['decoded_bytes'])} "
                  f"of KV: {t['ratio']:.2f}x, {t['bits_per_value']:.2f} bits/value "
                  f"({t['file_bits_per_value']:.2f} with container overhead)"
                  + (f", [red]{t['bad_checksums']} bad checksum(s)[/red]" if t["bad_checksums"] else ""))
    shares = [c["codec_stats"] for c in r["chunks"] if "codec_stats" in c]
    if shares:  # bits per value by part, weighted by each chunk's number of values
        keys = [k for k in shares[0] if k.startswith("bpv_")]
        weights = [c["decoded_bytes"] for c in r["chunks"] if "codec_stats" in c]
        parts = {k[4:].replace("_", " "): sum(s[k] * w for s, w in zip(shares, weights)) / sum(weights)
                 for k in keys}
        console.print("bits/value by part: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if v >= 0.0005))
    for name, e in r["extras"].items():
        console.print(f"extra  {name} {e['dtype']} {e['shape']}")
    if "stats" in r:
        st = Table(show_edge=False, header_style="bold", title="per-layer statistics")
        for col in ("layer", "K/V", "min", "max", "mean", "std", "outlier channels (absmax/median)"):
            st.add_column(col, justify="left" if col.startswith("outlier") else "right")
        for s in sorted(r["stats"], key=lambda s: (s["layer"], s["kind"])):
            st.add_row(str(s["layer"]), s["kind"], f"{s['min']:.3f}", f"{s['max']:.3f}",
                       f"{s['mean']:.3f}", f"{s['std']:.3f}",
                       ", ".join(f"{o['channel']} ({o['absmax_over_median']:.1f}x)"
                                 for o in s["outlier_channels"]))
        console.print(st)
