"""CacheGen codec (codec id 2): per-token quantization + rANS with parametric tables.

Bitstream: format-spec/cachegen.md. Public API:

- `CacheGenCodec` (registered as ``"cachegen"``, id 2)
- `cachegen_params(bins=..., prob_bits=..., lanes=...)` -> validated params dict (UsageError)
- `cachegen_encode(kv, params, threads=None, impl="auto")` -> (payload, recorded params)
- `cachegen_decode(payload, shape, dtype, params, threads=None, impl="auto")` -> tensor
- `cachegen_reference_roundtrip(kv, params)` -> dequantize(quantize(kv)), the exact decode result
- `cachegen_payload_stats(payload, shape, params=None)` -> dict of bits/value by part
- `parse_bins_spec`, `resolve_bins`, `native_available`
"""

from __future__ import annotations

from struct import error as struct_error
from typing import Any

import numpy as np
import torch

from ...errors import CodecParamsInvalid, DecodeError, KvtoolError, NonFiniteValues, UsageError
from .. import register
from ..base import Codec
from . import reference as ref
from .bins import LMCACHE_DEFAULT, canonical_bins_spec, parse_bins_spec, resolve_bins
from .native import default_threads, native_available, native_module

PARAMS_VERSION = 1
DEFAULT_PROB_BITS = 14
DEFAULT_LANES = 32
_KEYS = {"version", "bins", "prob_bits", "lanes"}
_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def cachegen_params(bins: str = "default", prob_bits: int = DEFAULT_PROB_BITS, lanes: int = DEFAULT_LANES) -> dict:
    """Build codec parameters from user options; raises UsageError with a clear message."""
    parse_bins_spec(bins)
    if not isinstance(prob_bits, int) or isinstance(prob_bits, bool) or not (
        ref.PROB_BITS_MIN <= prob_bits <= ref.PROB_BITS_MAX
    ):
        raise UsageError(f"cachegen prob_bits must be an integer in {ref.PROB_BITS_MIN}..{ref.PROB_BITS_MAX}, got {prob_bits!r}")
    if not isinstance(lanes, int) or isinstance(lanes, bool) or not (1 <= lanes <= ref.LANES_MAX):
        raise UsageError(f"cachegen lanes must be an integer in 1..{ref.LANES_MAX}, got {lanes!r}")
    return {"version": PARAMS_VERSION, "bins": canonical_bins_spec(bins), "prob_bits": prob_bits, "lanes": lanes}


def _validate(params: Any) -> dict:
    p = CacheGenCodec()._check_version(params)
    Codec._reject_unknown_keys("cachegen", p, _KEYS)
    bins = p.get("bins", "default")
    if not isinstance(bins, str):
        raise CodecParamsInvalid("cachegen: 'bins' must be a string")
    try:
        return cachegen_params(bins, p.get("prob_bits", DEFAULT_PROB_BITS), p.get("lanes", DEFAULT_LANES))
    except UsageError as exc:
        raise CodecParamsInvalid(str(exc)) from None


def check_shape(shape: Any) -> tuple[int, int, int, int]:
    """A declared chunk shape the bitstream can hold, as ints; DecodeError otherwise (CPU and GPU decoders)."""
    try:
        shp = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise DecodeError(f"cachegen: bad chunk shape {shape!r}") from None
    if len(shp) != 4 or shp[0] != 2 or min(shp) < 1:
        raise DecodeError(f"cachegen: chunk shape must be [2, L, T, C] with positive sizes, got {list(shp)}")
    if shp[2] >= ref.MAX_TOKENS or shp[2] * shp[3] > (1 << 30) or shp[1] > 32767:
        raise DecodeError(f"cachegen: chunk shape {list(shp)} is beyond the format's limits")
    return shp  # type: ignore[return-value]


def check_chunk(kv: Any) -> tuple[int, int, int]:
    """(L, T, C) of a KV_BLOB chunk the bitstream can hold; UsageError otherwise (CPU and GPU coders)."""
    if not isinstance(kv, torch.Tensor):
        raise UsageError("cachegen: the KV chunk must be a torch tensor")
    if kv.dtype not in ref.DTYPE_CODES:
        raise UsageError(f"cachegen: unsupported KV dtype {kv.dtype}; expected bfloat16, float16 or float32")
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.numel() == 0:
        raise UsageError(f"cachegen: the KV chunk must have shape [2, L, T, C], got {list(kv.shape)}")
    _, L, T, C = kv.shape
    if T >= ref.MAX_TOKENS or T * C > (1 << 30) or L > 32767:
        raise UsageError(f"cachegen: chunk shape {list(kv.shape)} is beyond the format's limits")
    return int(L), int(T), int(C)


def cachegen_encode(kv: torch.Tensor, params: dict | None = None, *, threads: int | None = None,
                    impl: str = "auto") -> tuple[bytes, dict]:
    """Encode one [2, L, T, C] chunk. impl: 'auto' (native if built), 'native' or 'reference'."""
    L, T, C = check_chunk(kv)
    p = _validate(params if params is not None else CacheGenCodec().default_params())
    bins = resolve_bins(p["bins"], L)
    p["bins"] = canonical_bins_spec(p["bins"], L)
    x = kv.detach().to("cpu").contiguous().view(2 * L, T, C)
    mod = _pick(impl)
    if mod is None:
        return ref.encode_chunk(x, bins, p["prob_bits"], p["lanes"]), p
    arr = x.view(_VIEW[x.dtype]).numpy()
    try:
        payload = mod.encode(arr, ref.DTYPE_CODES[x.dtype], 2 * L, T, C, np.array(bins, dtype="<u2").tobytes(),
                             p["prob_bits"], p["lanes"], _threads(threads))
    except mod.NonFiniteError:
        raise NonFiniteValues("cachegen: the KV input holds NaN or infinity") from None
    return payload, p


