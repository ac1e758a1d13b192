"""The CacheGen coder on the CPU: the native C coder (kernels/cachegen_cpu.c) when it is
built, else the pure-Python reference (`reference.py`), to the same bytes and values.

`decode_array` needs no torch with the native coder (what `kvtool verify` uses);
the reference coder is written in torch and imports it.
"""

from __future__ import annotations

from struct import error as struct_error
from typing import TYPE_CHECKING, Any

import numpy as np

from ...dtypes import NUMPY_STORAGE, canonical_name
from ...errors import CodecParamsInvalid, DecodeError, NonFiniteValues, UnsupportedDtype, UsageError
from .bins import canonical_bins_spec, resolve_bins
from .native import default_threads, native_module
from .params import check_chunk, check_shape, default_params, validate_params
from .payload import DTYPE_CODE_OF, check_table_budget, parse_header

if TYPE_CHECKING:
    import torch

# The integer view the native coder reads and writes, by element size.
_NATIVE_VIEW = {2: np.int16, 4: np.int32}


def cachegen_encode(kv: "torch.Tensor", params: dict | None = None, *, threads: int | None = None,
                    impl: str = "auto") -> tuple[bytes, dict]:
    """Encode one [2, L, T, C] chunk. impl: 'auto' (native if built), 'native' or 'reference'."""
    L, T, C = check_chunk(kv)
    p = validate_params(params if params is not None else default_params())
    bins = resolve_bins(p["bins"], L)
    p["bins"] = canonical_bins_spec(p["bins"], L)
    x = kv.detach().to("cpu").contiguous().view(2 * L, T, C)
    mod = _pick(impl)
    if mod is None:
        from . import reference

        payload = reference.encode_chunk(x, bins, p["prob_bits"], p["lanes"])
        check_table_budget(len(payload), C, [b // 2 - 1 for b in bins], writing=True)
        return payload, p
    code = DTYPE_CODE_OF[str(x.dtype).removeprefix("torch.")]
    arr = x.view(_torch_view(x.element_size())).numpy()
    try:
        payload = mod.encode(arr, code, 2 * L, T, C,
                             np.array(bins, dtype="<u2").tobytes(), p["prob_bits"], p["lanes"], _threads(threads))
    except mod.NonFiniteError:
        raise NonFiniteValues("cachegen: the KV input holds NaN or infinity") from None
    check_table_budget(len(payload), C, [b // 2 - 1 for b in bins], writing=True)
    return payload, p


def decode_array(payload: bytes | memoryview, shape: Any, dtype: str, params: dict, *,
                 threads: int | None = None, impl: str = "auto") -> np.ndarray:
    """Decode a payload into a new numpy array of `shape` holding KV dtype `dtype` (a name, as
    `kvtool.dtypes.NUMPY_STORAGE` says); DecodeError on any corruption."""
    p = validate_params(params)
    _, L, T, C = check_shape(shape)
    try:
        dtype = canonical_name(dtype)
    except UnsupportedDtype:
        raise DecodeError(f"cachegen: unsupported KV dtype {dtype}") from None
    try:
        bins = resolve_bins(p["bins"], L)
    except UsageError as exc:
        raise CodecParamsInvalid(str(exc)) from None
    mod = _pick(impl)
    if mod is None:
        out = _reference_decode(payload, dtype, L, T, C, bins)
        P, N = payload[4], payload[5]
    else:
        # the header, and the tables' budget (section 8), before the C decoder allocates anything
        parse_header(payload, 2 * L, T, C, DTYPE_CODE_OF[dtype], [b // 2 - 1 for b in bins])
        out = np.empty((2 * L, T, C), dtype=NUMPY_STORAGE[dtype])
        try:
            P, N = mod.decode(payload, out.view(_NATIVE_VIEW[out.itemsize]), DTYPE_CODE_OF[dtype], 2 * L, T, C,
                              np.array(bins, dtype="<u2").tobytes(), _threads(threads))
        except mod.CorruptError as exc:
            raise DecodeError(f"cachegen: {exc}") from None
    if P != p["prob_bits"] or N != min(p["lanes"], C):
        raise DecodeError("cachegen: payload header disagrees with the codec parameters (prob_bits/lanes)")
    return out.reshape(2, L, T, C)


def cachegen_decode(payload: bytes | memoryview, shape: Any, dtype: "torch.dtype", params: dict, *,
                    threads: int | None = None, impl: str = "auto") -> "torch.Tensor":
    """Decode a payload into a new tensor of `shape` and `dtype`; DecodeError on any corruption."""
    import torch

    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_CODE_OF:
        raise DecodeError(f"cachegen: unsupported KV dtype {dtype}")
    return torch.from_numpy(decode_array(payload, shape, name, params, threads=threads, impl=impl)).view(dtype)


def cachegen_reference_roundtrip(kv: "torch.Tensor", params: dict | None = None) -> "torch.Tensor":
    """dequantize(quantize(kv)) by the reference arithmetic: what decode(encode(kv)) must equal."""
    from . import reference

    p = validate_params(params if params is not None else default_params())
    _, L, T, C = kv.shape
    bins = resolve_bins(p["bins"], L)
    x = kv.contiguous().view(2 * L, T, C)
    q, scales = reference.quantize(x, bins)
    return reference.dequantize(q, scales, bins, kv.dtype).view(2, L, T, C)


def _reference_decode(payload, dtype: str, L: int, T: int, C: int, bins: list[int]) -> np.ndarray:
    import torch

    from . import reference

    try:
        out = reference.decode_chunk(payload, getattr(torch, dtype), 2 * L, T, C, bins)
    except (IndexError, ValueError, OverflowError, struct_error) as exc:  # belt and braces
        raise DecodeError(f"cachegen: corrupt payload ({exc})") from None
    return out.view(_torch_view(out.element_size())).numpy().view(NUMPY_STORAGE[dtype])


def _torch_view(size: int):
    import torch

    return {2: torch.int16, 4: torch.int32}[size]


def _threads(threads: int | None) -> int:
    if threads is None:
        return default_threads()
    if not isinstance(threads, int) or threads < 1:
        raise UsageError(f"cachegen: threads must be a positive integer, got {threads!r}")
    return threads


def _pick(impl: str):
    if impl == "reference":
        return None
    if impl == "native":
        mod = native_module(warn=False)
        if mod is None:
            raise UsageError("cachegen: the native coder is not built (pip install -e .)")
        return mod
    if impl != "auto":
        raise UsageError(f"cachegen: impl must be 'auto', 'native' or 'reference', got {impl!r}")
    return native_module(warn=True)
