"""`kvtool inspect FILE`: what a file holds, without decoding it (unless --stats)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from ..ops.file_requests import InspectRequest
from .commands import request_command
from .output import emit, escaped, human_bytes, plural, progress, renders

if TYPE_CHECKING:
    from ..ops.inspect import FileSummary


def run(request: InspectRequest, json: bool) -> None:
    from ..ops.inspect import inspect

    with progress("decoding", "chunks", enabled=request.stats and not json) as update:
        summary = inspect(request, on_chunk=update)
    if request.wide and not json:  # as wide as the lines are: full hashes never wrap, whatever the terminal
        render(Console(highlight=False, width=4096), escaped(summary), wide=True)
    else:
        emit(summary, json)


command = request_command(InspectRequest, run, "Show the header, model identity, chunk table and totals of a KV file.")


@renders("FileSummary")
def render(console: Console, r: FileSummary, wide: bool = False) -> None:
    """Designed for 80 columns (a pipe, a CI log): short hashes and one line per chunk;
    `--wide` prints them in full."""
    model = r.model  # the file's model identity, as the manifest records it
    console.print(f"[bold]{r.path}[/bold]", overflow="fold")
    console.print(f"file   kvtool format {r.format_version}, {human_bytes(r.file_size)}, "
                  f"blobs aligned to {r.alignment}")
    console.print(f"model  {model['name']} ({model['architecture']})", overflow="fold")
    console.print(f"       {model['num_layers']} layers, {model['num_kv_heads']} KV heads x {model['head_dim']}, "
                  f"{rope_text(model.get('rope'))}")
    print_fingerprint(console, model["fingerprint"], wide)
    if r.latent is not None:  # an mla_latent file: one latent per token and layer (container.md 3.2)
        console.print(f"layout {r.kv_layout}: kv_lora_rank {r.latent['kv_lora_rank']} + rope_dim "
                      f"{r.latent['rope_dim']} per token and layer")
    console.print(f"KV     {r.kv_dtype}, {r.num_tokens} tokens in {plural(r.num_chunks, 'chunk')} of "
                  f"{r.chunk_size}; token ids {checksum_text(r.tokens_checksum)}")
    console.print(chunk_table(r.chunks, wide))
    if r.chunks_omitted:
        console.print(f"... {plural(r.chunks_omitted, 'more chunk')} (--all lists them)")
    t = r.totals
    console.print(f"total  {human_bytes(t['stored_bytes'])} for {human_bytes(t['decoded_bytes'])} of KV: "
                  f"{t['ratio']:.2f}x, {t['bits_per_value']:.2f} bits/value "
                  f"({t['file_bits_per_value']:.2f} in the file)")
    if t["bad_checksums"]:
        console.print(f"[red]{plural(t['bad_checksums'], 'bad checksum')}[/red]: verify names them")
    by_codec = bits_by_part(r.chunks)
    for codec, parts in by_codec.items():  # one line per codec: each breaks its bits into its own parts
        label = "bits/value by part" + ("" if len(by_codec) == 1 else f", {codec} chunks")
        label += " (listed chunks): " if r.chunks_omitted else ": "
        console.print(label + ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if v >= 0.0005))
    for name, e in r.extras.items():
        console.print(f"extra  {name}: {e['dtype']} [{' x '.join(str(n) for n in e['shape'])}], "
                      f"{human_bytes(e['stored_bytes'])}")
    for c in r.calibrations:
        console.print(f"calibration {c['digest'][:16]}... carried: {human_bytes(c['stored_bytes'])}, "
                      f"{c['bits_per_value']:.3f} bits/value over this file's KV (crc {c['checksum']})")
    if r.stats:
        console.print("per-layer statistics (outliers: channel, absmax / median)")
        console.print(stats_table(r.stats))


def chunk_table(chunks: list[dict[str, Any]], wide: bool) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False, show_edge=False)
    for col, justify in (("#", "right"), ("tokens", "left"), ("codec", "left"), ("stored", "right"),
                         ("ratio", "right"), ("bits/v", "right"), ("crc", "left"), ("prefix hash", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    if wide:
        table.add_column("codec parameters", no_wrap=True)
    for c in chunks:
        row = [str(c["index"]), f"{c['start']}-{c['end']}", c["codec"], human_bytes(c["stored_bytes"]),
               f"{c['ratio']:.2f}x", f"{c['bits_per_value']:.2f}", checksum_text(c["checksum"]),
               c["prefix_hash"] if wide else c["prefix_hash"][:12]]
        if wide:
            row.append(", ".join(f"{k}={v}" for k, v in c["codec_params"].items() if k != "version"))
        table.add_row(*row)
    return table


def stats_table(stats: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False, show_edge=False)
    for col in ("layer", "K/V", "min", "max", "mean", "std", "outliers"):
        table.add_column(col, justify="left" if col == "outliers" else "right", no_wrap=col != "outliers")
    for s in sorted(stats, key=lambda s: (s["layer"], s["kind"])):
        table.add_row(str(s["layer"]), s["kind"], f"{s['min']:.3f}", f"{s['max']:.3f}", f"{s['mean']:.3f}",
                      f"{s['std']:.3f}", ", ".join(f"{o['channel']} ({o['absmax_over_median']:.1f}x)"
                                                    for o in s["outlier_channels"]))
    return table


def bits_by_part(chunks: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each codec's bits per value by part, weighted by each chunk's number of values: codecs
    have parts of their own (a file `store get` wrote may mix them), so each is summed apart."""
    by_codec: dict[str, list[dict[str, Any]]] = {}
    for c in chunks:
        if "codec_stats" in c:
            by_codec.setdefault(c["codec"], []).append(c)
    return {codec: _weighted_parts(rows) for codec, rows in by_codec.items()}


def _weighted_parts(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = dict.fromkeys(k for c in rows for k in c["codec_stats"] if k.startswith("bpv_"))
    total = sum(c["decoded_bytes"] for c in rows) or 1
    return {k[4:].replace("_", " "): sum(c["codec_stats"].get(k, 0.0) * c["decoded_bytes"] for c in rows) / total
            for k in keys}


def print_fingerprint(console: Console, fingerprint: str, wide: bool) -> None:
    short = fingerprint if wide or len(fingerprint) <= 40 else f"{fingerprint[:23]}…{fingerprint[-8:]}"
    console.print(f"       fingerprint {short}", overflow="fold")


def rope_text(rope: Any) -> str:
    """{'rope_theta': 100000.0, 'rope_scaling': None} -> 'rope theta 100000'."""
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return "rope ?"
    text = f"rope theta {rope['rope_theta']:g}"
    scaling = rope.get("rope_scaling")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type") or scaling.get("type") or "scaled"
        factor = scaling.get("factor")
        text += f", {kind} scaling" + (f" x{factor:g}" if isinstance(factor, (int, float)) else "")
    return text


def checksum_text(status: str) -> str:
    return "[green]ok[/green]" if status == "ok" else "[red]BAD[/red]"