def cachegen_decode(payload: bytes | memoryview, shape: Any, dtype: torch.dtype, params: dict, *,
                    threads: int | None = None, impl: str = "auto") -> torch.Tensor:
    """Decode a payload into a new tensor of `shape` and `dtype`; DecodeError on any corruption."""
    p = _validate(params)
    _, L, T, C = check_shape(shape)
    if dtype not in ref.DTYPE_CODES:
        raise DecodeError(f"cachegen: unsupported KV dtype {dtype}")
    try:
        bins = resolve_bins(p["bins"], L)
    except UsageError as exc:
        raise CodecParamsInvalid(str(exc)) from None
    mod = _pick(impl)
    if mod is None:
        try:
            out = ref.decode_chunk(payload, dtype, 2 * L, T, C, bins)
        except (IndexError, ValueError, OverflowError, struct_error) as exc:  # belt and braces
            raise DecodeError(f"cachegen: corrupt payload ({exc})") from None
        P, N = payload[4], payload[5]
    else:
        out = torch.empty((2 * L, T, C), dtype=dtype)
        try:
            P, N = mod.decode(payload, out.view(_VIEW[dtype]).numpy(), ref.DTYPE_CODES[dtype], 2 * L, T, C,
                              np.array(bins, dtype="<u2").tobytes(), _threads(threads))
        except mod.CorruptError as exc:
            raise DecodeError(f"cachegen: {exc}") from None
    if P != p["prob_bits"] or N != min(p["lanes"], C):
        raise DecodeError("cachegen: payload header disagrees with the codec parameters (prob_bits/lanes)")
    return out.view(2, L, T, C)


def cachegen_reference_roundtrip(kv: torch.Tensor, params: dict | None = None) -> torch.Tensor:
    """dequantize(quantize(kv)) by the reference arithmetic: what decode(encode(kv)) must equal."""
    p = _validate(params if params is not None else CacheGenCodec().default_params())
    _, L, T, C = kv.shape
    bins = resolve_bins(p["bins"], L)
    x = kv.contiguous().view(2 * L, T, C)
    q, scales = ref.quantize(x, bins)
    return ref.dequantize(q, scales, bins, kv.dtype).view(2, L, T, C)


def cachegen_payload_stats(payload: bytes | memoryview, shape: Any, params: dict | None = None) -> dict:
    """Per-chunk size figures: bits per value in total and by part (header, scales, tables,
    lane_states, payload, padding), their shares of the payload, and the coder settings."""
    _, L, T, C = check_shape(shape)
    stats = ref.payload_stats(payload, 2 * L, T, C)
    stats["ratio_vs_bf16"] = 16.0 / stats["bits_per_value"]
    if params is not None:
        stats["params"] = _validate(params)
    return stats


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


class CacheGenCodec(Codec):
    name = "cachegen"
    codec_id = 2
    params_version = PARAMS_VERSION
    lossless = False

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads

    def default_params(self) -> dict[str, Any]:
        return {"version": PARAMS_VERSION, "bins": "default", "prob_bits": DEFAULT_PROB_BITS,
                "lanes": DEFAULT_LANES}

    def validate_params(self, params: Any) -> dict[str, Any]:
        return _validate(params)

    accepts_cuda = True  # a CUDA chunk is encoded on the GPU, to the same bytes

    def encode(self, kv: torch.Tensor, params: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        if kv.is_cuda:
            from ... import cuda

            if cuda.available():
                try:
                    return cuda.cachegen_encode(kv, params)
                except KvtoolError:
                    raise
                except (cuda.CudaUnavailable, RuntimeError) as exc:  # no kernel, launch failure, out of memory
                    cuda.notice("CacheGen coder", str(exc))
            kv = kv.cpu()
        return cachegen_encode(kv, params, threads=self.threads)

    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype,
               params: dict[str, Any]) -> torch.Tensor:
        return cachegen_decode(payload, shape, dtype, params, threads=self.threads)

    def decode_to(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype,
                  params: dict[str, Any], device: torch.device) -> torch.Tensor:
        if device.type == "cuda":
            from ... import cuda

            if cuda.available():
                try:
                    return cuda.cachegen_decode(payload, shape, dtype, params, device=device)
                except KvtoolError:
                    raise  # the payload's fault, as the CPU decoder would say
                except (cuda.CudaUnavailable, RuntimeError) as exc:  # no kernel, launch failure, out of memory
                    cuda.notice("CacheGen coder", str(exc))
        return super().decode_to(payload, shape, dtype, params, device)

    def decode_batch_to(self, payloads: list[memoryview], shapes: list[tuple[int, ...]], dtype: torch.dtype,
                        params: dict[str, Any], device: torch.device) -> list[torch.Tensor]:
        """Several payloads of one parameter set onto `device`: one GPU launch for all of them."""
        if device.type == "cuda":
            from ... import cuda

            if cuda.available():
                try:
                    from ...cuda import cachegen as gpu

                    return gpu.decode_chunks(payloads, shapes, dtype, params, device=device)
                except KvtoolError:
                    raise
                except (cuda.CudaUnavailable, RuntimeError) as exc:  # no kernel, launch failure, out of memory
                    cuda.notice("CacheGen coder", str(exc))
        return [self.decode_to(p, s, dtype, params, device) for p, s in zip(payloads, shapes)]

register(CacheGenCodec())

__all__ = [
    "CacheGenCodec", "cachegen_params", "cachegen_encode", "cachegen_decode", "cachegen_reference_roundtrip",
    "cachegen_payload_stats", "parse_bins_spec", "resolve_bins", "canonical_bins_spec", "native_available",
    "LMCACHE_DEFAULT",
]
