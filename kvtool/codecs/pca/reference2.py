"""Pure reference of the pca bitstream version 2 (format-spec/pca.md §11): the spec in executable form.

Version 2 keeps version 1's transform, quantizer and table choice (`reference`), and lays the
entropy coding out for a decoder of many independent units (a GPU's threads):

- every row's symbols (components ascending, tokens ascending within one, as in version 1) are cut
  into units of `U` symbols (a multiple of 64; the row's last unit may be shorter); which components
  and tokens a unit's symbols belong to follows from the side bytes alone;
- each unit is one stream of its own (a rANS state, its words, its escapes, its low and sign bits);
  two units share a region, the first read forward from its start, the second backward from its
  end, and a table of region lengths gives every region's offset by one prefix sum, before
  anything is decoded (one length per two units);
- the writer starts each unit's rANS state at `2^31 | z`, z the first 31 of the unit's raw bits
  (low bits, then sign bits): the 31 bits a state would otherwise waste (`bits back`);
- the RoPE tables are computed by a fixed sequence of float64 operations (`rope_tables`), each
  correctly rounded, so no value depends on a platform's libm.

`decode_unit` decodes one unit from the payload alone (given its index); `decode_chunk` decodes
all units at once (numpy across units) and gives the same coefficients, which the tests check.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ...errors import DecodeError, NonFiniteValues, UsageError
from . import reference as v1
from .calibration import Calibration

FORMAT_VERSION = 2
HEADER = struct.Struct("<4sBBBBIIII")  # magic, version, dtype, unit / 64, reserved, rows, tokens, channels, sinks
UNIT_STEP, UNIT_MAX = 64, 4096  # a unit's symbols: a multiple of 64, at most 4096
DEFAULT_UNIT = 768  # kvtool's choice: format-spec/pca.md §11.7
BACK_BITS = 31  # raw bits carried in a unit's initial rANS state
STATE_TOP = 1 << BACK_BITS
RANS_L = v1.RANS_L
PROB_BITS = v1.PROB_BITS
ESCAPE = v1.ESCAPE
ALL_ZERO = v1.ALL_ZERO
FREQ, CUM, SYMBOL_OF_SLOT = v1.FREQ, v1.CUM, v1.SYMBOL_OF_SLOT


# --------------------------------------------------------------------------- RoPE without libm (§11.5)
# pi/2 in four parts (the first three of 24 significant bits, so k * part is exact for |k| < 2^29)
PIO2 = [float.fromhex(h) for h in ("0x1.921fb40000000p+0", "0x1.4442d00000000p-24", "0x1.8469880000000p-48",
                                   "0x1.8cc51701b839ap-72")]
TWO_OVER_PI = float.fromhex("0x1.45f306dc9c883p-1")
# Taylor coefficients, each the float64 quotient of exact integers: (-1)^n / (2n+1)!, (-1)^n / (2n)!
SIN_C = [(-1) ** n / float(np.prod(np.arange(1, 2 * n + 2, dtype=np.float64))) for n in range(1, 8)]  # 1/3! .. 1/15!
COS_C = [(-1) ** n / float(np.prod(np.arange(1, 2 * n + 1, dtype=np.float64))) for n in range(1, 8)]  # 1/2! .. 1/14!


def sincos(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sin, cos) float64 of float64 angles by §11.5's operations, in its order (numpy rounds every
    float64 operation and fuses none)."""
    theta = np.asarray(theta, dtype=np.float64)
    k = np.rint(theta * TWO_OVER_PI)
    r = theta
    for part in PIO2:
        r = r - k * part
    z = r * r
    ps = SIN_C[-1]
    for c in SIN_C[-2::-1]:
        ps = c + z * ps
    s = r + r * (z * ps)
    pc = COS_C[-1]
    for c in COS_C[-2::-1]:
        pc = c + z * pc
    co = 1.0 + z * pc
    quad = np.mod(k, 4.0).astype(np.int64)
    sin = np.select([quad == 0, quad == 1, quad == 2], [s, co, -s], -co)
    cos = np.select([quad == 0, quad == 1, quad == 2], [co, -s, -co], s)
    return sin, cos


