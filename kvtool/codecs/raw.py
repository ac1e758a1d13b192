"""Codec 0, `raw`: the tensor's little-endian bytes, nothing else."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import NUMPY_STORAGE, itemsize
from ..errors import DecodeError
from .base import Codec

if TYPE_CHECKING:
    import torch


class RawCodec(Codec):
    name = "raw"
    codec_id = 0
    params_version = 1
    lossless = True
    payload_is_tensor_bytes = True

    def default_params(self) -> dict[str, Any]:
        return {"version": 1}

    def validate_params(self, params: Any) -> dict[str, Any]:
        params = self._check_version(params)
        self._reject_unknown_keys(self.name, params, {"version"})
        return params

    def encode_host(self, kv: "torch.Tensor", params: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        return tensor_bytes(kv), params

    def decode_array(self, payload, shape, dtype, params) -> np.ndarray:
        expected = math.prod(shape) * itemsize(dtype)
        if payload.nbytes != expected:
            raise DecodeError(f"raw payload holds {payload.nbytes} bytes, shape needs {expected}")
        return np.frombuffer(bytearray(payload), dtype=NUMPY_STORAGE[dtype]).reshape(shape)


def tensor_bytes(t: "torch.Tensor") -> memoryview:
    """A tensor's bytes in memory order (little-endian on every supported host)."""
    import torch

    t = t.contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")

