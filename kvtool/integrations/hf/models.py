"""A transformers causal LM as kvtool sees it: its identity (the fingerprint a file records, a digest
of its config, the digest of its weights), its tokenizer, and whether its KV cache is one kvtool can
hold (plain K and V of every token, per layer).

The identity is kvtool's own engine's for the architectures that engine runs (`engine.families`:
Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, OLMo 2): a file captured by either engine loads into the
other. For any other architecture it is
built from the config the same way, with the config's digest among the fingerprinted facts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ...engine.families import rope_from_hf
from ...engine.loader import (HUB_ID, SUPPORTED_ARCHITECTURES, config_from_hf, hub_cache_folder, identity_from_config,
                              model_folder, weights_files)
from ...engine.weights_digest import weights_digest
from ...errors import ModelError, UnsupportedCache, UsageError
from ...format import layout
from ...identity import ModelIdentity, canonical_json

#: config keys that say how a config was saved or loaded, not what the model computes
NOT_DIGESTED = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype",
                          "_attn_implementation", "attn_implementation", "_attn_implementation_autoset",
                          "use_cache", "output_attentions", "output_hidden_states", "return_dict"})

ENGINE = f"transformers {transformers.__version__}"


class HFTokenizer:
    """A transformers tokenizer behind the interface kvtool's operations use (that of
    `kvtool.engine.Tokenizer`), with transformers' conventions: `encode` adds the tokenizer's
    special tokens unless told not to (as `tokenizer(text)` does), and a chat template renders
    as `apply_chat_template(..., tokenize=False)` renders it."""

    def __init__(self, tokenizer):
        self.hf = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ModelError(f"{self.hf.name_or_path}: the tokenizer has no chat template")
        try:
            return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as err:  # jinja's errors, or the template's own raise_exception
            raise ModelError(f"{self.hf.name_or_path}: the chat template failed: {err}") from None

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None


@dataclass
class HFModel:
    """A transformers model with what kvtool records of it: `identity` is the file's model object,
    `config_digest` the SHA-256 of its canonical config; `folder` where it was loaded from."""

    model: Any  # transformers.PreTrainedModel, a causal LM
    identity: ModelIdentity
    config_digest: str
    folder: Path | None = None
    _tokenizer: HFTokenizer | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def tokenizer(self) -> HFTokenizer:
        """The model's tokenizer: the one it was given, or its folder's (loaded when first asked for:
        a cache moves without one)."""
        if self._tokenizer is None:
            if self.folder is None:
                raise ModelError(f"{self.name}: no tokenizer (the model was not loaded from a folder): give token ids")
            self._tokenizer = HFTokenizer(_auto_tokenizer(self.folder))
        return self._tokenizer

    @property
    def config(self):
        """The text decoder's config (vocab_size, num_hidden_layers, ...)."""
        return self.model.config.get_text_config(decoder=True)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def max_position_embeddings(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", None) or layout.MAX_TOKENS)

    @cached_property
    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention), after `check_plain_kv`."""
        return check_plain_kv(self.model.config)

    def engine_metadata(self) -> dict[str, str]:
        """What a file records of the engine that computed its KV."""
        return {"engine": ENGINE, "attn_implementation": str(self.model.config._attn_implementation),
                "config_digest": self.config_digest}

    @classmethod
    def of(cls, model, tokenizer=None) -> "HFModel":
        """A loaded transformers model (and optionally its tokenizer), its identity read from its
        config and, where it was loaded from a folder or the local Hub cache, that folder's weights."""
        if isinstance(model, HFModel):
            return model
        if not isinstance(model, transformers.PreTrainedModel):
            raise UsageError(f"expected a transformers model (PreTrainedModel), got {type(model).__name__}")
        check_plain_kv(model.config)
        folder, name = _folder_and_name(model)
        identity, digest = model_identity(model.config, name, folder, architecture=type(model).__name__)
        return cls(model, identity, digest, folder, HFTokenizer(tokenizer) if tokenizer is not None else None)