def rope_tables(cal: Calibration, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [L, tokens, D/2] float32 of positions start..: f32 of §11.5's sin/cos of
    f64(position) * f64(inv_freq)."""
    pos = np.arange(start, start + tokens, dtype=np.float64)
    angle = pos[None, :, None] * cal.inv_freq.astype(np.float64)[:, None, :]
    sin, cos = sincos(angle)
    return cos.astype(np.float32), sin.astype(np.float32)


# --------------------------------------------------------------------------- layout (§11.2)
def unit_spans(side: np.ndarray, Tc: int, unit: int) -> np.ndarray:
    """int64 [units, 3]: (row, first symbol, symbol count) of every unit, in payload order, from
    the side bytes."""
    n = (side != ALL_ZERO).sum(1).astype(np.int64) * Tc  # symbols of each row
    per_row = -(-n // unit)
    row = np.repeat(np.arange(len(n), dtype=np.int64), per_row)
    first = (np.arange(int(per_row.sum()), dtype=np.int64) - np.repeat(np.cumsum(per_row) - per_row, per_row)) * unit
    return np.stack([row, first, np.minimum(unit, n[row] - first)], 1).reshape(-1, 3)


def _bits(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The bits of `values` (LSB first, `widths` each), concatenated, as uint8 0/1."""
    total = int(widths.sum())
    if total == 0:
        return np.zeros(0, np.uint8)
    reps = np.repeat(values.astype(np.uint64), widths)
    starts = np.repeat(np.cumsum(widths) - widths, widths)
    shift = (np.arange(total, dtype=np.int64) - starts).astype(np.uint64)
    return ((reps >> shift) & np.uint64(1)).astype(np.uint8)


def _value_of(bits: np.ndarray) -> int:
    return int(sum(int(b) << i for i, b in enumerate(bits)))


# --------------------------------------------------------------------------- writer
@dataclass
class _Unit:
    row: int
    syms: np.ndarray  # int64 [n]
    tabs: np.ndarray  # int64 [n]
    raw: np.ndarray  # uint8 0/1: low bits, then sign bits
    escapes: np.ndarray  # uint16


def _rans_encode_units(units: list[_Unit]) -> list[tuple[int, np.ndarray]]:
    """Per unit: (the state the writer ends with, its words in the order it emitted them)."""
    n = len(units)
    steps = max((len(u.syms) for u in units), default=0)
    start = np.zeros((n, steps), np.uint64)
    freq = np.ones((n, steps), np.uint64)
    valid = np.zeros((n, steps), bool)
    x = np.zeros(n, np.uint64)
    for i, u in enumerate(units):
        start[i, :len(u.syms)] = CUM[u.tabs, u.syms]
        freq[i, :len(u.syms)] = FREQ[u.tabs, u.syms]
        valid[i, :len(u.syms)] = True
        x[i] = STATE_TOP | _value_of(u.raw[:BACK_BITS])
    emitted = np.zeros((steps, n), bool)
    words = np.zeros((steps, n), np.uint16)
    limit_shift = np.uint64(32 - PROB_BITS)
    for k in range(steps - 1, -1, -1):
        v, f, c = valid[:, k], freq[:, k], start[:, k]
        emit = v & (x >= (f << limit_shift))
        words[k] = (x & np.uint64(0xFFFF)).astype(np.uint16)
        emitted[k] = emit
        x = np.where(emit, x >> np.uint64(16), x)
        x = np.where(v, ((x // f) << np.uint64(PROB_BITS)) + (x % f) + c, x)
    # emission order: symbol n-1's word first, so reversed step order
    return [(int(x[i]), words[::-1, i][emitted[::-1, i]]) for i in range(n)]


def encode_chunk(raw: np.ndarray, dtype: str, cal: Calibration, step: float, sinks: int, start: int,
                 unit: int = DEFAULT_UNIT) -> bytes:
    """raw: the chunk [2, L, T, C] as stored (bf16 as uint16 bits). Returns the version-2 payload."""
    _, L, T, C = raw.shape
    if cal.layers != L or cal.channels != C:
        raise UsageError(f"pca: the calibration is for {cal.layers} layers x {cal.channels} channels, the chunk "
                         f"has {L} x {C}")
    if not (UNIT_STEP <= unit <= UNIT_MAX and unit % UNIT_STEP == 0):
        raise UsageError(f"pca: a unit's symbols must be a multiple of {UNIT_STEP} up to {UNIT_MAX}")
    x = v1.from_dtype(raw, dtype)
    if not np.isfinite(x).all():
        raise NonFiniteValues("pca: the KV input holds NaN or infinity")
    n_sink = min(T, max(0, sinks - start))
    Tc = T - n_sink
    tables = rope_tables(cal, start + n_sink, Tc)
    q = v1.forward(x[:, :, n_sink:], cal, start + n_sink, step, tables=tables)  # [2, L, Tc, C]
    return encode_coefficients(q.reshape(2 * L, Tc, C), raw[:, :, :n_sink], dtype, unit)


def encode_coefficients(q: np.ndarray, sink_raw: np.ndarray, dtype: str, unit: int = DEFAULT_UNIT) -> bytes:
    """The version-2 payload of coefficients `q` (int [2L, Tc, C]) after sink tokens `sink_raw`
    ([2, L, S, C] as stored), the tables and shifts chosen as version 1's writer chooses them: what
    `encode_chunk` writes once the transform is done (and what a payload's coefficients re-laid
    from version 1 are: `kvtool.codecs.pca.relay`)."""
    if not (UNIT_STEP <= unit <= UNIT_MAX and unit % UNIT_STEP == 0):
        raise UsageError(f"pca: a unit's symbols must be a multiple of {UNIT_STEP} up to {UNIT_MAX}")
    R, Tc, C = q.shape
    L, n_sink, T = R // 2, sink_raw.shape[2], sink_raw.shape[2] + Tc
    m = np.abs(q)
    neg = q < 0
    side = v1.choose(m) if Tc else np.full((2 * L, C), ALL_ZERO, np.uint8)
    units: list[_Unit] = []
    for r in range(2 * L):
        live = np.nonzero(side[r] != ALL_ZERO)[0]
        shift = np.repeat((side[r, live] >> 5).astype(np.int64), Tc)
        mm = m[r][:, live].T.reshape(-1)  # component-major
        ng = neg[r][:, live].T.reshape(-1)
        hi = mm >> shift
        sym = np.minimum(hi, ESCAPE)
        tab = np.repeat((side[r, live] & 31).astype(np.int64), Tc)
        lo = mm & ((1 << shift) - 1)
        for i in range(0, len(mm), unit):
            sl = slice(i, i + unit)
            nz = mm[sl] != 0
            raw_bits = np.concatenate([_bits(lo[sl], shift[sl]), ng[sl][nz].astype(np.uint8)])
            units.append(_Unit(r, sym[sl], tab[sl], raw_bits,
                               (hi[sl][sym[sl] == ESCAPE] - ESCAPE).astype(np.uint16)))
    coded = _rans_encode_units(units)
    # a unit's stream: its end state, its words in reading order (the reverse of emission), its
    # escapes, its raw bits from bit 31 on; two units share a region, the second stored backward
    streams = [struct.pack("<I", state) + words[::-1].astype("<u2").tobytes() + u.escapes.astype("<u2").tobytes()
               + np.packbits(u.raw[BACK_BITS:], bitorder="little").tobytes() for u, (state, words) in zip(units, coded)]
    regions = [b"".join([streams[i], streams[i + 1][::-1] if i + 1 < len(streams) else b""])
               for i in range(0, len(streams), 2)]
    if any(len(r) > 0xFFFF for r in regions):
        raise UsageError("pca: a pair of units exceeds 65535 bytes (use a smaller unit)")
    sink_bytes = np.ascontiguousarray(sink_raw).tobytes()
    out = [HEADER.pack(v1.MAGIC, FORMAT_VERSION, v1.DTYPE_CODES[dtype], unit // UNIT_STEP, 0, 2 * L, T, C, n_sink),
           side.tobytes(), b"\0" * v1._pad4(side.size), sink_bytes, b"\0" * v1._pad4(len(sink_bytes)),
           np.array([len(r) for r in regions], "<u2").tobytes()]
    return b"".join(out + regions)


# --------------------------------------------------------------------------- reader
@dataclass
class Layout:
    """What a reader knows before decoding any unit: every unit's symbols and region."""
    shape: tuple[int, int, int, int]
    dtype: str
    unit: int  # symbols a unit
    n_sink: int
    Tc: int
    side: np.ndarray  # uint8 [2L, C]
    sink_at: int
    spans: np.ndarray  # int64 [units, 3]: (row, first symbol, count) per unit
    reg_at: np.ndarray  # int64 [pairs]: each pair's region's offset in the payload
    reg_len: np.ndarray  # int64 [pairs]

    def stream(self, data: bytes, u: int) -> bytes:
        """Unit u's stream: its pair's region (u even), or that region backward (u odd)."""
        at, n = int(self.reg_at[u // 2]), int(self.reg_len[u // 2])
        region = data[at:at + n]
        return region if u % 2 == 0 else region[::-1]


def parse(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> Layout:
    _, L, T, C = shape
    if len(payload) < HEADER.size:
        raise DecodeError("pca: payload shorter than its header")
    magic, version, dcode, unit64, reserved, rows, tokens, channels, n_sink = HEADER.unpack_from(payload, 0)
    if magic != v1.MAGIC or version != FORMAT_VERSION or reserved != 0:
        raise DecodeError("pca: not a pca payload of version 2")
    if dcode != v1.DTYPE_CODES[dtype] or rows != 2 * L or tokens != T or channels != C or n_sink > T \
            or not 1 <= unit64 <= UNIT_MAX // UNIT_STEP:
        raise DecodeError("pca: the payload's header does not match the chunk's shape and dtype")
    pos = HEADER.size
    if len(payload) < pos + rows * C:
        raise DecodeError("pca: payload shorter than its side bytes")
    side = np.frombuffer(bytes(payload[pos:pos + rows * C]), np.uint8).reshape(rows, C)
    if ((side != ALL_ZERO) & ((side >> 5) == 7)).any():
        raise DecodeError("pca: a side byte names shift 7")
    Tc = T - n_sink
    if Tc == 0 and (side != ALL_ZERO).any():
        raise DecodeError("pca: a chunk without coded tokens has a coded component")
    pos += rows * C + v1._pad4(rows * C)
    sink_at = pos
    item = 4 if dtype == "float32" else 2
    pos += 2 * L * n_sink * C * item
    pos += v1._pad4(pos - sink_at)
    spans = unit_spans(side, Tc, unit64 * UNIT_STEP)
    pairs = -(-len(spans) // 2)
    if len(payload) < pos + 2 * pairs:
        raise DecodeError("pca: payload shorter than its unit table")
    reg_len = np.frombuffer(bytes(payload[pos:pos + 2 * pairs]), "<u2").astype(np.int64)
    pos += 2 * pairs
    reg_at = pos + np.concatenate([[0], np.cumsum(reg_len)[:-1]]).astype(np.int64) if pairs else np.zeros(0, np.int64)
    if len(payload) != pos + int(reg_len.sum()):
        raise DecodeError(f"pca: payload is {len(payload)} bytes, its tables say {pos + int(reg_len.sum())}")
    need = np.full(pairs, 8, np.int64)
    if len(spans) % 2:
        need[-1] = 4
    if (reg_len < need).any():
        raise DecodeError("pca: a unit's region is shorter than its states")
    return Layout((2, L, T, C), dtype, unit64 * UNIT_STEP, n_sink, Tc, side, sink_at, spans, reg_at, reg_len)


def _unit_meta(lay: Layout, u: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(component, token, table, shift) of each symbol of unit u."""
    r, first, n = (int(v) for v in lay.spans[u])
    live = np.nonzero(lay.side[r] != ALL_ZERO)[0]
    i = np.arange(first, first + n)
    comp = live[i // lay.Tc]
    sb = lay.side[r, comp].astype(np.int64)
    return comp, i % lay.Tc, sb & 31, sb >> 5


def _raw_parts(stream: bytes, sym: np.ndarray, state: int, words_read: int, shift: np.ndarray) -> tuple[np.ndarray,
                                                                                                         int]:
    """(the signed coefficients of a unit, the bytes of its stream it used) from its symbols and
    the state its rANS ended in."""
    if state >> BACK_BITS != 1:
        raise DecodeError("pca: a unit's rANS stream does not end in a state of 2^31 + 31 bits")
    is_esc = sym == ESCAPE
    n_esc = int(is_esc.sum())
    esc_at = 4 + 2 * words_read
    raw_at = esc_at + 2 * n_esc
    if raw_at > len(stream):
        raise DecodeError("pca: a unit's escapes end early")
    hi = sym.copy()
    hi[is_esc] += np.frombuffer(stream, "<u2", count=n_esc, offset=esc_at).astype(np.int64)
    lo_bits = int(shift.sum())
    # every bit the unit may use: the state's 31, then the stream's bytes after the escapes
    bits = np.concatenate([np.array([(state >> j) & 1 for j in range(BACK_BITS)], np.uint8),
                           np.unpackbits(np.frombuffer(stream, np.uint8, offset=raw_at), bitorder="little")])
    if lo_bits > len(bits):
        raise DecodeError("pca: a unit's low bits end early")
    lo_w = np.zeros(len(sym), np.int64)
    if lo_bits:
        starts = np.cumsum(shift) - shift
        for j in range(int(shift.max())):
            has = shift > j
            lo_w[has] |= bits[starts[has] + j].astype(np.int64) << j
    mag = (hi << shift) | lo_w
    if (mag > v1.Q_LIMIT).any():
        raise DecodeError("pca: a coefficient exceeds 32767")
    nz = mag != 0
    used = lo_bits + int(nz.sum())
    if used > len(bits):
        raise DecodeError("pca: a unit's sign bits end early")
    raw_bytes = max(0, -(-(used - BACK_BITS) // 8))
    # the bits after the last one used, up to the end of its byte, are zero
    if bits[used:BACK_BITS + 8 * raw_bytes].any():
        raise DecodeError("pca: a unit's raw bits do not match its symbols")
    val = mag.copy()
    signs = bits[lo_bits:used].astype(bool)
    val[np.nonzero(nz)[0][signs]] *= -1
    return val, raw_at + raw_bytes


def _rans_scalar(stream: bytes, tab: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(symbols, end state, words read) of one unit's stream, one symbol at a time (§11.3)."""
    x = struct.unpack_from("<I", stream, 0)[0]
    p = 4
    sym = np.zeros(len(tab), np.int64)
    for i in range(len(tab)):
        slot = x & ((1 << PROB_BITS) - 1)
        s = int(SYMBOL_OF_SLOT[tab[i], slot])
        x = int(FREQ[tab[i], s]) * (x >> PROB_BITS) + slot - int(CUM[tab[i], s])
        if x < RANS_L:
            if p + 2 > len(stream):
                raise DecodeError("pca: a unit's rANS words end early")
            x = (x << 16) | struct.unpack_from("<H", stream, p)[0]
            p += 2
        sym[i] = s
    return sym, x, (p - 4) // 2


def decode_unit(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str, u: int,
                lay: Layout | None = None) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Unit u alone, one symbol at a time: (row, components, tokens, coefficients). Reads the
    header, the side bytes and the unit table (to find its region), then its own stream only."""
    lay = lay or parse(payload, shape, dtype)
    stream = lay.stream(bytes(payload), u)
    comp, tok, tab, shift = _unit_meta(lay, u)
    sym, x, words_read = _rans_scalar(stream, tab)
    val, _ = _raw_parts(stream, sym, x, words_read, shift)
    return int(lay.spans[u][0]), comp, tok, val


def _rans_decode_units(streams: list[bytes], tabs: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray,
                                                                              np.ndarray]:
    """Every unit's symbols at once (numpy across units): (symbols per unit, end states, words read)."""
    n = len(streams)
    steps = max((len(t) for t in tabs), default=0)
    tab = np.zeros((n, steps), np.int64)
    valid = np.zeros((n, steps), bool)
    for i, t in enumerate(tabs):
        tab[i, :len(t)] = t
        valid[i, :len(t)] = True
    # the streams back to back, each followed by 4 zero bytes (a read at its end sees zeros): no
    # more room than the payload's bytes (a units-by-longest-stream array would let a hostile
    # region table of one long region and many short ones ask for gigabytes: §11.4)
    length = np.array([len(s) for s in streams], np.int64)
    base = np.concatenate([[0], np.cumsum(length + 4)[:-1]]).astype(np.int64)
    buf = np.frombuffer(b"".join(s + b"\0\0\0\0" for s in streams), np.uint8).astype(np.uint64)
    x = buf[base] | buf[base + 1] << np.uint64(8) | buf[base + 2] << np.uint64(16) | buf[base + 3] << np.uint64(24) \
        if n else np.zeros(0, np.uint64)
    p = np.full(n, 4, np.int64)
    out = np.zeros((n, steps), np.int64)
    mask = np.uint64((1 << PROB_BITS) - 1)
    short = np.zeros(n, bool)
    for k in range(steps):
        v, t = valid[:, k], tab[:, k]
        slot = (x & mask).astype(np.int64)
        sym = SYMBOL_OF_SLOT[t, slot]
        xn = FREQ[t, sym].astype(np.uint64) * (x >> np.uint64(PROB_BITS)) + slot.astype(np.uint64) \
            - CUM[t, sym].astype(np.uint64)
        need = v & (xn < np.uint64(RANS_L))
        short |= need & (p + 2 > length)
        at = base + np.minimum(p, length)  # (past its end: its zeros, and `short` refuses it)
        w = buf[at] | (buf[at + 1] << np.uint64(8))
        xn = np.where(need, (xn << np.uint64(16)) | w, xn)
        p = np.where(need, p + 2, p)
        x = np.where(v, xn, x)
        out[:, k] = sym
    if short.any():
        raise DecodeError("pca: a unit's rANS words end early")
    return [out[i, :len(t)] for i, t in enumerate(tabs)], x, (p - 4) // 2


def decode_coefficients(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> tuple[Layout, np.ndarray]:
    """(layout, q int64 [2L, Tc, C]) with every unit decoded (all units' rANS steps together); each
    pair's two streams must fill its region exactly."""
    lay = parse(payload, shape, dtype)
    _, L, T, C = shape
    data = bytes(payload)
    metas = [_unit_meta(lay, u) for u in range(len(lay.spans))]
    streams = [lay.stream(data, u) for u in range(len(lay.spans))]
    syms, states, words_read = _rans_decode_units(streams, [m[2] for m in metas])
    q = np.zeros((2 * L, lay.Tc, C), np.int64)
    used = np.zeros(len(lay.reg_len), np.int64)
    for u, ((comp, tok, _, shift), sym) in enumerate(zip(metas, syms)):
        val, n = _raw_parts(streams[u], sym, int(states[u]), int(words_read[u]), shift)
        q[lay.spans[u][0], tok, comp] = val
        used[u // 2] += n
    if (used != lay.reg_len).any():
        raise DecodeError("pca: a pair of units does not fill its region exactly")
    if (np.abs(q).sum(-1) > v1.TOKEN_L1_LIMIT).any():
        raise DecodeError(f"pca: a token's coefficients sum past {v1.TOKEN_L1_LIMIT}")
    return lay, q


def decode_chunk(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str, cal: Calibration, step: float,
                 start: int) -> np.ndarray:
    """The chunk [2, L, T, C] in dtype's storage (bf16 as uint16 bits)."""
    _, L, T, C = shape
    if cal.layers != L or cal.channels != C:
        raise DecodeError(f"pca: the calibration is for {cal.layers} layers x {cal.channels} channels, the chunk "
                          f"has {L} x {C}")
    lay, q = decode_coefficients(payload, shape, dtype)
    n_sink, Tc = lay.n_sink, lay.Tc
    sink = sink_tokens(payload, lay)
    out = np.empty((2, L, T, C), dtype=sink.dtype)
    out[:, :, :n_sink] = sink
    if Tc:
        tables = rope_tables(cal, start + n_sink, Tc)
        x = v1.inverse(q.reshape(2, L, Tc, C), cal, start + n_sink, step, tables=tables)
        out[:, :, n_sink:] = v1.to_dtype(x, dtype)
    return out


def sink_tokens(payload: bytes | memoryview, lay: Layout) -> np.ndarray:
    """The sink tokens [2, L, S, C] as stored (bf16 as uint16 bits), where `parse` found them."""
    _, L, _, C = lay.shape
    storage = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}[lay.dtype]
    return np.frombuffer(bytes(payload), storage, count=2 * L * lay.n_sink * C,
                         offset=lay.sink_at).reshape(2, L, lay.n_sink, C)


def units_of(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> int:
    """The number of independent decode units of a version-2 payload."""
    return len(parse(payload, shape, dtype).spans)


def payload_stats(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> dict:
    """Bits per value by part (header and side bytes, sinks, unit table, segments)."""
    lay = parse(payload, shape, dtype)
    _, L, T, C = shape
    values = 2 * L * T * C
    table_at = len(payload) - int(lay.reg_len.sum()) - 2 * len(lay.reg_len)
    acc = {"header": 8 * HEADER.size, "side": 8 * (lay.sink_at - HEADER.size), "sinks": 8 * (table_at - lay.sink_at),
           "unit_table": 16 * len(lay.reg_len), "regions": 8 * int(lay.reg_len.sum())}
    total = 8 * len(payload)
    return {"values": values, "bytes": len(payload), "bits_per_value": total / values,
            **{f"bpv_{k}": v / values for k, v in acc.items()},
            "bits_per_value_by_part": {k: v / values for k, v in acc.items()},
            "share": {k: v / total for k, v in acc.items()},
            "units": len(lay.spans), "unit_symbols": lay.unit, "sink_tokens": lay.n_sink,
            "components_coded": int((lay.side != ALL_ZERO).sum()), "components": 2 * L * C}
