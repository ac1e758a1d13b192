"""Codec registry: stable names and ids, resolved in one place.

Ids are part of the format (format-spec/container.md, "Codec registry") and are
never reused: 0 raw, 1 zstd, 2 cachegen.
"""

from __future__ import annotations

from .base import Codec
from ..errors import UnknownCodec

_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}


def register(codec: Codec) -> Codec:
    if codec.name in _BY_NAME or codec.codec_id in _BY_ID:
        raise RuntimeError(f"codec {codec.name}/{codec.codec_id} registered twice")
    _BY_NAME[codec.name] = codec
    _BY_ID[codec.codec_id] = codec
    return codec


def get_codec(key: str | int) -> Codec:
    _load_builtin()
    codec = _BY_ID.get(key) if isinstance(key, int) else _BY_NAME.get(key)
    if codec is None:
        known = ", ".join(f"{c.name} ({c.codec_id})" for c in _BY_ID.values())
        raise UnknownCodec(f"unknown codec {key!r}; this build knows {known}")
    return codec


def codec_names() -> list[str]:
    _load_builtin()
    return [c.name for c in sorted(_BY_ID.values(), key=lambda c: c.codec_id)]


_loaded = False


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import raw, zstd  # noqa: F401  (each module registers itself)

    try:
        from . import cachegen  # noqa: F401
    except ImportError:
        pass


__all__ = ["Codec", "register", "get_codec", "codec_names"]
