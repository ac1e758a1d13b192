"""The requests of the commands that read files and the store without running a model
(`compress`, `dump`, `inspect`, `verify`, `store put`, `store get`): each option a field declared
once (`ops/fields.py`), checked when the request is made, without torch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..devices import check_device_spec
from ..errors import UsageError
from ..store.names import ExtraKeys
from .fields import (bins_option, bitstream_option, calibration_option, codec_option, continue_option,
                     device_option, embed_calibration_option, level_option,
                     max_kl_option, min_top1_option, model_dtype_option, model_option, namespace_option, option,
                     other_weights_option, output_option, input_file_argument, prompt_file_option, prompt_option,
                     quality_option, shuffle_option, store_option, tokens_option)
from .inputs import codec_params, continuation, fraction, model_dtype_name, non_negative, parse_size


@dataclass(frozen=True)
class CompressRequest:
    """One `compress` (see there). The codec's options become its `params` here (pca's: once
    the file's model is known, `params_for`)."""

    path: str | Path = input_file_argument()
    output: str | Path = output_option()
    codec: str = codec_option("zstd")
    level: int | None = level_option()
    shuffle: bool | None = shuffle_option()
    bins: str | None = bins_option()
    quality: str | None = quality_option()
    calibration: str | None = calibration_option()
    bitstream: int | None = bitstream_option()
    #: pca: carry the calibration object in the file (format-spec/pca.md §3.3)
    embed_calibration: bool = embed_calibration_option()
    params: dict[str, Any] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.embed_calibration and self.codec != "pca":
            raise UsageError("--embed-calibration carries pca's calibration object in the file: give --codec pca")
        if self.codec != "pca":  # (pca's parameters need the file's model: `params_for`)
            object.__setattr__(self, "params", self.params_for(None))
        if os.path.realpath(self.path) == os.path.realpath(self.output):
            raise UsageError(f"{self.output}: the output is the input; give compress another -o (it writes a new "
                             "file)")

    def params_for(self, model_fingerprint: str | None) -> dict[str, Any]:
        """The codec's parameters (pca's with the calibration of the model `model_fingerprint`)."""
        if self.params is not None:
            return self.params
        return codec_params(self.codec, level=self.level, shuffle=self.shuffle, bins=self.bins,
                            quality=self.quality, calibration=self.calibration, model_fingerprint=model_fingerprint,
                            bitstream=self.bitstream)


@dataclass(frozen=True)
class DumpRequest:
    """One `dump` (see there): which chunks and layers, checked against the file when it is open."""

    path: str | Path = input_file_argument()
    output: str | Path = output_option()
    chunks: str | None = option(None, "--chunks", metavar="LIST", help="Chunk indices, e.g. '0-3,7' (default: all).")
    layers: str | None = option(None, "--layers", metavar="LIST", help="Layer indices, e.g. '0,5-9' (default: all).")

    def __post_init__(self) -> None:
        suffix = Path(self.output).suffix.lower()
        if suffix not in (".safetensors", ".npy"):
            raise UsageError(f"output must end in .safetensors or .npy, got {Path(self.output).name!r}")


@dataclass(frozen=True)
class InspectRequest:
    """One `inspect` (see there)."""

    path: str | Path = input_file_argument()
    stats: bool = option(False, "--stats", kind=bool, help="Decode and show per-layer K/V statistics.")
    wide: bool = option(False, "--wide", kind=bool, help=(  # (how the command prints it: the summary is the same)
        "Everything in full: hashes, fingerprint, codec parameters."))
    all_chunks: bool = option(False, "--all", kind=bool, help=(
        "List every chunk (by default the first 1,000; the totals always cover all)."))


