"""The codec contract every chunk encoding follows.

A codec turns one chunk in the canonical KV_BLOB layout
`[2, num_layers, num_tokens, num_kv_heads * head_dim]` (K then V, contiguous,
one of the KV dtypes) into a byte payload, and back. Its parameters live in the
chunk's manifest entry as a JSON object that always carries `"version"`, so a
codec can evolve its parameters without touching the container.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from ..errors import CodecParamsInvalid


class Codec(ABC):
    name: ClassVar[str]  # stable, lower-case, written to the manifest
    codec_id: ClassVar[int]  # stable numeric id, written to the manifest
    params_version: ClassVar[int]  # the newest parameter version this build writes
    lossless: ClassVar[bool]
    # True if encode() takes CUDA tensors itself (and writes the same bytes as on the CPU);
    # otherwise the writer hands it a CPU copy.
    accepts_cuda: ClassVar[bool] = False

    @abstractmethod
    def default_params(self) -> dict[str, Any]:
        """Parameters used when the user gives none (includes "version")."""

    @abstractmethod
    def validate_params(self, params: Any) -> dict[str, Any]:
        """Return a normalised copy of `params`, or raise CodecParamsInvalid."""

    @abstractmethod
    def encode(self, kv: torch.Tensor, params: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """Encode a contiguous CPU KV_BLOB. Returns (payload, params to record)."""

    @abstractmethod
    def decode(
        self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype, params: dict[str, Any]
    ) -> torch.Tensor:
        """Decode a payload into a new tensor of exactly `shape` and `dtype`.

        Must raise DecodeError (never crash, hang, or allocate beyond `shape`)
        on a corrupt payload."""

    def decode_to(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype,
                  params: dict[str, Any], device: torch.device) -> torch.Tensor:
        """`decode`, with the result on `device`. This default decodes on the CPU and
        copies; a codec with a device decoder overrides it (same values)."""
        tensor = self.decode(payload, shape, dtype, params)
        return tensor if device.type == "cpu" else tensor.to(device)

    # Helpers shared by the concrete codecs.
    def _check_version(self, params: Any) -> dict[str, Any]:
        if not isinstance(params, dict):
            raise CodecParamsInvalid(f"{self.name}: codec parameters must be a JSON object")
        version = params.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise CodecParamsInvalid(f"{self.name}: codec parameters lack an integer 'version'")
        if version < 1 or version > self.params_version:
            raise CodecParamsInvalid(
                f"{self.name}: parameter version {version} is not supported "
                f"(this build reads 1..{self.params_version})"
            )
        return dict(params)

    @staticmethod
    def _reject_unknown_keys(name: str, params: dict[str, Any], allowed: set[str]) -> None:
        extra = sorted(set(params) - allowed)
        if extra:
            raise CodecParamsInvalid(f"{name}: unknown codec parameter(s) {', '.join(extra)}")
