"""The `segment` manifest key (format-spec/segment.md): a file holding a position-independent
segment's KV, and the positions its keys were rotated at."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ManifestInvalid, MissingField, UnsupportedVersion
from . import layout

SEGMENT_KEY = "segment"
SEGMENT_VERSION = 1
_KEYS = ("version", "stored_start")


@dataclass(frozen=True)
class SegmentInfo:
    """`segment.stored_start`: token i of the file had position stored_start + i."""

    stored_start: int = 0
    version: int = SEGMENT_VERSION

    def to_json(self) -> dict[str, int]:
        return {"version": self.version, "stored_start": self.stored_start}


def segment_extension(stored_start: int = 0) -> dict[str, Any]:
    """The `extensions` a ContainerWriter needs to mark its file a segment."""
    if isinstance(stored_start, bool) or not isinstance(stored_start, int) or stored_start < 0:
        raise ManifestInvalid(f"segment.stored_start must be an integer >= 0, got {stored_start!r}")
    return {SEGMENT_KEY: SegmentInfo(stored_start).to_json()}


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_segment(extensions: dict[str, Any], num_tokens: int) -> SegmentInfo | None:
    """The file's segment key, checked as segment.md section 1 says (None: not a segment)."""
    if SEGMENT_KEY not in extensions:
        return None
    seg = extensions[SEGMENT_KEY]
    if not isinstance(seg, dict):
        raise ManifestInvalid("manifest: segment must be an object")
    unknown = sorted(set(seg) - set(_KEYS))
    if unknown:
        raise ManifestInvalid(f"manifest: segment holds the undefined key {unknown[0]!r}")
    for key in _KEYS:
        if key not in seg:
            raise MissingField(f"manifest: segment lacks the required key {key!r}")
    version, start = seg["version"], seg["stored_start"]
    if not _integer(version) or version < 1:
        raise ManifestInvalid(f"manifest: segment.version must be an integer >= 1, got {version!r}")
    if version > SEGMENT_VERSION:
        raise UnsupportedVersion(f"segment version {version} is newer than this reader's ({SEGMENT_VERSION})")
    if not _integer(start) or not 0 <= start <= layout.MAX_TOKENS - num_tokens:
        raise ManifestInvalid(f"manifest: segment.stored_start = {start!r} is not an integer in "
                              f"[0, {layout.MAX_TOKENS - num_tokens}]")
    return SegmentInfo(stored_start=start, version=version)
