"""The per-layer bins table of the CacheGen codec.

Text form (recorded in the chunk's codec parameters as ``"bins"``)::

    spec   := "default" | INT | part (";" part)*
    part   := ("k" | "v" | "kv") ":" entry ("," entry)*
    entry  := range "=" INT
    range  := INT "-" INT      half-open: layers a .. b-1
            | INT "-"          layer a to the last layer
            | INT              one layer
            | "*"              every layer

``k`` entries apply to the key layers, ``v`` to the value layers, ``kv`` to
both. Every layer of K and V must be covered exactly once (overlaps are an
error); ranges past the model's last layer are ignored, so one table serves
models of any depth. ``"default"`` is LMCache's table: K 32 bins for layers
0-9 and 16 after, V 32 bins for layers 0-1 and 16 after; a model with fewer
than 10 layers gets 32 bins everywhere. A bare integer gives every layer that
many bins. Bins are integers in 4..256; a layer with ``bins`` uses the
symbols ``0 .. 2*(bins//2 - 1)``.
"""

from __future__ import annotations

import re

from ...errors import UsageError

BINS_MIN = 4
BINS_MAX = 256
#: What the grammar calls blanks (cachegen.md §1): ASCII space and tab, nothing else.
BLANKS = " \t"
LMCACHE_DEFAULT = "k:0-10=32,10-=16;v:0-2=32,2-=16"
LMCACHE_SHALLOW = "kv:*=32"  # fewer than 10 layers

# ASCII digits only (str.isdigit and \d accept '²' and other scripts' digits, which int() refuses),
# and few of them (a 5,000-digit layer number would hit Python's integer-string limit)
_NUMBER = re.compile(r"[0-9]{1,6}")
_RANGE = re.compile(r"^(?:(\*)|([0-9]{1,6})(?:(-)([0-9]{0,6}))?)$")


def _int(text: str, what: str, spec: str) -> int:
    if not _NUMBER.fullmatch(text):
        raise UsageError(f"bins spec {spec!r}: {what} {text!r} is not a non-negative integer")
    return int(text)


def _bins_value(text: str, spec: str) -> int:
    b = _int(text.strip(BLANKS), "bin count", spec)
    if not BINS_MIN <= b <= BINS_MAX:
        raise UsageError(f"bins spec {spec!r}: bin count {b} is outside {BINS_MIN}..{BINS_MAX}")
    return b


def parse_bins_spec(spec: str) -> list[tuple[str, int, int | None, int]]:
    """Parse a spec into (group, start, end-or-None, bins) entries; group is 'k' or 'v'.

    Raises UsageError with a message naming the offending part."""
    if not isinstance(spec, str):
        raise UsageError(f"bins spec must be a string, got {type(spec).__name__}")
    s = spec.strip(BLANKS).lower()
    if not s:
        raise UsageError("bins spec is empty; try 'default' or e.g. 'k:0-10=32,10-=16;v:0-2=32,2-=16'")
    if s == "default":
        return [("default", 0, None, 0)]
    if _NUMBER.fullmatch(s):
        b = _bins_value(s, spec)
        return [("k", 0, None, b), ("v", 0, None, b)]
    out: list[tuple[str, int, int | None, int]] = []
    for part in s.split(";"):
        part = part.strip(BLANKS)
        if not part:
            raise UsageError(f"bins spec {spec!r}: empty part between ';'")
        if ":" not in part:
            raise UsageError(f"bins spec {spec!r}: part {part!r} lacks 'k:', 'v:' or 'kv:'")
        group, body = (x.strip(BLANKS) for x in part.split(":", 1))
        if group not in ("k", "v", "kv"):
            raise UsageError(f"bins spec {spec!r}: unknown group {group!r} (expected k, v or kv)")
        if not body:
            raise UsageError(f"bins spec {spec!r}: group {group!r} has no entries")
        for entry in body.split(","):
            entry = entry.strip(BLANKS)
            if "=" not in entry:
                raise UsageError(f"bins spec {spec!r}: entry {entry!r} should look like 'START-END=BINS'")
            rng, val = (x.strip(BLANKS) for x in entry.split("=", 1))
            m = _RANGE.match(rng)
            if not m and ":" in rng:
                raise UsageError(f"bins spec {spec!r}: {rng!r} looks like a new group; separate groups with ';'")
            if not m:
                raise UsageError(
                    f"bins spec {spec!r}: layer range {rng!r} should be 'A-B' (A..B-1), 'A-' (A to the end), 'A' or '*'"
                )
            b = _bins_value(val, spec)
            if m.group(1):
                start, end = 0, None
            else:
                start = int(m.group(2))
                if m.group(3):
                    end = int(m.group(4)) if m.group(4) else None
                else:
                    end = start + 1
                if end is not None and end <= start:
                    raise UsageError(f"bins spec {spec!r}: layer range {rng!r} is empty (end must exceed start)")
            for g in ("k", "v") if group == "kv" else (group,):
                out.append((g, start, end, b))
    return out


def resolve_bins(spec: str, num_layers: int) -> list[int]:
    """Bins for the 2L coded layers (K layers 0..L-1, then V layers 0..L-1)."""
    if num_layers < 1:
        raise UsageError(f"a chunk needs at least one layer, got {num_layers}")
    entries = parse_bins_spec(spec)
    if entries[0][0] == "default":
        entries = parse_bins_spec(LMCACHE_DEFAULT if num_layers >= 10 else LMCACHE_SHALLOW)
    table: dict[str, list[int | None]] = {"k": [None] * num_layers, "v": [None] * num_layers}
    for g, start, end, b in entries:
        stop = num_layers if end is None else min(end, num_layers)
        for layer in range(start, stop):
            if table[g][layer] is not None:
                raise UsageError(f"bins spec {spec!r}: {g.upper()} layer {layer} is given bins twice")
            table[g][layer] = b
    for g in ("k", "v"):
        missing = [i for i, b in enumerate(table[g]) if b is None]
        if missing:
            raise UsageError(
                f"bins spec {spec!r}: {g.upper()} layer(s) {_ranges(missing)} of {num_layers} have no bins"
            )
    return [int(b) for b in table["k"]] + [int(b) for b in table["v"]]  # type: ignore[arg-type]


def canonical_bins_spec(spec: str, num_layers: int | None = None) -> str:
    """A normalised spec string; 'default' is expanded when num_layers is known."""
    entries = parse_bins_spec(spec)
    if entries[0][0] == "default":
        if num_layers is None:
            return "default"
        entries = parse_bins_spec(LMCACHE_DEFAULT if num_layers >= 10 else LMCACHE_SHALLOW)
    parts = []
    for g in ("k", "v"):
        items = []
        for gg, start, end, b in entries:
            if gg != g:
                continue
            if end is None:
                rng = f"{start}-"
            elif end == start + 1:
                rng = f"{start}"
            else:
                rng = f"{start}-{end}"
            items.append(f"{rng}={b}")
        parts.append(f"{g}:" + ",".join(items))
    return ";".join(parts)


def _ranges(idx: list[int]) -> str:
    out = []
    start = prev = idx[0]
    for i in idx[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)
