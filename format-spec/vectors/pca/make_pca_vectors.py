"""Build the pca test vectors in this folder (python format-spec/vectors/pca/make_pca_vectors.py).

Two tiny calibration objects (1 KV head of head_dim 8, so C = 8; 1 layer for the walk-through,
2 layers for the rest) and a few chunks coded by this script's own writer (`spec_encode`), written from
format-spec/ alone: it imports nothing from kvtool (the frequency tables come from
format-spec/pca_tables.json, checked against the SHA-256 pca.md gives). The coefficients are
chosen first (so that the chunks hold what a test vector should: several shifts, components
that are zero everywhere, escapes, renormalisation words) and the inputs made from them; the
writer then codes those inputs as any writer would. For each vector NAME this writes:

  NAME.json          shape, dtype, the codec parameters (as a manifest holds them), and the
                     payload's SHA-256
  NAME.in.bin        the input chunk [2, L, T, C] as stored, little-endian (bf16 as its bits)
  NAME.payload.bin   the pca payload (format-spec/pca.md section 4)
  NAME.out.bin       the decoded chunk [2, L, T, C], as NAME.in.bin
  NAME.rope.bin      the RoPE tables of the coded tokens, float32: cos [L, Tc, D/2] then sin
                     (positions position + S .. position + T - 1); absent when Tc = 0
  <digest>.kvcal     the calibration objects, named by their SHA-256 (section 3)

and the "Test vectors" section of format-spec/pca.md (between its markers) and README.md's
table. tests/test_pca_vectors.py checks the coders against the files, and the text against
what `walkthrough()` renders from them.

`spec_decode` is a decoder, scalar, following the text of pca.md step by step: the
walk-through's tables are its trace. tests/test_pca_vectors.py holds kvtool's coders (reference
and native) to these files.
"""

from __future__ import annotations

import hashlib
import json
import struct
from fractions import Fraction
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SPEC = HERE.parents[1] / "pca.md"

D = 8  # head_dim of the one-head objects (C = D); the three-head objects have D = 6, C = 18
INV_FREQ = np.array([1.0, 0.1, 0.01, 0.001], dtype=np.float32)  # 10000 ** (-2i / 8): RoPE base 10000
STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}
DTYPE_CODE = {"bfloat16": 0, "float16": 1, "float32": 2}
WALK = "walk_bf16"
BEGIN, END = "<!-- pca-vectors:begin -->", "<!-- pca-vectors:end -->"


class SpecError(Exception):
    pass


# --------------------------------------------------------------------------- what the spec gives
# Everything below is written from format-spec/ alone (pca.md and pca_tables.json): this script
# imports nothing from kvtool, so its vectors are a second implementation's, not kvtool's bytes
# checked against themselves.
TABLES_FILE = HERE.parents[1] / "pca_tables.json"
TABLES_SHA256 = "1e316800e70f92a01de9880950904d95d019bea2eb7fd068a9b49e81b0c5b7d9"  # pca.md §6.2
BASIS_ONE = 1 << 14  # Q14 (pca.md §3)
CAL_FORMAT = "kvtool-pca-calibration/1"


def load_tables() -> tuple[list[list[int]], list[list[int]]]:
    """(FREQ, COST_Q8) [32][16] from pca_tables.json, after checking its SHA-256 against pca.md's."""
    data = TABLES_FILE.read_bytes()
    if hashlib.sha256(data).hexdigest() != TABLES_SHA256:
        raise SystemExit(f"{TABLES_FILE} is not the normative tables file (its SHA-256 differs)")
    tables = json.loads(data)
    return tables["freq"], tables["cost_q8"]


FREQ, COST_Q8 = load_tables()
CUM = [[sum(f[:s]) for s in range(17)] for f in FREQ]


class Cal:
    """A calibration object's tensors (pca.md §3): mean, weight F32 [2, L, C], basis I16 [2, L, C, C],
    inv_freq F32 [L, D/2]. (A plain class: this file is also loaded without being a module of sys.modules.)"""

    def __init__(self, mean: np.ndarray, weight: np.ndarray, basis: np.ndarray, inv_freq: np.ndarray,
                 head_dim: int, model: str, digest: str = "") -> None:
        self.mean, self.weight, self.basis, self.inv_freq = mean, weight, basis, inv_freq
        self.head_dim, self.model, self.digest = head_dim, model, digest

    @property
    def layers(self) -> int:
        return self.mean.shape[1]

    @property
    def channels(self) -> int:
        return self.mean.shape[2]


def calibration_bytes(cal: Cal) -> bytes:
    """The object's file in the one fixed layout pca.md §3 describes: the header's JSON compact,
    `__metadata__` first, the tensors in name order, data in that order, spaces to a multiple of 8."""
    tensors = {"basis": ("I16", cal.basis.astype("<i2")), "inv_freq": ("F32", cal.inv_freq.astype("<f4")),
               "mean": ("F32", cal.mean.astype("<f4")), "weight": ("F32", cal.weight.astype("<f4"))}
    header: dict = {"__metadata__": {"format": CAL_FORMAT, "head_dim": str(cal.head_dim), "model": cal.model}}
    parts, at = [], 0
    for name, (dtype, array) in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [at, at + len(raw)]}
        parts.append(raw)
        at += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(parts)


def parse_calibration(data: bytes, expect_digest: str | None = None) -> Cal:
    """A calibration object from its bytes (safetensors, read by hand), its digest checked."""
    digest = hashlib.sha256(data).hexdigest()
    if expect_digest is not None and digest != expect_digest:
        raise SpecError(f"calibration bytes hash to {digest}, not {expect_digest}")
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__")
    if meta.get("format") != CAL_FORMAT or set(header) != {"basis", "inv_freq", "mean", "weight"}:
        raise SpecError("not a calibration object")
    np_dtype = {"F32": "<f4", "I16": "<i2"}
    arrays = {name: np.frombuffer(data, np_dtype[e["dtype"]], int(np.prod(e["shape"])), 8 + n + e["data_offsets"][0])
              .reshape(e["shape"]) for name, e in header.items()}
    return Cal(mean=arrays["mean"].astype(np.float32), weight=arrays["weight"].astype(np.float32),
               basis=arrays["basis"].astype(np.int16), inv_freq=arrays["inv_freq"].astype(np.float32),
               head_dim=int(meta["head_dim"]), model=meta.get("model", ""), digest=digest)


