"""The native pca coder (`kvtool._pca_native`, kernels/pca_cpu.c), with the reference's interface.

`encode_chunk` / `decode_chunk` take what `reference.encode_chunk` / `reference.decode_chunk` take
(plus `threads`) and give the same bytes and values. What the C coder needs from the calibration
object is prepared here once per object: the basis as pairs of rows for the int16 transform (and
its transpose for the decoder), and per layer the bound on a token's sum of U^2 under which the
encoder's int32 sums are exact. The RoPE tables come from `calibration.rope_tables`, the one
function every coder takes them from.

When the extension is missing (no compiler at install time) `coder()` gives the reference and
says so once, in one line. KVTOOL_PCA_NATIVE=0 forces the reference (tests and debugging).
"""

from __future__ import annotations

import struct
import threading
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from ...devices import host_threads
from ...errors import DecodeError, NonFiniteValues, UsageError
from ...native_loader import NativeExtension
from . import reference
from .calibration import Calibration, blocks_per_head, rope_tables

EXTENSION = NativeExtension("_pca_native", "KVTOOL_PCA_NATIVE", "pca coder", "the slow numpy reference")

ROPE_KEPT_BYTES = 8 << 20  # the RoPE tables kept per calibration (32k positions of the default model)
JB = 24  # the C transform's column block (kernels/pca_kernels.h PCA_JB): m2's width is a multiple of it
DTYPE_CODES = reference.DTYPE_CODES
_STORAGE = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.float32}  # what the C coder reads/writes
_OUT = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}  # what decode_chunk returns
FREQ = np.ascontiguousarray(reference.FREQ, dtype=np.int32)
COST = np.ascontiguousarray(reference.COST, dtype=np.int32)
SLOT_SYM = np.ascontiguousarray(reference.SYMBOL_OF_SLOT, dtype=np.uint8)


def native_module(warn: bool = True) -> ModuleType | None:
    """The extension module, or None (forced off, or not built)."""
    return EXTENSION.module(warn)


def native_available() -> bool:
    return native_module(warn=False) is not None


def coder(impl: str = "auto") -> Any:
    """What codes a chunk: this module (native) or `reference`. impl: 'auto', 'native', 'reference'."""
    if impl == "reference":
        return reference
    if impl == "native":
        if native_module(warn=False) is None:
            raise UsageError("pca: the native coder is not built (pip install -e .)")
        return _this()
    if impl != "auto":
        raise UsageError(f"pca: impl must be 'auto', 'native' or 'reference', got {impl!r}")
    return _this() if native_module(warn=True) is not None else reference


def _this() -> ModuleType:
    import sys

    return sys.modules[__name__]


