"""A pca payload's coefficients re-laid in another bitstream layout, nothing decoded to values.

Versions 1 and 2 of pca's bitstream (format-spec/pca.md §11) code the same coefficients with the
same side bytes; only the entropy coding's layout differs (version 1's `lanes` per row, version
2's independent units of `unit` symbols). So a chunk moves from one layout to another by reading
its coefficients and coding them again: no transform, no second rounding (decoding to values and
encoding those would quantize twice: a few coefficients a chunk move), and this step reads no
calibration object. The bytes are those the writer gives the same coefficients in the target
layout, so those kvtool writes from the same KV wherever §11.5's RoPE tables equal libm's
(every position below 131,072 for the bases and head sizes measured; pca.md §11.7).

The pure references do the work (numpy: 27-33x slower than the native coder's decode and
encode): `compress` calls this for pca chunks it would otherwise decode and encode again.
"""

from __future__ import annotations

from typing import Any

from . import reference, reference2

#: the parameters that name the coefficients: a chunk re-laid keeps them (the layout's may change)
SAME_COEFFICIENTS = ("calibration", "step", "quality", "sinks", "position")


def can_relay(source: dict[str, Any], target: dict[str, Any]) -> bool:
    """Whether a chunk coded with (validated) `source` parameters becomes one coded with `target`
    by re-laying its coefficients: the same coefficients, another layout."""
    return source != target and all(source.get(key) == target.get(key) for key in SAME_COEFFICIENTS)


def relay(payload: bytes | memoryview, shape: tuple[int, ...], dtype: str, source: dict[str, Any],
          target: dict[str, Any]) -> bytes:
    """The payload of `target`'s layout holding `payload`'s coefficients and sink tokens (both
    parameter sets validated and `can_relay`). Every check a reader makes of the source's
    coefficients is made (DecodeError); its header was checked against `source` by the caller."""
    if source["version"] == 1:
        sink, q = reference.decode_coefficients(payload, shape, dtype)
    else:
        layout, q = reference2.decode_coefficients(payload, shape, dtype)
        sink = reference2.sink_tokens(payload, layout)
    if target["version"] == 1:
        return reference.encode_coefficients(q, sink, dtype, target["lanes"])
    return reference2.encode_coefficients(q, sink, dtype, target["unit"])