def rope_tables(cal: Cal, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [L, tokens, D/2]: f32(cos(f64(pos) * f64(inv_freq))) (pca.md §5)."""
    pos = np.arange(start, start + tokens, dtype=np.float64)
    angle = pos[None, :, None] * cal.inv_freq.astype(np.float64)[:, None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def turn(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, back: bool) -> np.ndarray:
    """x [L, T, C] float32 turned by the rotate-half pairs (i, i + D/2) of each head (pca.md §5):
    every product rounded to float32, then the sum or difference (numpy float32 does not fuse)."""
    L, T, C = x.shape
    hd = 2 * cos.shape[-1]  # the head size D: the tables have D/2 frequencies
    h = x.reshape(L, T, C // hd, hd)
    a, b = h[..., :hd // 2], h[..., hd // 2:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if back:
        first, second = a * c + b * s, b * c - a * s
    else:
        first, second = a * c - b * s, b * c + a * s
    return np.concatenate([first, second], -1).reshape(L, T, C).astype(np.float32)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the dtype as stored, nearest even (bf16: the upper 16 bits after rounding)."""
    if dtype == "float32":
        return x.astype(np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):  # past the float16 maximum: an infinity, as IEEE 754 converts
            return x.astype(np.float16)
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_storage(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def spec_forward(x: np.ndarray, cal: Cal, start: int, step: float) -> np.ndarray:
    """pca.md §5.1: q int64 [2, L, Tc, C] of the coded tokens x float32 [2, L, Tc, C]."""
    cos, sin = rope_tables(cal, start, x.shape[2])
    q = np.empty(x.shape, np.int64)
    r = np.float64(1.0) / (np.float64(step) * np.float64(1 << 22))
    for p in range(2):
        xp = turn(x[p], cos, sin, back=True) if p == 0 else x[p]
        u = ((xp - cal.mean[p][:, None, :]).astype(np.float32) * cal.weight[p][:, None, :]).astype(np.float32)
        U = np.clip(np.rint(u.astype(np.float64) * 256.0), -(2 ** 23 - 1), 2 ** 23 - 1).astype(np.int64)
        acc = np.einsum("ltc,lck->ltk", U, cal.basis[p].astype(np.int64))  # exact integers
        q[p] = np.clip(np.rint(acc.astype(np.float64) * r), -32767, 32767).astype(np.int64)
    if (np.abs(q).sum(-1) > 1 << 16).any():
        raise SpecError("a token's sum of |q| exceeds 2^16 at this step")
    return q


def spec_choose(m: list[int], Tc: int) -> int:
    """pca.md §6.2: the side byte of a live component with magnitudes m (its coded tokens)."""
    best = None
    for shift in range(7):
        sym = [min(v >> shift, 15) for v in m]
        for tab in range(32):
            cost = sum(COST_Q8[tab][j] for j in sym) + 256 * (shift * Tc + 16 * sym.count(15))
            if best is None or cost < best[0]:  # strict: ties keep the smaller shift, then table
                best = (cost, tab | shift << 5)
    return best[1]


def _bits(values: list[tuple[int, int]]) -> bytes:
    """(value, width) pairs packed LSB-first (pca.md §6.4), zero-padded to whole bytes."""
    acc, n = 0, 0
    for v, w in values:
        acc |= (v & ((1 << w) - 1)) << n
        n += w
    return acc.to_bytes((n + 7) // 8, "little")


def spec_encode(raw: np.ndarray, dtype: str, cal: Cal, step: float, sinks: int, position: int,
                lanes: int) -> bytes:
    """pca.md §4-6 as a writer: the payload of the chunk raw [2, L, T, C] as stored."""
    _, L, T, C = raw.shape
    S = sink_count(T, sinks, position)
    Tc = T - S
    x = from_storage(raw, dtype)
    q = spec_forward(x[:, :, S:], cal, position + S, step).reshape(2 * L, Tc, C)
    rows, table = [], []
    for r in range(2 * L):
        side = [0xFF if not Tc or not q[r, :, k].any() else spec_choose([abs(int(v)) for v in q[r, :, k]], Tc)
                for k in range(C)]
        syms, tabs, lo, sign, esc = [], [], [], [], []
        for k in range(C):
            if side[k] == 0xFF:
                continue
            shift = side[k] >> 5
            for t in range(Tc):
                v = int(q[r, t, k])
                m = abs(v)
                hi = m >> shift
                syms.append(min(hi, 15))
                tabs.append(side[k] & 31)
                lo.append((m & ((1 << shift) - 1), shift))
                if hi >= 15:
                    esc.append(hi - 15)
                if m:
                    sign.append((int(v < 0), 1))
        states = [1 << 16] * lanes
        emitted = []
        for i in range(len(syms) - 1, -1, -1):  # §6.3's writer: the symbols in reverse order
            lane, f, c = i % lanes, FREQ[tabs[i]][syms[i]], CUM[tabs[i]][syms[i]]
            s = states[lane]
            if s >= f << 20:
                emitted.append(s & 0xFFFF)
                s >>= 16
            states[lane] = ((s // f) << 12) + (s % f) + c
        words = emitted[::-1]
        tail = _bits(lo) + _bits(sign) + struct.pack(f"<{len(esc)}H", *esc)
        body = (bytes(side) + bytes(-C % 4) + struct.pack(f"<{lanes}I", *states)
                + struct.pack(f"<{len(words)}H", *words) + bytes(2 * (len(words) % 2)) + tail + bytes(-len(tail) % 4))
        table.append(struct.pack("<IIII", len(words), sum(w for _, w in lo), len(sign), len(esc)))
        rows.append(body)
    header = struct.pack("<4sBBBBIIII", b"KVPC", 1, DTYPE_CODE[dtype], lanes, 0, 2 * L, T, C, S)
    sink_bytes = np.ascontiguousarray(raw[:, :, :S]).astype(np.dtype(STORAGE[dtype]).newbyteorder("<")).tobytes()
    return header + b"".join(table) + sink_bytes + bytes(-len(sink_bytes) % 4) + b"".join(rows)


# --------------------------------------------------------------------------- calibration objects
def _householder_basis(vectors: list[list[int]]) -> np.ndarray:
    """int16 [C, C]: Q14 of the product of the Householder reflections of `vectors` (exact
    rationals, then round half to even), an orthonormal basis that is the same on every machine."""
    C = len(vectors[0])
    m = [[Fraction(int(i == j)) for j in range(C)] for i in range(C)]
    for v in vectors:
        vv = sum(x * x for x in v)
        h = [[Fraction(int(i == j)) - Fraction(2 * v[i] * v[j], vv) for j in range(C)] for i in range(C)]
        m = [[sum(m[i][k] * h[k][j] for k in range(C)) for j in range(C)] for i in range(C)]
    return np.array([[round(x * BASIS_ONE) for x in row] for row in m], dtype=np.int16)


def make_calibration(layers: int, seed: int, heads: int = 1, head_dim: int = D, per_head: bool = False,
                     tiny_weight: bool = False) -> Cal:
    """`heads` KV heads of `head_dim`; `per_head`: the basis zero outside the heads' D x D blocks
    (pca.md section 5.3), else one dense C x C basis; `tiny_weight`: V's channel 0 of layer 0
    weighs 2^-14, so a step that keeps the other channels' values to ~10^-3 moves its values by
    tens (a value near the float16 maximum decodes past it)."""
    rng = np.random.default_rng(seed)
    C = heads * head_dim
    basis = np.zeros((2, layers, C, C), np.int16)
    for p in range(2):
        for layer in range(layers):
            if per_head:
                for h in range(heads):
                    block = slice(h * head_dim, (h + 1) * head_dim)
                    basis[p, layer, block, block] = _householder_basis(
                        [rng.integers(-9, 10, head_dim).tolist() for _ in range(3)])
            else:
                basis[p, layer] = _householder_basis([rng.integers(-9, 10, C).tolist() for _ in range(3)])
    mean = (rng.integers(-48, 49, (2, layers, C)) / 64).astype(np.float32)  # multiples of 1/64
    weight = (rng.integers(40, 161, (2, layers, C)) / 64).astype(np.float32)  # 0.625 .. 2.5
    if tiny_weight:
        weight[1, 0, 0] = 2.0 ** -14
    inv_freq = INV_FREQ if head_dim == D else (10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    cal = Cal(mean=mean, weight=weight, basis=basis, inv_freq=np.tile(inv_freq, (layers, 1)),
                             head_dim=head_dim, model="kvtool-pca-vector-model")
    return cal


# name: (layers, seed[, KV heads, head_dim, per-head basis]); "heads" and "blocks": 3 KV heads of
# D = 6 (C = 18: the head pairing of section 5 and, in version 1, two zero bytes after each row's
# side bytes), "blocks" with a basis per KV head (section 5.3)
CALIBRATIONS = {"walk": (1, 101), "main": (2, 202), "heads": (1, 303, 3, 6), "blocks": (1, 404, 3, 6, True),
                "edges": (1, 505, 1, D, False, True)}


# --------------------------------------------------------------------------- the vectors
# name: calibration, dtype, tokens T, sinks, position, step, lanes, seed; the coefficients of each
# vector are `coefficients(...)`'s, with its outliers
VECTORS = {
    WALK: ("walk", "bfloat16", 6, 4, 2, 2.0, 2, 1),
    "bf16_sinks": ("main", "bfloat16", 10, 4, 0, 1.0, 16, 2),
    "fp16_position": ("main", "float16", 8, 4, 1000, 0.25, 4, 3),
    "fp32_lanes1": ("main", "float32", 9, 4, 3, 0.5, 1, 4),
    "fp32_far": ("main", "float32", 5, 0, 70000, 0.125, 3, 5),
    "bf16_sinks_only": ("main", "bfloat16", 3, 4, 0, 1.0, 16, 6),
    "bf16_heads": ("heads", "bfloat16", 8, 4, 2, 1.0, 5, 7),
    "fp16_heads_blocks": ("blocks", "float16", 7, 4, 3, 0.5, 3, 8),
    "fp16_edges": ("edges", "float16", 12, 4, 10, 2.0 ** -8, 4, 0),
}
EDGES = "fp16_edges"  # its input is `edges_input`'s, not made from coefficients


SCALE = {8: [40.0, 12.0, 5.0, 0.0, 1.2, 0.6, 0.0, 0.4],  # components 3 and 6: zero
         18: [40.0, 12.0, 5.0, 0.0, 1.2, 0.6, 0.0, 0.4, 9.0, 3.0, 0.0, 2.0, 0.8, 6.0, 0.3, 1.5, 0.5, 0.2]}


def coefficients(L: int, Tc: int, seed: int, C: int = D) -> np.ndarray:
    """int64 [2, L, Tc, C]: a PCA-like spread (large first components, small last ones), some
    components zero at every token, and one outlier per row (an escape at small shifts)."""
    rng = np.random.default_rng(seed)
    q = np.rint(rng.standard_normal((2, L, Tc, C)) * np.array(SCALE[C])).astype(np.int64)
    for p in range(2):
        for layer in range(L):
            if Tc:
                q[p, layer, int(rng.integers(0, Tc)), 4 + p] = int(rng.choice([-1, 1]) * rng.integers(240, 300))
    return q


def make_input(cal: Cal, q: np.ndarray, dtype: str, T: int, S: int, start: int, step: float,
               seed: int) -> np.ndarray:
    """The chunk [2, L, T, C] as stored: S sink tokens of noise, then tokens whose coefficients are
    (near) q: x = mean + (basis q step) / weight, turned forward for K, rounded to dtype."""
    rng = np.random.default_rng(seed + 1000)
    L, C = cal.layers, cal.channels
    x = np.zeros((2, L, T, C), np.float32)
    x[:, :, :S] = (rng.standard_normal((2, L, S, C)) * 2).astype(np.float32)
    b = cal.basis.astype(np.float64) / BASIS_ONE
    u = np.einsum("plck,pltk->pltc", b, q.astype(np.float64)) * step
    coded = (u / cal.weight[:, :, None, :] + cal.mean[:, :, None, :]).astype(np.float32)
    if T > S:
        cos, sin = rope_tables(cal, start + S, T - S)
        coded[0] = turn(coded[0], cos, sin, back=False)
    x[:, :, S:] = coded
    return np.ascontiguousarray(to_storage(x, dtype).view(STORAGE[dtype]))


def edges_input(T: int, seed: int) -> np.ndarray:
    """float16 [2, 1, T, 8]: values of ~3 * 10^-3 (some decode to float16 subnormals), and V's
    channel 0 (weight 2^-14) at -65504 and 65504 in turn (some decode past the float16 maximum:
    infinities, pca.md section 5.2)."""
    x = (np.random.default_rng(seed).standard_normal((2, 1, T, D)) * 3e-3).astype(np.float32)
    x[1, 0, :, 0] = np.where(np.arange(T) % 2, 65504.0, -65504.0)
    return to_storage(x, "float16")


def sink_count(T: int, sinks: int, position: int) -> int:
    return min(T, max(0, sinks - position))


def build() -> dict[str, Cal]:
    cals = {}
    for old in HERE.glob("*.kvcal"):
        old.unlink()
    for name, args in CALIBRATIONS.items():
        data = calibration_bytes(make_calibration(*args))
        cal = parse_calibration(data)
        (HERE / f"{cal.digest}.kvcal").write_bytes(data)
        cals[name] = cal
    for name, (calname, dtype, T, sinks, position, step, lanes, seed) in VECTORS.items():
        cal = cals[calname]
        S = sink_count(T, sinks, position)
        if name == EDGES:
            raw = edges_input(T, seed)
        else:
            q = coefficients(cal.layers, T - S, seed, cal.channels)
            raw = make_input(cal, q, dtype, T, S, position, step, seed)
        payload = spec_encode(raw, dtype, cal, step, sinks, position, lanes)
        out = spec_decode(payload, raw.shape, dtype, cal, step, position)
        params = {"version": 1, "calibration": cal.digest, "step": step, "sinks": sinks, "lanes": lanes,
                  "position": position}
        meta = {"shape": list(raw.shape), "dtype": dtype, "params": params,
                "payload_sha256": hashlib.sha256(payload).hexdigest()}
        (HERE / f"{name}.json").write_text(
            "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items()) + "\n}\n")
        (HERE / f"{name}.in.bin").write_bytes(raw.tobytes())
        (HERE / f"{name}.payload.bin").write_bytes(payload)
        (HERE / f"{name}.out.bin").write_bytes(out.tobytes())
        rope = HERE / f"{name}.rope.bin"
        if T > S:
            cos, sin = rope_tables(cal, position + S, T - S)
            rope.write_bytes(cos.astype("<f4").tobytes() + sin.astype("<f4").tobytes())
        elif rope.exists():
            rope.unlink()
    return cals


# --------------------------------------------------------------------------- reading them back
def load(name: str) -> dict:
    """A vector as files give it: meta, input, payload, output (arrays in storage dtypes), calibration."""
    meta = json.loads((HERE / f"{name}.json").read_text())
    shape, dtype = tuple(meta["shape"]), meta["dtype"]
    storage = np.dtype(STORAGE[dtype]).newbyteorder("<")
    cal_bytes = (HERE / f"{meta['params']['calibration']}.kvcal").read_bytes()
    return {"name": name, "meta": meta, "shape": shape, "dtype": dtype, "params": meta["params"],
            "input": np.frombuffer((HERE / f"{name}.in.bin").read_bytes(), storage).reshape(shape),
            "payload": (HERE / f"{name}.payload.bin").read_bytes(),
            "output": np.frombuffer((HERE / f"{name}.out.bin").read_bytes(), storage).reshape(shape),
            "cal_bytes": cal_bytes, "cal": parse_calibration(cal_bytes, meta["params"]["calibration"])}


def rope_of(name: str, L: int, Tc: int) -> tuple[np.ndarray, np.ndarray] | None:
    path = HERE / f"{name}.rope.bin"
    if not path.exists():
        return None
    t = np.frombuffer(path.read_bytes(), "<f4").reshape(2, L, Tc, -1)
    return t[0], t[1]


# --------------------------------------------------------------------------- a decoder from the text
def _f32(x) -> np.float32:
    return np.float32(x)


def spec_decode(payload: bytes, shape: tuple[int, ...], dtype: str, cal: Cal, step: float,
                position: int, cos=None, sin=None, trace: dict | None = None) -> np.ndarray:
    """pca.md sections 4-6 as written, one value at a time. cos/sin [L, Tc, D/2]: the tables to use
    (default: the spec's formula). `trace`: filled with what the walk-through prints."""
    _, L, T, C = shape
    if len(payload) < 24:
        raise SpecError("short header")
    magic, version, dcode, lanes, zero, R, tokens, channels, S = struct.unpack_from("<4sBBBBIIII", payload, 0)
    if (magic, version, zero) != (b"KVPC", 1, 0) or dcode != DTYPE_CODE[dtype] or not 1 <= lanes <= 64 \
            or (R, tokens, channels) != (2 * L, T, C) or S > T:
        raise SpecError("header")
    pos = 24
    table = [struct.unpack_from("<IIII", payload, pos + 16 * r) for r in range(R)] if len(payload) >= pos + 16 * R \
        else None
    if table is None:
        raise SpecError("short row table")
    pos += 16 * R
    item = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    sink_at = pos
    pos += 2 * L * S * C * item
    pos += (-(pos - sink_at)) % 4  # the sinks, then zeros to a multiple of 4
    Tc = T - S
    rows = []
    for r, (nwords, lo_bits, sign_bits, nesc) in enumerate(table):
        row = {"at": pos}
        row["side"] = list(payload[pos:pos + C])
        pos += C + (-C) % 4
        row["states"] = list(struct.unpack_from(f"<{lanes}I", payload, pos)) if len(payload) >= pos + 4 * lanes \
            else None
        pos += 4 * lanes
        row["words"] = list(struct.unpack_from(f"<{nwords}H", payload, pos)) if len(payload) >= pos + 2 * nwords \
            else None
        pos += 2 * nwords + 2 * (nwords % 2)
        tail = pos
        row["lo"] = payload[pos:pos + (lo_bits + 7) // 8]
        pos += (lo_bits + 7) // 8
        row["sign"] = payload[pos:pos + (sign_bits + 7) // 8]
        pos += (sign_bits + 7) // 8
        row["escapes"] = list(struct.unpack_from(f"<{nesc}H", payload, pos)) if len(payload) >= pos + 2 * nesc \
            else None
        pos += 2 * nesc
        pos += (-(pos - tail)) % 4
        row["counts"] = (nwords, lo_bits, sign_bits, nesc)
        rows.append(row)
    if pos != len(payload):
        raise SpecError(f"length {len(payload)}, table says {pos}")
    freq, cum = FREQ, CUM
    q = np.zeros((R, Tc, C), np.int64)
    for r, row in enumerate(rows):
        side = row["side"]
        if any(b != 0xFF and b >> 5 == 7 for b in side):
            raise SpecError("shift 7")
        live = [k for k in range(C) if side[k] != 0xFF]
        order = [(k, t) for k in live for t in range(Tc)]  # symbol order: components, then tokens
        x = list(row["states"])
        words, nxt, syms, steps = row["words"], 0, [], []
        for i, (k, t) in enumerate(order):
            lane, tab = i % lanes, side[k] & 31
            before = x[lane]
            slot = before & 4095
            s = next(j for j in range(16) if cum[tab][j] <= slot < cum[tab][j + 1])
            after = freq[tab][s] * (before >> 12) + slot - cum[tab][s]
            word = None
            if after < 1 << 16:
                if nxt >= len(words):
                    raise SpecError("words end early")
                word = words[nxt]
                nxt += 1
                after = after << 16 | word
            x[lane] = after
            syms.append(s)
            steps.append((i, lane, k, t, tab, before, slot, s, after, word))
        if any(v != 1 << 16 for v in x) or nxt != len(words):
            raise SpecError("rANS end")
        shifts = [side[k] >> 5 for k, _ in order]
        if sum(shifts) != row["counts"][1]:
            raise SpecError("lo bit count")
        if sum(s == 15 for s in syms) != row["counts"][3]:
            raise SpecError("escape count")
        lo_all = int.from_bytes(row["lo"], "little")
        sign_all = int.from_bytes(row["sign"], "little")
        bit, esc_i, sign_i, mags, coefs = 0, 0, 0, [], []
        for (k, t), s, sh in zip(order, syms, shifts):
            hi = s
            if s == 15:
                hi = 15 + row["escapes"][esc_i]
                esc_i += 1
            lo = (lo_all >> bit) & ((1 << sh) - 1)
            bit += sh
            m = hi << sh | lo
            if m > 32767:
                raise SpecError("m > 32767")
            mags.append((hi, lo, m))
        if sum(m != 0 for _, _, m in mags) != row["counts"][2]:
            raise SpecError("sign bit count")
        for (k, t), (hi, lo, m) in zip(order, mags):
            neg = 0
            if m:
                neg = (sign_all >> sign_i) & 1
                sign_i += 1
            q[r, t, k] = -m if neg else m
            coefs.append((k, t, hi, lo, neg, q[r, t, k]))
        if trace is not None:
            trace.setdefault("rows", []).append({**row, "steps": steps, "coefs": coefs, "order": order})
    if (np.abs(q).sum(-1) > 1 << 16).any():
        raise SpecError("token sum")
    storage = STORAGE[dtype]
    out = np.zeros((2, L, T, C), storage)
    out[:, :, :S] = np.frombuffer(payload, np.dtype(storage).newbyteorder("<"), 2 * L * S * C, sink_at) \
        .reshape(2, L, S, C)
    if Tc == 0:
        return out
    if cos is None:
        cos, sin = rope_tables(cal, position + S, Tc)
    for p in range(2):
        for layer in range(L):
            h = [_f32(np.float64(step) / (16384 * np.float64(cal.weight[p, layer, c]))) for c in range(C)]
            for t in range(Tc):
                xs = []
                for c in range(C):
                    acc = sum(int(q[p * L + layer, t, k]) * int(cal.basis[p, layer, c, k]) for k in range(C))
                    xs.append(_f32(_f32(acc) * h[c]) + cal.mean[p, layer, c])
                    if trace is not None:
                        trace.setdefault("x", {})[(p, layer, t, c)] = (acc, h[c], xs[-1])
                if p == 0:
                    hd = cal.head_dim
                    half = hd // 2
                    turned = list(xs)
                    for head in range(C // hd):  # pairs (h*D + i, h*D + D/2 + i), one head's at a time
                        for i in range(half):
                            a, b = xs[head * hd + i], xs[head * hd + half + i]
                            cs, sn = cos[layer, t, i], sin[layer, t, i]
                            turned[head * hd + i] = _f32(_f32(a * cs) - _f32(b * sn))
                            turned[head * hd + half + i] = _f32(_f32(b * cs) + _f32(a * sn))
                    xs = turned
                for c in range(C):
                    out[p, layer, S + t, c] = _round_to(xs[c], dtype)
    return out


def _round_to(x: np.float32, dtype: str):
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):  # past the float16 maximum: an infinity (pca.md section 5.2)
            return np.float16(x)
    bits = int(np.float32(x).view(np.uint32))
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # nearest even (finite values)


# --------------------------------------------------------------------------- the spec's section
NOTES = {
    WALK: "the walk-through (9.2): 2 sinks, lanes 2, an odd word count, an escape, shifts 0-4 and 6",
    "bf16_sinks": "position 0: S = 4 exact tokens, 6 coded; 16 lanes, no rANS word",
    "fp16_position": "position 1000 (no sinks), lanes 4",
    "fp32_lanes1": "position 3: S = 1; one lane, so every word in one stream",
    "fp32_far": "sinks 0, position 70000 (large RoPE angles), lanes 3",
    "bf16_sinks_only": "T = S = 3: no coded token, every side byte 0xFF, lane states only",
    "bf16_heads": ("3 KV heads of D = 6 (C = 18): pairs (6h + i, 6h + 3 + i), 2 zero bytes after the side "
                   "bytes; lanes 5"),
    "fp16_heads_blocks": ("as `bf16_heads`, with a basis per KV head (5.3: zero outside the 6 x 6 blocks); "
                          "lanes 3"),
    EDGES: ("noise, not coefficients: V channel 0 (weight 2^-14) at ±65504 decodes to ±inf 7 times; "
            "2 float16 subnormals"),
}


def _hex(data: bytes) -> str:
    return " ".join(f"{b:02x}" for b in data)


def _f32s(x) -> str:
    """A float32 as its shortest decimal and its bits."""
    x = np.float32(x)
    return f"{np.format_float_positional(x, unique=True, trim='-')} (`{int(x.view(np.uint32)):08x}`)"


def _bf16s(bits: int) -> str:
    value = np.array([bits << 16], np.uint32).view(np.float32)[0]
    return f"`{bits:04x}` = {np.format_float_positional(value, unique=True, trim='-')}"


def _table(head: list[str], rows: list[list], align: str | None = None) -> list[str]:
    align = align or "-" * len(head)
    marks = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(head) + " |", "| " + " | ".join(marks) + " |"] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _para(text: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, 100, break_long_words=False, break_on_hyphens=False)


def vectors_table() -> list[str]:
    rows = []
    for name in VECTORS:
        v = load(name)
        _, L, T, C = v["shape"]
        p = v["params"]
        S = struct.unpack_from("<I", v["payload"], 20)[0]
        R = 2 * L
        counts = [struct.unpack_from("<IIII", v["payload"], 24 + 16 * r) for r in range(R)]
        rows.append([f"`{name}`", v["dtype"], L, T, p["position"], p["sinks"], S, p["step"], p["lanes"],
                     len(v["payload"]), "; ".join(", ".join(map(str, c)) for c in counts), NOTES[name]])
    return _table(["vector", "dtype", "L", "T", "position", "sinks", "S", "step", "lanes", "bytes",
                   "per row: words, lo bits, sign bits, escapes", "what it shows"], rows, "--rrrrrrrr--")


def walkthrough() -> str:
    v = load(WALK)
    cal, payload, p = v["cal"], v["payload"], v["params"]
    _, L, T, C = v["shape"]
    S = struct.unpack_from("<I", payload, 20)[0]
    Tc = T - S
    lanes = payload[6]
    cos, sin = rope_of(WALK, L, Tc)
    trace: dict = {}
    out = spec_decode(payload, v["shape"], v["dtype"], cal, p["step"], p["position"], cos, sin, trace)
    assert out.tobytes() == v["output"].tobytes()
    o: list[str] = []
    o += ["### 9.1 The files", "",
          "`format-spec/vectors/pca/` holds the vectors below and the five calibration objects they use, each",
          "named `<digest>.kvcal` by its SHA-256 (point `KVTOOL_CALIBRATION_PATH` at the folder). For each",
          "vector NAME: `NAME.json` (the shape `[2, L, T, C]`, the dtype, the codec parameters as a manifest",
          "records them, the payload's SHA-256), `NAME.in.bin` (the chunk that was coded, as stored,",
          "little-endian: bf16 as its 16 bits), `NAME.payload.bin`, `NAME.out.bin` (what a reader MUST decode,",
          "laid out as the input) and `NAME.rope.bin` (the float32 tables of the coded tokens, section 5:",
          "`cos[L][Tc][D/2]`, then `sin` likewise, for positions `position + S` to `position + T - 1`; absent",
          "when `Tc = 0`). A writer MUST produce `NAME.payload.bin` from `NAME.in.bin` and the parameters, a",
          "reader MUST produce `NAME.out.bin` from the payload, both byte for byte.", ""]
    o += _para("Each calibration object has an orthonormal basis in Q14 and RoPE frequencies of base 10000, "
               "`f32(10000^(-2i/D))`. Those of the first six vectors and `fp16_edges` (and of version 2's "
               "`bf16_many_units` and `fp32_past_2e32`, section 11.8) have one "
               "KV head of `D = 8` (so `C = 8`; frequencies `1, 0.1, 0.01, 0.001`); `fp16_edges`' object gives V's "
               "channel 0 the weight 2^-14, so that at its step of 2^-8 values of that channel near ±65504 decode "
               "past the float16 maximum, to infinities (section 5.2), while its other values, of ~10^-3, "
               "decode to some float16 subnormals. Those of `bf16_heads` and "
               "`fp16_heads_blocks` have three KV heads of `D = 6` (`C = 18`; frequencies `1, 0.046415888, "
               "0.0021544347`): keys turn by the pairs `(6h + i, 6h + 3 + i)` of head `h` (section 5), and each "
               "row's 18 side bytes are followed by two zero bytes (section 4). `bf16_heads`' basis is dense "
               "(every component mixes all three heads); `fp16_heads_blocks`' is zero outside the heads' "
               "`6 x 6` blocks (section 5.3), an ordinary object that a coder MAY sum block by block. "
               "`make_pca_vectors.py` rebuilds everything.") + [""]
    o += vectors_table() + [""]
    o += _para("Every row of every vector that codes tokens and is made from coefficients (all but `fp16_edges`) "
               "has components that are zero at every coded "
               "token (side byte `0xFF`) and one escape; together the rows use every shift from 0 to 6.") + [""]
    # ---- the walk-through
    o += [f"### 9.2 Walk-through: `{WALK}`", "", "The parameters:", "", "```json", json.dumps(p), "```", ""]
    raw = v["cal_bytes"]
    (n,) = struct.unpack_from("<Q", raw, 0)
    o += _para(f"The calibration object they name (`{p['calibration'][:16]}...kvcal`, {len(raw)} bytes, "
               f"`L = {L}`, `D = C = {C}`) is a safetensors file: a u64 header length ({n}), the header's JSON "
               "(then spaces to a multiple of 8), the tensors' bytes at the offsets it gives, little-endian:")
    o += ["", "```json", raw[8:8 + n].decode().rstrip(), "```", ""]
    o += _para("Its tensors (`mean` and `weight` of part 0 = K, then part 1 = V; `basis[p][0][c]` as rows "
               "`c`, columns `k`, in Q14):") + ["", "```"]
    for name in ("mean", "weight"):
        for part in range(2):
            values = ", ".join(np.format_float_positional(x, unique=True, trim="-")
                               for x in getattr(cal, name)[part, 0])
            o.append(f"{name}[{part}][0]".ljust(14) + f" = [{values}]")
    for part in range(2):
        for c in range(C):
            o.append(f"basis[{part}][0][{c}]".ljust(14) + " = [" + ", ".join(f"{int(x):6d}" for x in cal.basis[part, 0, c]) + "]")
    o.append("inv_freq[0]".ljust(14) + " = [" + ", ".join(np.format_float_positional(x, unique=True, trim="-")
                                                        for x in cal.inv_freq[0]) + "]")
    o += ["```", ""]
    o += _para(f"`T = {T}` tokens at positions {p['position']}..{p['position'] + T - 1}; `S = min({T}, max(0, "
               f"{p['sinks']} - {p['position']})) = {S}` of them are sinks (positions {p['position']} and "
               f"{p['position'] + 1}), so the coded tokens `t = 0..{Tc - 1}` are positions "
               f"{p['position'] + S}..{p['position'] + T - 1}. The payload, {len(payload)} bytes:")
    o += ["", "```"]
    for at in range(0, len(payload), 16):
        o.append(f"{at:4d}  {_hex(payload[at:at + 16])}")
    o += ["```", ""]
    # header and layout
    hdr = struct.unpack_from("<4sBBBBIIII", payload, 0)
    fields = [(0, 4, "magic", '"KVPC"'), (4, 1, "version", hdr[1]), (5, 1, "dtype", f"{hdr[2]} (bf16)"),
              (6, 1, "lanes N", hdr[3]), (7, 1, "reserved", hdr[4]), (8, 4, "rows R", f"{hdr[5]} (= 2L)"),
              (12, 4, "tokens T", hdr[6]), (16, 4, "channels C", hdr[7]), (20, 4, "sink tokens S", hdr[8])]
    rows = trace["rows"]
    for r, row in enumerate(rows):
        at = 24 + 16 * r
        for j, name in enumerate(("words", "lo_bits", "sign_bits", "escapes")):
            fields.append((at + 4 * j, 4, f"row {r}: {name}", row["counts"][j]))
    o += ["The header and the row table (row 0 is K layer 0, row 1 is V layer 0):", ""]
    o += _table(["offset", "bytes", "field", "value"], [[a, f"`{_hex(payload[a:a + n])}`", f, val]
                                                       for a, n, f, val in fields], "rr--")
    sink_at = 24 + 16 * len(rows)
    sink_len = 2 * L * S * C * 2
    layout = [(sink_at, sink_len, f"sinks `[2, {L}, {S}, {C}]` bf16: K's tokens 0, 1, then V's (`NAME.in.bin`'s "
                                  f"first {S} tokens, as stored)")]
    if (-sink_len) % 4:
        layout.append((sink_at + sink_len, (-sink_len) % 4, "zeros to a multiple of 4"))
    for r, row in enumerate(rows):
        nwords, lo_bits, sign_bits, nesc = row["counts"]
        at = row["at"]
        parts = [(C, f"row {r}: side bytes, one per component"), ((-C) % 4, "zeros to 4"),
                 (4 * lanes, f"row {r}: {lanes} final lane states, u32"),
                 (2 * nwords, f"row {r}: {nwords} rANS words, u16"), (2 * (nwords % 2), "one u16 zero (odd count)"),
                 ((lo_bits + 7) // 8, f"row {r}: {lo_bits} lo bits"),
                 ((sign_bits + 7) // 8, f"row {r}: {sign_bits} sign bits"),
                 (2 * nesc, f"row {r}: {nesc} escape, u16")]
        tail = sum(n for n, _ in parts[5:])
        parts.append(((-tail) % 4, "zeros to a multiple of 4 (lo, sign, escapes together)"))
        for n, what in parts:
            if n:
                layout.append((at, n, what))
                at += n
    o += ["", "What follows the row table:", ""]
    o += _table(["offset", "length", "part", "bytes"], [[a, n, w, f"`{_hex(payload[a:a + n])}`" if n <= 16 else "..."]
                                                       for a, n, w in layout], "rr--")
    o += [""] + _para(f"The lengths add up: `24 + 16 R` for the header and the table, `2 L S C` values of "
                      f"sinks (2 bytes each in bf16) and zeros to 4, then per row `C` side bytes and zeros to 4, "
                      f"`4 N` bytes of states, `2 words` and a u16 zero when `words` is odd, "
                      f"`ceil(lo_bits / 8) + ceil(sign_bits / 8) + 2 escapes` and zeros to 4: "
                      f"{len(payload)} bytes, as the payload is (a reader MUST refuse any other length). The "
                      f"padding is zero; the reader does not look at it.") + [""]
    # side bytes
    o += ["Side bytes (`0xFF`: all zero, not coded; else `table | shift << 5`):", ""]
    side_rows = []
    for r, row in enumerate(rows):
        side_rows.append([f"row {r}"] + [("`ff`: zero" if b == 0xFF else f"`{b:02x}`: t {b & 31}, s {b >> 5}")
                                         for b in row["side"]])
    o += _table(["", *[f"k = {k}" for k in range(C)]], side_rows)
    o += [""] + _para(
        f"Row 0 codes {len(rows[0]['order'])} symbols (its live components times `Tc = {Tc}`: components "
        f"ascending, tokens ascending within one), row 1 {len(rows[1]['order'])}. Symbol `i` goes to lane "
        f"`i mod {lanes}` and is decoded with its component's table; each step decodes lane 0, then lane 1, "
        "and a lane whose state falls below 2^16 takes the row's next word. In the tables below `x` is the "
        "lane's state before the symbol, `slot = x & 4095`, `sym` the symbol whose range holds `slot`, `x'` "
        "the state after it (with the word, if one was read). `hi` is the symbol, or 15 plus the next escape; "
        "`lo` is read from the row's lo bits (`shift` bits per symbol, least significant first, at the bit "
        "offset after `@`; a byte's bit 0 comes first); the sign from the sign bits, one per non-zero "
        "magnitude (`1`: negative), at the offset after `@`; `q = ±(hi << shift | lo)`.") + [""]
    for r, row in enumerate(rows):
        o += [f"Row {r}: states `{', '.join(f'{s:#010x}' for s in row['states'])}`, words "
              f"`{', '.join(f'{w:#06x}' for w in row['words'])}`, lo bytes `{_hex(row['lo'])}`, sign bytes "
              f"`{_hex(row['sign'])}`, escapes `{', '.join(str(e) for e in row['escapes'])}`.", ""]
        trows, bit, sbit = [], 0, 0
        for (i, lane, k, t, tab, before, slot, s, after, word), (_, _, hi, lo, neg, qv) in zip(row["steps"],
                                                                                              row["coefs"]):
            shift = row["side"][k] >> 5
            m = abs(int(qv))
            sign_col = "" if m == 0 else f"{neg} @{sbit}"
            sbit += m != 0
            hi_col = f"15 + {hi - 15} = {hi}" if s == 15 else str(hi)
            trows.append([i, lane, k, t, tab, f"`{before:#010x}`", slot, s, f"`{after:#010x}`",
                          "" if word is None else f"`{word:#06x}`", hi_col, f"{lo} @{bit}" if shift else "",
                          sign_col, int(qv)])
            bit += shift
        o += _table(["i", "lane", "k", "t", "table", "x", "slot", "sym", "x'", "word", "hi", "lo", "sign", "q"],
                    trows, "rrrrr-rr----rr")
        o += [""]
    o += _para("After each row's last symbol every state is `0x00010000` and every word was read (else the "
               "chunk is corrupt). The coefficients `q`, per row one bracket per coded token `t`, components "
               "`k = 0..7` within it:") + ["", "```"]
    q = np.zeros((2, Tc, C), np.int64)
    for r, row in enumerate(rows):
        for (k, t, _, _, _, qv) in row["coefs"]:
            q[r, t, k] = qv
    for r in range(2):
        o.append(f"row {r}: " + "  ".join("[" + ", ".join(f"{int(x):4d}" for x in q[r, t]) + "]" for t in range(Tc)))
    o += ["```", ""]
    # the writer's choice for one component
    k = 0
    mags = [abs(int(x)) for x in q[0, :, k]]
    o += _para(f"The writer's choice (section 6.2) for row 0's component {k} (magnitudes "
               f"{', '.join(map(str, mags))}): per shift, the symbols, the table of least cost and that cost in "
               "1/256 bits, `Σ_j count[j] * COST_Q8[table][j] + 256 * (shift * Tc + 16 * count[15])`:") + [""]
    crows, best = [], None
    for shift in range(7):
        sym = [min(m >> shift, 15) for m in mags]
        costs = [sum(COST_Q8[tab][j] for j in sym) + 256 * (shift * Tc + 16 * sym.count(15)) for tab in range(32)]
        tab = min(range(32), key=lambda j: (costs[j], j))
        crows.append([shift, ", ".join(map(str, sym)), tab, costs[tab]])
        if best is None or costs[tab] < best[2]:
            best = (shift, tab, costs[tab])
    o += _table(["shift", "symbols", "table", "cost"], crows, "r-rr")
    o += [""] + _para(f"Least: shift {best[0]}, table {best[1]} (ties would go to the smaller shift, then the "
                      f"smaller table): side byte `{best[1] | best[0] << 5:02x}`, as the payload has.") + [""]
    assert best[1] | best[0] << 5 == rows[0]["side"][k]
    # the values
    step = p["step"]
    esc_t = [next(t for (k, t, hi, lo, neg, qv) in rows[r]["coefs"] if hi >= 15) for r in range(2)]
    o += _para(f"The values (section 5.2), `Δ = {step:g}`: `acc[c] = Σ_k q[k] * basis[c][k]` (the basis of "
               f"the row's part and layer, in Q14, from the calibration object); `h[c] = f32(f64({step:g}) / "
               "(16384 * f64(weight[c])))`; `x = f32(acc) * h + mean`, two float32 operations; K is then turned "
               "forward with the pair's cos/sin at the token's position; last, the dtype's rounding (bf16: nearest "
               f"even). V (row 1) at `t = {esc_t[1]}` (position {p['position'] + S + esc_t[1]}), the token with "
               "row 1's escape, channels 0 and 5:") + [""]
    vrows = []
    for c in (0, 5):
        acc, h, x = trace["x"][(1, 0, esc_t[1], c)]
        terms = " + ".join(f"({int(q[1, esc_t[1], k])})({int(cal.basis[1, 0, c, k])})" for k in range(C)
                           if q[1, esc_t[1], k])
        bits = int(v["output"][1, 0, S + esc_t[1], c])
        vrows.append([c, f"{terms} = {acc}", _f32s(cal.weight[1, 0, c]), _f32s(h), _f32s(np.float32(acc) * h),
                      _f32s(cal.mean[1, 0, c]), _f32s(x), _bf16s(bits)])
    o += _table(["c", "acc", "weight", "h", "f32(acc) * h", "mean", "x", "bf16"], vrows, "r-------")
    t = esc_t[0]
    position = p["position"] + S + t
    o += [""] + _para(f"K (row 0) at `t = {t}` (position {position}), the pairs of channels `(i, i + 4)` for "
                      "`i = 0` and `3`: first `x` as for V (`a`, `b`: before the turn), then `a' = a*cos - b*sin`, "
                      "`b' = b*cos + a*sin`, each product rounded to float32, then the difference or sum (no fused "
                      "multiply-add):") + [""]
    krows = []
    for i in (0, 3):
        a, b = trace["x"][(0, 0, t, i)][2], trace["x"][(0, 0, t, i + 4)][2]
        cs, sn = cos[0, t, i], sin[0, t, i]
        ta = np.float32(np.float32(a * cs) - np.float32(b * sn))
        tb = np.float32(np.float32(b * cs) + np.float32(a * sn))
        krows.append([i, f"acc {trace['x'][(0, 0, t, i)][0]}: {_f32s(a)}", f"acc {trace['x'][(0, 0, t, i + 4)][0]}: "
                      f"{_f32s(b)}", _f32s(cs), _f32s(sn), _f32s(ta), _f32s(tb),
                      f"{_bf16s(int(v['output'][0, 0, S + t, i]))}, {_bf16s(int(v['output'][0, 0, S + t, i + 4]))}"])
    o += _table(["i", "a = x[i]", "b = x[i + 4]", "cos", "sin", "a'", "b'", "bf16 a', b'"], krows, "r-------")
    o += [""] + _para(f"The RoPE tables of the coded tokens (`{WALK}.rope.bin`; every vector's `NAME.rope.bin` "
                      "holds its own): `cos`, `sin` of `f64(position) * f64(inv_freq[i])`, rounded to float32:") + [""]
    rrows = []
    for t in range(Tc):
        rrows.append([p["position"] + S + t] + [f"{_f32s(cos[0, t, i])}, {_f32s(sin[0, t, i])}" for i in range(C // 2)])
    o += _table(["position", *[f"i = {i} ({INV_FREQ[i]:g})" for i in range(C // 2)]], rrows, "r----")
    return "\n".join(o) + "\n"


def write_spec() -> None:
    text = SPEC.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    SPEC.write_text(head + BEGIN + "\n" + walkthrough() + END + tail)


def main() -> None:
    build()
    write_spec()
    print(f"wrote {len(VECTORS)} vectors to {HERE} and the walk-through to {SPEC}")


if __name__ == "__main__":
    main()
