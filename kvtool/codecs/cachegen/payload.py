"""The CacheGen payload's framing (format-spec/cachegen.md sections 3-4), without torch.

The payload header and section directory (written by `build_header` for the
reference, native-checked and GPU coders alike, read by `parse_header`), the
Rice-coded side information of a layer section (`parse_side`), and the
bits-per-value breakdown `kvtool inspect` shows (`payload_stats`). The entropy
coder itself lives in `reference.py` (and the C and CUDA coders).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ...errors import DecodeError, DecoderMemoryExceeded, UsageError
from . import _tables as TB

FORMAT_VERSION = 1
MAGIC = b"CG"
HEADER_FIXED = 20
PROB_BITS_MIN, PROB_BITS_MAX = 10, 15
LANES_MAX = 64
MAX_TOKENS = 1 << 24
RICE_ESCAPE = 16
W_MU, W_SIGMA, W_K = 10, 5, 5
DTYPE_CODE_OF = {"bfloat16": 0, "float16": 1, "float32": 2}  # the KV dtype byte of the header, by dtype name
CODE_DTYPE_NAMES = {v: k for k, v in DTYPE_CODE_OF.items()}
SCALE_WIDTH = {0: 16, 1: 16, 2: 32}


def half_range(bins: int) -> int:
    return bins // 2 - 1


def header_size(layers: int) -> int:
    return HEADER_FIXED + ((layers + 3) & ~3) + 4 * layers


def build_header(dtype_code: int, prob_bits: int, lanes: int, tokens: int, channels: int,
                 half_ranges: list[int], lengths: list[int]) -> bytes:
    """The payload header and section directory for sections of `lengths` bytes (section 3)."""
    layers = len(half_ranges)
    hdr = bytearray(header_size(layers))
    hdr[0:2] = MAGIC
    hdr[2] = FORMAT_VERSION
    hdr[3], hdr[4], hdr[5] = dtype_code, prob_bits, lanes
    struct.pack_into("<III", hdr, 8, layers, tokens, channels)
    hdr[HEADER_FIXED:HEADER_FIXED + layers] = bytes(int(m) for m in half_ranges)
    struct.pack_into(f"<{layers}I", hdr, HEADER_FIXED + ((layers + 3) & ~3), *lengths)
    return bytes(hdr)


# The decoders' frequency tables (format-spec/cachegen.md section 8): per channel at most
# 2*S + 72 bytes (S entries of u16 cumulative frequencies, S the smallest power of two >= nsym + 1,
# a 64-byte bucket table, the u32 mean and sigma codes), bounded like decoded bytes
# (container.md section 5): <= 1024 x the chunk's stored length + 1 MiB.
TABLE_EXPANSION = 1024
TABLE_SLACK = 1 << 20


def table_size(half_range: int) -> int:
    """S: entries of one channel's padded cumulative table (a power of two >= 2M + 2)."""
    s = 2
    while s < 2 * half_range + 2:
        s <<= 1
    return s


def table_bytes(channels: int, half_ranges: list[int]) -> int:
    """The tables' budget of a chunk: sum over coded layers of C * (2S + 72) bytes."""
    return sum(channels * (2 * table_size(m) + 72) for m in half_ranges)


def check_table_budget(payload_len: int, channels: int, half_ranges: list[int], *, writing: bool = False) -> None:
    """DecoderMemoryExceeded when the chunk's tables exceed 1024 x its stored length + 1 MiB
    (checked by the CPU and GPU decoders); UsageError when `writing` (the encoders, on what they
    produced: such a payload would be unreadable)."""
    need = table_bytes(channels, half_ranges)
    if need <= TABLE_EXPANSION * payload_len + TABLE_SLACK:
        return
    if writing:
        raise UsageError(
            f"cachegen: this chunk compresses to {payload_len} bytes, too few for the {need} bytes of tables "
            f"its decoder needs (format-spec/cachegen.md section 8); use at most 64 bins or longer chunks")
    raise DecoderMemoryExceeded(
            f"cachegen: {len(half_ranges)} layers of {channels} channels need {need} bytes of decoder "
            f"tables, more than the format allows for a {payload_len}-byte payload")


