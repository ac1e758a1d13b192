"""The operations' requests: the options of one `capture`, `replay`, blended replay or
`calibrate`, each a field declared once (flag, type, default, help: `ops/fields.py`), the command
built from them (`kvtool.cli.commands`), each checked once, when the request is made, with the
one-line usage errors the commands print. (`ops/file_requests.py` holds the others' requests.)

Nothing here imports torch: the CLI makes its request before anything heavy loads, so a usage
error answers as fast as `--help`. What needs torch (the model's dtype, the device, which must
exist here) is resolved the first time the operation asks for it (`torch_model_dtype`, `where`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..devices import check_device_spec, resolve_device
from ..dtypes import dtype_from_name, dtype_name
from ..errors import UsageError
from ..format.layout import MAX_CHUNK_SIZE
from ..store.names import ExtraKeys
from .fields import (bins_option, bitstream_option, calibration_option, codec_option, compare_option, continue_option,
                     device_option, embed_calibration_option, engine_option,
                     generation_prompt_option, level_option, make, max_kl_option, min_top1_option, model_dtype_option,
                     model_option, namespace_option, option, other_weights_option, output_option, part,
                     prompt_file_option, prompt_option, quality_option, shuffle_option, store_chunk_size_option,
                     store_option, tokens_option)
from .inputs import (check_no_other_codec_options, check_text, check_token_source, codec_params, continuation,
                     fraction, kv_dtype_name, model_dtype_name, non_negative, parse_roi, pca_bitstream, pca_params,
                     pca_quality)

if TYPE_CHECKING:
    import torch

    from ..engine import LoadedModel


#: the engines that run a model: kvtool's paged runner, or Hugging Face transformers
ENGINES = ("kvtool", "hf")


class _RunsTheModel:
    """What a request that runs the model checks without torch (`check_model_options`, from its
    `__post_init__`) and resolves with torch on first use (`torch_model_dtype`, `where`)."""

    model_dtype: str
    device: str
    engine: str = "kvtool"

    def check_model_options(self) -> None:
        model_dtype_name(self.model_dtype)
        check_device_spec(self.device)
        if self.engine not in ENGINES:
            raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @cached_property
    def torch_model_dtype(self) -> "torch.dtype":
        """`model_dtype` as torch's dtype."""
        return dtype_from_name(model_dtype_name(self.model_dtype))

    @property
    def weights(self) -> "torch.dtype":
        """Deprecated: `torch_model_dtype`."""
        warnings.warn("a request's .weights is deprecated: use .torch_model_dtype", DeprecationWarning, stacklevel=2)
        return self.torch_model_dtype

    @cached_property
    def where(self) -> "torch.device":
        """The device the model runs on (a UsageError where it does not exist here)."""
        return resolve_device(self.device)


