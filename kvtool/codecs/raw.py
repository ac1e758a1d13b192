"""Codec 0, `raw`: the tensor's little-endian bytes, nothing else."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dtypes import itemsize
from ..errors import DecodeError
from . import register
from .base import Codec


class RawCodec(Codec):
    name = "raw"
    codec_id = 0
    params_version = 1
    lossless = True

    def default_params(self) -> dict[str, Any]:
        return {"version": 1}

    def validate_params(self, params: Any) -> dict[str, Any]:
        params = self._check_version(params)
        self._reject_unknown_keys(self.name, params, {"version"})
        return params

    def encode(self, kv: torch.Tensor, params: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        return tensor_bytes(kv), params

    def decode(self, payload, shape, dtype, params):
        expected = math.prod(shape) * itemsize(dtype)
        if payload.nbytes != expected:
            raise DecodeError(f"raw payload holds {payload.nbytes} bytes, shape needs {expected}")
        if expected == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(payload), dtype=dtype).view(shape)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in memory order (little-endian on every supported host)."""
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


register(RawCodec())