def _rope_tables_v2(cal: Any, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """format-spec/pca.md §11.5's tables (each entry its position's and frequency's alone, as
    version 1's: so a kept table's slice is a chunk's)"""
    from . import reference2

    return reference2.rope_tables(cal, start, tokens)


# --------------------------------------------------------------------------- prepared calibration
class _Prepared:
    def __init__(self, cal: Calibration):
        two, L, C, _ = cal.basis.shape
        self.cols = -(-C // JB) * JB
        b = cal.basis
        self.mean = np.ascontiguousarray(cal.mean, dtype=np.float32)
        self.weight = np.ascontiguousarray(cal.weight, dtype=np.float32)
        self.basis = np.ascontiguousarray(b, dtype=np.int16)
        self.m2_encode = self._pairs(b)  # rows c, columns k
        self.m2_decode = self._pairs(b.transpose(0, 1, 3, 2))  # rows k, columns c
        self.block = block_diagonal(b, cal.head_dim)
        # Cauchy-Schwarz: |sum over any channels of U[c] B[c, k]| <= |U| |B_k|; int32 is exact
        # when sum U^2 * max_k |B_k|^2 < 2^62
        norm2 = (b.astype(np.int64) ** 2).sum(2).max(-1)  # [2, L]
        self.sumsq_limit = np.ascontiguousarray(((1 << 62) - 1) // np.maximum(norm2, 1), dtype=np.int64)
        self.gains: dict[float, np.ndarray] = {}
        # layers turned with the same frequencies share one table: rope_tables for the distinct
        # rows only (each entry depends on its position and frequency alone, so the values are
        # those of the full tables), a 30x smaller table for the default model
        rows, of_layer = np.unique(cal.inv_freq, axis=0, return_inverse=True)
        self.rope = SimpleNamespace(inv_freq=rows)
        self.rope_map = np.ascontiguousarray(of_layer.reshape(-1), dtype=np.int32)
        # positions 0..n-1 of those tables, kept: a chunk's are a slice (the same numbers, as each
        # entry is its position's and frequency's alone), not a float64 cos and sin per chunk
        none = (np.empty((len(rows), 0, rows.shape[1]), np.float32),) * 2
        self._rope_kept = {1: none, 2: none}  # per bitstream version; read-only once kept
        self._rope_lock = threading.Lock()
        self._rope_limit = max(0, ROPE_KEPT_BYTES // (8 * rows.size))  # positions kept at most

    def rope_tables(self, start: int, tokens: int, version: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """calibration.rope_tables (version 1) or reference2.rope_tables (version 2, §11.5) of the
        distinct rows, [rows, tokens, D/2] each, contiguous"""
        make = rope_tables if version == 1 else _rope_tables_v2
        end = start + tokens
        cos, sin = self._rope_kept[version]
        if end > cos.shape[1] and end <= self._rope_limit:
            with self._rope_lock:
                cos, sin = self._rope_kept[version]
                if end > cos.shape[1]:
                    n = min(self._rope_limit, max(end, 2 * cos.shape[1], 4096))
                    cos, sin = make(self.rope, 0, n)  # type: ignore[arg-type]
                    cos.flags.writeable = sin.flags.writeable = False  # its slices go to every coder
                    self._rope_kept[version] = (cos, sin)
        if end > cos.shape[1]:
            return make(self.rope, start, tokens)  # type: ignore[arg-type]
        return np.ascontiguousarray(cos[:, start:end]), np.ascontiguousarray(sin[:, start:end])

    def _pairs(self, m: np.ndarray) -> np.ndarray:
        """[2, L, R, J] -> [2, L, R/2, cols, 2]: rows 2i and 2i+1 side by side, columns padded with 0."""
        two, L, R, J = m.shape
        out = np.zeros((two, L, R // 2, self.cols, 2), np.int16)
        out[:, :, :, :J, :] = m.reshape(two, L, R // 2, 2, J).transpose(0, 1, 2, 4, 3)
        return out

    def gain(self, cal: Calibration, step: float) -> np.ndarray:
        g = self.gains.get(step)
        if g is None:
            g = self.gains[step] = np.ascontiguousarray(reference.gains(cal, step))
        return g


def block_diagonal(basis: np.ndarray, head_dim: int) -> int:
    """head_dim when every row's basis [2, L, C, C] is zero outside its KV heads' D x D blocks
    (a calibration learned with axes per head) and D is a multiple of 8 (the C transform's
    column step), else 0. The C coder then multiplies the blocks only: the same integers, as
    the products it leaves out are zeros."""
    return head_dim if head_dim % 8 == 0 and blocks_per_head(basis, head_dim) else 0


_prepared: dict[int, tuple[Calibration, _Prepared]] = {}
_lock = threading.Lock()


def prepared(cal: Calibration) -> _Prepared:
    """The arrays the C coder reads for `cal` (kept for the last few objects)."""
    hit = _prepared.get(id(cal))
    if hit is not None and hit[0] is cal:
        return hit[1]
    with _lock:
        if len(_prepared) >= 4:
            _prepared.pop(next(iter(_prepared)))
        prep = _Prepared(cal)
        _prepared[id(cal)] = (cal, prep)
    return prep


def _threads(threads: int | None) -> int:
    if threads is None:
        return host_threads()
    if not isinstance(threads, int) or threads < 1:
        raise UsageError(f"pca: threads must be a positive integer, got {threads!r}")
    return threads


# --------------------------------------------------------------------------- the coder
def encode_chunk(raw: np.ndarray, dtype: str, cal: Calibration, step: float, sinks: int, start: int,
                 lanes: int = 16, threads: int | None = None) -> bytes:
    """As reference.encode_chunk: raw [2, L, T, C] as stored (bf16 as uint16 bits) -> the payload."""
    mod = native_module(warn=False)
    if mod is None:
        raise UsageError("pca: the native coder is not built (pip install -e .)")
    _, L, T, C = raw.shape
    if cal.layers != L or cal.channels != C:
        raise UsageError(f"pca: the calibration is for {cal.layers} layers x {cal.channels} channels, the chunk "
                         f"has {L} x {C}")
    prep = prepared(cal)
    n_sink = min(T, max(0, sinks - start))
    cos, sin = prep.rope_tables(start + n_sink, T - n_sink)
    r = 1.0 / (float(step) * float(1 << (reference.U_FRACTION + 14)))
    data = np.ascontiguousarray(raw).view(_STORAGE[dtype])
    try:
        return mod.encode(data, DTYPE_CODES[dtype], L, T, C, cal.head_dim, n_sink, lanes, prep.cols, prep.block, r, prep.mean,
                          prep.weight, prep.m2_encode, prep.basis, prep.sumsq_limit, len(prep.rope.inv_freq), cos, sin,
                          prep.rope_map, FREQ, COST, SLOT_SYM,
                          _threads(threads))
    except mod.NonFiniteError:
        raise NonFiniteValues("pca: the KV input holds NaN or infinity") from None
    except mod.RangeError as exc:
        raise UsageError(f"pca: a token's coefficients are too large for step {step} (sum of |q| {exc} > "
                         f"{reference.TOKEN_L1_LIMIT}); use a larger step or another codec") from None


def decode_chunk(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str, cal: Calibration, step: float,
                 start: int, threads: int | None = None) -> np.ndarray:
    """As reference.decode_chunk: the chunk [2, L, T, C] in dtype's storage (bf16 as uint16 bits)."""
    mod = native_module(warn=False)
    if mod is None:
        raise UsageError("pca: the native coder is not built (pip install -e .)")
    _, L, T, C = shape
    if cal.layers != L or cal.channels != C:
        raise DecodeError(f"pca: the calibration is for {cal.layers} layers x {cal.channels} channels, the chunk "
                          f"has {L} x {C}")
    prep = prepared(cal)
    # the tables start after the sinks the payload says it holds (the C coder checks the rest)
    n_sink = struct.unpack_from("<I", payload, 20)[0] if len(payload) >= reference.HEADER.size else 0
    n_sink = n_sink if n_sink <= T else 0
    cos, sin = prep.rope_tables(start + n_sink, T - n_sink)
    out = np.empty((2, L, T, C), dtype=_OUT[dtype])
    try:
        mod.decode(payload, out.view(_STORAGE[dtype]), DTYPE_CODES[dtype], L, T, C, cal.head_dim, n_sink, prep.cols,
                   prep.block,
                   prep.mean, prep.gain(cal, step), prep.m2_decode, len(prep.rope.inv_freq), cos, sin, prep.rope_map,
                   FREQ, COST, SLOT_SYM, _threads(threads))
    except mod.CorruptError as exc:
        raise DecodeError(f"pca: {exc}") from None
    return out


# --------------------------------------------------------------------------- bitstream version 2
def encode_chunk_v2(raw: np.ndarray, dtype: str, cal: Calibration, step: float, sinks: int, start: int,
                    unit: int | None = None, threads: int | None = None) -> bytes:
    """As reference2.encode_chunk: the C coder gives the whole payload (version 1's transform and
    choice, then each unit's raw bits and rANS, two units' streams a region) around the header
    and the sinks given here."""
    from . import reference2

    mod = native_module(warn=False)
    if mod is None:
        raise UsageError("pca: the native coder is not built (pip install -e .)")
    unit = reference2.DEFAULT_UNIT if unit is None else unit
    if not (reference2.UNIT_STEP <= unit <= reference2.UNIT_MAX and unit % reference2.UNIT_STEP == 0):
        raise UsageError(f"pca: a unit's symbols must be a multiple of {reference2.UNIT_STEP} up to "
                         f"{reference2.UNIT_MAX}")
    _, L, T, C = raw.shape
    if cal.layers != L or cal.channels != C:
        raise UsageError(f"pca: the calibration is for {cal.layers} layers x {cal.channels} channels, the chunk "
                         f"has {L} x {C}")
    prep = prepared(cal)
    n_sink = min(T, max(0, sinks - start))
    cos, sin = prep.rope_tables(start + n_sink, T - n_sink, version=2)
    r = 1.0 / (float(step) * float(1 << (reference.U_FRACTION + 14)))
    data = np.ascontiguousarray(raw).view(_STORAGE[dtype])
    head = reference2.HEADER.pack(reference.MAGIC, reference2.FORMAT_VERSION, DTYPE_CODES[dtype],
                                  unit // reference2.UNIT_STEP, 0, 2 * L, T, C, n_sink)
    sink_bytes = np.ascontiguousarray(data[:, :, :n_sink]).tobytes()
    try:  # the whole payload, laid out by the C coder (§11.2)
        return mod.encode2(data, DTYPE_CODES[dtype], L, T, C, cal.head_dim, n_sink, unit, prep.cols, prep.block, r,
                           prep.mean, prep.weight, prep.m2_encode, prep.basis, prep.sumsq_limit,
                           len(prep.rope.inv_freq), np.ascontiguousarray(cos), np.ascontiguousarray(sin),
                           prep.rope_map, FREQ, COST, SLOT_SYM, _threads(threads), head, sink_bytes)
    except mod.NonFiniteError:
        raise NonFiniteValues("pca: the KV input holds NaN or infinity") from None
    except mod.RangeError as exc:
        raise UsageError(f"pca: a token's coefficients are too large for step {step} (sum of |q| {exc} > "
                         f"{reference.TOKEN_L1_LIMIT}); use a larger step or another codec") from None
    except OverflowError:
        raise UsageError("pca: a pair of units exceeds 65535 bytes (use a smaller unit)") from None


def decode_chunk_v2(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str, cal: Calibration, step: float,
                    start: int, threads: int | None = None) -> np.ndarray:
    """As reference2.decode_chunk: the header, side bytes and region table parsed here (as the
    reference parses them), every unit decoded by the C coder, which reports the stream bytes
    each unit used; each region must be filled exactly by its units."""
    from . import reference2

    mod = native_module(warn=False)
    if mod is None:
        raise UsageError("pca: the native coder is not built (pip install -e .)")
    _, L, T, C = shape
    if cal.layers != L or cal.channels != C:
        raise DecodeError(f"pca: the calibration is for {cal.layers} layers x {cal.channels} channels, the chunk "
                          f"has {L} x {C}")
    lay = reference2.parse(payload, shape, dtype)
    prep = prepared(cal)
    n = len(lay.spans)
    pairs = len(lay.reg_len)
    # a pair's two units side by side: the forward one reads its region from the start, the
    # backward one from the end
    units = np.empty((pairs, 2, 6), np.int64)
    units.reshape(-1, 6)[:n, :3] = lay.spans
    units[:, 0, 3] = lay.reg_at
    units[:, 1, 3] = lay.reg_at + lay.reg_len - 1
    units[:, 0, 4] = 1
    units[:, 1, 4] = -1
    units[:, :, 5] = lay.reg_len[:, None]
    units = units.reshape(-1, 6)[:n]
    row_units = np.searchsorted(lay.spans[:, 0], np.arange(2 * L + 1), side="left").astype(np.int32)
    consumed = np.zeros(n, np.int64)
    cos, sin = prep.rope_tables(start + lay.n_sink, lay.Tc, version=2)
    out = np.empty((2, L, T, C), dtype=_OUT[dtype])
    try:
        mod.decode2(payload, out.view(_STORAGE[dtype]), DTYPE_CODES[dtype], L, T, C, cal.head_dim, lay.n_sink,
                    prep.cols, prep.block, prep.mean, prep.gain(cal, step), prep.m2_decode, len(prep.rope.inv_freq),
                    np.ascontiguousarray(cos), np.ascontiguousarray(sin), prep.rope_map, FREQ, COST, SLOT_SYM, units,
                    row_units, consumed, _threads(threads))
    except mod.CorruptError as exc:
        raise DecodeError(f"pca: {exc}") from None
    if n % 2:
        consumed = np.append(consumed, 0)
    if n and (consumed.reshape(-1, 2).sum(1) != lay.reg_len).any():
        raise DecodeError("pca: a pair of units does not fill its region exactly")
    storage = _OUT[dtype]
    out[:, :, :lay.n_sink] = np.frombuffer(bytes(payload[lay.sink_at:lay.sink_at + out[:, :, :lay.n_sink].nbytes]),
                                           storage).reshape(2, L, lay.n_sink, C)
    return out