# --- capture ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptureRequest:
    """What one capture writes: the options of `capture` (see there), checked once, here. The
    codec's options (`level`, `shuffle`, `bins`, `quality`, `calibration`, `bitstream`) become its
    `params` and then read None (the parameters hold them); or give `params` itself, the codec's
    parameters as they are, and no option beside it (a usage error). pca without a `calibration`:
    the model's registered one, found once the model is loaded (`codec_params_for`). `roi` (ranges, or the command line's text) is
    checked against the prompt's length when it is known. The check resolves `extra_keys` (the
    store's partition)."""

    output: str | Path | None = output_option("Output path (optional with --store).", required=False)
    store: str | None = store_option()
    namespace: str | None = namespace_option()
    chunk_size: int = option(256, "--chunk-size", kind=int, metavar="N", help="Tokens per chunk.")
    codec: str = codec_option("raw")
    level: int | None = level_option()
    shuffle: bool | None = shuffle_option()
    bins: str | None = bins_option()
    quality: str | None = quality_option()
    calibration: str | None = calibration_option()
    bitstream: int | None = bitstream_option()
    #: pca: carry the calibration object in the file (format-spec/pca.md §3.3)
    embed_calibration: bool = embed_calibration_option()
    params: dict[str, Any] | None = None  # (the Python API's: the codec's parameters as they are)
    # a KV dtype's name (bf16, fp16, fp32 or their long names) or a torch dtype
    kv_dtype: Any = option("bf16", "--dtype", metavar="DTYPE", help="KV dtype: bf16, fp16 or fp32.")
    block_size: int = option(16, "--block-size", kind=int, metavar="N", help="Tokens per paged-KV block.")
    shuffle_seed: int | None = 0
    hidden_states: bool = option(False, "--hidden-states", kind=bool, help=(
        "Also store the final hidden states (replay then computes nothing for the first new token)."))
    roi: list[tuple[int, int]] | str | None = option(None, "--roi", metavar="RANGES", help=(
        "A roi_mask of token ranges, e.g. '0:16,40:64' ([start, end))."))
    segment: bool = option(False, "--segment", kind=bool, help=(
        "Mark the file a segment, computed alone from position 0, for replay --blend."))
    metadata: dict[str, str] | None = None
    extra_keys: ExtraKeys = field(init=False, repr=False)

    def codec_params_for(self, fingerprint: str) -> dict[str, Any] | None:
        """The parameters chunks are written with, for the model `fingerprint`: `params`, or pca's
        with the calibration `kvtool calibrate` registered for that model (a one-line usage error
        saying to run it when there is none)."""
        if self.codec == "pca" and self.params is None:
            return pca_params(self.quality, None, fingerprint, self.bitstream)
        return self.params

    @cached_property
    def torch_kv_dtype(self) -> "torch.dtype":
        """`kv_dtype` as torch's dtype (torch is imported here, not when the request is checked)."""
        return dtype_from_name(self.kv_dtype)

    def __post_init__(self) -> None:
        # frozen: the KV dtype becomes its canonical name here (a torch dtype is named, not imported)
        object.__setattr__(self, "kv_dtype", kv_dtype_name(dtype_name(self.kv_dtype) if not isinstance(
            self.kv_dtype, str) else self.kv_dtype))
        if isinstance(self.roi, str):  # the command line's ranges, parsed once: a typo fails before the model loads
            object.__setattr__(self, "roi", parse_roi(self.roi))
        options = (("level", self.level), ("shuffle", self.shuffle), ("bins", self.bins), ("quality", self.quality),
                   ("calibration", self.calibration), ("bitstream", self.bitstream))
        if self.params is not None:  # the Python API's parameters, as they are: an option beside them would be lost
            given = [name for name, value in options if value is not None]
            if given:
                raise UsageError(f"params and {', '.join(given)}: give the codec's parameters as params or as "
                                 "options, not both (a copy made with replace and new options: pass params=None)")
        elif (params := self._codec_params()) is not None:  # the options, now parameters, are held there alone
            object.__setattr__(self, "params", params)
            for name, _ in options:  # (so that a copy made with `replace` takes them as given, once)
                object.__setattr__(self, name, None)
        if self.output is None and self.store is None:
            raise UsageError("give -o OUT, --store URL, or both")
        if self.namespace is not None and self.store is None:
            raise UsageError("--namespace names a partition of the store: give --store URL")
        # frozen: set once, here; a bad namespace fails before the model loads
        object.__setattr__(self, "extra_keys", ExtraKeys(namespace=self.namespace or ""))
        if self.embed_calibration and (self.codec != "pca" or self.output is None):
            raise UsageError("--embed-calibration carries pca's calibration object in the file: give --codec pca "
                             "and -o OUT")
        if self.segment and self.hidden_states:
            raise UsageError("--segment and --hidden-states: a segment's hidden states are not those of a prompt it "
                             "is placed in")
        for flag, value in (("--chunk-size", self.chunk_size), ("--block-size", self.block_size)):
            if not 1 <= value <= MAX_CHUNK_SIZE:  # (the one given wrongly named, not both)
                raise UsageError(f"{flag} must be in 1..{MAX_CHUNK_SIZE}, got {value}")

    def _codec_params(self) -> dict[str, Any] | None:
        """The codec's options as its parameters; None for the codec's defaults (none given) and
        for pca without a calibration (its options checked here: the model's calibration is found
        once the model is loaded). An unknown codec fails here either way."""
        if self.codec == "pca" and self.calibration is None:
            check_no_other_codec_options(self.codec, self.level, self.shuffle, self.bins)
            pca_quality(self.quality)
            pca_bitstream(self.bitstream)
            return None
        params = codec_params(self.codec, level=self.level, shuffle=self.shuffle, bins=self.bins,
                              quality=self.quality, calibration=self.calibration, bitstream=self.bitstream)
        given = (self.level, self.shuffle, self.bins, self.quality, self.calibration, self.bitstream)
        return params if any(option is not None for option in given) else None

    @classmethod
    def from_options(cls, output: str | Path | None, **options: Any) -> "CaptureRequest":
        """Deprecated: `CaptureRequest(output, ...)` takes the command line's spelling itself."""
        warnings.warn("CaptureRequest.from_options is deprecated: use CaptureRequest(output, ...)",
                      DeprecationWarning, stacklevel=2)
        return cls(output, **options)


