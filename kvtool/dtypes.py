"""The KV dtypes the format allows, by their on-disk names."""

from __future__ import annotations

import sys

import torch

from .errors import UnsupportedDtype

# Name on disk -> torch dtype. v1 allows exactly these three; anything else
# (fp8, int8, float64) must be cast by the writer or encoded by a codec.
KV_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
# Short names accepted on the command line.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                 "half": "float16", "float": "float32"}

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
    raise ImportError("kvtool reads and writes little-endian data and needs a little-endian host")


def dtype_from_name(name: str) -> torch.dtype:
    name = DTYPE_ALIASES.get(name, name)
    try:
        return KV_DTYPES[name]
    except (KeyError, TypeError):
        raise UnsupportedDtype(
            f"unsupported KV dtype {name!r}; expected one of {', '.join(KV_DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in KV_DTYPES.items():
        if dt == dtype:
            return name
    raise UnsupportedDtype(f"unsupported KV dtype {dtype}; expected one of {', '.join(KV_DTYPES)}")


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
