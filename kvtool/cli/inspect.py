"""`kvtool inspect FILE`: what a file holds, without decoding it (unless --stats)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from .options import InputPath, JsonOpt
from .output import emit, human_bytes, renders

StatsOpt = Annotated[bool, typer.Option("--stats", help="Decode and show per-layer K/V statistics.")]


def command(path: InputPath, stats: StatsOpt = False, json: JsonOpt = False) -> None:
    """Show the header, model identity, chunk table and totals of a KV file."""
    from ..ops.inspect import inspect

    emit(inspect(path, stats=stats), json)


@renders("FileSummary")
def render(console: Console, r: dict[str, Any]) -> None:
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
    if r.get("stats"):
        st = Table(show_edge=False, header_style="bold", title="per-layer statistics")
        for col in ("layer", "K/V", "min", "max", "mean", "std", "outlier channels (absmax/median)"):
            st.add_column(col, justify="left" if col.startswith("outlier") else "right")
        for s in sorted(r["stats"], key=lambda s: (s["layer"], s["kind"])):
            st.add_row(str(s["layer"]), s["kind"], f"{s['min']:.3f}", f"{s['max']:.3f}",
                       f"{s['mean']:.3f}", f"{s['std']:.3f}",
                       ", ".join(f"{o['channel']} ({o['absmax_over_median']:.1f}x)"
                                 for o in s["outlier_channels"]))
        console.print(st)
