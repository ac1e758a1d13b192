"""What users hand the operations, checked once: prompts and token files, token ids against
a vocabulary, index sets, regions of interest, codec options, model dtypes and devices.

An operation's request (`ReplayRequest`, `BlendRequest`, `CaptureRequest`) calls these when it
is made, before anything is opened or loaded; its steps then trust what it holds."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..errors import InputFileError, PromptError, UnsupportedDtype, UsageError, shown
from ..fsutil import read_text_file

MODEL_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
                "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def check_text(text: str, what: str) -> str:
    """`text` if it is valid Unicode (a command-line argument of undecodable bytes is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PromptError(f"{what}: not valid UTF-8 text") from None
    return text


def continuation(tokens: int) -> int:
    """`--continue`: how many tokens to generate after the prompt (at least one: its logits are
    what a replay, a blend or a verify compares)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise UsageError("--continue must be at least 1")
    return tokens


def check_token_source(prompt: str | None, prompt_file: Path | None, tokens_file: Path | None,
                       chat: bool = False) -> None:
    """Exactly one of a prompt, a prompt file or a token-id file; `chat` formats a prompt, so not
    token ids."""
    if sum(x is not None for x in (prompt, prompt_file, tokens_file)) != 1:
        raise UsageError("give exactly one of --prompt, --prompt-file or --tokens")
    if chat and tokens_file is not None:
        raise UsageError("--chat formats a prompt; --tokens are token ids already")


def read_token_file(path: Path) -> list[int]:
    """Token ids from a file: a JSON list or whitespace-separated integers."""
    text = read_text_file(path)
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.split()]
    except (ValueError, RecursionError):
        raise InputFileError(f"{path}: expected a JSON list or whitespace-separated integers") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputFileError(f"{path}: expected a list of integer token ids")
    return ids


def parse_index_set(spec: str | None, upper: int, what: str) -> list[int]:
    """'0-3,7,9-' -> sorted unique indices below `upper`."""
    if spec is None:
        return list(range(upper))
    chosen: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if part.startswith("-"):  # "-1" is not "the last one" here, nor "0-1"
                raise ValueError
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo = int(lo_s)
                hi = int(hi_s) if hi_s else upper - 1
            else:
                lo = hi = int(part)
        except ValueError:
            raise UsageError(f"--{what}: cannot read {part!r} (indices from 0: e.g. '0-3,7' or '5-' to the end)") from None
        if lo > hi:
            raise UsageError(f"--{what}: {part!r} is an empty range (write the smaller index first, e.g. '{hi}-{lo}')")
        if lo < 0 or hi >= upper:
            raise UsageError(f"--{what}: {part!r} is outside 0..{upper - 1}")
        chosen.update(range(lo, hi + 1))
    return sorted(chosen)


def parse_roi(spec: str) -> list[tuple[int, int]]:
    """'0:16,40:64' -> [(0, 16), (40, 64)]: token ranges [start, end)."""
    ranges = []
    for part in spec.split(","):
        try:
            start, end = (int(x) for x in part.strip().split(":"))
        except ValueError:
            raise UsageError(f"--roi {spec!r}: expected START:END[,START:END...] token ranges") from None
        if not 0 <= start < end:
            raise UsageError(f"--roi range {start}:{end} is empty or negative")
        ranges.append((start, end))
    return ranges


def codec_params(codec: str, *, level: int | None = None, shuffle: bool | None = None,
                 bins: str | None = None, quality: str | None = None, calibration: str | None = None,
                 model_fingerprint: str | None = None, bitstream: int | None = None) -> dict[str, Any]:
    """Codec options (`--level`, `--shuffle`, `--bins`, `--quality`, `--calibration`,
    `--bitstream`) -> parameters validated by the codec. pca's calibration defaults to the one
    `kvtool calibrate` made for the model `model_fingerprint`."""
    from .. import codecs

    impl = codecs.get_codec(codec)
    if (quality is not None or calibration is not None or bitstream is not None) and codec != "pca":
        raise UsageError("--quality, --calibration and --bitstream apply to the pca codec only")
    if codec == "pca":
        check_no_other_codec_options(codec, level, shuffle, bins)
        return pca_params(quality, calibration, model_fingerprint, bitstream)
    params = impl.default_params()
    if level is not None or shuffle is not None:
        if "level" not in params:
            raise UsageError("--level and --shuffle apply to the zstd codec only")
        if level is not None:
            params["level"] = level
        if shuffle is not None:
            params["shuffle"] = "byteplane" if shuffle else "none"
    if bins is not None:
        if "bins" not in params:
            raise UsageError("--bins applies to the cachegen codec only")
        params["bins"] = bins  # resolved against the model's layer count when a chunk is encoded
    return impl.validate_params(params)


def check_no_other_codec_options(codec: str, level: int | None, shuffle: bool | None, bins: str | None) -> None:
    """`--level`, `--shuffle` and `--bins` name other codecs' parameters: given with `codec`, a usage error."""
    if level is not None or shuffle is not None:
        raise UsageError("--level and --shuffle apply to the zstd codec only")
    if bins is not None:
        raise UsageError("--bins applies to the cachegen codec only")


def pca_quality(quality: str | None) -> str:
    """`--quality`, checked (before any calibration is looked for); the default when None."""
    from ..codecs.pca import DEFAULT_QUALITY, QUALITY

    if quality is not None and quality not in QUALITY:
        raise UsageError(f"--quality {quality!r}: choose {', '.join(QUALITY)}")
    return quality or DEFAULT_QUALITY


def pca_bitstream(bitstream: int | None) -> int:
    """`--bitstream`, checked: pca's bitstream version (format-spec/pca.md §11), 1 when None."""
    from ..codecs.pca import bitstream_version
    from ..errors import CodecParamsInvalid

    try:
        return bitstream_version(bitstream)
    except CodecParamsInvalid:
        raise UsageError(f"--bitstream {shown(bitstream)}: choose 1 (the default) or 2") from None


def pca_params(quality: str | None, calibration: str | None, model_fingerprint: str | None,
               bitstream: int | None = None) -> dict[str, Any]:
    """pca's parameters: the quality point (`pca_quality`) with the calibration object `calibration`
    (a digest), or else the one `kvtool calibrate` registered for the model `model_fingerprint`, in
    bitstream `bitstream` (`pca_bitstream`); the object must be here (a usage error, one line,
    otherwise)."""
    from ..codecs.pca import params_for
    from ..codecs.pca.calibration import CalibrationNotFound, find, for_model

    quality = pca_quality(quality)  # before the calibration is looked for
    version = pca_bitstream(bitstream)
    digest = calibration or (for_model(model_fingerprint) if model_fingerprint else None)
    if digest is None:
        raise UsageError("--codec pca: no calibration object for this model; run `kvtool calibrate` "
                         "(with the same --model) once, or give --calibration DIGEST")
    try:
        find(digest)  # present and intact, before any chunk is written
    except CalibrationNotFound as err:  # an option that names nothing here: a usage error (exit 2)
        raise UsageError(str(err)) from None
    return params_for(digest, quality, version=version)


def model_dtype_name(name: str) -> str:
    """--model-dtype fp32|bf16|fp16 -> the dtype's name (a usage error when unknown)."""
    if name not in MODEL_DTYPES:
        raise UsageError(f"--model-dtype {name!r}: expected fp32, bf16 or fp16")
    return MODEL_DTYPES[name]


def kv_dtype_name(name: str) -> str:
    """--dtype bf16|fp16|fp32 -> the KV dtype's name."""
    from ..dtypes import canonical_name

    try:
        return canonical_name(name)
    except UnsupportedDtype as err:
        raise UsageError(f"--dtype: {err}") from None


def non_negative(name: str, value: float | None) -> None:
    if value is not None and not 0 <= value < float("inf"):
        raise UsageError(f"{name} {value}: expected a finite number >= 0")


def fraction(name: str, value: float | None) -> None:
    if value is not None and not 0 <= value <= 1:
        raise UsageError(f"{name} {value}: expected a fraction in [0, 1]")


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*\Z", re.IGNORECASE)


def parse_size(text: str | int | None, option: str = "--max-bytes") -> int | None:
    """`10G`, `512MiB`, `1.5g`, `1000000` -> bytes (K/M/G/T are powers of 1024)."""
    if text is None or isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"{option}: {text!r} is not a size (e.g. 512M, 10G, 1000000)")
    scale = 1024 ** " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * scale)
