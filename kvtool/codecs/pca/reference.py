"""Pure reference of the pca codec (format-spec/pca.md): the spec in executable form.

numpy only. The transform is integer arithmetic wherever a sum is taken (float64 sums of
integers below 2^53 are exact, so any order gives the same result), and float32 elementwise
operations in the order the spec writes them; the rANS lanes of all rows advance together.
A native or device coder must produce exactly these bytes and decode exactly these values.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ...errors import DecodeError, NonFiniteValues, UsageError
from . import _tables as TB
from .calibration import Calibration, rope_tables

MAGIC = b"KVPC"
FORMAT_VERSION = 1
RANS_L = 1 << 16
PROB_BITS = TB.PROB_BITS
ESCAPE = TB.SYMBOLS - 1
MAX_SHIFT = 6
ALL_ZERO = 0xFF  # side byte of a component that is zero at every coded token
U_FRACTION = 8  # fixed-point bits of the weighted channels (§5.1)
U_LIMIT = (1 << 23) - 1
Q_LIMIT = 32767
TOKEN_L1_LIMIT = 1 << 16  # sum of |q| over a token's components: keeps decoder sums within int32
DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}
HEADER = struct.Struct("<4sBBBBIIII")  # magic, version, dtype, lanes, reserved, rows, tokens, channels, sinks
ROW_ENTRY = struct.Struct("<IIII")  # words, lo bits, sign bits, escapes

FREQ = np.array(TB.FREQ, dtype=np.int64)  # [32, 16]
CUM = np.concatenate([np.zeros((len(TB.FREQ), 1), np.int64), np.cumsum(FREQ, 1)], 1)  # [32, 17]
COST = np.array(TB.COST_Q8, dtype=np.int64)  # [32, 16]
SYMBOL_OF_SLOT = np.array([np.repeat(np.arange(TB.SYMBOLS), f) for f in TB.FREQ], dtype=np.int64)  # [32, 4096]


# --------------------------------------------------------------------------- the transform (§5)
def _turn(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, head_dim: int, back: bool) -> np.ndarray:
    """Rotate-half RoPE of x [L, T, C] float32 by (cos, sin) [L, T, D/2]; `back`: the inverse turn."""
    L, T, C = x.shape
    h = x.reshape(L, T, C // head_dim, head_dim)
    a, b = h[..., : head_dim // 2], h[..., head_dim // 2:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if back:
        first, second = a * c + b * s, b * c - a * s
    else:
        first, second = a * c - b * s, b * c + a * s
    return np.concatenate([first, second], -1).reshape(L, T, C).astype(np.float32)


def forward(x: np.ndarray, cal: Calibration, start: int, step: float, tables=None) -> np.ndarray:
    """Coefficients q int64 [2, L, T, C] of x float32 [2, L, T, C] (positions start..); `tables`:
    (cos, sin) of those positions when not version 1's (`rope_tables`)."""
    cos, sin = tables if tables is not None else rope_tables(cal, start, x.shape[2])
    out = np.empty(x.shape, dtype=np.int64)
    r = 1.0 / (float(step) * float(1 << (U_FRACTION + 14)))
    for part in range(2):
        xp = _turn(x[part], cos, sin, cal.head_dim, back=True) if part == 0 else x[part]
        u = ((xp - cal.mean[part][:, None, :]) * cal.weight[part][:, None, :]).astype(np.float32)
        big = np.clip(np.rint(u.astype(np.float64) * float(1 << U_FRACTION)), -U_LIMIT, U_LIMIT)
        acc = np.matmul(big, cal.basis[part].astype(np.float64))  # exact: integers below 2^53
        out[part] = np.clip(np.rint(acc * r), -Q_LIMIT, Q_LIMIT).astype(np.int64)
    l1 = np.abs(out).sum(-1)
    if (l1 > TOKEN_L1_LIMIT).any():
        raise UsageError(f"pca: a token's coefficients are too large for step {step} (sum of |q| "
                         f"{int(l1.max())} > {TOKEN_L1_LIMIT}); use a larger step or another codec")
    return out


