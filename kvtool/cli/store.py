"""`kvtool store put|get|ls|stats|gc|fsck|rm`: the chunk store (format-spec/store.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from ..ops.file_requests import (StoreFsckRequest, StoreGcRequest, StoreGetRequest, StoreListRequest, StorePutRequest,
                                 StoreRmRequest, StoreStatsRequest)
from .commands import request_command
from .output import KEPT_AS_STORED, emit, escaped, human_bytes, plural, renders

if TYPE_CHECKING:
    from ..ops.store import (StoreFsckResult, StoreGcResult, StoreGetResult, StoreListing, StorePutResult,
                             StoreRmResult, StoreStats)

app = typer.Typer(help="The chunk store: many sequences' chunks, by prefix; a folder or Redis.",
                  no_args_is_help=True, add_completion=False)


def _run(operation: str) -> Callable[[Any, bool], None]:
    """`run(request, json)` of the store's operation `operation` (imported when it runs)."""
    def run(request: Any, json: bool) -> None:
        from ..ops import store as ops

        emit(getattr(ops, operation)(request), json)
    return run


def _list(request: StoreListRequest, json: bool) -> None:
    from ..ops import store as ops

    listing = ops.ls(request)
    if request.wide and not json:
        render_ls(Console(highlight=False, width=1 << 16, soft_wrap=True), escaped(listing), wide=True)
    else:
        emit(listing, json)


for _name, _request, _run_it, _doc in (
    ("put", StorePutRequest, _run("put"), "Store the whole chunks of kvtool files (copied as encoded; chunks "
                                          "already stored are skipped)."),
    ("get", StoreGetRequest, _run("get"), "Write the longest cached prefix of a prompt as a kvtool file (exit 1 "
                                          "when nothing is cached): its whole chunks, then the longest "
                                          "block-aligned run of tokens past them that a stored sequence shares."),
    ("ls", StoreListRequest, _list, "List stored objects, most recently used first (a terminal shows short ids; "
                                    "`store rm` takes either)."),
    ("stats", StoreStatsRequest, _run("stats"), "How many objects and bytes, per kind and per model."),
    ("gc", StoreGcRequest, _run("gc"), "Evict least recently used objects down to --max-bytes; remove dead "
                                       "writers' temp files."),
    ("fsck", StoreFsckRequest, _run("fsck"), "Check every object; exit 1 when damage is found and left in place."),
    ("rm", StoreRmRequest, _run("rm"), "Remove objects by name, by model, by namespace, or all of them (with the "
                                       "entries naming them)."),
):
    app.command(_name)(request_command(_request, _run_it, _doc))


# --- rendering ---------------------------------------------------------------------------


@renders("StorePutResult")
def render_put(console: Console, r: StorePutResult) -> None:
    for f in r.files:
        console.print(f"{f.file}: {plural(f.chunks, 'whole chunk')} of {f.model} (chunk size "
                      f"{f.chunk_size}): {f.stored} stored, {f.present} already there")
    t = r.totals
    console.print(f"{r.store}: {t['stored']} of {plural(t['chunks'], 'chunk')} stored "
                  f"({human_bytes(t['stored_bytes'])}), {t['present']} deduplicated")
    if t["present"]:
        console.print(KEPT_AS_STORED)



@renders("StoreGetResult")
def render_get(console: Console, r: StoreGetResult) -> None:
    console.print(f"wrote {r.output}: {r.cached_tokens} of the prompt's {r.prompt_tokens} tokens cached "
                  f"({plural(r.chunks, 'chunk')}, {', '.join(r.codecs)}), {human_bytes(r.file_bytes)}")
    if r.reencoded:
        console.print(f"{plural(r.reencoded, 'chunk')} re-encoded as {r.codecs[0]} (stored in another codec)")
    if len(r.codecs) > 1:
        console.print(f"the chunks are in {len(r.codecs)} codecs, each as stored; --codec CODEC writes them all in "
                      "one")
    for why in r.refused:
        console.print(f"[yellow]refused: {why}[/yellow]")


@renders("StoreListing")
def render_ls(console: Console, r: StoreListing, wide: bool = False) -> None:
    """A row per object. On a terminal the last column is each object's short id (distinct in the
    store, as git abbreviates commits) so that rows fit and are told apart; into a pipe or a file,
    and with --wide, the whole name on the row's one line. `store rm` takes either."""
    whole = wide or not console.is_terminal
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("kind", "model", "chunk", "bytes", "last used"):
        table.add_column(col, justify="right" if col in ("chunk", "bytes") else "left", no_wrap=True)
    table.add_column("name" if whole else "id", no_wrap=True, overflow="ellipsis")
    now = time.time()
    for o in r.objects:  # one stored object each, as the store lists it
        model = o.get("model_name") or o.get("model", "")[:12]  # the model's name where its objects say it
        table.add_row(o["kind"], model[:24], str(o.get("chunk_size", "")), human_bytes(o["bytes"]),
                      _ago(now - o["last_used"]), o["name"] if whole else o["id"])
    console.print(table)
    console.print(f"{plural(len(r.objects), 'object')} in {r.store}")


@renders("StoreStats")
def render_stats(console: Console, r: StoreStats) -> None:
    console.print(f"{r.store}: {plural(r.objects, 'object')}, {human_bytes(r.bytes)} ({_kinds(r.by_kind)})")
    for key, m in sorted(r.models.items()):  # the same words per model as for the store: objects, of each kind
        console.print(f"  model {key}: {plural(m['objects'], 'object')} ({_kinds(m['by_kind'])}), "
                      f"{human_bytes(m['bytes'])}, chunk size {', '.join(map(str, m['chunk_sizes']))}")
    if r.foreign:
        console.print(f"[yellow]{plural(r.foreign, 'foreign file')}: `kvtool store fsck` removes them[/yellow]")


def _kinds(by_kind: dict[str, int]) -> str:
    return ", ".join(plural(n, k) for k, n in sorted(by_kind.items())) or "nothing"


@renders("StoreGcResult")
def render_gc(console: Console, r: StoreGcResult) -> None:
    console.print(f"{r.store}: removed {plural(r.removed, 'object')} ({human_bytes(r.removed_bytes)}) "
                  f"and {plural(r.temps_removed, 'temp file')}; {human_bytes(r.remaining_bytes)} remain "
                  f"(cap {human_bytes(r.max_bytes)})")


@renders("StoreFsckResult")
def render_fsck(console: Console, r: StoreFsckResult) -> None:
    for d in r.damaged:
        console.print(f"[red]damaged[/red] {d['reason']}")
    what = f", removed {r.removed}" if r.repair else " (left in place: --no-repair)"
    if r.entries_removed:
        entries = "block index entry" if r.entries_removed == 1 else "block index entries"
        what += f" (and {r.entries_removed} {entries} that named them)"
    console.print(f"{r.store}: {plural(r.checked, 'object')} checked, {r.intact} intact, "
                  f"{len(r.damaged)} damaged{what}; {plural(r.temps_removed, 'temp file')} removed")


@renders("StoreRmResult")
def render_rm(console: Console, r: StoreRmResult) -> None:
    entries = "block index entry" if r.block_entries == 1 else "block index entries"
    pointers = f", {r.block_entries} of them {entries} that named what went" if r.block_entries else ""
    console.print(f"{r.store}: removed {plural(r.removed, 'object')} ({human_bytes(r.removed_bytes)}){pointers}")


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{max(seconds, 0):.0f} s ago"
