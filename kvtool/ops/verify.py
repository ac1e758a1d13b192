"""`verify`: prove a file is intact (structure, every checksum, decoding, finiteness,
prefix hashes, fingerprint), optionally against a reference file and by a replay.

Everything but `replay` runs in numpy: verifying a file needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import count_nonfinite, to_float64
from ..errors import (ChecksumMismatch, DataError, KvtoolError, ManifestInvalid, ModelMismatch, NonFiniteValues,
                      PaddingNotZero, PrefixHashMismatch, ToleranceExceeded, UnsupportedVersion,
                      VerificationFailed)
from ..format.layout import VERSION_MAJOR, VERSION_MINOR
from ..format import ContainerReader
from ..format.hashing import crc32, prefix_hashes
from ..format.made_by import check_vocabulary
from ..identity import model_fingerprint
from .file_requests import VerifyRequest
from .inputs import model_dtype_name
from .result import Result
from .windows import count_nonfinite_windowed, kv_windows


#: A report names at most this many problems and counts the rest (`problems_omitted`): a hostile
#: file of 65,536 chunks may have two problems each, and 15 MB of them said nothing more
#: (format-spec/container.md §5, output limits).
MAX_LISTED_PROBLEMS = 100


@dataclass
class VerifyReport(Result):
    path: str
    num_chunks: int
    num_tokens: int
    checks: dict[str, str]
    chunks: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)  # the first MAX_LISTED_PROBLEMS
    replay_threshold: dict[str, Any] | None = None  # with replay: the top-1 threshold applied, and why
    problem_types: list[str] = field(default_factory=list)  # the error class of each problem listed
    comparison: dict[str, Any] | None = None
    replay: dict[str, Any] | None = None
    problems_omitted: int = 0  # problems found past the first MAX_LISTED_PROBLEMS, counted only

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def problem_count(self) -> int:
        return len(self.problems) + self.problems_omitted

    def add(self, problem: KvtoolError) -> None:
        if len(self.problems) >= MAX_LISTED_PROBLEMS:
            self.problems_omitted += 1
            return
        self.problems.append(str(problem))
        self.problem_types.append(type(problem).__name__)


def verify(path: str | Path | VerifyRequest, *, on_stage: Callable[[str], None] | None = None,
           on_chunk: Callable[[int, int], None] | None = None, **options: Any) -> VerifyReport:
    """Every check `kvtool verify` makes: a `VerifyRequest`, or its fields. With `check` (the
    default) problems raise VerificationFailed carrying the report; without, the report says them
    (`.ok`, `.problems`)."""
    request = path if isinstance(path, VerifyRequest) else VerifyRequest(path, **options)
    with ContainerReader(request.path) as reader:
        report = check_file(reader, on_chunk=on_chunk)
        if request.against is not None and not report.problems:  # a damaged file is not compared
            with ContainerReader(request.against) as other:
                try:
                    report.comparison = compare_files(reader, other, atol=request.atol, rtol=request.rtol)
                except DataError as err:  # the reference itself is damaged
                    report.add(type(err)(f"{request.against}: {err}"))
            if report.comparison is not None and not report.comparison["ok"]:
                report.add(ToleranceExceeded(f"decoded KV differs from {request.against} beyond tolerance"))
    if request.replay and not report.problems:
        _replay(request, report, on_stage)
    if request.check and report.problems:
        more = f" (and {report.problem_count - 1} more)" if report.problem_count > 1 else ""
        raise VerificationFailed(f"verify failed: {report.problems[0]}{more}", report=report,
                                 problems=report.problems)
    return report


# A lossless file replayed on another device or dtype than it was captured with: the model's last
# bits differ, so near-ties may flip; held to the level of CacheGen's finest bins.
LOSSLESS_ELSEWHERE_TOP1 = 0.88


def expected_top1(reader: ContainerReader, device: str | None = None,
                  model_dtype: str | None = None) -> tuple[float, str]:
    """The top-1 agreement a replay of this file should reach, from what its codecs promise:
    lossless chunks reproduce the recompute exactly (when the replay runs the model as the
    capture did: same device and dtype; else the last bits differ and near-ties may flip);
    CacheGen keeps what the RD benchmark measured for its bins (the weakest chunk decides)."""
    from .. import codecs

    made = reader.manifest.metadata
    if (device, model_dtype) == (made.get("device", device), made.get("model_dtype", model_dtype)):
        expected, why = 1.0, "lossless: the recompute exactly"
    else:
        expected, why = LOSSLESS_ELSEWHERE_TOP1, (f"lossless, but captured on {made.get('device')} "
                                              f"({made.get('model_dtype')}): the model's last bits differ")
    for chunk in reader.chunks:
        codec = codecs.get_codec(chunk.codec_id)
        if codec.lossless:
            continue
        promise = codec.expected_top1(chunk.codec_params, reader.manifest.num_layers)
        if promise is None:  # a lossy codec that documents no expectation: nothing to hold it to
            return 0.0, f"{codec.name}: no documented expectation"
        if promise[0] < expected:
            expected, why = promise
    return expected, why


def _replay(request: VerifyRequest, report: VerifyReport, on_stage: Callable[[str], None] | None) -> None:
    """`--replay`: the file replayed and compared with a full recompute, held to `min_top1` (by
    default what its codecs promise: `expected_top1`); what fails is the report's problem."""
    from .replay import replay  # (torch: only for --replay)

    min_top1 = request.min_top1
    if min_top1 is None:
        from ..devices import describe, resolve_device

        with ContainerReader(request.path) as reader:
            min_top1, why = expected_top1(reader, describe(resolve_device(request.device)),
                                          model_dtype_name(request.model_dtype))
    else:
        why = "given (--min-top1)"
    report.replay_threshold = {"min_top1": min_top1, "why": why}
    try:
        result = replay(request.path, request.model, continue_tokens=request.continue_tokens, compare=True,
                        min_top1=min_top1, max_kl=request.max_kl, device=request.device,
                        model_dtype=request.model_dtype, on_stage=on_stage,
                        allow_other_weights=request.allow_other_weights)
    except ToleranceExceeded as err:
        result = err.report
    report.replay = result.to_dict()
    for failure in result.failures:
        report.add(ToleranceExceeded(f"replay: {failure}"))