@dataclass(frozen=True)
class PromptCaptureRequest(_RunsTheModel):
    """One `kvtool capture` (`capture_prompt`, see there): the model, its tokens (exactly one of
    `prompt`, `prompt_file`, `tokens_file`) and what the `capture` writes; checked once, here,
    before the model loads. The check resolves `torch_model_dtype` and `where` (its device)."""

    capture: CaptureRequest = part(CaptureRequest)
    prompt: str | None = prompt_option()
    prompt_file: Path | None = prompt_file_option()
    tokens_file: Path | None = tokens_option()
    chat: bool = option(False, "--chat", kind=bool, help=(
        "The prompt is a user message: apply the model's chat template (as transformers does)."))
    generation_prompt: bool = generation_prompt_option()
    model: str | Path | LoadedModel | None = model_option()
    device: str = device_option()
    model_dtype: str = model_dtype_option()
    engine: str = engine_option()

    def __post_init__(self) -> None:
        if self.capture.segment and self.chat:
            raise UsageError("--segment is text to place inside other prompts: --chat would wrap it in a chat "
                             "template")
        check_generation_prompt(self.chat, self.generation_prompt)
        self.check_model_options()
        check_token_source(self.prompt, self.prompt_file, self.tokens_file, self.chat)
        if self.engine == "hf" and self.capture.block_size != 16:
            raise UsageError("--block-size is kvtool's paged cache; transformers' cache (--engine hf) is one block")

    @classmethod
    def of(cls, **options: Any) -> "PromptCaptureRequest":
        """The request made of its fields and its capture's, by name (`capture_prompt`'s keywords)."""
        return make(cls, options)


def check_generation_prompt(chat: bool, generation_prompt: bool) -> None:
    """`--no-generation-prompt` says how `--chat` renders the template: without a chat, nothing."""
    if not generation_prompt and not chat:
        raise UsageError("--no-generation-prompt applies to --chat")


def prompt_metadata(chat: bool, tokens_file: Path | None, generation_prompt: bool = True) -> dict[str, str] | None:
    """What the file records of how the prompt became tokens (nothing for token ids): the format
    and, for a chat, whether the template ended with the assistant's turn opened (transformers'
    `add_generation_prompt`). The model's part (its template's digest, the special tokens its
    tokenizer adds) is added once it is loaded (`ops.capture.tokenizer_metadata`)."""
    if tokens_file is not None:
        return None
    if chat:
        return {"prompt_format": "chat template, user message",
                "add_generation_prompt": "true" if generation_prompt else "false"}
    return {"prompt_format": "plain text"}


