"""Codec 1, `zstd`: lossless Zstandard over byte planes.

With `shuffle: "byteplane"` (the default) the payload is the Zstandard frame of
the tensor's bytes regrouped by significance: every element's most significant
byte first, then the next, down to the least significant (for bf16/fp16: all
high bytes, then all low bytes). The exponent-carrying high bytes of KV values
are highly repetitive while the low mantissa bytes are nearly random, so
separating them lets the entropy coder see the redundancy (bench/RESULTS.md).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard

from ..dtypes import NUMPY_STORAGE, itemsize
from ..errors import CodecParamsInvalid, DecodeError
from .base import Codec
from .raw import tensor_bytes

if TYPE_CHECKING:
    import torch

SHUFFLES = ("byteplane", "none")


class ZstdCodec(Codec):
    name = "zstd"
    codec_id = 1
    params_version = 1
    lossless = True

    def default_params(self) -> dict[str, Any]:
        # Level 1, not zstd's usual 3: on shuffled KV it compresses better (1.47x vs 1.42x on
        # SmolLM2 bf16 KV) and about three times as fast (bench/bench_container.py, RESULTS §1).
        return {"version": 1, "level": 1, "shuffle": "byteplane"}

    def validate_params(self, params: Any) -> dict[str, Any]:
        params = self._check_version(params)
        self._reject_unknown_keys(self.name, params, {"version", "level", "shuffle"})
        for key in ("level", "shuffle"):  # the decoder needs shuffle; never guess it
            if key not in params:
                raise CodecParamsInvalid(f"zstd: codec parameters lack {key!r}")
        level = params["level"]
        if not isinstance(level, int) or isinstance(level, bool) or not -7 <= level <= 22:
            raise CodecParamsInvalid(f"zstd: level must be an integer in [-7, 22], got {level!r}")
        if params["shuffle"] not in SHUFFLES:
            raise CodecParamsInvalid(f"zstd: shuffle must be one of {', '.join(SHUFFLES)}, "
                                     f"got {params['shuffle']!r}")
        return params

    def encode_host(self, kv: "torch.Tensor", params: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        data = shuffle_planes(kv) if params["shuffle"] == "byteplane" else tensor_bytes(kv)
        return zstandard.ZstdCompressor(level=params["level"]).compress(data), params

    def decode_array(self, payload, shape, dtype, params) -> np.ndarray:
        """Streamed straight into the result (format-spec/container.md §5, memory): the frame is
        read a window at a time into the array, never as a whole in bytes of its own."""
        expected = math.prod(shape) * itemsize(dtype)
        try:
            frame = zstandard.frame_content_size(payload)
        except zstandard.ZstdError as err:
            raise DecodeError(f"zstd payload is not a zstd frame ({err})") from None
        if frame not in (expected, -1):  # -1: size not recorded (other writers)
            raise DecodeError(f"zstd frame holds {frame} bytes, shape needs {expected}")
        out = np.empty(shape, dtype=NUMPY_STORAGE[dtype])
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(payload, read_across_frames=False)
            if params["shuffle"] == "byteplane":
                _read_planes(reader, out, itemsize(dtype), expected)
            else:
                _read_exactly(reader, memoryview(out.reshape(-1).view(np.uint8)), expected)
            if reader.read(1):  # (also reads the frame's end: its checksum is checked here)
                raise DecodeError(f"zstd payload decodes to more than the {expected} bytes the shape needs")
            if frame_length(payload) != payload.nbytes:
                raise DecodeError("zstd payload has bytes after its frame")
        except zstandard.ZstdError as err:
            raise DecodeError(f"zstd payload is corrupt ({err})") from None
        return out


#: A byte plane is decoded this many bytes at a time, then spread into its elements: the window
#: is all a decode holds beside its result.
PLANE_WINDOW = 4 << 20


def _read_exactly(reader, into: memoryview, expected: int, before: int = 0) -> None:
    """Fill `into` from the frame (`before` bytes of it read already), or DecodeError saying how
    many bytes it held."""
    done = 0
    while done < into.nbytes:
        got = reader.readinto(into[done:])
        if not got:
            raise DecodeError(f"zstd payload decoded to {before + done} bytes, shape needs {expected}")
        done += got


def _read_planes(reader, out: np.ndarray, k: int, expected: int) -> None:
    """The inverse of `shuffle_planes`, a window of a plane at a time: plane p (byte k - 1 - p of
    every element) spread into `out`."""
    n = out.size
    elements = out.reshape(-1).view(np.uint8).reshape(n, k)  # [n, k], writes into `out`
    window = np.empty(min(n, PLANE_WINDOW), dtype=np.uint8)
    for p in range(k):
        for start in range(0, n, window.size):
            part = window[:min(window.size, n - start)]
            _read_exactly(reader, memoryview(part), expected, before=p * n + start)
            elements[start:start + part.size, k - 1 - p] = part


def frame_length(payload) -> int:
    """The bytes of the Zstandard frame that `payload` starts with (RFC 8878 §3.1.1: its header,
    its blocks, its checksum), of a frame that decoded: a streamed decode stops at the frame's end
    and would not see bytes after it. zstandard says no frame's size, only its header's."""
    data = memoryview(payload).cast("B")
    at = zstandard.frame_header_size(data)
    has_checksum = data[4] & 0x04  # Frame_Header_Descriptor: Content_Checksum_flag
    last = False
    while not last:
        if at + 3 > data.nbytes:
            return data.nbytes + 1  # (cannot happen after a decode: the frame ended)
        header = int.from_bytes(data[at:at + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        at += 3 + (1 if kind == 1 else size)  # an RLE block holds one byte, others `size`
    return at + (4 if has_checksum else 0)


def shuffle_planes(t: "torch.Tensor") -> memoryview:
    """Regroup bytes: plane 0 = most significant byte of every element, and so on."""
    import torch

    k = t.element_size()
    elements = t.contiguous().view(torch.uint8).numpy().reshape(-1, k)  # [n, k]; column k-1 is most significant
    planes = np.empty((k, elements.shape[0]), dtype=np.uint8)  # [k, n]
    for p in range(k):  # strided column copies: ~3 GB/s, 20x faster than a transpose
        planes[p] = elements[:, k - 1 - p]
    return memoryview(planes.reshape(-1))
