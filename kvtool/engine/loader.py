"""Load a local Hugging Face model folder into kvtool's engine.

Reads `config.json`, `*.safetensors` (single file or sharded with
`model.safetensors.index.json`) and `tokenizer.json` (with the `tokenizers`
package). No transformers import, nothing fetched from any hub. Which families
it reads, and how each config maps onto the engine, is `families.py`'s.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelError
from ..identity import ModelIdentity
from .families import FAMILIES, family_fields, identity_extra, identity_rope, rope_from_hf, unsupported
from .model import LayerWeights, ModelConfig, Weights, rope_inv_freq
from .weights_digest import weights_digest

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
_rope_from_hf = rope_from_hf  # its old name here (tests/test_spec_fine_print.py)


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer`: text <-> token ids."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:  # pragma: no cover
            raise ModelError("reading tokenizer.json needs the 'tokenizers' package: "
                             "pip install tokenizers") from None
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as err:
            raise ModelError(f"cannot read {path}: {err}") from None
        self.folder = Path(path).parent
        config = self.folder / "tokenizer_config.json"
        try:
            self._config = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot read {config}: {err}") from None
        if not isinstance(self._config, dict):
            self._config = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) match."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's chat template (its folder's chat_template.jinja or tokenizer_config.json)
        rendered as transformers renders it: a sandboxed Jinja environment, blocks trimmed."""
        template = self.chat_template
        if template is None:
            raise ModelError(f"{self.folder} has no chat template (chat_template.jinja or tokenizer_config.json)")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    **self.special_tokens)
        except TemplateError as err:
            raise ModelError(f"{self.folder}: the chat template failed: {err}") from None

    @property
    def chat_template(self) -> str | None:
        jinja = self.folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        template = self._config.get("chat_template")
        return template if isinstance(template, str) else None

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as tokenizer_config.json names them (templates use them)."""
        return {k: v for k, v in self._config.items() if k.endswith("_token") and isinstance(v, str)}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer
    identity: ModelIdentity
    dtype: torch.dtype

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        """Where the weights are; the paged KV buffers are made there too."""
        return self.weights.embed.device

    @property
    def name(self) -> str:
        return self.identity.name


def load_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LoadedModel:
    """Load a model of a family the engine runs (`families.FAMILIES`): a local HF folder, a Hub
    id already in the local Hugging Face cache (never downloaded), or `None`: the embedded
    default model."""
    if path is None:
        from .default_model import MODEL_NAME, default_model_path

        path, name = default_model_path(), MODEL_NAME
    elif Path(path).expanduser().exists() or not HUB_ID.fullmatch(str(path)):
        path = Path(path).expanduser()
        name = path.resolve().name if path.exists() else path.name
    else:
        path, name = hub_cache_folder(str(path)), str(path).split("/")[-1]
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"model folder not found: {path}")
    hf = _read_json(path / "config.json")
    config = config_from_hf(hf, path)
    weights = _load_weights(path, config, hf, dtype, device)
    tok_path = path / "tokenizer.json"
    if not tok_path.is_file():
        raise ModelError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    return LoadedModel(path=path, config=config, weights=weights, tokenizer=Tokenizer(tok_path),
                       identity=identity_from_config(config, name, weights_digest(path, weights_files(path))),
                       dtype=dtype)


def model_identity(path: str | Path) -> ModelIdentity:
    """A model folder's identity (fingerprint and weights digest) without loading its weights:
    what an engine serving that folder records, e.g. the vLLM connector."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelError(f"model folder not found: {path}")
    hf = _read_json(path / "config.json")
    if hf.get("kv_lora_rank") is not None:  # latent attention: kvtool's engine does not run it, vLLM does
        return latent_identity(hf, path.resolve().name, weights_digest(path, weights_files(path)), path)
    if (hf.get("architectures") or [None])[0] == "GptOssForCausalLM":  # vLLM runs it, kvtool's engine does not
        return gptoss_identity(hf, path.resolve().name, weights_digest(path, weights_files(path)), path)
    config = config_from_hf(hf, path)
    return identity_from_config(config, path.resolve().name, weights_digest(path, weights_files(path)))


#: What an MLA model's identity records in `extra` beside the layout kind (container.md 3.2): the
#: ranks and head widths that decide what its latent means and how its heads use it.
LATENT_FACTS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank")


