"""Every failure kvtool knows about, one class each.

The CLI turns any `KvtoolError` into one line on stderr and `exit_code` (see
`kvtool/cli/app.py`). Exit codes follow `kvtool verify`'s contract:
1 = the data is wrong (checksums, decoded values, tolerances),
2 = usage errors or input that cannot be read as a kvtool file at all.
"""

from __future__ import annotations


class KvtoolError(Exception):
    """Base class. `str(err)` is the one-line message shown to users."""

    exit_code = 2


# --- usage ------------------------------------------------------------------


class UsageError(KvtoolError):
    """Bad arguments or options (wrong combination, bad value)."""


class InputFileError(KvtoolError):
    """An input path is missing, unreadable or not a regular file."""


class OutputError(KvtoolError):
    """An output path cannot be written (a directory, no permission, read-only disk)."""


# --- container structure (exit 2: the file cannot be read) -------------------


class FormatError(KvtoolError):
    """Base for every way a file fails to be a readable kvtool container."""


class NotAKvtoolFile(FormatError):
    """The leading magic bytes are wrong."""


class UnsupportedVersion(FormatError):
    """The file's major version is one this reader does not know."""


class TruncatedFile(FormatError):
    """The file is shorter than its header, trailer or manifest require."""


class BadHeader(FormatError):
    """The fixed header has impossible values (size, alignment, flags)."""


class BadTrailer(FormatError):
    """The trailer's fields are impossible (a missing end magic is TruncatedFile)."""


class ManifestTooLarge(FormatError):
    """The manifest is larger than the format's cap."""


class ManifestCorrupt(FormatError):
    """The manifest bytes fail their checksum or are not UTF-8 JSON."""


class ManifestInvalid(FormatError):
    """The manifest is JSON but breaks the schema (types, ranges, consistency)."""


class MissingField(ManifestInvalid):
    """A required manifest key is absent."""


class DuplicateField(ManifestInvalid):
    """A JSON object in the manifest repeats a key."""


class BlobOutOfBounds(FormatError):
    """A blob's offset/length points outside the data region of the file."""


class BlobOverlap(FormatError):
    """Two blobs share bytes, or a blob breaks the alignment rule."""


class UnknownCodec(FormatError):
    """A chunk names a codec id this build does not implement (an id/name clash is ManifestInvalid)."""


class CodecParamsInvalid(FormatError):
    """A codec's parameters are missing, of the wrong type, or of an unknown version."""


class UnsupportedDtype(FormatError):
    """A dtype outside bfloat16 / float16 / float32 (the KV dtypes v1 allows)."""


# --- data integrity (exit 1: the file is readable but its data is wrong) ------


class DataError(KvtoolError):
    exit_code = 1


class ChecksumMismatch(DataError):
    """Stored bytes do not match their recorded CRC-32."""


class DecodeError(DataError):
    """A codec could not decode a blob (corrupt or truncated stream)."""


class ShapeMismatch(DataError):
    """A blob decoded to a shape or dtype other than the one declared."""


class NonFiniteValues(DataError):
    """Decoded KV holds NaN or infinity."""


class PrefixHashMismatch(DataError):
    """A chunk's recorded prefix hash differs from the hash of the token ids."""


class ToleranceExceeded(DataError):
    """A comparison (`verify --against`, replay thresholds) fell outside tolerance."""


# --- models -------------------------------------------------------------------


class ModelError(KvtoolError):
    """A model folder is missing, unreadable, or of an unsupported architecture."""


class ModelMismatch(KvtoolError):
    """A KV file was made by a different model than the one given."""


class PromptError(KvtoolError):
    """Empty prompt, or one longer than the model's context."""
