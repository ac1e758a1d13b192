"""The codec contract every chunk encoding follows.

A codec turns one chunk in the canonical KV_BLOB layout
`[2, num_layers, num_tokens, num_kv_heads * head_dim]` (K then V, contiguous,
one of the KV dtypes) into a byte payload, and back. Its parameters live in the
chunk's manifest entry as a JSON object that always carries `"version"`, so a
codec can evolve its parameters without touching the container.

Decoding has one CPU implementation per codec, `decode_array`, in numpy (no
torch: `inspect` and `verify` never import it); `decode` wraps its result as a
tensor without a copy. Where a chunk goes and which device encodes or decodes
it is the codec's own decision (`input_placement`, `encode`, `decode_to`), and
so is its fallback to the CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..errors import CodecParamsInvalid

if TYPE_CHECKING:
    import torch


class Codec(ABC):
    name: ClassVar[str]  # stable, lower-case, written to the manifest
    codec_id: ClassVar[int]  # stable numeric id, written to the manifest
    params_version: ClassVar[int]  # the newest parameter version this build writes
    lossless: ClassVar[bool]
    # True when the payload is the tensor's bytes as they are (a reader may then read it
    # straight into a tensor, or view it without a copy).
    payload_is_tensor_bytes: ClassVar[bool] = False
    # True when a GPU decodes several chunks of this codec faster in one launch (`decode_batch_to`)
    # than one by one: the load path then reads them in groups into pinned memory and decodes each
    # group on the device (kvtool.load.path), instead of decoding each chunk on the CPU.
    decodes_in_device_batches: ClassVar[bool] = False

    @abstractmethod
    def default_params(self) -> dict[str, Any]:
        """Parameters used when the user gives none (includes "version")."""

    @abstractmethod
    def validate_params(self, params: Any) -> dict[str, Any]:
        """Return a normalised copy of `params`, or raise CodecParamsInvalid."""

    @abstractmethod
    def encode_host(self, kv: "torch.Tensor", params: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """Encode a contiguous CPU KV_BLOB. Returns (payload, params to record)."""

    @abstractmethod
    def decode_array(self, payload: memoryview, shape: tuple[int, ...], dtype: str,
                     params: dict[str, Any]) -> np.ndarray:
        """Decode a payload on the CPU into a new numpy array of exactly `shape`, holding KV
        dtype `dtype` (a name) as `kvtool.dtypes.NUMPY_STORAGE` says.

        Must raise DecodeError (never crash, hang, or allocate beyond `shape`)
        on a corrupt payload."""

    def encode(self, kv: "torch.Tensor", params: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """Encode a KV_BLOB on any device, to the same bytes. This default encodes a CPU copy;
        a codec with a device encoder overrides it."""
        return self.encode_host(kv if kv.device.type == "cpu" else kv.cpu(), params)

    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: "torch.dtype",
               params: dict[str, Any]) -> "torch.Tensor":
        """`decode_array` as a CPU tensor of `dtype` (no copy)."""
        import torch

        from ..dtypes import dtype_name

        array = self.decode_array(payload, tuple(shape), dtype_name(dtype), params)
        return torch.from_numpy(array).view(dtype)

    def decode_to(self, payload: memoryview, shape: tuple[int, ...], dtype: "torch.dtype",
                  params: dict[str, Any], device: "torch.device") -> "torch.Tensor":
        """`decode`, with the result on `device`. This default decodes on the CPU and
        copies; a codec with a device decoder overrides it (same values)."""
        tensor = self.decode(payload, shape, dtype, params)
        return tensor if device.type == "cpu" else tensor.to(device)

    def decode_batch_to(self, payloads: list[memoryview], shapes: list[tuple[int, ...]], dtype: "torch.dtype",
                        params: dict[str, Any], device: "torch.device") -> list["torch.Tensor"]:
        """Several payloads of one parameter set onto `device` (a device decoder may take them
        in one launch)."""
        return [self.decode_to(p, s, dtype, params, device) for p, s in zip(payloads, shapes)]

    def input_placement(self, device: "torch.device") -> tuple["torch.device", bool]:
        """Where a chunk gathered on `device` should be handed to `encode`: (device, pinned).
        This default: the CPU, pinned when the chunk comes off a GPU (the fastest way off it)."""
        import torch

        return torch.device("cpu"), device.type == "cuda"

    def check_position(self, params: dict[str, Any], position: int) -> None:
        """Refuse (CodecParamsInvalid) parameters that disagree with where the chunk sits, its
        first token's `position` in its sequence (the container's parser asks). This default:
        parameters that say nothing of it."""

    def max_expansion(self, tokens: int, itemsize: int) -> int:
        """How many times its stored length a chunk of `tokens` tokens may decode to, when more
        than the container's 1024 (format-spec/container.md §5): 0, none. (pca: its smallest payload
        of a chunk still holds a side byte per row and channel, so it expands less than tokens x itemsize.)"""
        return 0

    def payload_stats(self, payload: memoryview, shape: tuple[int, ...],
                      params: dict[str, Any]) -> dict[str, Any] | None:
        """A breakdown of a payload's bits by part, for `inspect`; None when the codec has none."""
        return None

    def relays(self, params: dict[str, Any], target: dict[str, Any]) -> bool:
        """Whether a payload coded with `params` becomes one coded with `target` by `relay`: the
        same content in another layout, without decoding it to values (a lossy codec then rounds
        nothing twice). No codec but pca does."""
        return False

    def relay(self, payload: memoryview, shape: tuple[int, ...], dtype: str, params: dict[str, Any],
              target: dict[str, Any]) -> bytes:
        """The payload `target` gives the content of `payload` (coded with `params`; `relays`)."""
        raise NotImplementedError(f"{self.name} does not re-lay payloads")

    def expected_top1(self, params: dict[str, Any], num_layers: int) -> tuple[float, str] | None:
        """What a lossy codec promises a replay (top-1 agreement with a recompute, and why), for
        `verify --replay`'s default threshold; None when it documents no expectation."""
        return None

    def warm_up(self, device: "torch.device") -> None:
        """Pay one-time costs (kernel builds and loads) before anything is timed on `device`."""

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