def gains(cal: Calibration, step: float) -> np.ndarray:
    """h [2, L, C] float32: float32(float64(step) / (16384 * float64(weight)))."""
    return (float(step) / (16384.0 * cal.weight.astype(np.float64))).astype(np.float32)


def inverse(q: np.ndarray, cal: Calibration, start: int, step: float, tables=None) -> np.ndarray:
    """float32 [2, L, T, C] from coefficients q [2, L, T, C] (|q| bounded as forward bounds it);
    `tables` as for `forward`."""
    cos, sin = tables if tables is not None else rope_tables(cal, start, q.shape[2])
    h = gains(cal, step)
    out = np.empty(q.shape, dtype=np.float32)
    for part in range(2):
        # acc[l, t, c] = sum_k q[l, t, k] * basis[l, c, k]: exact (|acc| < 2^31)
        acc = np.matmul(q[part].astype(np.float64), cal.basis[part].astype(np.float64).transpose(0, 2, 1))
        x = (acc.astype(np.int64).astype(np.float32) * h[part][:, None, :]).astype(np.float32)
        x = (x + cal.mean[part][:, None, :]).astype(np.float32)
        out[part] = _turn(x, cos, sin, cal.head_dim, back=False) if part == 0 else x
    return out


def to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the KV dtype's storage (bf16 as uint16 bits), rounding to nearest even."""
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):  # past ±65504 a value is float16's infinity, as IEEE 754 rounds it
            return x.astype(np.float16)
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_dtype(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


# --------------------------------------------------------------------------- table choice (§6.2)
def choose(m: np.ndarray) -> np.ndarray:
    """Side bytes [R, C] for magnitudes m [R, T, C]: the (table, shift) of fewest bits."""
    R, T, C = m.shape
    best_cost = np.full((R, C), np.iinfo(np.int64).max, dtype=np.int64)
    best = np.zeros((R, C), dtype=np.int64)
    for shift in range(MAX_SHIFT + 1):
        hi = m >> shift
        sym = np.minimum(hi, ESCAPE)
        cell = (np.arange(R)[:, None, None] * C + np.arange(C)[None, None, :]) * TB.SYMBOLS + sym  # [R, T, C]
        hist = np.bincount(cell.reshape(-1), minlength=R * C * TB.SYMBOLS).reshape(R, C, TB.SYMBOLS)
        cost = hist @ COST.T + 256 * (shift * T + 16 * hist[..., ESCAPE:ESCAPE + 1])  # [R, C, 32]
        table = cost.argmin(-1)
        c = np.take_along_axis(cost, table[..., None], -1)[..., 0]
        better = c < best_cost
        best_cost = np.where(better, c, best_cost)
        best = np.where(better, table | (shift << 5), best)
    return np.where((m == 0).all(1), ALL_ZERO, best).astype(np.uint8)


# --------------------------------------------------------------------------- bits
def _pack_bits(values: np.ndarray, widths: np.ndarray) -> bytes:
    """values' low `widths` bits, LSB first, concatenated; zero-padded to whole bytes."""
    total = int(widths.sum())
    if total == 0:
        return b""
    reps = np.repeat(values.astype(np.uint64), widths)
    starts = np.repeat(np.cumsum(widths) - widths, widths)
    shift = (np.arange(total, dtype=np.int64) - starts).astype(np.uint64)
    return np.packbits(((reps >> shift) & np.uint64(1)).astype(np.uint8), bitorder="little").tobytes()


def _unpack_bits(data: bytes, widths: np.ndarray) -> np.ndarray:
    total = int(widths.sum())
    bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")[:total].astype(np.uint64)
    starts = np.cumsum(widths) - widths
    out = np.zeros(len(widths), dtype=np.uint64)
    for j in range(int(widths.max()) if len(widths) else 0):
        has = widths > j
        out[has] |= bits[starts[has] + j] << np.uint64(j)
    return out.astype(np.int64)


# --------------------------------------------------------------------------- rANS (§6.3)
def _rans_encode(syms: list[np.ndarray], tables: list[np.ndarray], lanes: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row: (final states [lanes] uint32, words uint16 in reading order)."""
    R = len(syms)
    steps = max((-(-len(s) // lanes) for s in syms), default=0)
    size = steps * lanes
    start = np.zeros((R, size), np.uint64)
    freq = np.ones((R, size), np.uint64)
    valid = np.zeros((R, size), bool)
    for r, (s, t) in enumerate(zip(syms, tables)):
        start[r, :len(s)] = CUM[t, s]
        freq[r, :len(s)] = FREQ[t, s]
        valid[r, :len(s)] = True
    start, freq, valid = (a.reshape(R, steps, lanes) for a in (start, freq, valid))
    x = np.full((R, lanes), RANS_L, np.uint64)
    emitted = np.zeros((steps, R, lanes), bool)
    words = np.zeros((steps, R, lanes), np.uint16)
    limit_shift = np.uint64(32 - PROB_BITS)
    for k in range(steps - 1, -1, -1):
        v, f, c = valid[:, k], freq[:, k], start[:, k]
        emit = v & (x >= (f << limit_shift))
        words[k] = (x & np.uint64(0xFFFF)).astype(np.uint16)
        emitted[k] = emit
        x = np.where(emit, x >> np.uint64(16), x)
        x = np.where(v, ((x // f) << np.uint64(PROB_BITS)) + (x % f) + c, x)
    return [(x[r].astype(np.uint32), words[:, r, :][emitted[:, r, :]]) for r in range(R)]


def _rans_decode(states: np.ndarray, words: list[np.ndarray], tables: list[np.ndarray], counts: np.ndarray,
                 lanes: int) -> list[np.ndarray]:
    """Per row: the symbols. states [R, lanes]; tables[r]: the table of each symbol of row r."""
    R = len(words)
    steps = int(max((-(-int(n) // lanes) for n in counts), default=0))
    size = steps * lanes
    tab = np.zeros((R, size), np.int64)
    valid = np.zeros((R, size), bool)
    for r in range(R):
        tab[r, :counts[r]] = tables[r]
        valid[r, :counts[r]] = True
    tab, valid = tab.reshape(R, steps, lanes), valid.reshape(R, steps, lanes)
    nwords = np.array([len(w) for w in words], np.int64)
    base = np.concatenate([[0], np.cumsum(nwords)[:-1]]).astype(np.int64)
    pool = np.concatenate(words + [np.zeros(1, np.uint16)]).astype(np.uint64)
    ptr = np.zeros(R, np.int64)
    x = states.astype(np.uint64)
    out = np.zeros((R, steps, lanes), np.int64)
    mask = np.uint64((1 << PROB_BITS) - 1)
    for k in range(steps):
        v, t = valid[:, k], tab[:, k]
        slot = (x & mask).astype(np.int64)
        sym = SYMBOL_OF_SLOT[t, slot]
        f, c = FREQ[t, sym].astype(np.uint64), CUM[t, sym].astype(np.uint64)
        xn = f * (x >> np.uint64(PROB_BITS)) + slot.astype(np.uint64) - c
        need = v & (xn < np.uint64(RANS_L))
        order = np.cumsum(need, 1)
        if (ptr + order[:, -1] > nwords).any():
            raise DecodeError("pca: a row's rANS words end early")
        idx = np.where(need, base[:, None] + ptr[:, None] + order - 1, len(pool) - 1)
        xn = np.where(need, (xn << np.uint64(16)) | pool[idx], xn)
        x = np.where(v, xn, x)
        ptr += order[:, -1]
        out[:, k] = sym
    if (x != RANS_L).any() or (ptr != nwords).any():
        raise DecodeError("pca: a row's rANS stream does not end where it began")
    return [out[r].reshape(-1)[:counts[r]] for r in range(R)]


# --------------------------------------------------------------------------- chunk (§4)
@dataclass
class Row:
    side: np.ndarray  # [C] uint8
    states: np.ndarray  # [lanes] uint32
    words: np.ndarray  # uint16
    lo: bytes
    lo_bits: int
    sign: bytes
    sign_bits: int
    escapes: np.ndarray  # uint16


def _pad4(n: int) -> int:
    return (-n) % 4


def encode_chunk(raw: np.ndarray, dtype: str, cal: Calibration, step: float, sinks: int, start: int,
                 lanes: int = 16) -> bytes:
    """raw: the chunk [2, L, T, C] as stored (bf16 as uint16 bits). Returns the payload."""
    _, L, T, C = raw.shape
    if cal.layers != L or cal.channels != C:
        raise UsageError(f"pca: the calibration is for {cal.layers} layers x {cal.channels} channels, the chunk "
                         f"has {L} x {C}")
    x = from_dtype(raw, dtype)
    if not np.isfinite(x).all():
        raise NonFiniteValues("pca: the KV input holds NaN or infinity")
    n_sink = min(T, max(0, sinks - start))
    q = forward(x[:, :, n_sink:], cal, start + n_sink, step)  # [2, L, Tc, C]
    return encode_coefficients(q.reshape(2 * L, T - n_sink, C), raw[:, :, :n_sink], dtype, lanes)


def encode_coefficients(q: np.ndarray, sink_raw: np.ndarray, dtype: str, lanes: int = 16) -> bytes:
    """The payload of coefficients `q` (int [2L, Tc, C], as `forward` gives them) after sink
    tokens `sink_raw` ([2, L, S, C] as stored), the tables and shifts chosen as §6.2 says: what
    `encode_chunk` writes once the transform is done (and what a payload's coefficients re-laid
    from version 2 are: `kvtool.codecs.pca.relay`)."""
    R, Tc, C = q.shape
    L, n_sink, T = R // 2, sink_raw.shape[2], sink_raw.shape[2] + Tc
    m = np.abs(q)
    neg = q < 0
    side = choose(m) if Tc else np.full((2 * L, C), ALL_ZERO, np.uint8)
    syms, tables, rows = [], [], []
    for r in range(2 * L):
        live = np.nonzero(side[r] != ALL_ZERO)[0]
        shift = (side[r, live] >> 5).astype(np.int64)
        mm = m[r][:, live].T  # [components, Tc]: component-major order
        hi = mm >> shift[:, None]
        sym = np.minimum(hi, ESCAPE).reshape(-1)
        syms.append(sym)
        tables.append(np.repeat((side[r, live] & 31).astype(np.int64), Tc))
        widths = np.repeat(shift, Tc)
        lo_vals = (mm & ((1 << shift[:, None]) - 1)).reshape(-1)
        nz = mm.reshape(-1) != 0
        rows.append(dict(side=side[r], lo=_pack_bits(lo_vals, widths), lo_bits=int(widths.sum()),
                         sign=_pack_bits(neg[r][:, live].T.reshape(-1)[nz].astype(np.int64), np.ones(int(nz.sum()), np.int64)),
                         sign_bits=int(nz.sum()), escapes=(hi.reshape(-1)[sym == ESCAPE] - ESCAPE).astype(np.uint16)))
    coded = _rans_encode(syms, tables, lanes)
    out = [HEADER.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], lanes, 0, 2 * L, T, C, n_sink)]
    for row, (_, words) in zip(rows, coded):
        out.append(ROW_ENTRY.pack(len(words), row["lo_bits"], row["sign_bits"], len(row["escapes"])))
    sink_bytes = np.ascontiguousarray(sink_raw).tobytes()
    out += [sink_bytes, b"\0" * _pad4(len(sink_bytes))]
    for row, (states, words) in zip(rows, coded):
        body = [row["side"].tobytes(), b"\0" * _pad4(C), states.astype("<u4").tobytes(), words.astype("<u2").tobytes(),
                b"\0" * (2 * (len(words) % 2)), row["lo"], row["sign"], row["escapes"].astype("<u2").tobytes()]
        tail = sum(len(b) for b in body[5:])
        out += body + [b"\0" * _pad4(tail)]
    return b"".join(out)


def _row_sizes(C: int, lanes: int, words: int, lo_bits: int, sign_bits: int, escapes: int) -> tuple[int, ...]:
    lo, sign, esc = -(-lo_bits // 8), -(-sign_bits // 8), 2 * escapes
    return (C + _pad4(C), 4 * lanes, 2 * words + 2 * (words % 2), lo, sign, esc, _pad4(lo + sign + esc))


def parse(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> tuple[int, int, list, int, int]:
    """Check the header against `shape`/`dtype`. Returns (lanes, sinks, row entries, sink offset, rows offset)."""
    _, L, T, C = shape
    if len(payload) < HEADER.size:
        raise DecodeError("pca: payload shorter than its header")
    magic, version, dcode, lanes, reserved, rows, tokens, channels, n_sink = HEADER.unpack_from(payload, 0)
    if magic != MAGIC or version != FORMAT_VERSION or reserved != 0:
        raise DecodeError("pca: not a pca payload of version 1")
    if dcode != DTYPE_CODES[dtype] or rows != 2 * L or tokens != T or channels != C or not 1 <= lanes <= 64 \
            or n_sink > T:
        raise DecodeError("pca: the payload's header does not match the chunk's shape and dtype")
    pos = HEADER.size
    if len(payload) < pos + ROW_ENTRY.size * rows:
        raise DecodeError("pca: payload shorter than its row table")
    entries = [ROW_ENTRY.unpack_from(payload, pos + ROW_ENTRY.size * r) for r in range(rows)]
    pos += ROW_ENTRY.size * rows
    sink_at = pos
    item = 4 if dtype == "float32" else 2
    pos += 2 * L * n_sink * C * item
    pos += _pad4(pos - sink_at)
    total = pos + sum(sum(_row_sizes(C, lanes, *e)) for e in entries)
    if total != len(payload):
        raise DecodeError(f"pca: payload is {len(payload)} bytes, its tables say {total}")
    return lanes, n_sink, entries, sink_at, pos


def decode_chunk(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str, cal: Calibration, step: float,
                 start: int) -> np.ndarray:
    """The chunk [2, L, T, C] in dtype's storage (bf16 as uint16 bits)."""
    _, L, T, C = shape
    if cal.layers != L or cal.channels != C:
        raise DecodeError(f"pca: the calibration is for {cal.layers} layers x {cal.channels} channels, the chunk "
                          f"has {L} x {C}")
    sink, q = decode_coefficients(payload, shape, dtype)
    n_sink, Tc = sink.shape[2], T - sink.shape[2]
    out = np.empty((2, L, T, C), dtype=sink.dtype)
    out[:, :, :n_sink] = sink
    if Tc:
        out[:, :, n_sink:] = to_dtype(inverse(q.reshape(2, L, Tc, C), cal, start + n_sink, step), dtype)
    return out


def decode_coefficients(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> tuple[np.ndarray,
                                                                                                    np.ndarray]:
    """(the sink tokens [2, L, S, C] as stored, the coefficients int64 [2L, Tc, C]) of a payload,
    every check of §7 but the calibration's made (no calibration is needed to read them)."""
    _, L, T, C = shape
    lanes, n_sink, entries, sink_at, pos = parse(payload, shape, dtype)
    data = bytes(payload)
    storage = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}[dtype]
    sink = np.frombuffer(data, storage, count=2 * L * n_sink * C, offset=sink_at).reshape(2, L, n_sink, C)
    Tc = T - n_sink
    sides, states, words, rests = [], [], [], []
    for words_n, lo_bits, sign_bits, escapes in entries:
        sizes = _row_sizes(C, lanes, words_n, lo_bits, sign_bits, escapes)
        side = np.frombuffer(data, np.uint8, count=C, offset=pos)
        at = pos + sizes[0]
        states.append(np.frombuffer(data, "<u4", count=lanes, offset=at))
        words.append(np.frombuffer(data, "<u2", count=words_n, offset=at + sizes[1]))
        at += sizes[1] + sizes[2]
        rests.append((data[at:at + sizes[3]], data[at + sizes[3]:at + sizes[3] + sizes[4]],
                      np.frombuffer(data, "<u2", count=escapes, offset=at + sizes[3] + sizes[4]), lo_bits, sign_bits))
        sides.append(side)
        pos += sum(sizes)
    side = np.stack(sides) if sides else np.zeros((0, C), np.uint8)
    if ((side != ALL_ZERO) & ((side >> 5) == 7)).any():
        raise DecodeError("pca: a side byte names shift 7")
    live = [np.nonzero(s != ALL_ZERO)[0] for s in side]
    tables = [np.repeat((s[lv] & 31).astype(np.int64), Tc) for s, lv in zip(side, live)]
    counts = np.array([len(lv) * Tc for lv in live], np.int64)
    syms = _rans_decode(np.stack(states) if states else np.zeros((0, lanes)), words, tables, counts, lanes)
    q = np.zeros((2 * L, Tc, C), np.int64)
    for r, (lv, sym, (lo, sign, esc, lo_bits, sign_bits)) in enumerate(zip(live, syms, rests)):
        shift = np.repeat((side[r, lv] >> 5).astype(np.int64), Tc)
        if int(shift.sum()) != lo_bits:
            raise DecodeError("pca: a row's low-bit count does not match its side bytes")
        is_esc = sym == ESCAPE
        if int(is_esc.sum()) != len(esc):
            raise DecodeError("pca: a row's escape count does not match its symbols")
        hi = sym.copy()
        hi[is_esc] = ESCAPE + esc.astype(np.int64)
        mag = (hi << shift) | _unpack_bits(lo, shift)
        if (mag > Q_LIMIT).any():
            raise DecodeError("pca: a coefficient exceeds 32767")
        nz = mag != 0
        if int(nz.sum()) != sign_bits:
            raise DecodeError("pca: a row's sign-bit count does not match its coefficients")
        signs = _unpack_bits(sign, np.ones(sign_bits, np.int64)).astype(bool)
        val = mag.copy()
        val[np.nonzero(nz)[0][signs]] *= -1
        q[r][:, lv] = val.reshape(len(lv), Tc).T
    if (np.abs(q).sum(-1) > TOKEN_L1_LIMIT).any():
        raise DecodeError(f"pca: a token's coefficients sum past {TOKEN_L1_LIMIT}")
    return sink, q


def payload_stats(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> dict:
    """Bits per value of everything in a payload, by part (parses the framing only), and how many
    components were coded at all."""
    _, L, T, C = shape
    lanes, n_sink, entries, sink_at, rows_at = parse(payload, shape, dtype)
    values = 2 * L * T * C
    acc = {"header": 8 * sink_at, "sinks": 8 * (rows_at - sink_at), "side": 0, "lane_states": 0, "rans": 0,
           "low_bits": 0, "signs": 0, "escapes": 0, "padding": 0}
    pos, live = rows_at, 0
    data = bytes(payload)
    for words, lo_bits, sign_bits, escapes in entries:
        sizes = _row_sizes(C, lanes, words, lo_bits, sign_bits, escapes)
        live += int((np.frombuffer(data, np.uint8, count=C, offset=pos) != ALL_ZERO).sum())
        acc["side"] += 8 * C
        acc["lane_states"] += 8 * sizes[1]
        acc["rans"] += 16 * words
        acc["low_bits"] += lo_bits
        acc["signs"] += sign_bits
        acc["escapes"] += 16 * escapes
        acc["padding"] += 8 * (sizes[0] - C) + 16 * (words % 2) + 8 * (sizes[3] + sizes[4] + sizes[6]) \
            - lo_bits - sign_bits
        pos += sum(sizes)
    total = 8 * len(payload)
    return {"values": values, "bytes": len(payload), "bits_per_value": total / values,
            **{f"bpv_{k}": v / values for k, v in acc.items()},
            "bits_per_value_by_part": {k: v / values for k, v in acc.items()},
            "share": {k: v / total for k, v in acc.items()},
            "lanes": lanes, "sink_tokens": n_sink, "components_coded": live, "components": 2 * L * C}
