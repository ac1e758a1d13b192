"""Pure-Python reference of the CacheGen bitstream (format-spec/cachegen.md).

This module is the executable form of the spec: the native coder
(kernels/cachegen_cpu.c) must produce exactly the bytes `encode_chunk` produces
and decode to exactly what `decode_chunk` decodes. It is also the fallback when
the native extension is unavailable. Quantization is vectorised in torch, the
rANS lanes in numpy (all layers and lanes of one step at a time).
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import DecodeError, NonFiniteValues
from . import _tables as TB
from .payload import (CODE_DTYPE_NAMES, FORMAT_VERSION, HEADER_FIXED, LANES_MAX, MAGIC, MAX_TOKENS,  # noqa: F401
                      PROB_BITS_MAX, PROB_BITS_MIN, RICE_ESCAPE, SCALE_WIDTH, W_K, W_MU, W_SIGMA, Header,
                      build_header, half_range, header_size, parse_header, parse_side, payload_stats)

RANS_L = 1 << 16
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
SCALE_NP = {0: np.uint16, 1: np.uint16, 2: np.uint32}

_PHI = np.array(TB.PHI, dtype=np.int64)
_INV4S = np.array(TB.INV4S, dtype=np.int64)
_SIG2_THR = np.array(TB.SIG2_THR, dtype=np.uint64)


# --------------------------------------------------------------------------- quantization
def quantize(x: torch.Tensor, bins: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [2L, T, C] KV tensor. Returns (symbols uint8 [2L, T, C], scales [2L, T] in x's dtype).

    scale = max |x| over the channels (exact in the KV dtype);
    q = clamp(round_half_even(fp32(fp32((x * pre) * fp32(M / (scale * pre))) + M)), 0, 2M), with
    pre = 2^64 when scale < 2^-100 (else 1) and factor 0 when scale == 0."""
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteValues("cachegen: the KV input holds NaN or infinity")
    scales = x.abs().amax(dim=-1)
    M = torch.tensor([half_range(b) for b in bins], dtype=torch.float32).view(-1, 1)
    sf = scales.float()
    # tokens with scale < 2^-100 (M / scale would overflow) are pre-scaled by 2^64, exactly
    pre = torch.where(sf < 2.0**-100, torch.full_like(sf, 2.0**64), torch.ones_like(sf))
    factor = torch.where(sf > 0, M / torch.where(sf > 0, sf * pre, torch.ones_like(sf)), torch.zeros_like(sf))
    y = (x.float() * pre.unsqueeze(-1)) * factor.unsqueeze(-1)
    y = y + M.unsqueeze(-1)
    q = torch.round(y)
    q = torch.minimum(torch.clamp(q, min=0), (2 * M).unsqueeze(-1))
    return q.to(torch.uint8), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, bins: list[int], dtype: torch.dtype) -> torch.Tensor:
    """value = dtype(fp32(fp32(fp32(q - M) / M) * fp32(scale)))"""
    M = torch.tensor([half_range(b) for b in bins], dtype=torch.float32).view(-1, 1, 1)
    unit = (q.float() - M) / M
    return (unit * scales.float().unsqueeze(-1)).to(dtype)