def latent_identity(hf: dict, name: str, digest: str | None, path: Path | str = "") -> ModelIdentity:
    """The identity of a multi-head latent attention model (DeepSeek-V2/V3, Kimi K2): one KV
    "head" of kv_lora_rank + qk_rope_head_dim channels, the layout kind and its ranks in `extra`
    (so its fingerprint, and every store name, is never a K/V model's). Facts its config lacks are
    a one-line ModelError."""
    archs = hf.get("architectures") or []
    try:
        rank, rope_dim = int(hf["kv_lora_rank"]), int(hf["qk_rope_head_dim"])
        rope = dict(hf.get("rope_parameters") or {})
        theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return ModelIdentity(
            weights_digest=digest, name=name, architecture=str(archs[0]) if archs else str(hf.get("model_type")),
            num_layers=int(hf["num_hidden_layers"]), num_attention_heads=int(hf["num_attention_heads"]),
            num_kv_heads=1, head_dim=rank + rope_dim, hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope={"rope_theta": theta, "rope_scaling": scaling},
            extra={"kv_layout": "mla_latent", **{key: hf.get(key) for key in LATENT_FACTS}})
    except (KeyError, TypeError, ValueError) as err:
        raise ModelError(f"{path}: config.json of a latent attention model lacks or mistypes {err}") from None


def gptoss_identity(hf: dict, name: str, digest: str | None, path: Path | str = "") -> ModelIdentity:
    """The identity of a gpt-oss model, read from config.json alone: per layer a key and a value per
    KV head as Llama's, with what else decides them (biased projections, YaRN RoPE, which layers
    slide and their window, the experts) and how attention uses them (a learned sink per head), in
    `extra`, so no other architecture's chunk ever matches. Facts its config lacks: one-line ModelError."""
    try:
        layers = int(hf["num_hidden_layers"])
        types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        if len(types) != layers or any(kind not in ("sliding_attention", "full_attention") for kind in types):
            raise ValueError(f"layer_types {types}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(hf.get("rope_theta", rope.pop("rope_theta", 10000.0)))
        return ModelIdentity(
            weights_digest=digest, name=name, architecture="GptOssForCausalLM", num_layers=layers,
            num_attention_heads=int(hf["num_attention_heads"]), num_kv_heads=int(hf["num_key_value_heads"]),
            head_dim=int(hf["head_dim"]), hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope={"rope_theta": theta, "rope_scaling": rope or None},
            extra={"sliding_window": int(hf["sliding_window"]),
                   "sliding_layers": [i for i, kind in enumerate(types) if kind == "sliding_attention"],
                   "attention_bias": bool(hf.get("attention_bias", True)), "attention_sinks": True,
                   "experts": [int(hf["num_local_experts"]), int(hf["num_experts_per_tok"])]})
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ModelError(f"{path}: config.json of a gpt-oss model lacks or mistypes {err}") from None


# "org/name": a Hugging Face Hub id (a local folder of that name wins).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def model_folder(path: str | Path | None) -> tuple[Path, str]:
    """(folder, name) of a model as `load_model` finds it: a local folder, a Hub id already in the
    local Hugging Face cache (never downloaded), or `None`: the embedded default model. For other
    engines that read the same folders (transformers)."""
    if path is None:
        from .default_model import MODEL_NAME, default_model_path

        return default_model_path(), MODEL_NAME
    if Path(path).expanduser().exists() or not HUB_ID.fullmatch(str(path)):
        folder = Path(path).expanduser()
        name = folder.resolve().name if folder.exists() else folder.name
    else:
        folder, name = hub_cache_folder(str(path)), str(path).split("/")[-1]
    if not folder.is_dir():
        raise ModelError(f"model folder not found: {folder}")
    return folder, name


def hub_cache_folder(repo_id: str) -> Path:
    """The snapshot folder of a Hub model in the local Hugging Face cache, found by
    huggingface_hub's own resolution with local files only: nothing is downloaded."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ModelError(f"{repo_id!r} is not a folder here, and finding a Hub id in the Hugging Face cache "
                         f"needs huggingface_hub: pip install 'kvtool[model]'") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise ModelError(f"model {repo_id!r} is neither a folder nor in the Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}); kvtool never downloads: fetch it first "
                         f"(hf download {repo_id}) or give its folder") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelError(f"{path.parent}: no {path.name}")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise ModelError(f"cannot read {path}: {err}") from None
    if not isinstance(doc, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def config_from_hf(hf: dict, path: Path | str = "") -> ModelConfig:
    archs = hf.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise unsupported(arch, path)
    try:
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if hf.get("mlp_bias"):
            raise ModelError(f"{path}: MLP biases are not supported")
        fields = family_fields(arch, hf, path, *rope_from_hf(hf))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **fields,
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as err:
        raise ModelError(f"{path}: bad config.json ({type(err).__name__}: {err})") from None
    theta = cfg.rope_theta
    sizes = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "head_dim": head_dim, "num_hidden_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
             "intermediate_size": cfg.intermediate_size, "max_position_embeddings": cfg.max_position_embeddings,
             "sliding_window": cfg.sliding_window or 1}
    bad = [f"{k} = {v}" for k, v in sizes.items() if v < 1] + ([f"rope_theta = {theta}"] if not theta > 0 else [])
    bad += [f"rope_local_base_freq = {cfg.rope_local_theta}"] if cfg.rope_local_theta is not None \
        and not cfg.rope_local_theta > 0 else []
    if bad:
        raise ModelError(f"{path}: bad config.json ({', '.join(bad)}: must be positive)")
    if heads % kv_heads:
        raise ModelError(f"{path}: {heads} attention heads not divisible by {kv_heads} KV heads")
    if head_dim % 2:
        raise ModelError(f"{path}: bad config.json (head_dim = {head_dim}: RoPE needs it even)")
    rope_inv_freq(cfg)  # raises ModelError for an unsupported scaling type
    return cfg


def identity_from_config(config: ModelConfig, name: str, weights_digest: str | None = None) -> ModelIdentity:
    return ModelIdentity(
        weights_digest=weights_digest,
        name=name,
        architecture=config.architecture,
        num_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        rope=identity_rope(config),
        extra=identity_extra(config),
    )


def weights_files(path: Path) -> list[str]:
    """The safetensors files a folder's weights are in, by name (sharded: as its index says)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors weights (other formats are not supported)")
    return files


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = weights_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(str(path / name)))
        except (OSError, SafetensorError) as err:
            raise ModelError(f"cannot read {path / name}: {err}") from None
    return tensors