def load_hf_model(path: str | Path | None, *, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", attn_implementation: str | None = None) -> HFModel:
    """A model folder (or a Hub id already in the local cache; None: kvtool's default model) loaded
    by transformers (`AutoModelForCausalLM`, `AutoTokenizer`) in `dtype` on `device`, in eval mode.
    A model whose cache kvtool cannot hold is refused from its config, before its weights load."""
    folder, name = model_folder(path)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"{folder}: transformers cannot read its config ({_first_line(err)})") from None
    check_plain_kv(config)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # kvtool prints its own progress, nothing else
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError, ImportError) as err:
        raise ModelError(f"{folder}: transformers cannot load it as a causal LM ({_first_line(err)})") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    model = model.to(device).eval()
    identity, digest = model_identity(model.config, name, folder, architecture=type(model).__name__)
    return HFModel(model, identity, digest, folder, HFTokenizer(_auto_tokenizer(folder)))


def _auto_tokenizer(folder: Path):
    """The folder's tokenizer, as `AutoTokenizer` finds it."""
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, ImportError) as err:
        raise ModelError(f"{folder}: transformers cannot load its tokenizer ({_first_line(err)})") from None


# --- identity -----------------------------------------------------------------------------------


def model_identity(config, name: str, folder: Path | None, *, architecture: str) -> tuple[ModelIdentity, str]:
    """(the identity a file records, the config's digest) of a transformers config. The weights
    digest is that of `folder`'s safetensors files (none without a folder or such files)."""
    text = config.get_text_config(decoder=True)
    arch = (getattr(config, "architectures", None) or [architecture])[0]
    digest = config_digest(config, arch)
    weights = None
    if folder is not None:
        try:
            weights = weights_digest(folder, weights_files(folder))
        except ModelError:  # no safetensors (e.g. .bin weights): the file records no weights digest
            weights = None
    as_dict = {**text.to_dict(), "architectures": [arch]}
    if arch in SUPPORTED_ARCHITECTURES:
        try:  # the identity kvtool's engine gives the same folder: files move between the engines
            return identity_from_config(config_from_hf(as_dict, folder or name), name, weights), digest
        except ModelError:  # a variant kvtool's engine does not run (another activation, biases)
            pass
    heads = int(text.num_attention_heads)
    theta, scaling = rope_from_hf(as_dict)
    identity = ModelIdentity(
        name=name, architecture=arch, num_layers=int(text.num_hidden_layers), num_attention_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        hidden_size=int(text.hidden_size), intermediate_size=int(getattr(text, "intermediate_size", None) or 0),
        vocab_size=int(text.vocab_size),
        rms_norm_eps=float(next((getattr(text, k) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
                                 if getattr(text, k, None) is not None), 0.0)),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        rope={"rope_theta": theta, "rope_scaling": scaling},
        # what the fields above do not say of this architecture, the config's digest does
        extra={"config_digest": digest}, weights_digest=weights)
    return identity, digest


def config_digest(config, architecture: str | None = None) -> str:
    """"sha256:" + the SHA-256 of the config's canonical JSON (kvtool.identity.canonical_json),
    without the keys that say how it was saved or loaded (its dtype, transformers' version, its
    path, the attention implementation): the same model's config digests alike however it is loaded."""
    doc = {k: v for k, v in config.to_dict().items() if k not in NOT_DIGESTED}
    if architecture is not None:  # a model made in memory has none until it is saved
        doc["architectures"] = [architecture]
    try:
        text = canonical_json(doc)
    except (TypeError, ValueError):  # a value JSON does not hold (an infinity, an object): named by its repr
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr).encode()
    return "sha256:" + hashlib.sha256(text).hexdigest()


