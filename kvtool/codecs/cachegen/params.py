"""CacheGen's codec parameters and the chunk shapes its bitstream can hold, checked the same
way for the CPU and GPU coders (format-spec/cachegen.md section 2)."""

from __future__ import annotations

from typing import Any

from ...errors import CodecParamsInvalid, DecodeError, UsageError
from .bins import canonical_bins_spec, parse_bins_spec
from .payload import DTYPE_CODE_OF, LANES_MAX, MAX_TOKENS, PROB_BITS_MAX, PROB_BITS_MIN

PARAMS_VERSION = 1
DEFAULT_PROB_BITS = 14
DEFAULT_LANES = 32
KEYS = {"version", "bins", "prob_bits", "lanes"}


def default_params() -> dict[str, Any]:
    return {"version": PARAMS_VERSION, "bins": "default", "prob_bits": DEFAULT_PROB_BITS, "lanes": DEFAULT_LANES}


def cachegen_params(bins: str = "default", prob_bits: int = DEFAULT_PROB_BITS, lanes: int = DEFAULT_LANES) -> dict:
    """Build codec parameters from user options; raises UsageError with a clear message."""
    parse_bins_spec(bins)
    if not isinstance(prob_bits, int) or isinstance(prob_bits, bool) or not (
        PROB_BITS_MIN <= prob_bits <= PROB_BITS_MAX
    ):
        raise UsageError(f"cachegen prob_bits must be an integer in {PROB_BITS_MIN}..{PROB_BITS_MAX}, got {prob_bits!r}")
    if not isinstance(lanes, int) or isinstance(lanes, bool) or not (1 <= lanes <= LANES_MAX):
        raise UsageError(f"cachegen lanes must be an integer in 1..{LANES_MAX}, got {lanes!r}")
    return {"version": PARAMS_VERSION, "bins": canonical_bins_spec(bins), "prob_bits": prob_bits, "lanes": lanes}


def validate_params(params: Any) -> dict:
    """A normalised copy of recorded parameters; CodecParamsInvalid otherwise."""
    if not isinstance(params, dict):
        raise CodecParamsInvalid("cachegen: codec parameters must be a JSON object")
    version = params.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CodecParamsInvalid("cachegen: codec parameters lack an integer 'version'")
    if not 1 <= version <= PARAMS_VERSION:
        raise CodecParamsInvalid(f"cachegen: parameter version {version} is not supported "
                                 f"(this build reads 1..{PARAMS_VERSION})")
    extra = sorted(set(params) - KEYS)
    if extra:
        raise CodecParamsInvalid(f"cachegen: unknown codec parameter(s) {', '.join(extra)}")
    bins = params.get("bins", "default")
    if not isinstance(bins, str):
        raise CodecParamsInvalid("cachegen: 'bins' must be a string")
    try:
        return cachegen_params(bins, params.get("prob_bits", DEFAULT_PROB_BITS), params.get("lanes", DEFAULT_LANES))
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
    if shp[2] >= MAX_TOKENS or shp[2] * shp[3] > (1 << 30) or shp[1] > 32767:
        raise DecodeError(f"cachegen: chunk shape {list(shp)} is beyond the format's limits")
    return shp  # type: ignore[return-value]


def check_chunk(kv: Any) -> tuple[int, int, int]:
    """(L, T, C) of a KV_BLOB chunk the bitstream can hold; UsageError otherwise (CPU and GPU coders)."""
    import torch

    if not isinstance(kv, torch.Tensor):
        raise UsageError("cachegen: the KV chunk must be a torch tensor")
    if str(kv.dtype).removeprefix("torch.") not in DTYPE_CODE_OF:
        raise UsageError(f"cachegen: unsupported KV dtype {kv.dtype}; expected bfloat16, float16 or float32")
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.numel() == 0:
        raise UsageError(f"cachegen: the KV chunk must have shape [2, L, T, C], got {list(kv.shape)}")
    _, L, T, C = kv.shape
    if T >= MAX_TOKENS or T * C > (1 << 30) or L > 32767:
        raise UsageError(f"cachegen: chunk shape {list(kv.shape)} is beyond the format's limits")
    return int(L), int(T), int(C)