def _load_weights(path: Path, cfg: ModelConfig, hf: dict, dtype: torch.dtype,
                  device: torch.device | str) -> Weights:
    raw = _read_safetensors(path)
    family = FAMILIES[cfg.architecture]
    # Some checkpoints omit the "model." prefix.
    prefix = "model." if "model.embed_tokens.weight" in raw else ""

    def take(name: str, required: bool = True, norm: bool = False) -> torch.Tensor | None:
        t = raw.pop(name, None)
        if t is None:
            if required:
                raise ModelError(f"{path}: weight {name} missing")
            return None
        if norm and family.float32_norms:  # these families scale in float32 (model.rms_norm)
            return t.to(device=device, dtype=torch.float32) + (1.0 if family.gemma_norms else 0.0)
        # Always a fresh, owned copy: safetensors hands out views of the memory-mapped
        # file, which GEMMs stream more slowly than anonymous memory (and which would
        # tie the model to a file that a re-conversion may replace).
        out = t.to(device=device, dtype=dtype)
        return out.clone() if out.data_ptr() == t.data_ptr() else out

    def cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ModelError(f"{path}: only some of q/k/v have a bias")
        return torch.cat(parts, dim=0).contiguous()

    layers = []
    qk_norm = cfg.qk_norm is not None
    for i in range(cfg.num_layers):
        p = f"{prefix}layers.{i}."
        if family.fused:  # Phi-3: q, k, v and gate, up already stacked as kvtool stacks them
            wqkv, bqkv = take(p + "self_attn.qkv_proj.weight"), take(p + "self_attn.qkv_proj.bias", False)
            w_gate_up = take(p + "mlp.gate_up_proj.weight")
        else:
            wqkv = cat(*(take(p + f"self_attn.{x}_proj.weight") for x in "qkv"))  # [(H+2Hkv)*D, E]
            bqkv = cat(*(take(p + f"self_attn.{x}_proj.bias", False) for x in "qkv"))
            w_gate_up = cat(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))  # [2F, E]
        layers.append(LayerWeights(
            wqkv=wqkv, bqkv=bqkv, w_gate_up=w_gate_up,
            wo=take(p + "self_attn.o_proj.weight"),
            bo=take(p + "self_attn.o_proj.bias", False),
            w_down=take(p + "mlp.down_proj.weight"),
            q_norm=take(p + "self_attn.q_norm.weight", norm=True) if qk_norm else None,
            k_norm=take(p + "self_attn.k_norm.weight", norm=True) if qk_norm else None,
            **{"attn_norm": None, "mlp_norm": None,  # the family's norms, by its names
               **{field: take(p + name + ".weight", norm=True) for field, name in family.norms.items()}},
        ))
        del wqkv, w_gate_up
    embed = take(prefix + "embed_tokens.weight")
    norm = take(prefix + "norm.weight", norm=True)
    lm_head = take("lm_head.weight", required=False)
    if lm_head is None or cfg.tie_word_embeddings:
        lm_head = embed
    expected = (cfg.vocab_size, cfg.hidden_size)
    if tuple(embed.shape) != expected:
        raise ModelError(f"{path}: embed_tokens has shape {tuple(embed.shape)}, "
                         f"config says {expected}")
    q_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    if layers and tuple(layers[0].wqkv.shape) != (q_rows, cfg.hidden_size):
        raise ModelError(f"{path}: attention weights do not match config.json's head counts")
    if layers and tuple(layers[0].w_gate_up.shape) != (2 * cfg.intermediate_size, cfg.hidden_size):
        raise ModelError(f"{path}: MLP weights do not match config.json's intermediate_size")
    if qk_norm and layers:
        width = cfg.head_dim if cfg.qk_norm == "head" else cfg.num_kv_heads * cfg.head_dim
        if tuple(layers[0].k_norm.shape) != (width,):
            raise ModelError(f"{path}: k_norm has shape {tuple(layers[0].k_norm.shape)}, the family needs ({width},)")
    return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