@dataclass
class Header:
    dtype_code: int
    prob_bits: int
    lanes: int
    layers: int
    tokens: int
    channels: int
    half_ranges: list[int]
    offsets: list[int]
    lengths: list[int]
    words: list[int] | None = None  # per section, once a decoder has counted them


def parse_header(p: bytes | memoryview, layers: int, tokens: int, channels: int,
                 dtype_code: int | None, half_ranges: list[int] | None) -> Header:
    n = len(p)
    if n < HEADER_FIXED:
        raise DecodeError("cachegen: payload shorter than its header")
    if bytes(p[0:2]) != MAGIC:
        raise DecodeError("cachegen: bad magic")
    if p[2] != FORMAT_VERSION:
        raise DecodeError(f"cachegen: unknown bitstream version {p[2]}")
    dc, P, N = p[3], p[4], p[5]
    if dc not in CODE_DTYPE_NAMES or (dtype_code is not None and dc != dtype_code):
        raise DecodeError("cachegen: payload dtype differs from the declared dtype")
    if not PROB_BITS_MIN <= P <= PROB_BITS_MAX:
        raise DecodeError("cachegen: prob_bits out of range")
    if not 1 <= N <= min(LANES_MAX, channels):
        raise DecodeError("cachegen: lane count out of range")
    if p[6] or p[7]:
        raise DecodeError("cachegen: reserved header bytes are nonzero")
    lay, tok, ch = struct.unpack_from("<III", p, 8)
    if (lay, tok, ch) != (layers, tokens, channels):
        raise DecodeError("cachegen: payload shape differs from the declared shape")
    hs = header_size(layers)
    if n < hs:
        raise DecodeError("cachegen: payload shorter than its header")
    hr = list(p[HEADER_FIXED : HEADER_FIXED + layers])
    if half_ranges is not None and hr != list(half_ranges):
        raise DecodeError("cachegen: payload bins differ from the codec parameters")
    if any(h < 1 or h > 127 for h in hr):
        raise DecodeError("cachegen: bad per-layer half range")
    if any(p[HEADER_FIXED + layers : HEADER_FIXED + ((layers + 3) & ~3)]):
        raise DecodeError("cachegen: nonzero header padding")
    d = HEADER_FIXED + ((layers + 3) & ~3)
    lens = list(struct.unpack_from(f"<{layers}I", p, d))
    offs = []
    pos = hs
    for i, sl in enumerate(lens):
        if sl < 4 or sl & 3:
            raise DecodeError(f"cachegen: layer {i}: bad section length")
        offs.append(pos)
        pos += sl
        if pos > n:
            raise DecodeError(f"cachegen: layer {i}: section runs past the payload")
    if pos != n:
        raise DecodeError("cachegen: payload has trailing bytes")
    check_table_budget(n, channels, hr)
    return Header(dc, P, N, layers, tokens, channels, hr, offs, lens)


def _scale_ok(b: np.ndarray, dc: int) -> bool:
    b = b.astype(np.uint64)
    if dc == 2:
        return bool(((b & 0x80000000) == 0).all() and ((b & 0x7F800000) != 0x7F800000).all())
    if dc == 0:
        return bool(((b & 0x8000) == 0).all() and ((b & 0x7F80) != 0x7F80).all())
    return bool(((b & 0x8000) == 0).all() and ((b & 0x7C00) != 0x7C00).all())


@dataclass
class Side:
    scales: np.ndarray
    mq: np.ndarray
    sq: np.ndarray
    bits_scales: int
    bits_mu: int
    bits_sigma: int
    side_bytes: int