@dataclass(frozen=True)
class VerifyRequest:
    """One `verify` (see there), checked before the file is opened. `check`: problems raise
    VerificationFailed carrying the report (else the report says them)."""

    path: str | Path = input_file_argument()
    against: Path | None = option(None, "--against", kind=Path, metavar="FILE", help=(
        "Compare decoded KV with this file (e.g. the raw original of a lossy file)."))
    atol: float = option(0.0, "--atol", kind=float, metavar="X", help="Allowed absolute error per value.")
    rtol: float = option(0.0, "--rtol", kind=float, metavar="X", help=(
        "Allowed error relative to the layer's largest reference magnitude."))
    replay: bool = option(False, "--replay", kind=bool, help=(
        "Also replay the file into the model and compare with a full recompute."))
    model: str | Path | None = model_option()
    min_top1: float | None = min_top1_option(
        "With --replay: minimum top-1 agreement (default: what the file's codec promises: 1.0 lossless, "
        "0.65-0.90 cachegen by its fewest bins, pca by its quality).")
    max_kl: float | None = max_kl_option("With --replay: maximum mean KL.")
    continue_tokens: int = continue_option(64, (
        "With --replay: teacher-forced tokens the agreement is measured over (a promise is judged on 64)."))
    device: str = device_option()
    model_dtype: str = model_dtype_option()
    allow_other_weights: bool = other_weights_option()
    check: bool = True

    def __post_init__(self) -> None:
        if check_device_spec(self.device).group(1) == "cuda":  # a bad option is an error with or without --replay
            from ..devices import resolve_device

            resolve_device(self.device)  # (imports torch: only when CUDA is asked for)
        model_dtype_name(self.model_dtype)
        non_negative("--atol", self.atol)
        non_negative("--rtol", self.rtol)
        fraction("--min-top1", self.min_top1)
        non_negative("--max-kl", self.max_kl)
        continuation(self.continue_tokens)


# --- the store ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StorePutRequest:
    """One `store put` (see there)."""

    files: tuple[str | Path, ...] = option(dataclasses.MISSING, "FILE.kvc...", kind=list, argument=True,
                                           metavar="FILE.kvc...", help="kvtool files whose chunks to store.")
    store: str = store_option(required=True)
    namespace: str | None = namespace_option()
    extra_keys: ExtraKeys = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(self.files or ()))
        if not self.files:
            raise UsageError("give at least one .kvc file")
        object.__setattr__(self, "extra_keys", ExtraKeys(namespace=self.namespace or ""))


GET_CODEC_HELP = ("Every chunk in this codec (raw, zstd, cachegen, pca): those stored in another are re-encoded. "
                  "Default: each as stored.")


@dataclass(frozen=True)
class StoreGetRequest:
    """One `store get` (see there). An unknown `codec` fails here (pca's parameters name the
    model's calibration: once it is loaded, `params_for`)."""

    store: str = store_option(required=True)
    output: str | Path = output_option()
    prompt: str | None = prompt_option()
    prompt_file: Path | None = prompt_file_option()
    tokens_file: Path | None = tokens_option()
    model: str | Path | None = model_option()
    chunk_size: int | None = option(None, "--chunk-size", kind=int, metavar="N", help=(
        "Tokens per chunk of the stored KV (default: the stored size that covers the most)."))
    chat: bool = option(False, "--chat", kind=bool, help="The prompt is a user message: apply the chat template.")
    namespace: str | None = namespace_option()
    codec: str | None = codec_option(None, GET_CODEC_HELP)
    block_size: int | None = option(16, "--block-size", kind=int, metavar="N", help=(
        "Match the prefix to a multiple of N tokens past the whole chunks (the engine's block; N = the chunk "
        "size: whole chunks only)."))
    sglang_page_size: int | None = option(None, "--sglang-page-size", kind=int, metavar="N", help=(
        "Read the pages SGLang's kvtool backend saved (its page size N) instead of chunks."))
    sglang_tp: int = option(1, "--sglang-tp", kind=int, metavar="N", help=(
        "With --sglang-page-size: the tensor-parallel ranks that wrote them."))
    params: dict[str, Any] | None = field(init=False, default=None)
    extra_keys: ExtraKeys = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.sglang_page_size is not None:
            if self.chunk_size is not None or self.codec is not None:
                raise UsageError("--sglang-page-size reads SGLang's pages as stored (raw): no --chunk-size or --codec")
            if self.sglang_page_size <= 0:
                raise UsageError(f"--sglang-page-size must be positive, got {self.sglang_page_size}")
        if self.codec is not None and self.codec != "pca":
            object.__setattr__(self, "params", codec_params(self.codec))
        object.__setattr__(self, "extra_keys", ExtraKeys(namespace=self.namespace or ""))

    def params_for(self, model_fingerprint: str) -> dict[str, Any] | None:
        if self.codec == "pca":
            return codec_params(self.codec, model_fingerprint=model_fingerprint)
        return self.params