# --------------------------------------------------------------------------- tables
def estimate_params(q: np.ndarray, nsym: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q: [Lk, T, C] symbols; nsym: [Lk]. Returns (mq, sq) of shape [Lk, C]."""
    n = q.shape[1]
    qi = q.astype(np.uint64)
    s1 = qi.sum(axis=1, dtype=np.uint64)
    s2 = (qi * qi).sum(axis=1, dtype=np.uint64)
    N = np.uint64(n)
    mq = (np.uint64(8) * s1 + N) // (np.uint64(2) * N)
    mq = np.minimum(mq, (4 * (nsym.astype(np.uint64) - 1))[:, None])
    V = N * s2 - s1 * s1
    N2 = N * N
    var16 = ((V // N2) << np.uint64(16)) + (((V % N2) << np.uint64(16)) // N2)
    s2q = var16 + np.uint64(5461)
    sq = (_SIG2_THR[None, None, :] <= s2q[..., None]).sum(axis=-1)
    return mq.astype(np.int64), sq.astype(np.int64)


def build_cum(mq: np.ndarray, sq: np.ndarray, nsym: np.ndarray, prob_bits: int, width: int) -> np.ndarray:
    """Cumulative frequencies [..., width] (width >= max nsym + 1); entries past nsym hold 2^P."""
    mq = np.asarray(mq, dtype=np.int64)
    sq = np.asarray(sq, dtype=np.int64)
    ns = np.broadcast_to(np.asarray(nsym, dtype=np.int64), mq.shape)
    s = np.arange(width, dtype=np.int64)
    num = 4 * s - 2 - mq[..., None]
    zf = num * _INV4S[sq][..., None]
    zlim = TB.PHI_ZMAX * 65536
    zf = np.clip(zf, -zlim, zlim - 1)
    zi = zf + zlim
    idx = zi >> 11
    frac = zi & 2047
    lo = _PHI[idx]
    hi = _PHI[np.minimum(idx + 1, len(_PHI) - 1)]
    ph = lo + (((hi - lo) * frac) >> 11)
    spread = (1 << prob_bits) - ns
    cum = s + ((ph * spread[..., None]) >> 16)
    cum = np.where(s >= ns[..., None], 1 << prob_bits, cum)
    cum[..., 0] = 0
    return cum


# --------------------------------------------------------------------------- Rice side information
class _Bits:
    def __init__(self) -> None:
        self.vals: list[int] = []
        self.lens: list[int] = []

    def put(self, v: int, n: int) -> None:
        if n:
            self.vals.append(int(v))
            self.lens.append(int(n))

    @property
    def nbits(self) -> int:
        return int(sum(self.lens))

    def tobytes(self, nbytes: int) -> bytes:
        out = np.zeros(nbytes * 8, dtype=np.uint8)
        if self.vals:
            lens = np.array(self.lens, dtype=np.int64)
            vals = np.array(self.vals, dtype=np.uint64)
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            rep = np.repeat(vals, lens)
            shift = (np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(starts, lens)).astype(np.uint64)
            out[: len(rep)] = ((rep >> shift) & np.uint64(1)).astype(np.uint8)
        return np.packbits(out, bitorder="little").tobytes()


def rice_block_put(bits: _Bits, values: np.ndarray, w: int) -> None:
    v = np.asarray(values, dtype=np.int64)
    base = int(np.sort(v)[(len(v) - 1) // 2])
    z = np.where(v >= base, 2 * (v - base), 2 * (base - v) - 1)
    best_k, best = 0, None
    for k in range(min(w, 31) + 1):
        qq = z >> k
        cost = int(np.where(qq < RICE_ESCAPE, qq + 1 + k, RICE_ESCAPE + w).sum())
        if best is None or cost < best:
            best, best_k = cost, k
    bits.put(base, w)
    bits.put(best_k, W_K)
    k = best_k
    for vi, zi in zip(v.tolist(), z.tolist()):
        qq = zi >> k
        if qq < RICE_ESCAPE:
            bits.put((1 << qq) - 1, qq + 1)
            bits.put(zi & ((1 << k) - 1), k)
        else:
            bits.put((1 << RICE_ESCAPE) - 1, RICE_ESCAPE)
            bits.put(vi, w)


# --------------------------------------------------------------------------- chunk encode
def encode_chunk(x: torch.Tensor, bins: list[int], prob_bits: int, lanes: int) -> bytes:
    """x: contiguous [2L, T, C] tensor of a KV dtype."""
    Lk, T, C = x.shape
    dc = DTYPE_CODES[x.dtype]
    P = prob_bits
    N = min(lanes, C)
    q_t, scales_t = quantize(x, bins)
    q = q_t.numpy()
    sc_bits = scales_t.contiguous().view({0: torch.int16, 1: torch.int16, 2: torch.int32}[dc]).numpy()
    sc_bits = sc_bits.astype(np.int64) & ((1 << SCALE_WIDTH[dc]) - 1)
    Ms = np.array([half_range(b) for b in bins], dtype=np.int64)
    nsym = 2 * Ms + 1
    width = int(nsym.max()) + 1
    mq, sq = estimate_params(q, nsym)
    cum = build_cum(mq, sq, nsym[:, None], P, width)  # [Lk, C, width]

    # side information per layer
    sides = []
    for li in range(Lk):
        bits = _Bits()
        rice_block_put(bits, sc_bits[li], SCALE_WIDTH[dc])
        rice_block_put(bits, mq[li], W_MU)
        rice_block_put(bits, sq[li], W_SIGMA)
        nbytes = ((bits.nbits + 31) // 32) * 4
        sides.append(bits.tobytes(nbytes))

    # rANS: lanes of all layers advance together, in reverse decoding order
    G = -(-C // N)
    Cp = G * N
    li = np.arange(Lk)[:, None, None]
    ci = np.arange(C)[None, None, :]
    qi = q.astype(np.int64)
    st = np.zeros((Lk, T, Cp), dtype=np.uint64)
    fr = np.ones((Lk, T, Cp), dtype=np.uint64)
    st[:, :, :C] = cum[li, ci, qi]
    fr[:, :, :C] = cum[li, ci, qi + 1] - cum[li, ci, qi]
    valid = (np.arange(Cp) < C).reshape(G, N)
    st = st.reshape(Lk, T * G, N)
    fr = fr.reshape(Lk, T * G, N)
    steps = T * G
    x_st = np.full((Lk, N), RANS_L, dtype=np.uint64)
    emit_all = np.zeros((steps, Lk, N), dtype=bool)
    word_all = np.zeros((steps, Lk, N), dtype=np.uint16)
    sh = np.uint64(32 - P)
    Pu = np.uint64(P)
    for k in range(steps - 1, -1, -1):
        v = valid[k % G]
        s_ = st[:, k, :]
        f_ = fr[:, k, :]
        emit = (x_st >= (f_ << sh)) & v
        word_all[k] = (x_st & np.uint64(0xFFFF)).astype(np.uint16)
        emit_all[k] = emit
        x_st = np.where(emit, x_st >> np.uint64(16), x_st)
        xn = ((x_st // f_) << Pu) + (x_st % f_) + s_
        x_st = np.where(v, xn, x_st)

    sections = []
    for li_ in range(Lk):
        words = word_all[:, li_, :][emit_all[:, li_, :]]
        body = sides[li_] + x_st[li_].astype("<u4").tobytes() + words.astype("<u2").tobytes()
        body += b"\0" * ((-len(body)) % 4)
        sections.append(body)

    return build_header(dc, P, N, T, C, Ms, [len(sec) for sec in sections]) + b"".join(sections)


# --------------------------------------------------------------------------- chunk decode
def decode_symbols(payload: bytes | memoryview, dtype_code: int, layers: int, tokens: int, channels: int,
                   bins: list[int]) -> tuple[np.ndarray, np.ndarray, Header]:
    """Entropy-decode a payload: (symbols uint8 [Lk, T, C], scale bits [Lk, T], header)."""
    Ms = [half_range(b) for b in bins]
    h = parse_header(payload, layers, tokens, channels, dtype_code, Ms)
    Lk, T, C, P, N = layers, tokens, channels, h.prob_bits, h.lanes
    nsym = np.array([2 * m + 1 for m in Ms], dtype=np.int64)
    width = int(nsym.max()) + 1
    mq = np.empty((Lk, C), dtype=np.int64)
    sq = np.empty((Lk, C), dtype=np.int64)
    scales = np.empty((Lk, T), dtype=np.int64)
    states = np.empty((Lk, N), dtype=np.uint64)
    word_arrays = []
    for li in range(Lk):
        sec = payload[h.offsets[li] : h.offsets[li] + h.lengths[li]]
        sd = parse_side(sec, h.dtype_code, T, C, int(nsym[li]))
        scales[li], mq[li], sq[li] = sd.scales, sd.mq, sd.sq
        rest = len(sec) - sd.side_bytes
        if rest < 4 * N:
            raise DecodeError(f"cachegen: layer {li}: section too short for its rANS states")
        states[li] = np.frombuffer(sec, dtype="<u4", count=N, offset=sd.side_bytes)
        if (states[li] < RANS_L).any():
            raise DecodeError(f"cachegen: layer {li}: rANS state below its lower bound")
        wbytes = bytes(sec[sd.side_bytes + 4 * N :])
        word_arrays.append(wbytes)

    cum = build_cum(mq, sq, nsym[:, None], P, width)  # [Lk, C, width]
    # one sorted array for a batched search: row r = (layer, channel) offset by r * 2^16
    rows = (np.arange(Lk * C, dtype=np.int64) << 16).reshape(Lk, C, 1)
    flat = (cum + rows).reshape(-1)
    G = -(-C // N)
    valid = (np.arange(G * N) < C).reshape(G, N)
    chan = np.minimum(np.arange(G * N), C - 1).reshape(G, N)
    nwords = np.array([len(w) // 2 for w in word_arrays], dtype=np.int64)
    wbase = np.concatenate([[0], np.cumsum(nwords)[:-1]]).astype(np.int64)
    allwords = np.frombuffer(b"".join(w[: 2 * (len(w) // 2)] for w in word_arrays), dtype="<u2").astype(np.uint64)
    ptr = np.zeros(Lk, dtype=np.int64)
    x = states.copy()
    out = np.empty((Lk, T, G * N), dtype=np.uint8)
    mask = np.uint64((1 << P) - 1)
    Pu = np.uint64(P)
    lidx = np.arange(Lk)[:, None]
    for t in range(T):
        for g in range(G):
            v = valid[g]
            c = chan[g]
            slot = x & mask
            r = (lidx * C + c[None, :]).astype(np.int64)
            pos = np.searchsorted(flat, slot.astype(np.int64) + (r << 16), side="right") - 1
            s = pos - r * width
            st = cum[lidx, c[None, :], s].astype(np.uint64)
            fr = cum[lidx, c[None, :], s + 1].astype(np.uint64) - st
            xn = fr * (x >> Pu) + slot - st
            need = (xn < np.uint64(RANS_L)) & v
            cs = np.cumsum(need, axis=1)
            take = ptr[:, None] + cs - 1
            if (ptr + cs[:, -1] > nwords).any():
                raise DecodeError("cachegen: rANS stream ends early")
            idx = np.where(need, wbase[:, None] + take, 0)
            w = allwords[idx] if len(allwords) else np.zeros_like(xn)
            xn = np.where(need, (xn << np.uint64(16)) | w, xn)
            x = np.where(v, xn, x)
            ptr += cs[:, -1]
            out[:, t, g * N : (g + 1) * N] = s.astype(np.uint8)
    if (x != RANS_L).any():
        raise DecodeError("cachegen: rANS stream does not end in its initial state")
    for li in range(Lk):
        wb = word_arrays[li]
        used = int(ptr[li])
        want_pad = 2 if used & 1 else 0
        if len(wb) - 2 * used != want_pad or any(wb[2 * used :]):
            raise DecodeError(f"cachegen: layer {li}: rANS stream has trailing bytes")
    h.words = [int(p) for p in ptr]  # renormalisation words each section held (the spec derives them so)
    return out[:, :, :C], scales, h


def decode_chunk(payload: bytes | memoryview, dtype: torch.dtype, layers: int, tokens: int, channels: int,
                 bins: list[int]) -> torch.Tensor:
    dc = DTYPE_CODES[dtype]
    q, scales, _ = decode_symbols(payload, dc, layers, tokens, channels, bins)
    sbits = torch.from_numpy(scales.astype(np.int64))
    if dc == 2:
        sc = sbits.to(torch.int32).view(torch.float32)
    else:
        sc = sbits.to(torch.int16).view(dtype)
    # int64 -> int16 wraps values >= 2^15 the same way the bit pattern needs
    return dequantize(torch.from_numpy(q), sc, bins, dtype)
