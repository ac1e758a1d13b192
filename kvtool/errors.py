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


def shown(value: object, limit: int = 40) -> str:
    """A value a user or a file gave, as a message shows it: its repr (control characters escaped),
    cut short; of any size or type (an int past 4,300 digits has no repr at all: Python refuses)."""
    if type(value) is int and value.bit_length() > 128:
        return f"(an integer of {value.bit_length()} bits)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --- usage ------------------------------------------------------------------


class UsageError(KvtoolError):
    """Bad arguments or options (wrong combination, bad value)."""


class InputFileError(KvtoolError):
    """An input path is missing, unreadable or not a regular file."""


class OutputError(KvtoolError):
    """An output path cannot be written (a directory, no permission, read-only disk)."""


class OutOfMemory(KvtoolError):
    """An allocation the work needs failed (host or device memory)."""


class Interrupted(KvtoolError):
    """Ctrl-C, SIGTERM or SIGHUP: the work stopped; outputs being written were removed."""

    exit_code = 130


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


class CodecUnavailable(KvtoolError):
    """A codec of this build whose module cannot be loaded (a broken or missing native build)."""


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


class DecoderMemoryExceeded(DecodeError):
    """A payload declares more decoder working memory than its stored length allows
    (format-spec/cachegen.md section 8: the frequency tables' budget); refused before decoding."""


class ShapeMismatch(DataError):
    """A blob decoded to a shape or dtype other than the one declared."""


class NonFiniteValues(DataError):
    """Decoded KV holds NaN or infinity."""


class PaddingNotZero(DataError):
    """Bytes that no blob covers are not zero (format-spec/container.md section 2.3; `verify` reports it)."""


class PrefixHashMismatch(DataError):
    """A chunk's recorded prefix hash differs from the hash of the token ids (`verify` reports it)."""


class VerificationFailed(DataError):
    """`verify` found problems (checksums, decoding, prefix hashes, tolerances, replay thresholds).

    `report` is the full result (rendered before the error line); `problems` its findings."""

    def __init__(self, message: str, report=None, problems: list[str] | None = None):
        super().__init__(message)
        self.report = report
        self.problems = list(problems or [])


class ToleranceExceeded(DataError):
    """A replay fell below `--min-top1` or above `--max-kl`; `report` is the replay's result."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


# --- models -------------------------------------------------------------------


class ModelError(KvtoolError):
    """A model folder is missing, unreadable, or of an unsupported architecture."""


class ModelMismatch(KvtoolError):
    """A KV file was made by a different model than the one given."""


class UnsupportedCache(ModelError):
    """A model (or a cache object) whose KV cache is not plain K/V per layer for every token:
    linear attention or a recurrent state, multi-head latent attention, layers that share KV,
    sliding-window layers that dropped tokens, a batch of several sequences. The message says which."""


class NotAPrefixCache(UsageError):
    """A segment file whose keys are rotated for positions other than 0 (format-spec/segment.md
    §1) used as a prefix cache (replay FILE, store put): its KV belongs elsewhere; blend it."""


class RopeMismatch(ModelMismatch):
    """Cached keys were rotated with other RoPE settings (theta, scaling) than the model's:
    re-encoding them to new positions would give wrong keys, so a blend refuses them."""


class PromptError(KvtoolError):
    """Empty prompt, one longer than the model's context, or token ids outside the vocabulary."""


# --- engines and devices --------------------------------------------------------


class ConnectorError(KvtoolError, ValueError):
    """Bad arguments to a connector: missing kwargs, wrong memory object, bad slot
    mapping or token range, buffers of the wrong layout (a ValueError, as LMCache's
    connector contract says)."""


class CudaUnavailable(KvtoolError):
    """A CUDA kernel cannot be used here (no GPU, no nvcc, a failed build); the reason is
    the message. Code that has a CPU path catches it and says so in one notice."""


# --- the chunk store (format-spec/store.md) ----------------------------------------


class StoreError(KvtoolError):
    """Base for the chunk store's failures."""


class StoreUrlInvalid(StoreError):
    """A --store URL kvtool does not understand (not a path, file:// or redis://)."""


class NotAStore(StoreError):
    """A folder given as a store holds other files and no kvtool store marker."""


class StoreUnavailable(StoreError):
    """The store's server cannot be reached, or went away and did not come back in time."""


class StoreAccessDenied(StoreError):
    """The store's server answered and refused us: a wrong user name or password, or an ACL that
    does not let this user run the command or touch the key (never retried: it would not change)."""


class NotCached(StoreError):
    """Nothing the store holds covers the request (e.g. `store get` of a prompt never stored)."""

    exit_code = 1


class ObjectRefused(DataError):
    """A stored object failed a check of format-spec/store.md §5 (damaged, foreign, truncated,
    hostile). The store never returns it: it counts as a miss, and `fsck` removes it."""


class ObjectUnreadable(StoreError):
    """A stored object that cannot be read here (no permission, an I/O error): nothing is known
    of its bytes. A load counts a miss and says so once; `fsck` reports it and leaves it (it may
    be another user's, intact)."""

    exit_code = 1


class StoreDamaged(DataError):
    """`store fsck --no-repair` found damaged or foreign objects and left them; `report` is
    the fsck result (rendered before the error line)."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
