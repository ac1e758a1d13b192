"""The operations' requests: the options of one `capture`, `replay` or blended replay, each
checked once, when the request is made, with the one-line usage errors the commands print.

Nothing here imports torch: the CLI makes its request before anything heavy loads, so a usage
error answers as fast as `--help`. What needs torch (the model's dtype, the device, which must
exist here) is resolved the first time the operation asks for it (`weights`, `where`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..devices import check_device_spec, resolve_device
from ..dtypes import dtype_from_name, dtype_name
from ..errors import UsageError
from ..format.layout import MAX_CHUNK_SIZE
from ..store.names import ExtraKeys
from .inputs import (check_no_other_codec_options, check_text, check_token_source, codec_params, continuation,
                     fraction, kv_dtype_name, model_dtype_name, non_negative, parse_roi, pca_params, pca_quality)

if TYPE_CHECKING:
    import torch

    from ..engine import LoadedModel


#: the engines that run a model: kvtool's paged runner, or Hugging Face transformers
ENGINES = ("kvtool", "hf")


class _RunsTheModel:
    """What a request that runs the model checks without torch (`check_model_options`, from its
    `__post_init__`) and resolves with torch on first use (`weights`, `where`)."""

    model_dtype: str
    device: str
    engine: str = "kvtool"

    def check_model_options(self) -> None:
        model_dtype_name(self.model_dtype)
        check_device_spec(self.device)
        if self.engine not in ENGINES:
            raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @cached_property
    def weights(self) -> "torch.dtype":
        """The model's dtype (torch's)."""
        return dtype_from_name(model_dtype_name(self.model_dtype))

    @cached_property
    def where(self) -> "torch.device":
        """The device the model runs on (a UsageError where it does not exist here)."""
        return resolve_device(self.device)


# --- capture ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptureRequest:
    """What one capture writes: the options of `capture` (see there), checked once, here; the
    command line's spelling of them is parsed by `from_options`. `roi` is checked against the
    prompt's length when it is known. The check resolves `extra_keys` (the store's partition)."""

    output: str | Path | None
    store: str | None = field(default=None, repr=False)  # (a URL may carry a password: never in a repr)
    namespace: str | None = None
    chunk_size: int = 256
    codec: str = "raw"
    params: dict[str, Any] | None = None
    kv_dtype: Any = "bfloat16"  # a KV dtype's name (bf16, fp16, fp32 or their long names) or a torch dtype
    block_size: int = 16
    shuffle_seed: int | None = 0
    hidden_states: bool = False
    roi: list[tuple[int, int]] | None = None
    segment: bool = False
    metadata: dict[str, str] | None = None
    #: pca without `params`: the quality point of the model's registered calibration, looked up once
    #: the model is loaded (its fingerprint names it: `codec_params_for`)
    quality: str | None = None
    #: pca: carry the calibration object in the file (format-spec/pca.md §3.3)
    embed_calibration: bool = False
    extra_keys: ExtraKeys = field(init=False, repr=False)

    def codec_params_for(self, fingerprint: str) -> dict[str, Any] | None:
        """The parameters chunks are written with, for the model `fingerprint`: `params`, or pca's
        with the calibration `kvtool calibrate` registered for that model (a one-line usage error
        saying to run it when there is none)."""
        if self.codec == "pca" and self.params is None:
            return pca_params(self.quality, None, fingerprint)
        return self.params

    @cached_property
    def torch_kv_dtype(self) -> "torch.dtype":
        """`kv_dtype` as torch's dtype (torch is imported here, not when the request is checked)."""
        return dtype_from_name(self.kv_dtype)

    def __post_init__(self) -> None:
        # frozen: the KV dtype becomes its canonical name here (a torch dtype is named, not imported)
        object.__setattr__(self, "kv_dtype", kv_dtype_name(dtype_name(self.kv_dtype) if not isinstance(
            self.kv_dtype, str) else self.kv_dtype))
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
        if not 1 <= self.chunk_size <= MAX_CHUNK_SIZE or not 1 <= self.block_size <= MAX_CHUNK_SIZE:
            raise UsageError(f"--chunk-size and --block-size must be in 1..{MAX_CHUNK_SIZE}")

    @classmethod
    def from_options(cls, output: str | Path | None, *, codec: str = "raw", level: int | None = None,
                     shuffle: bool | None = None, bins: str | None = None, kv_dtype: str = "bf16",
                     chunk_size: int = 256, block_size: int = 16, hidden_states: bool = False,
                     roi: str | None = None, store: str | None = None, segment: bool = False,
                     namespace: str | None = None, metadata: dict[str, str] | None = None,
                     quality: str | None = None, calibration: str | None = None,
                     embed_calibration: bool = False) -> "CaptureRequest":
        """The command line's spelling (a dtype's name, a codec's options, `--roi` ranges as text)
        parsed into a request: a typo fails before the model loads. pca without `calibration`:
        the model's registered one, found once the model is loaded (`codec_params_for`)."""
        kv = kv_dtype_name(kv_dtype)
        ranges = parse_roi(roi) if roi is not None else None
        if codec == "pca" and calibration is None:  # (its options checked here, before the model loads)
            check_no_other_codec_options(codec, level, shuffle, bins)
            pca_quality(quality)
            params = None
        else:
            params = codec_params(codec, level=level, shuffle=shuffle, bins=bins, quality=quality,
                                  calibration=calibration)
        return cls(output, store=store, namespace=namespace, chunk_size=chunk_size, codec=codec, params=params,
                   kv_dtype=kv, block_size=block_size, hidden_states=hidden_states, roi=ranges, segment=segment,
                   metadata=metadata, quality=quality if params is None else None,
                   embed_calibration=embed_calibration)


