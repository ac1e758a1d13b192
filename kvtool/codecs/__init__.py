"""The codec table: stable names and ids, resolved in one place.

Ids are part of the format (format-spec/container.md, "Codec registry") and are
never reused: 0 raw, 1 zstd, 2 cachegen, 3 pca. The table is static: a codec's module is
imported the first time the codec is asked for, and nothing registers itself at import.
A codec whose module cannot load (a broken native build) is one line saying why.
"""

from __future__ import annotations

import importlib

from ..errors import CodecUnavailable, UnknownCodec
from .base import Codec

#: (id, name, module, class): the codecs of this build, in id order.
TABLE: tuple[tuple[int, str, str, str], ...] = (
    (0, "raw", ".raw", "RawCodec"),
    (1, "zstd", ".zstd", "ZstdCodec"),
    (2, "cachegen", ".cachegen", "CacheGenCodec"),
    (3, "pca", ".pca", "PcaCodec"),
)
_made: dict[int, Codec] = {}


def _did_you_mean(key: str | int) -> str:
    """' (did you mean cachegen?)' for a name one slip away from a codec's (difflib's ratio, as
    Python's own NameError suggestions do), else nothing."""
    import difflib

    if not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key.lower(), [name for _id, name, _m, _c in TABLE], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def get_codec(key: str | int) -> Codec:
    """The codec named `key` (its name, or its id in a file)."""
    entry = next((e for e in TABLE if (e[0] if isinstance(key, int) else e[1]) == key), None)
    if entry is None:
        known = ", ".join(f"{name} ({codec_id})" for codec_id, name, _module, _cls in TABLE)
        raise UnknownCodec(f"unknown codec {key!r}{_did_you_mean(key)}; this build knows {known}")
    codec_id, name, module, cls = entry
    codec = _made.get(codec_id)
    if codec is None:
        try:
            codec = getattr(importlib.import_module(module, __name__), cls)()
        except ImportError as err:
            raise CodecUnavailable(f"codec {name}: its module cannot load ({err}); reinstall kvtool "
                                   "(pip install -e .)") from None
        _made[codec_id] = codec
    return codec


def codec_names() -> list[str]:
    return [name for _codec_id, name, _module, _cls in TABLE]


__all__ = ["Codec", "TABLE", "codec_names", "get_codec"]