__all__ = ["CompressRequest", "DumpRequest", "InspectRequest", "StoreGetRequest", "StorePutRequest",
           "VerifyRequest"]


# --- the store's upkeep -----------------------------------------------------------------------------

#: what `store ls --kind` and the listing's rows call an object
OBJECT_KINDS = ("chunk", "entry", "tensor", "calibration", "foreign")


def model_key_option(help: str) -> Any:
    """`--model KEY`: a model key of the store's (or its first digits), not a model to load."""
    return option(None, "--model", metavar="KEY", help=help)


@dataclass(frozen=True)
class StoreListRequest:
    """One `store ls` (see there)."""

    store: str = store_option(required=True)
    kind: str | None = option(None, "--kind", metavar="KIND", help=(
        "Only chunk, entry, tensor, calibration or foreign objects."))
    model: str | None = model_key_option("Only this model key (or its first digits).")
    limit: int | None = option(None, "--limit", kind=int, metavar="N", help="At most N rows.")
    wide: bool = option(False, "--wide", kind=bool, help=(  # (how the command prints it: the listing is the same)
        "Whole names, not short ids, on a terminal too."))

    def __post_init__(self) -> None:
        if self.kind not in (None, *OBJECT_KINDS):
            raise UsageError(f"--kind: {self.kind!r} is not one of {', '.join(OBJECT_KINDS)}")
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be at least 1, got {self.limit}")


@dataclass(frozen=True)
class StoreStatsRequest:
    """One `store stats` (see there)."""

    store: str = store_option(required=True)


@dataclass(frozen=True)
class StoreGcRequest:
    """One `store gc` (see there); `max_bytes` a size ("10G") or a number of bytes."""

    store: str = store_option(required=True)
    max_bytes: int | str = option(dataclasses.MISSING, "--max-bytes", metavar="SIZE",
                                  help="Keep at most this much, e.g. 10G.")
    cap: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        cap = parse_size(self.max_bytes)
        if cap is None or cap < 0:
            raise UsageError("--max-bytes: give the size the store may keep, e.g. 10G")
        object.__setattr__(self, "cap", cap)


@dataclass(frozen=True)
class StoreFsckRequest:
    """One `store fsck` (see there)."""

    store: str = store_option(required=True)
    repair: bool = option(True, "--repair/--no-repair", kind=bool, show_default=True,
                          help="Remove damaged and foreign objects (default) or only report.")


@dataclass(frozen=True)
class StoreRmRequest:
    """One `store rm` (see there): exactly one of `names`, `model`, `namespace`, `everything`."""

    store: str = store_option(required=True)
    names: tuple[str, ...] | None = option(None, "[NAME...]", kind=list, argument=True,
                                           help="Object names (from `store ls`).")
    model: str | None = model_key_option("Every object of this model key.")
    everything: bool = option(False, "--all", kind=bool, help="Every object.")
    namespace: str | None = option(None, "--namespace", metavar="NAME", show_default=False,
                                   help="Every object of this namespace.")

    def __post_init__(self) -> None:
        if sum(bool(x) for x in (self.names, self.model, self.everything, self.namespace)) != 1:
            raise UsageError("give object names, or --model KEY, or --namespace NAME, or --all")
