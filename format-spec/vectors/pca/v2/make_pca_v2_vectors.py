"""Build the pca version-2 test vectors in this folder (python format-spec/vectors/pca/v2/make_pca_v2_vectors.py).

Version 2 (format-spec/pca.md section 11) codes the same coefficients as version 1 in independent
units. These vectors code the inputs of the version-1 vectors (`../NAME.in.bin`, their parameters
but for `unit` in place of `lanes`) and one longer chunk with many units, over the calibration
objects in `..`, with this script's own writer and reader (`spec_encode2`, `spec_decode2`), written
from format-spec/ alone: like `../make_pca_vectors.py` (whose transform, table choice and tables
it uses) it imports nothing from kvtool, so the vectors are a second implementation's bytes.
For each vector NAME this writes NAME.json (shape, dtype, parameters, the payload's SHA-256, and
every unit's row, first symbol and symbol count, and every pair's region length), NAME.in.bin, NAME.payload.bin,
NAME.out.bin and NAME.rope.bin (section 11.5's float32 tables of the coded tokens: cos [L][Tc][D/2],
then sin; absent when Tc = 0). tests/test_pca_v2_vectors.py checks kvtool's coders against them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
V1 = HERE.parent

# version 1's generator, loaded from its file (it is standalone too): calibration objects, the
# transform of sections 5.1-5.2 given tables, the writer's choice (6.2), the frequency tables
_spec = importlib.util.spec_from_file_location("make_pca_vectors", V1 / "make_pca_vectors.py")
mv1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mv1)

SpecError = mv1.SpecError
STORAGE = mv1.STORAGE
FREQ, CUM = mv1.FREQ, mv1.CUM
FROM_V1 = ("walk_bf16", "bf16_sinks", "fp16_position", "fp32_lanes1", "fp32_far", "bf16_sinks_only", "bf16_heads",
           "fp16_heads_blocks", "fp16_edges")
UNIT = 64  # the smallest unit, so these small chunks have rows of more than one unit
MANY = "bf16_many_units"  # 2 layers, 199 tokens from position 300, step 0.5: dozens of units, escapes
# from position 2^32 (frequency 1 among the object's): 11.5's tables unlike libm's, an odd number of
# units, a unit of fewer than 31 raw bits, |acc| > 2^24 where f32(acc) rounds (see `far_vector`);
# float32, so that the tables' differences reach the decoded values (float16 would round them away)
FAR = "fp32_past_2e32"
FAR_POSITION, FAR_STEP, FAR_SEED = 1 << 32, 0.25, 9
ESCAPE, ALL_ZERO, BACK_BITS = 15, 0xFF, 31


def calibration(digest: str):
    """The calibration object `../<digest>.kvcal`, its digest checked (version 1's reader)."""
    return mv1.parse_calibration((V1 / f"{digest}.kvcal").read_bytes(), digest)


# --------------------------------------------------------------------------- RoPE without libm (§11.5)
TWO_OVER_PI = float.fromhex("0x1.45f306dc9c883p-1")
PIO2 = [float.fromhex(h) for h in ("0x1.921fb40000000p+0", "0x1.4442d00000000p-24", "0x1.8469880000000p-48",
                                   "0x1.8cc51701b839ap-72")]  # P1..P4


def _factorial(n: int) -> float:
    out = 1
    for i in range(2, n + 1):
        out *= i
    return float(out)  # exact up to 15!


S_C = [(-1) ** n / _factorial(2 * n + 1) for n in range(1, 8)]  # S3 .. S15
C_C = [(-1) ** n / _factorial(2 * n) for n in range(1, 8)]  # C2 .. C14


def sincos(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sin, cos) float64 by §11.5's operations in its order (numpy rounds each, fuses none)."""
    k = np.rint(theta * TWO_OVER_PI)
    r = theta
    for part in PIO2:
        r = r - k * part
    z = r * r
    ps = S_C[-1]
    for c in S_C[-2::-1]:
        ps = c + z * ps
    s = r + r * (z * ps)
    pc = C_C[-1]
    for c in C_C[-2::-1]:
        pc = c + z * pc
    co = 1.0 + z * pc
    quad = np.mod(k, 4.0).astype(np.int64)
    return (np.select([quad == 0, quad == 1, quad == 2], [s, co, -s], -co),
            np.select([quad == 0, quad == 1, quad == 2], [co, -s, -co], s))


def rope_tables(cal, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float32 [L, tokens, D/2] of positions start.. (§11.5)."""
    pos = np.arange(start, start + tokens, dtype=np.float64)
    sin, cos = sincos(pos[None, :, None] * cal.inv_freq.astype(np.float64)[:, None, :])
    return cos.astype(np.float32), sin.astype(np.float32)


# --------------------------------------------------------------------------- the transform with 11.5's tables
def forward(x: np.ndarray, cal, cos: np.ndarray, sin: np.ndarray, step: float) -> np.ndarray:
    """§5.1: q int64 [2, L, Tc, C] of the coded tokens x float32 [2, L, Tc, C]."""
    q = np.empty(x.shape, np.int64)
    r = np.float64(1.0) / (np.float64(step) * np.float64(1 << 22))
    for p in range(2):
        xp = mv1.turn(x[p], cos, sin, back=True) if p == 0 else x[p]
        u = ((xp - cal.mean[p][:, None, :]).astype(np.float32) * cal.weight[p][:, None, :]).astype(np.float32)
        U = np.clip(np.rint(u.astype(np.float64) * 256.0), -(2 ** 23 - 1), 2 ** 23 - 1).astype(np.int64)
        acc = np.einsum("ltc,lck->ltk", U, cal.basis[p].astype(np.int64))  # exact integers
        q[p] = np.clip(np.rint(acc.astype(np.float64) * r), -32767, 32767).astype(np.int64)
    if (np.abs(q).sum(-1) > 1 << 16).any():
        raise SpecError("a token's sum of |q| exceeds 2^16 at this step")
    return q


def inverse(q: np.ndarray, cal, cos: np.ndarray, sin: np.ndarray, step: float, wrong: str = "") -> np.ndarray:
    """§5.2: float32 [2, L, Tc, C] of q [2, L, Tc, C]. `wrong`, for the far vector's facts: "acc", a
    reader that multiplies the exact acc by h in float64 and rounds once; "fma", one that fuses
    f32(acc) * h + mean (one rounding; exact in float64 but for the sum's rare last bit)."""
    out = np.empty(q.shape, np.float32)
    for p in range(2):
        acc = np.einsum("ltk,lck->ltc", q[p], cal.basis[p].astype(np.int64))  # exact integers
        h = (np.float64(step) / (16384 * cal.weight[p].astype(np.float64))).astype(np.float32)  # [L, C]
        if wrong == "fma":
            x = (acc.astype(np.float32).astype(np.float64) * h[:, None, :].astype(np.float64)
                 + cal.mean[p][:, None, :].astype(np.float64)).astype(np.float32)
        else:
            a = acc.astype(np.float64) if wrong == "acc" else acc.astype(np.float32)
            prod = (a * h[:, None, :].astype(a.dtype)).astype(np.float32)
            x = (prod + cal.mean[p][:, None, :]).astype(np.float32)
        out[p] = mv1.turn(x, cos, sin, back=False) if p == 0 else x
    return out


# --------------------------------------------------------------------------- layout (§11.2)
def unit_spans(side: list[list[int]], Tc: int, unit: int) -> list[tuple[int, int, int]]:
    """(row, first symbol, symbol count) of every unit, in payload order, from the side bytes."""
    spans = []
    for r, row in enumerate(side):
        n = sum(b != ALL_ZERO for b in row) * Tc
        spans += [(r, first, min(unit, n - first)) for first in range(0, n, unit)]
    return spans


def symbols(side_row: list[int], Tc: int) -> list[tuple[int, int, int, int]]:
    """(component, token, table, shift) of a row's symbols, in order (§11.2: version 1's order)."""
    return [(k, t, b & 31, b >> 5) for k, b in enumerate(side_row) if b != ALL_ZERO for t in range(Tc)]


def _pack(bits: list[int]) -> bytes:
    """Bits LSB-first into bytes, zero-padded."""
    return bytes(sum(b << j for j, b in enumerate(bits[i:i + 8])) for i in range(0, len(bits), 8))


# --------------------------------------------------------------------------- writer (§11.2-11.3)
def unit_stream(q: np.ndarray, r: int, syms: list[tuple[int, int, int, int]]) -> bytes:
    """The stream of the unit of row r holding `syms`."""
    lo, sign, esc, coded = [], [], [], []
    for k, t, tab, shift in syms:
        v = int(q[r, t, k])
        m = abs(v)
        hi = m >> shift
        lo += [(m >> j) & 1 for j in range(shift)]
        if m:
            sign.append(int(v < 0))
        if hi >= ESCAPE:
            esc.append(hi - ESCAPE)
        coded.append((tab, min(hi, ESCAPE)))
    raw = lo + sign
    x = (1 << BACK_BITS) | sum(b << j for j, b in enumerate(raw[:BACK_BITS]))  # bits back
    emitted = []
    for tab, s in reversed(coded):
        f, c = FREQ[tab][s], CUM[tab][s]
        if x >= f << 20:
            emitted.append(x & 0xFFFF)
            x >>= 16
        x = ((x // f) << 12) + (x % f) + c
    words = emitted[::-1]
    return (struct.pack(f"<I{len(words)}H{len(esc)}H", x, *words, *esc) + _pack(raw[BACK_BITS:]))


def spec_encode2(raw: np.ndarray, dtype: str, cal, step: float, sinks: int, position: int, unit: int) -> bytes:
    """The version-2 payload of the chunk raw [2, L, T, C] as stored."""
    _, L, T, C = raw.shape
    S = mv1.sink_count(T, sinks, position)
    Tc = T - S
    cos, sin = rope_tables(cal, position + S, Tc)
    q = forward(mv1.from_storage(raw, dtype)[:, :, S:], cal, cos, sin, step).reshape(2 * L, Tc, C)
    side = [[ALL_ZERO if not Tc or not q[r, :, k].any() else mv1.spec_choose([abs(int(v)) for v in q[r, :, k]], Tc)
             for k in range(C)] for r in range(2 * L)]
    streams = []
    for r, first, n in unit_spans(side, Tc, unit):
        streams.append(unit_stream(q, r, symbols(side[r], Tc)[first:first + n]))
    regions = [streams[i] + (streams[i + 1][::-1] if i + 1 < len(streams) else b"") for i in range(0, len(streams), 2)]
    if any(len(reg) > 0xFFFF for reg in regions):
        raise SpecError("a pair of units exceeds 65535 bytes")
    side_bytes = bytes(b for row in side for b in row)
    sink_bytes = np.ascontiguousarray(raw[:, :, :S]).astype(np.dtype(STORAGE[dtype]).newbyteorder("<")).tobytes()
    header = struct.pack("<4sBBBBIIII", b"KVPC", 2, mv1.DTYPE_CODE[dtype], unit // 64, 0, 2 * L, T, C, S)
    return (header + side_bytes + bytes(-len(side_bytes) % 4) + sink_bytes + bytes(-len(sink_bytes) % 4)
            + struct.pack(f"<{len(regions)}H", *(len(reg) for reg in regions)) + b"".join(regions))


# --------------------------------------------------------------------------- reader (§11.2-11.4)
def parse2(payload: bytes, shape: tuple[int, ...], dtype: str) -> dict:
    """Header, side bytes, sinks' offset, unit spans and regions of a version-2 payload."""
    _, L, T, C = shape
    magic, version, dcode, unit64, zero, R, tokens, channels, S = struct.unpack_from("<4sBBBBIIII", payload, 0)
    if (magic, version, zero, dcode) != (b"KVPC", 2, 0, mv1.DTYPE_CODE[dtype]) or (R, tokens, channels) != (2 * L, T, C) \
            or S > T or not 1 <= unit64 <= 64:
        raise SpecError("header")
    pos = 24
    side = [list(payload[pos + r * C:pos + (r + 1) * C]) for r in range(R)]
    if any(b != ALL_ZERO and b >> 5 == 7 for row in side for b in row) or (S == T and any(b != ALL_ZERO for row in side
                                                                                             for b in row)):
        raise SpecError("side bytes")
    pos += R * C + (-R * C) % 4
    sink_at = pos
    sink_len = 2 * L * S * C * np.dtype(STORAGE[dtype]).itemsize
    pos += sink_len + (-sink_len) % 4
    spans = unit_spans(side, T - S, 64 * unit64)
    pairs = -(-len(spans) // 2)
    reg_len = list(struct.unpack_from(f"<{pairs}H", payload, pos))
    pos += 2 * pairs
    if len(payload) != pos + sum(reg_len):
        raise SpecError("payload length")
    reg_at = [pos + sum(reg_len[:j]) for j in range(pairs)]
    return {"S": S, "Tc": T - S, "side": side, "sink_at": sink_at, "spans": spans, "reg_at": reg_at,
            "reg_len": reg_len}


def decode_stream(stream: bytes, syms: list[tuple[int, int, int, int]]) -> tuple[list[int], int]:
    """(the unit's coefficients, the bytes of its stream it used), §11.3 one symbol at a time."""
    x, p, out = struct.unpack_from("<I", stream, 0)[0], 4, []
    for _, _, tab, _ in syms:
        slot = x & 4095
        s = next(j for j in range(16) if CUM[tab][j] <= slot < CUM[tab][j + 1])
        x = FREQ[tab][s] * (x >> 12) + slot - CUM[tab][s]
        if x < 1 << 16:
            if p + 2 > len(stream):
                raise SpecError("words end early")
            x = x << 16 | struct.unpack_from("<H", stream, p)[0]
            p += 2
        out.append(s)
    if x >> BACK_BITS != 1:
        raise SpecError("end state")
    bits = [(x >> j) & 1 for j in range(BACK_BITS)]
    hi = []
    for s in out:
        if s == ESCAPE:
            if p + 2 > len(stream):
                raise SpecError("escapes end early")
            s += struct.unpack_from("<H", stream, p)[0]
            p += 2
        hi.append(s)
    bits += [(byte >> j) & 1 for byte in stream[p:] for j in range(8)]
    at, mags = 0, []
    for h, (_, _, _, shift) in zip(hi, syms):
        m = h << shift | sum(bits[at + j] << j for j in range(shift))
        at += shift
        if m > 32767:
            raise SpecError("m > 32767")
        mags.append(m)
    vals = []
    for m in mags:
        neg = bits[at] if m else 0
        at += int(m != 0)
        vals.append(-m if neg else m)
    if at > len(bits) or any(bits[at:BACK_BITS + 8 * max(0, -(-(at - BACK_BITS) // 8))]):
        raise SpecError("raw bits")
    return vals, p + max(0, -(-(at - BACK_BITS) // 8))


def spec_decode2(payload: bytes, shape: tuple[int, ...], dtype: str, cal, step: float, position: int) -> np.ndarray:
    """The chunk [2, L, T, C] in its storage dtype, unit by unit."""
    _, L, T, C = shape
    lay = parse2(payload, shape, dtype)
    S, Tc = lay["S"], lay["Tc"]
    q = np.zeros((2 * L, Tc, C), np.int64)
    used = [0] * len(lay["reg_len"])
    for u, (r, first, n) in enumerate(lay["spans"]):
        region = payload[lay["reg_at"][u // 2]:lay["reg_at"][u // 2] + lay["reg_len"][u // 2]]
        syms = symbols(lay["side"][r], Tc)[first:first + n]
        vals, nbytes = decode_stream(region if u % 2 == 0 else region[::-1], syms)
        for (k, t, _, _), v in zip(syms, vals):
            q[r, t, k] = v
        used[u // 2] += nbytes
    if used != lay["reg_len"] or (np.abs(q).sum(-1) > 1 << 16).any():
        raise SpecError("regions not filled exactly, or a token's sum past 2^16")
    storage = np.dtype(STORAGE[dtype]).newbyteorder("<")
    out = np.zeros((2, L, T, C), storage)
    out[:, :, :S] = np.frombuffer(payload, storage, 2 * L * S * C, lay["sink_at"]).reshape(2, L, S, C)
    if Tc:
        cos, sin = rope_tables(cal, position + S, Tc)
        out[:, :, S:] = mv1.to_storage(inverse(q.reshape(2, L, Tc, C), cal, cos, sin, step), dtype)
    return out


# --------------------------------------------------------------------------- the vectors
def many_units_input(cal) -> np.ndarray:
    """Deterministic bf16 noise [2, 2, 199, 8] with a few large values (escapes)."""
    rng = np.random.default_rng(38)
    x = (rng.standard_normal((2, cal.layers, 199, cal.channels)) * 3).astype(np.float32)
    x[0, 1, 17, 3] = 250.0
    x[1, 0, 150, 6] = -300.0
    return mv1.to_storage(x, "bfloat16")


def libm_tables(cal, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float32 [L, tokens, D/2] as version 1 (section 5) takes them: this platform's libm
    (Python's math module calls it) on f64(pos) * f64(inv_freq), rounded to float32."""
    import math

    angles = [[[float(pos) * float(w) for w in cal.inv_freq[layer].astype(np.float64)]
               for pos in range(start, start + tokens)] for layer in range(cal.layers)]
    cos = np.array([[[math.cos(a) for a in row] for row in layer] for layer in angles], np.float32)
    sin = np.array([[[math.sin(a) for a in row] for row in layer] for layer in angles], np.float32)
    return cos, sin


def far_facts(raw: np.ndarray, dtype: str, cal, payload: bytes) -> dict:
    """What `FAR` must hold, measured on the chunk: entries where 11.5's tables differ from libm's,
    the units (odd count), the fewest raw bits of a unit, the largest |acc| of section 5.2 and
    whether some f32(acc) rounds; and how many decoded values three wrong readers would get wrong:
    one that took libm's tables, one that did not round acc to float32, one that fused a multiply-add."""
    _, L, T, C = raw.shape
    cos, sin = rope_tables(cal, FAR_POSITION, T)
    lcos, lsin = libm_tables(cal, FAR_POSITION, T)
    unlike = (cos != lcos) | (sin != lsin)  # [L, T, D/2]
    q = forward(mv1.from_storage(raw, dtype), cal, cos, sin, FAR_STEP)
    lay = parse2(payload, raw.shape, dtype)
    qr = q.reshape(2 * L, T, C)
    raw_bits = [sum(shift + int(qr[r, t, k] != 0) for k, t, _, shift in symbols(lay["side"][r], T)[first:first + n])
                for r, first, n in lay["spans"]]
    acc = np.concatenate([np.einsum("ltk,lck->ltc", q[p], cal.basis[p].astype(np.int64)).ravel() for p in range(2)])
    big = acc[np.abs(acc) > 1 << 24]
    out = mv1.to_storage(inverse(q, cal, cos, sin, FAR_STEP), dtype)
    out_libm = mv1.to_storage(inverse(q, cal, lcos, lsin, FAR_STEP), dtype)
    out_exact = mv1.to_storage(inverse(q, cal, cos, sin, FAR_STEP, wrong="acc"), dtype)
    out_fma = mv1.to_storage(inverse(q, cal, cos, sin, FAR_STEP, wrong="fma"), dtype)
    return {"values_unlike_libm_reader": int((out.view(np.uint32) != out_libm.view(np.uint32)).sum()),
            "values_unlike_unrounded_acc_reader": int((out.view(np.uint32) != out_exact.view(np.uint32)).sum()),
            "values_unlike_fused_reader": int((out.view(np.uint32) != out_fma.view(np.uint32)).sum()),
            "rope_entries_unlike_libm": int(unlike.sum()),
            "positions_unlike_libm": sorted({FAR_POSITION + int(t) for t in np.nonzero(unlike)[1]}),
            "units": len(lay["spans"]), "fewest_raw_bits": min(raw_bits), "max_abs_acc": int(np.abs(acc).max()),
            "acc_rounded_by_f32": int((big.astype(np.float32).astype(np.int64) != big).sum())}


def far_vector(cal) -> tuple[int, np.ndarray]:
    """(T, the float32 chunk [2, L, T, C]) of the fewest tokens from position 2^32 (no sinks) whose
    facts hold: coefficients as version 1's vectors' but V layer 0's first component ±(2900 + 37 t) at
    token t (so |acc| passes 2^24 often) and V layer 1's last component zero, coded at step 0.25."""
    for T in range(8, 64):
        q = mv1.coefficients(cal.layers, T, FAR_SEED, cal.channels)
        q[1, 0, :, 0] = np.where(np.arange(T) % 2, 1, -1) * (2900 + 37 * np.arange(T))  # |acc| past 2^24
        q[1, 1, :, 7] = 0  # V layer 1 one component fewer: rows of unequal lengths, so the unit count can be odd
        raw = mv1.make_input(cal, q, "float32", T, 0, FAR_POSITION, FAR_STEP, FAR_SEED)
        payload = spec_encode2(raw, "float32", cal, FAR_STEP, 0, FAR_POSITION, UNIT)
        facts = far_facts(raw, "float32", cal, payload)
        if (facts["values_unlike_libm_reader"] and facts["values_unlike_unrounded_acc_reader"]
                and facts["values_unlike_fused_reader"] and facts["units"] % 2 and facts["fewest_raw_bits"] < BACK_BITS
                and facts["acc_rounded_by_f32"]):
            return T, raw
    raise SystemExit("no chunk length from 8 to 63 tokens holds what the far vector must")


def inputs() -> dict[str, tuple[dict, np.ndarray]]:
    out = {}
    for name in FROM_V1:
        meta = json.loads((V1 / f"{name}.json").read_text())
        raw = np.fromfile(V1 / f"{name}.in.bin", STORAGE[meta["dtype"]]).reshape(meta["shape"])
        params = {k: v for k, v in meta["params"].items() if k != "lanes"}
        out[name] = (dict(meta, params=dict(params, version=2, unit=UNIT)), raw)
    main = json.loads((V1 / "bf16_sinks.json").read_text())["params"]["calibration"]
    raw = many_units_input(calibration(main))
    params = {"version": 2, "calibration": main, "step": 0.5, "sinks": 4, "unit": UNIT, "position": 300}
    out[MANY] = ({"shape": list(raw.shape), "dtype": "bfloat16", "params": params}, raw)
    _, raw = far_vector(calibration(main))
    params = {"version": 2, "calibration": main, "step": FAR_STEP, "sinks": 0, "unit": UNIT, "position": FAR_POSITION}
    out[FAR] = ({"shape": list(raw.shape), "dtype": "float32", "params": params}, raw)
    return out


def build() -> None:
    for name, (meta, raw) in inputs().items():
        p = meta["params"]
        cal = calibration(p["calibration"])
        payload = spec_encode2(raw, meta["dtype"], cal, p["step"], p["sinks"], p["position"], p["unit"])
        out = spec_decode2(payload, raw.shape, meta["dtype"], cal, p["step"], p["position"])
        lay = parse2(payload, raw.shape, meta["dtype"])
        record = {"shape": list(raw.shape), "dtype": meta["dtype"], "params": p,
                  "payload_sha256": hashlib.sha256(payload).hexdigest(),
                  "units": [list(s) for s in lay["spans"]], "regions": lay["reg_len"]}
        if name == FAR:  # measured here; rope_entries_unlike_libm and its positions by this platform's libm
            record["facts"] = far_facts(raw, meta["dtype"], cal, payload)
        (HERE / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        (HERE / f"{name}.in.bin").write_bytes(np.ascontiguousarray(raw).tobytes())
        (HERE / f"{name}.payload.bin").write_bytes(payload)
        (HERE / f"{name}.out.bin").write_bytes(np.ascontiguousarray(out).tobytes())
        rope = HERE / f"{name}.rope.bin"
        if lay["Tc"]:
            cos, sin = rope_tables(cal, p["position"] + lay["S"], lay["Tc"])
            rope.write_bytes(cos.astype("<f4").tobytes() + sin.astype("<f4").tobytes())
        elif rope.exists():
            rope.unlink()
        print(f"{name}: {len(payload)} bytes, {len(lay['spans'])} units")


if __name__ == "__main__":
    build()