@dataclass(frozen=True)
class PromptCaptureRequest(_RunsTheModel):
    """One `kvtool capture` (`capture_prompt`, see there): the model, its tokens (exactly one of
    `prompt`, `prompt_file`, `tokens_file`) and what the `capture` writes; checked once, here,
    before the model loads. The check resolves `weights` (the model's dtype) and `where` (its
    device)."""

    capture: CaptureRequest
    prompt: str | None = None
    prompt_file: Path | None = None
    tokens_file: Path | None = None
    chat: bool = False
    generation_prompt: bool = True
    model: str | Path | LoadedModel | None = None
    device: str = "auto"
    model_dtype: str = "fp32"
    engine: str = "kvtool"

    def __post_init__(self) -> None:
        if self.capture.segment and self.chat:
            raise UsageError("--segment is text to place inside other prompts: --chat would wrap it in a chat "
                             "template")
        check_generation_prompt(self.chat, self.generation_prompt)
        self.check_model_options()
        check_token_source(self.prompt, self.prompt_file, self.tokens_file, self.chat)
        if self.engine == "hf" and self.capture.block_size != 16:
            raise UsageError("--block-size is kvtool's paged cache; transformers' cache (--engine hf) is one block")


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

    path: str | Path | None = None
    model: str | Path | LoadedModel | None = None
    continue_tokens: int = 32
    suffix: str | None = None
    suffix_file: Path | None = None
    prompt: str | None = None
    prompt_file: Path | None = None
    compare: bool = False
    min_top1: float | None = None
    max_kl: float | None = None
    device: str = "auto"
    model_dtype: str = "fp32"
    use_hidden_states: bool = True
    chat: bool = False
    generation_prompt: bool = True
    allow_other_weights: bool = False
    store: str | None = field(default=None, repr=False)  # (a URL may carry a password: never in a repr)
    chunk_size: int | None = None
    namespace: str | None = None
    engine: str = "kvtool"
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

    files: tuple[str | Path, ...] = ()
    model: str | Path | LoadedModel | None = None
    prompt: str | None = None
    prompt_file: Path | None = None
    delimiter: str | None = None
    store: str | None = field(default=None, repr=False)  # (a URL may carry a password: never in a repr)
    chunk_size: int | None = None
    recompute_ratio: float | None = None
    check_layer: int | None = None
    continue_tokens: int = 32
    compare: bool = False
    min_top1: float | None = None
    max_kl: float | None = None
    device: str = "auto"
    model_dtype: str = "fp32"
    allow_other_weights: bool = False
    block_size: int = 16
    namespace: str | None = None

    def __post_init__(self) -> None:
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


__all__ = ["BlendRequest", "CaptureRequest", "ENGINES", "PromptCaptureRequest", "ReplayRequest",
           "check_generation_prompt", "prompt_metadata"]