def _folder_and_name(model) -> tuple[Path | None, str]:
    """The folder a model was loaded from (its path, or its Hub id in the local cache; None when
    neither is known), and its name as kvtool's loader gives it (the folder's, or the Hub id's)."""
    where = str(getattr(model, "name_or_path", "") or "")
    if where and Path(where).expanduser().is_dir():
        folder = Path(where).expanduser()
        return folder, folder.resolve().name
    name = where.split("/")[-1] or type(model).__name__
    if HUB_ID.fullmatch(where):
        try:
            return hub_cache_folder(where), name
        except ModelError:  # not in the local cache: no folder, no weights digest
            pass
    return None, name


# --- what kvtool can hold -----------------------------------------------------------------------


def check_plain_kv(config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), for a model whose cache holds
    plain K and V per layer; `UnsupportedCache` in one line for any other. Read from the cache
    transformers itself would make for the config (`DynamicCache(config=...)`)."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedCache(f"{_arch(config)} is an encoder-decoder model; kvtool holds the KV of decoder-only "
                               f"models")
    text = config.get_text_config(decoder=True)
    if getattr(text, "kv_lora_rank", None) is not None:
        raise UnsupportedCache(f"{_arch(config)} uses multi-head latent attention (MLA): it caches a compressed "
                               f"latent, its keys and values of other widths (qk {getattr(text, 'qk_head_dim', '?')}, "
                               f"v {getattr(text, 'v_head_dim', '?')}); kvtool's transformers engine holds plain K/V "
                               f"per layer (kvtool.hf.to_cache and from_cache move its latent as an mla_latent file)")
    try:
        layers = DynamicCache(config=config).layers
    except Exception as err:  # a config transformers' own cache does not understand
        raise UnsupportedCache(f"{_arch(config)}: transformers builds no standard cache for it ({_first_line(err)})") \
            from None
    others = [i for i, layer in enumerate(layers) if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)]
    if others:
        kind = type(layers[others[0]]).__name__
        why = (f"{_layer_kinds(text, others)}: linear attention or a recurrent state (no K/V per token)"
               if "Linear" in kind else f"{kind} layers (more than K and V per token)")
        raise UnsupportedCache(f"{_arch(config)}'s cache holds {why}; kvtool holds plain K/V per layer")
    layer_count = int(text.num_hidden_layers)
    if layers and len(layers) != layer_count:
        raise UnsupportedCache(f"{_arch(config)}'s cache has {len(layers)} layers for {layer_count} decoder layers "
                               f"(layers share KV); kvtool holds K/V for every layer")
    return [getattr(layer, "sliding_window", None) for layer in layers] or [None] * layer_count


def check_window(model: HFModel, num_tokens: int) -> None:
    """A prompt's KV all in the model's cache: its sliding-window layers keep the last window - 1
    tokens, so a longer prompt would lose its first ones from them."""
    windows = [w for w in model.windows if w is not None]
    if windows and num_tokens > min(windows) - 1:
        raise UnsupportedCache(f"{model.identity.architecture}'s sliding-window layers keep only the last "
                               f"{min(windows) - 1} tokens: a prompt of {num_tokens} would not be all in its cache")


def _layer_kinds(text, indices: list[int]) -> str:
    """The config's own name for the layers at `indices` (Jamba's "mamba", Qwen3-Next's
    "linear_attention"), and which they are: "mamba layers 0, 2"."""
    names = set()
    for attr in ("layers_block_type", "layer_types"):  # Jamba names its mamba layers in the first
        types = getattr(text, attr, None)
        if isinstance(types, (list, tuple)) and len(types) > max(indices):
            names = {str(types[i]) for i in indices}
            break
    shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
    return f"{'/'.join(sorted(names)) or 'state'} layers {shown}"


def _arch(config) -> str:
    return (getattr(config, "architectures", None) or [type(config).__name__.removesuffix("Config")])[0]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


__all__ = ["ENGINE", "HFModel", "HFTokenizer", "check_plain_kv", "check_window", "config_digest", "load_hf_model",
           "model_identity"]
