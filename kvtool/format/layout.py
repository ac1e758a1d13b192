"""Fixed-size structures of the container: header, trailer, limits.

Mirrors format-spec/container.md section by section; change both together.
All integers are little-endian.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import BadHeader, BadTrailer, NotAKvtoolFile, TruncatedFile, UnsupportedVersion

MAGIC = b"\x89KVC\r\n\x1a\n"  # PNG-style: catches text-mode and 7-bit transfers
END_MAGIC = b"\x89KVCEND\n"
VERSION_MAJOR = 1
VERSION_MINOR = 1  # the newest minor version this reader knows (1.1: the mla_latent layout kind)
SUPPORTED_MAJOR_VERSIONS = (1,)

# struct Header { u8 magic[8]; u16 major; u16 minor; u32 header_size;
#                 u32 alignment; u32 flags; u8 reserved[40]; }   // 64 bytes
HEADER_STRUCT = struct.Struct("<8sHHIII40s")
HEADER_SIZE = HEADER_STRUCT.size
# struct Trailer { u64 manifest_offset; u64 manifest_length; u32 manifest_crc32;
#                  u32 reserved; u8 end_magic[8]; }                // 32 bytes
TRAILER_STRUCT = struct.Struct("<QQII8s")
TRAILER_SIZE = TRAILER_STRUCT.size

# The layout kinds of a chunk (container.md section 3.2), each with the minor version that brought
# it: a writer writes the least version that holds its file, so a K/V file stays a 1.0 file.
KV_BLOB = "kv_blob"  # [2, layers, tokens, kv_heads * head_dim]: K then V
MLA_LATENT = "mla_latent"  # [1, layers, tokens, kv_lora_rank + rope_dim]: one latent per token and layer
LAYOUT_MINOR = {KV_BLOB: 0, MLA_LATENT: 1}
LAYOUT_PLANES = {KV_BLOB: 2, MLA_LATENT: 1}  # the leading dimension of a chunk

DEFAULT_ALIGNMENT = 4096  # page size and the common direct-I/O block size
MIN_ALIGNMENT = 64  # a cache line; keeps every dtype naturally aligned
MAX_ALIGNMENT = 1 << 20
MANIFEST_ALIGNMENT = 8

# Limits a reader enforces before allocating anything.
MAX_MANIFEST_BYTES = 64 << 20
MAX_TOKENS = 1 << 24
MAX_CHUNK_SIZE = 1 << 16
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_CHUNK_DECODED_BYTES = 4 << 30
MAX_EXPANSION = 1024  # decoded bytes may exceed stored bytes by at most this factor
EXPANSION_SLACK = 1 << 20
# What a manifest may list, so that any file is judged in seconds and memory near its size
# (format-spec/container.md section 5; the revision of 1.0 of 2026-11-26).
MAX_CHUNKS = 1 << 16  # chunk entries: MAX_TOKENS at the default 256 tokens a chunk
MAX_JSON_SEPARATORS = 48 * MAX_CHUNKS  # `,` and `:` outside strings: a chunk entry has 25-38
MAX_FREE_FORM_VALUES = 1 << 16  # JSON values in `model`, `metadata` and unknown top-level keys


def align_up(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Header:
    major: int = VERSION_MAJOR
    minor: int = VERSION_MINOR
    alignment: int = DEFAULT_ALIGNMENT
    flags: int = 0

    def pack(self) -> bytes:
        return HEADER_STRUCT.pack(MAGIC, self.major, self.minor, HEADER_SIZE,
                                  self.alignment, self.flags, bytes(40))

    @classmethod
    def unpack(cls, data: bytes) -> "Header":
        if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
            if len(data) < len(MAGIC) and MAGIC.startswith(data):
                raise TruncatedFile(f"file is {len(data)} bytes, shorter than the kvtool header")
            raise NotAKvtoolFile("not a kvtool file (wrong magic bytes)")
        if len(data) < HEADER_SIZE:
            raise TruncatedFile(f"file is {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header")
        _, major, minor, header_size, alignment, flags, reserved = HEADER_STRUCT.unpack(
            data[:HEADER_SIZE])
        if major not in SUPPORTED_MAJOR_VERSIONS:
            raise UnsupportedVersion(
                f"file format version {major}.{minor} is not supported "
                f"(this reader reads major version(s) {', '.join(map(str, SUPPORTED_MAJOR_VERSIONS))})")
        if header_size != HEADER_SIZE:
            raise BadHeader(f"header size {header_size} is not {HEADER_SIZE}")
        if not (MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT) or alignment & (alignment - 1):
            raise BadHeader(f"blob alignment {alignment} is not a power of two in "
                            f"[{MIN_ALIGNMENT}, {MAX_ALIGNMENT}]")
        if flags != 0:
            raise BadHeader(f"header flags {flags:#x} are not defined in version {major}")
        if reserved != bytes(40):
            raise BadHeader("reserved header bytes are not zero")
        return cls(major=major, minor=minor, alignment=alignment, flags=flags)


@dataclass(frozen=True)
class Trailer:
    manifest_offset: int
    manifest_length: int
    manifest_crc32: int

    def pack(self) -> bytes:
        return TRAILER_STRUCT.pack(self.manifest_offset, self.manifest_length,
                                   self.manifest_crc32, 0, END_MAGIC)

    @classmethod
    def unpack(cls, data: bytes, file_size: int) -> "Trailer":
        if file_size < HEADER_SIZE + TRAILER_SIZE:
            raise TruncatedFile(f"file is {file_size} bytes, too short to hold header and trailer")
        offset, length, crc, reserved, end_magic = TRAILER_STRUCT.unpack(data)
        if end_magic != END_MAGIC:
            raise TruncatedFile("file has no trailer (truncated, or still being written)")
        if reserved != 0:
            raise BadTrailer("reserved trailer field is not zero")
        if length > MAX_MANIFEST_BYTES:
            from ..errors import ManifestTooLarge

            raise ManifestTooLarge(
                f"manifest of {length} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
        if offset < HEADER_SIZE:
            raise BadTrailer(f"manifest offset {offset} lies inside the {HEADER_SIZE}-byte header")
        if offset % MANIFEST_ALIGNMENT:
            raise BadTrailer(f"manifest offset {offset} is not a multiple of {MANIFEST_ALIGNMENT}")
        if offset + length + TRAILER_SIZE != file_size:
            raise BadTrailer(
                f"manifest range [{offset}, {offset + length}) does not end where the trailer "
                f"begins ({file_size - TRAILER_SIZE})")
        return cls(offset, length, crc)