def check_file(reader: ContainerReader, on_chunk: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Run every check on an open file; collect problems instead of stopping at the first one.
    `on_chunk(done, total)` reports progress."""
    m = reader.manifest
    report = VerifyReport(path=str(reader.path), num_chunks=len(m.chunks), num_tokens=m.num_tokens,
                          checks={"structure": "ok"}, chunks=[])
    checks, problem = report.checks, report.add
    if (reader.header.major, reader.header.minor) > (VERSION_MAJOR, VERSION_MINOR):
        checks["version"] = "NEWER"
        problem(UnsupportedVersion(f"format {reader.version} is newer than this verifier's "
                                   f"{VERSION_MAJOR}.{VERSION_MINOR}: it may hold what kvtool cannot check"))
    try:
        padding = reader.nonzero_padding()
    except KvtoolError as err:  # the file ends inside the padding (cut short since it was opened)
        padding = []
        checks["padding"] = "BAD"
        problem(err)
    else:
        checks["padding"] = "BAD" if padding else "ok"
    for start, end in padding[:3]:
        problem(PaddingNotZero(f"bytes [{start}, {end}) cover no blob and are not zero"))
    tokens = None
    try:
        tokens = reader.token_ids()
        checks["token_ids"] = "ok"
        check_vocabulary(tokens, m.model.get("vocab_size"))
    except KvtoolError as err:
        checks["token_ids"] = "BAD"
        problem(err)
    if model_fingerprint({k: v for k, v in m.model.items() if k != "fingerprint"}) == m.model["fingerprint"]:
        checks["fingerprint"] = "ok"
    else:
        checks["fingerprint"] = "BAD"
        problem(ManifestInvalid("model fingerprint does not match the recorded model identity"))
    expected_hashes = prefix_hashes(tokens, m.chunk_size) if tokens is not None else None
    for c in m.chunks:
        status = {"index": c.index, "checksum": "ok", "decode": "ok", "finite": "ok", "prefix_hash": "ok"}
        if expected_hashes is not None and expected_hashes[c.index] != c.prefix_hash:
            status["prefix_hash"] = "BAD"
            problem(PrefixHashMismatch(f"chunk {c.index}: prefix hash does not match the token ids"))
        elif expected_hashes is None:
            status["prefix_hash"] = "unchecked"
        payload = _intact(reader, c.blob, f"chunk {c.index}", problem)
        if payload is None:
            status.update(checksum="BAD", decode="skipped", finite="skipped")
        else:
            try:
                bad = count_nonfinite_windowed(reader.decode_chunk_array(c.index, payload), c.dtype)
                if bad:
                    status["finite"] = "BAD"
                    problem(NonFiniteValues(f"chunk {c.index}: {bad} non-finite value(s)"))
            except KvtoolError as err:
                status.update(decode="BAD", finite="skipped")
                problem(err)
        del payload  # (a chunk's bytes: not kept while the next one is read)
        report.chunks.append(status)
        if on_chunk is not None:
            on_chunk(c.index + 1, len(m.chunks))
    for name, e in m.extras.items():
        data = _intact(reader, e.blob, f"extra {name}", problem)
        if data is None:
            checks[f"extra:{name}"] = "BAD"
            continue
        try:
            values = reader.decode_extra_array(name, data)  # roi_mask: bytes other than 0/1 are a DecodeError
            bad = 0 if values.dtype == np.bool_ else count_nonfinite(values, e.dtype)
        except KvtoolError as err:
            checks[f"extra:{name}"] = "BAD"
            problem(type(err)(f"extra {name}: {err}"))
            continue
        checks[f"extra:{name}"] = "BAD" if bad else "ok"
        if bad:
            problem(NonFiniteValues(f"extra {name}: {bad} non-finite value(s)"))
    for digest, blob in m.calibrations.items():  # carried pca calibration objects (pca.md §3.3)
        data = _intact(reader, blob, f"calibration {digest[:16]}...", problem)
        checks[f"calibration:{digest[:16]}"] = "BAD" if data is None else "ok"
        if data is not None:
            from ..codecs.pca.calibration import from_bytes

            try:
                from_bytes(bytes(data), expect_digest=digest)
            except KvtoolError as err:
                checks[f"calibration:{digest[:16]}"] = "BAD"
                problem(type(err)(f"calibration {digest[:16]}...: {err}"))
    return report


def _intact(reader: ContainerReader, blob, what: str, problem: Callable[[KvtoolError], None]):
    """The blob's stored bytes, read once (with pread: a file cut short meanwhile is refused,
    not a SIGBUS) and checked; None, with the problem said, when they are gone or corrupt."""
    try:
        data = reader.blob_bytes(blob, verify=False, what=what)
    except KvtoolError as err:  # the file ends inside it
        problem(err)
        return None
    if crc32(data) != blob.crc32:
        problem(ChecksumMismatch(f"{what}: CRC-32C mismatch (stored bytes are corrupt)"))
        return None
    return data


@np.errstate(invalid="ignore", over="ignore", divide="ignore")  # NaN/inf KV: compared as such, not warned
def compare_files(reader: ContainerReader, other: ContainerReader, *, atol: float,
                  rtol: float) -> dict[str, Any]:
    """Per-layer max abs / relative error of `reader` against the reference `other`."""
    a, b = reader.manifest, other.manifest
    if (a.planes, a.num_layers, a.hidden_kv) != (b.planes, b.num_layers, b.hidden_kv):
        raise ModelMismatch(f"cannot compare: {reader.path} has {a.num_layers} layers x {a.hidden_kv} "
                            f"channels, {other.path} has {b.num_layers} x {b.hidden_kv}")
    if a.num_tokens != b.num_tokens or not np.array_equal(reader.token_ids(), other.token_ids()):
        raise ModelMismatch(f"cannot compare: {reader.path} and {other.path} hold different token sequences")
    max_abs = np.zeros((a.planes, a.num_layers))  # a.planes: K and V, or an mla_latent file's one latent
    ref_max = np.zeros((a.planes, a.num_layers))
    sq_err = np.zeros((a.planes, a.num_layers))
    for start in range(0, a.num_tokens, a.chunk_size):
        end = min(start + a.chunk_size, a.num_tokens)
        x = read_range_array(reader, start, end)
        y = read_range_array(other, start, end)  # [2, L, T, C], each file's dtype
        for layers, tokens in kv_windows(x.shape):  # float64 a window at a time, not the chunk (8x it)
            xw = to_float64(x[:, layers, tokens], a.kv_dtype)
            yw = to_float64(y[:, layers, tokens], b.kv_dtype)
            err = np.abs(xw - yw)
            max_abs[:, layers] = np.maximum(max_abs[:, layers], err.max(axis=(2, 3)))
            ref_max[:, layers] = np.maximum(ref_max[:, layers], np.abs(yw).max(axis=(2, 3)))
            sq_err[:, layers] += (err * err).sum(axis=(2, 3))
    rmse = np.sqrt(sq_err / (a.num_tokens * a.hidden_kv))
    rel = max_abs / np.maximum(ref_max, 1e-30)
    within = max_abs <= atol + rtol * ref_max
    layers = [{"kind": ("KV" if a.planes == 2 else "L")[k], "layer": l, "max_abs": float(max_abs[k, l]), "max_rel": float(rel[k, l]),
               "rmse": float(rmse[k, l]), "ok": bool(within[k, l])}
              for l in range(a.num_layers) for k in range(a.planes)]
    return {"against": str(other.path), "atol": atol, "rtol": rtol, "ok": bool(within.all()),
            "max_abs": float(max_abs.max()), "max_rel": float(rel.max()), "layers": layers}


def read_range_array(reader: ContainerReader, start: int, end: int) -> np.ndarray:
    """KV_BLOB [2, L, end - start, C] of tokens [start, end) in the file's numpy storage, decoding
    only the chunks it touches (one chunk's range: a view of it, not a copy)."""
    size = reader.manifest.chunk_size
    parts = []
    for i in range(start // size, (end - 1) // size + 1):
        c = reader.chunks[i]
        parts.append(reader.read_chunk_array(i)[:, :, max(start, c.start) - c.start:min(end, c.end) - c.start])
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2)
