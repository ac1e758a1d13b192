"""The KV dtypes the format allows, by their on-disk names; torch is imported only when a
torch dtype is asked for.

Data that never meets a model (inspect, verify) stays in numpy: a bfloat16
array is held as its bit patterns (`uint16`, numpy has no bfloat16); float16
and float32 as themselves (`numpy_storage`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .errors import UnsupportedDtype

if TYPE_CHECKING:
    import numpy as np

# v1 allows exactly these three; anything else (fp8, int8, float64) must be cast by the
# writer or encoded by a codec.
KV_DTYPE_NAMES = ("bfloat16", "float16", "float32")
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
# numpy holds each KV dtype as: bfloat16 as its bit patterns, the others as themselves
# (`NUMPY_STORAGE`, made on first use: naming a dtype imports no numpy).
_STORAGE_CODES = {"bfloat16": "<u2", "float16": "<f2", "float32": "<f4"}
# The exponent mask of each dtype's bit pattern: a value is NaN or infinite exactly when its
# exponent bits are all ones.
_EXPONENT_MASK = {"bfloat16": ("<u2", 0x7F80), "float16": ("<u2", 0x7C00), "float32": ("<u4", 0x7F800000)}


def __getattr__(name: str):
    if name == "NUMPY_STORAGE":
        import numpy as np

        value = globals()["NUMPY_STORAGE"] = {k: np.dtype(code) for k, code in _STORAGE_CODES.items()}
        return value
    raise AttributeError(f"module 'kvtool.dtypes' has no attribute {name!r}")
# Short names accepted on the command line.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                 "half": "float16", "float": "float32"}

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
    raise ImportError("kvtool reads and writes little-endian data and needs a little-endian host")


def canonical_name(name: str) -> str:
    """'bf16' or 'bfloat16' -> 'bfloat16'; UnsupportedDtype for anything else."""
    name = DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in ITEMSIZE:
        raise UnsupportedDtype(f"unsupported KV dtype {name!r}; expected bf16, fp16 or fp32 "
                               f"({', '.join(KV_DTYPE_NAMES)})")
    return name


def dtype_from_name(name: str):
    """On-disk (or short) name -> torch dtype."""
    import torch

    return getattr(torch, canonical_name(name))


def dtype_name(dtype) -> str:
    """torch dtype (or a name) -> on-disk name; UnsupportedDtype for others."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise UnsupportedDtype(f"unsupported KV dtype {dtype}; expected one of {', '.join(KV_DTYPE_NAMES)}")
    return name


def itemsize(dtype) -> int:
    """Bytes per value of a KV dtype (torch dtype or name)."""
    return ITEMSIZE[dtype_name(dtype)]


def count_nonfinite(values: np.ndarray, name: str) -> int:
    """How many of `values` (numpy storage of KV dtype `name`) are NaN or infinite."""
    import numpy as np

    bits_type, mask = _EXPONENT_MASK[canonical_name(name)]
    bits = values.view(bits_type)
    return int(np.count_nonzero((bits & mask) == mask))


def bfloat16_to_float32(values: np.ndarray) -> np.ndarray:
    """Numpy storage of bfloat16 (uint16) -> float32, bit for bit (a bfloat16 is the high half of
    a float32): no float cast, so a signaling NaN stays itself and nothing warns."""
    import numpy as np

    return (values.astype(np.uint32) << 16).view(np.float32)


def to_float64(values: np.ndarray, name: str) -> np.ndarray:
    """Numpy storage of KV dtype `name` -> float64 values (exact: every KV value is a float64).
    A signaling NaN (stored bits a file may hold) becomes a quiet NaN, without numpy's
    RuntimeWarning: NaN stays NaN, and what reads the values reports it as such."""
    import numpy as np

    with np.errstate(invalid="ignore"):
        if canonical_name(name) == "bfloat16":
            return bfloat16_to_float32(values).astype(np.float64)
        return values.astype(np.float64)