def parse_side(sec: bytes | memoryview, dc: int, tokens: int, channels: int, nsym: int) -> Side:
    rd = _Reader(sec)
    ws = SCALE_WIDTH[dc]
    scales = rice_block_get(rd, tokens, ws, (1 << ws) - 1, "scale")
    b0 = rd.pos
    if not _scale_ok(scales, dc):
        raise DecodeError("cachegen: a scale is negative, infinite or NaN")
    mq = rice_block_get(rd, channels, W_MU, 4 * (nsym - 1), "mean")
    b1 = rd.pos
    sq = rice_block_get(rd, channels, W_SIGMA, TB.NSIGMA - 1, "sigma")
    b2 = rd.pos
    padded = (rd.pos + 31) & ~31
    if padded > rd.n:
        raise DecodeError("cachegen: side information overruns its section")
    if rd.get(padded - rd.pos) != 0:
        raise DecodeError("cachegen: nonzero padding after side information")
    return Side(scales, mq, sq, b0, b1 - b0, b2 - b1, padded // 8)


# --------------------------------------------------------------------------- side information
class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
        self.n = len(self.bits)
        self.pos = 0

    def get(self, n: int) -> int:
        if self.pos + n > self.n:
            raise DecodeError("cachegen: side information runs past its section")
        v = 0
        seg = self.bits[self.pos : self.pos + n]
        for i, b in enumerate(seg.tolist()):
            v |= b << i
        self.pos += n
        return v

    def rice(self, base: int, k: int, w: int) -> int:
        q = 0
        while q < RICE_ESCAPE:
            if self.pos >= self.n:
                raise DecodeError("cachegen: side information runs past its section")
            b = int(self.bits[self.pos])
            self.pos += 1
            if not b:
                break
            q += 1
        if q == RICE_ESCAPE:
            return self.get(w)
        z = (q << k) | self.get(k)
        d = -((z + 1) >> 1) if z & 1 else z >> 1
        v = base + d
        if v < 0 or v >= (1 << w):
            raise DecodeError("cachegen: a Rice-coded value is out of range")
        return v


def rice_block_get(rd: _Reader, n: int, w: int, vmax: int, what: str) -> np.ndarray:
    base = rd.get(w)
    k = rd.get(W_K)
    if k > w:
        raise DecodeError(f"cachegen: {what} block has Rice parameter {k} > {w}")
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        v = rd.rice(base, k, w)
        if v > vmax:
            raise DecodeError(f"cachegen: {what} value {v} out of range")
        out[i] = v
    return out


# --------------------------------------------------------------------------- stats
def payload_stats(payload: bytes | memoryview, layers: int, tokens: int, channels: int) -> dict:
    """Bits per value of everything in a payload, by category (parses headers and side info only)."""
    if len(payload) < HEADER_FIXED:
        raise DecodeError("cachegen: payload shorter than its header")
    h = parse_header(payload, layers, tokens, channels, None, None)
    nvals = layers * tokens * channels
    acc = {"header": header_size(layers) * 8, "scales": 0, "tables": 0, "lane_states": 0, "payload": 0,
           "padding": 0}
    for li in range(layers):
        sec = payload[h.offsets[li] : h.offsets[li] + h.lengths[li]]
        sd = parse_side(sec, h.dtype_code, tokens, channels, 2 * h.half_ranges[li] + 1)
        acc["scales"] += sd.bits_scales
        acc["tables"] += sd.bits_mu + sd.bits_sigma
        side_bits = sd.bits_scales + sd.bits_mu + sd.bits_sigma
        acc["lane_states"] += 32 * h.lanes
        words_bytes = len(sec) - sd.side_bytes - 4 * h.lanes
        acc["payload"] += 8 * words_bytes  # includes <= 2 bytes of section padding
        acc["padding"] += sd.side_bytes * 8 - side_bits
    total = 8 * len(payload)
    out = {
        "values": nvals,
        "bytes": len(payload),
        "bits_per_value": total / nvals,
        # flat copies, for printers that show the scalar entries only
        **{f"bpv_{k}": v / nvals for k, v in acc.items()},
        "bits_per_value_by_part": {k: v / nvals for k, v in acc.items()},
        "share": {k: v / total for k, v in acc.items()},
        "prob_bits": h.prob_bits,
        "lanes": h.lanes,
        "bins": [2 * m + 2 for m in h.half_ranges],
    }
    return out