# --- replay -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayRequest(_RunsTheModel):
    """The options of one `replay` (see there), checked once, here, before anything is opened or
    loaded: a KV `path` or a `store` URL. The check resolves `weights` (the model's dtype),
    `where` (its device) and `extra_keys` (the store's partition)."""

    path: str | Path | None = option(None, "[FILE]", argument=True, help=(
        "A kvtool file (.kvc); or --store URL with --prompt/--prompt-file."))
    store: str | None = store_option()
    chunk_size: int | None = store_chunk_size_option()
    model: str | Path | LoadedModel | None = model_option()
    continue_tokens: int = continue_option()
    suffix: str | None = option(None, "--suffix", metavar="TEXT", help="Text after the cached tokens.")
    suffix_file: Path | None = option(None, "--suffix-file", kind=Path, metavar="FILE",
                                      help="File with text to append.")
    prompt: str | None = prompt_option("A new prompt: reuse the chunks of its cached prefix, compute the rest.")
    prompt_file: Path | None = prompt_file_option("A new prompt, from a file.")
    compare: bool = compare_option()
    min_top1: float | None = min_top1_option()
    max_kl: float | None = max_kl_option()
    device: str = device_option()
    model_dtype: str = model_dtype_option()
    use_hidden_states: bool = option(True, "--no-hidden-states", kind=bool, negate=True,
                                     help="Ignore stored hidden states (measures the KV alone).")
    chat: bool = option(False, "--chat", kind=bool, help="--prompt in the chat template.")
    generation_prompt: bool = generation_prompt_option()
    allow_other_weights: bool = other_weights_option()
    namespace: str | None = namespace_option()
    engine: str = engine_option()
    extra_keys: ExtraKeys = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.store is None):
            raise UsageError("give a KV file or --store URL, not both" if self.path is not None
                             else "give a KV file or --store URL")
        if self.namespace is not None and self.store is None:
            raise UsageError("--namespace names a partition of the store: give --store URL")
        if sum(x is not None for x in (self.suffix, self.suffix_file, self.prompt, self.prompt_file)) > 1:
            raise UsageError("give at most one of --suffix, --suffix-file, --prompt, --prompt-file")
        if self.chat and self.prompt is None and self.prompt_file is None:
            raise UsageError("--chat formats a new prompt: give --prompt or --prompt-file")
        check_generation_prompt(self.chat, self.generation_prompt)
        fraction("--min-top1", self.min_top1)
        non_negative("--max-kl", self.max_kl)
        continuation(self.continue_tokens)
        self.check_model_options()
        # frozen: the store's partition is resolved once, here
        object.__setattr__(self, "extra_keys", ExtraKeys(namespace=self.namespace or ""))
        if self.store is not None and self.prompt is None and self.prompt_file is None:
            raise UsageError("replay --store needs the prompt: --prompt or --prompt-file")

    @property
    def compares(self) -> bool:
        """Runs the recompute: asked for, or implied by a threshold on the comparison."""
        return self.compare or self.min_top1 is not None or self.max_kl is not None


# --- a blended replay ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BlendRequest(_RunsTheModel):
    """The options of one `blend_replay` (see there), checked once, here, before anything is read
    or loaded. The check resolves `ratio` (`recompute_ratio`, or the default share), `weights`
    (the model's dtype) and `where` (its device); `check_layer` is checked against the model once
    it is loaded."""

    files: tuple[str | Path, ...] = option((), "--blend", kind=list, metavar="SEG.kvc", show_default=False, help=(
        "A cached segment to blend (CacheBlend), once each in prompt order, before the question "
        "(--prompt/--prompt-file)."))
    model: str | Path | LoadedModel | None = model_option()
    prompt: str | None = prompt_option()
    prompt_file: Path | None = prompt_file_option()
    delimiter: str | None = option(None, "--blend-delimiter", metavar="TEXT", help=(
        "Blend a prompt split at TEXT (LMCache's: ' # # '): segments, then the question last."))
    store: str | None = store_option()
    chunk_size: int | None = store_chunk_size_option()
    recompute_ratio: float | None = option(None, "--recompute-ratio", kind=float, metavar="X", help=(
        "--blend: share of cached tokens recomputed (default 0.15)."))
    check_layer: int | None = option(None, "--check-layer", kind=int, metavar="N", help=(
        "--blend: layer choosing what to recompute (default 1)."))
    continue_tokens: int = continue_option()
    compare: bool = compare_option()
    min_top1: float | None = min_top1_option()
    max_kl: float | None = max_kl_option()
    device: str = device_option()
    model_dtype: str = model_dtype_option()
    allow_other_weights: bool = other_weights_option()
    block_size: int = 16
    namespace: str | None = namespace_option()

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(self.files or ()))  # (frozen: a list or None becomes a tuple)
        fraction("--recompute-ratio", self.recompute_ratio)
        fraction("--min-top1", self.min_top1)
        non_negative("--max-kl", self.max_kl)
        continuation(self.continue_tokens)
        if (self.prompt is None) == (self.prompt_file is None):
            raise UsageError("--blend needs the question or the delimited prompt: --prompt or --prompt-file (one)")
        if self.delimiter is None and not self.files:
            raise UsageError("give segment files (--blend FILE) or a delimited prompt (--blend-delimiter)")
        if self.delimiter is None and self.store is not None:
            raise UsageError("--store with --blend: segments are found in the store by splitting the prompt: "
                             "give --blend-delimiter")
        if self.chunk_size is not None and self.store is None:
            raise UsageError("--chunk-size applies to --store")
        if self.namespace is not None and self.store is None:
            raise UsageError("--namespace names a partition of the store: give --store URL")
        if self.delimiter is not None:
            check_text(self.delimiter, "--blend-delimiter")
        self.check_model_options()

    @cached_property
    def ratio(self) -> float:
        """`recompute_ratio`, or the engine's default share."""
        if self.recompute_ratio is not None:
            return self.recompute_ratio
        from ..engine.blend import DEFAULT_RECOMPUTE_RATIO

        return DEFAULT_RECOMPUTE_RATIO

    @property
    def compares(self) -> bool:
        """Runs the full prefill and naive reuse: asked for, or implied by a threshold."""
        return self.compare or self.min_top1 is not None or self.max_kl is not None


# --- calibrate --------------------------------------------------------------------------------

#: `codecs/pca/fit.py`'s BASES, named here without importing it (it imports torch); a test holds them equal
CALIBRATION_BASES = ("head", "layer")


@dataclass(frozen=True)
class CalibrateRequest:
    """The options of one `calibrate_model` (see there); `basis` checked here."""

    model: str | Path | LoadedModel | None = model_option()
    text_files: tuple[Path, ...] | None = option(None, "--text", kind=list[Path], metavar="FILE", help=(
        "UTF-8 text to learn on (repeatable; default: Python's own documentation and modules, texts no "
        "benchmark here measures on)."))
    basis: str = option("layer", "--basis", metavar="layer|head", help=(
        "principal axes per layer (the default: fewest bits) or per KV head (the coder multiplies head by "
        "head: C/D times fewer operations, ~10% more bits; bench/RESULTS.md §34)"))
    kscale: float | None = None  # (the Python API's: None, the fit's default)

    def __post_init__(self) -> None:
        if self.basis not in CALIBRATION_BASES:
            raise UsageError(f"--basis must be one of {', '.join(CALIBRATION_BASES)}, got {self.basis!r}")


__all__ = ["BlendRequest", "CalibrateRequest", "CaptureRequest", "ENGINES", "PromptCaptureRequest", "ReplayRequest",
           "check_generation_prompt", "prompt_metadata"]
