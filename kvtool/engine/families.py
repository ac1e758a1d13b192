"""The model families kvtool's engine runs: from a Hugging Face config to `ModelConfig`'s switches.

One entry per architecture of `config.json`: how its config maps onto the engine's switches
(`family_fields`), what its weights are called (`Family`), and whether CacheBlend's re-rotation of
cached keys holds for it (`Family.blend`, docs/models.md). What a family
has that the engine does not run is refused in one line (`ModelError`) naming what it runs.
The facts come from transformers 5.19's modeling files of each family; tests/test_families.py
holds the engine to transformers on tiny random models of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelError
from .model import ModelConfig

# LayerWeights' norms -> the weight's name inside a layer, by where the family puts its norms.
PRE_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}  # Llama
SANDWICH_NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",  # Gemma
                  "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
POST_NORMS = {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}  # OLMo 2

RE_ROTATION = ("holds: keys are RoPE'd projections of the layer's input, and a move to new positions is "
               "one more turn")


@dataclass(frozen=True)
class Family:
    label: str
    norms: dict[str, str]
    blend: str  # whether --blend's re-rotation holds, and what differs
    gemma_norms: bool = False  # RMSNorm scales by (1 + w), in float32
    float32_norms: bool = False  # the norm scales before rounding to a half dtype (its weights kept in float32)
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj, already kvtool's stacked layout


WINDOW_NOTE = ("; sliding-window layers attend within the window at the new positions, as the segment's own "
               "tokens did when captured alone (only what a token saw across a segment's start differs, as in "
               "every layer: what the recompute repairs)")

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("Llama", PRE_NORMS, RE_ROTATION + " (plain, linear and llama3 RoPE)"),
    "MistralForCausalLM": Family("Mistral", PRE_NORMS, RE_ROTATION + WINDOW_NOTE),
    "Qwen2ForCausalLM": Family("Qwen2", PRE_NORMS, RE_ROTATION + " (the q/k/v biases come before RoPE)"),
    "Qwen3ForCausalLM": Family("Qwen3", PRE_NORMS, RE_ROTATION + ": the RMSNorm of each key head comes before "
                               "RoPE" + WINDOW_NOTE),
    "Gemma2ForCausalLM": Family("Gemma 2", SANDWICH_NORMS, RE_ROTATION + "; soft-capping acts on scores, not "
                                "on keys" + WINDOW_NOTE, gemma_norms=True, float32_norms=True),
    "Gemma3ForCausalLM": Family("Gemma 3", SANDWICH_NORMS, RE_ROTATION + ": the key norm comes before RoPE; "
                                "sliding layers' keys turn with their own base (rope_local_theta), the global "
                                "layers' with theirs" + WINDOW_NOTE, gemma_norms=True, float32_norms=True),
    "Phi3ForCausalLM": Family("Phi-3", PRE_NORMS, RE_ROTATION + " (full-width RoPE; longrope is refused at "
                              "load)" + WINDOW_NOTE, fused=True),
    "Olmo2ForCausalLM": Family("OLMo 2", POST_NORMS, RE_ROTATION + ": the RMSNorm of the whole key projection "
                               "comes before RoPE", float32_norms=True),
}

RUNS = ("kvtool's engine runs " + ", ".join(f"{f.label} ({arch})" for arch, f in FAMILIES.items()))

# Architectures people will try, refused with the reason.
REFUSED = {
    "Gemma3ForConditionalGeneration": "the image-and-text Gemma 3; the engine runs the text-only "
                                      "Gemma3ForCausalLM (Gemma 3 1B, or a text-only export)",
    "Qwen3MoeForCausalLM": "mixture-of-experts MLPs are not in the engine",
    "MixtralForCausalLM": "mixture-of-experts MLPs are not in the engine",
    "PhiForCausalLM": "Phi-1/2 (LayerNorm, partial rotary, a parallel MLP) is not Phi-3",
    "Olmo3ForCausalLM": "OLMo 3's sliding-window layout is not in the engine; it runs OLMo 2",
}


def unsupported(arch: Any, path: Path | str) -> ModelError:
    why = REFUSED.get(arch) if isinstance(arch, str) else None
    return ModelError(f"{path}: unsupported architecture {arch!r}" + (f" ({why})" if why else "") + f"; {RUNS}")


def family_fields(arch: str, hf: dict, path: Path | str, theta: float, scaling: dict | None) -> dict[str, Any]:
    """`ModelConfig`'s per-family fields for `arch` (rope_theta and rope_scaling as read from `hf`;
    Gemma 3 gives its own), and the sliding window. Raises ModelError for what the engine does not run."""
    label = FAMILIES[arch].label
    partial = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelError(f"{path}: {label} with partial rotary embeddings (partial_rotary_factor {partial}) is "
                         f"not supported; the engine runs RoPE over the whole head")
    if hf.get("use_bidirectional_attention"):
        raise ModelError(f"{path}: {label} with bidirectional attention (an embedding model) is not supported; "
                         f"the engine runs causal decoders")
    fields: dict[str, Any] = {"rope_theta": theta, "rope_scaling": scaling}
    if arch.startswith("Gemma"):
        fields.update(_gemma(arch, hf, path))
    else:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"{path}: {label} with activation {act!r} is not supported (the engine runs SiLU)")
    if arch == "Phi3ForCausalLM" and (scaling or {}).get("rope_type") in ("longrope", "su", "yarn"):
        raise ModelError(f"{path}: Phi-3 with longrope scaling (the 128k-context models) is not supported: its "
                         f"factors switch with the sequence length; the engine runs Phi-3 with plain RoPE (4k models)")
    if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        fields["qk_norm"] = "head"
    elif arch == "Olmo2ForCausalLM":
        fields["qk_norm"] = "full"
    fields.update(_window(arch, hf, path))
    if arch == "Gemma3ForCausalLM" and fields.get("sliding_window") is None:
        raise ModelError(f"{path}: Gemma 3 without a sliding_window is not supported (its sliding layers' RoPE "
                         f"base goes with their window in the engine)")
    return fields


def _gemma(arch: str, hf: dict, path: Path | str) -> dict[str, Any]:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelError(f"{path}: {FAMILIES[arch].label} with activation {act!r} is not supported "
                         f"(the engine runs gelu_pytorch_tanh)")
    hidden = int(hf["hidden_size"])
    fields = {"activation": "gelu_tanh", "embed_scale": math.sqrt(hidden),
              "attn_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
              "final_softcap": _positive(hf.get("final_logit_softcapping"), "final_logit_softcapping", path)}
    if arch == "Gemma2ForCausalLM":  # Gemma 3's attention ignores attn_logit_softcapping (as transformers does)
        fields["attn_softcap"] = _positive(hf.get("attn_logit_softcapping"), "attn_logit_softcapping", path)
    else:
        fields.update(_gemma3_rope(hf, path))
    return fields


def _positive(value: Any, name: str, path: Path | str) -> float | None:
    if value is None:
        return None
    if not float(value) > 0:
        raise ModelError(f"{path}: bad config.json ({name} = {value}: must be positive or null)")
    return float(value)


def _gemma3_rope(hf: dict, path: Path | str) -> dict[str, Any]:
    """Gemma 3's two RoPE settings: transformers 5 writes rope_parameters per layer type, 4.x wrote
    rope_theta (global), rope_scaling (global) and rope_local_base_freq."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta, scaling = rope_from_hf({"rope_parameters": {"rope_theta": 1_000_000.0, **full}})
        local_theta, local_scaling = rope_from_hf({"rope_parameters": {"rope_theta": 10_000.0, **local}})
        if local_scaling is not None:
            raise ModelError(f"{path}: Gemma 3 with RoPE scaling on its sliding layers "
                             f"({local_scaling.get('rope_type')!r}) is not supported (the engine runs plain RoPE there)")
    else:
        theta, scaling = rope_from_hf({"rope_theta": 1_000_000.0, **hf})
        local_theta = float(hf.get("rope_local_base_freq", 10_000.0))
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


def _window(arch: str, hf: dict, path: Path | str) -> dict[str, Any]:
    """sliding_window and sliding_layers as transformers 5.19 reads them for `arch`."""
    window = hf.get("sliding_window")
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if arch in ("LlamaForCausalLM", "Olmo2ForCausalLM"):
        return {}  # they never slide
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):  # every layer, when set
        return {"sliding_window": int(window)} if window else {}
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not hf.get("use_sliding_window", False) or not window:
            return {}
        if types is None:
            types = ["sliding_attention" if i >= int(hf.get("max_window_layers", 28)) else "full_attention"
                     for i in range(layers)]
    elif types is None:  # Gemma: every other layer (2), or five of every six (3)
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern",
                                                                    hf.get("_sliding_window_pattern", 6)))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"sliding_attention",
                                                                                   "full_attention"}:
        raise ModelError(f"{path}: bad config.json (layer_types must list full_attention or sliding_attention "
                         f"for each of the {layers} layers)")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not window or not sliding:
        return {}
    return {"sliding_window": int(window), "sliding_layers": sliding}


def rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from a transformers 4.x (rope_theta/rope_scaling) or 5.x
    (rope_parameters) config; scaling is None for plain RoPE, else a dict with
    "rope_type" (never the legacy "type") and its factors, without the theta."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = dict(hf.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return float(theta), scaling


def identity_rope(config: ModelConfig) -> dict[str, Any]:
    """`model.rope` of a file: theta and scaling, and where sliding layers have their own base
    (Gemma 3) that base and the layers (format-spec/segment.md §3)."""
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling}
    if config.rope_local_theta is not None:
        rope["rope_local_theta"] = config.rope_local_theta
        rope["local_layers"] = [i for i in range(config.num_layers) if config.layer_window(i) is not None]
    return rope


def identity_extra(config: ModelConfig) -> dict[str, Any]:
    """`model.extra`: the switches that change KV values beyond the identity's own fields, where
    they differ from Llama's (so a Llama, Mistral or Qwen2 file keeps the fingerprint it had)."""
    extra: dict[str, Any] = {}
    if config.sliding_layers is not None:
        extra["sliding_window"] = config.sliding_window
        extra["sliding_layers"] = list(config.sliding_layers)
    for name, default in (("qk_norm", None), ("activation", "silu"), ("embed_scale", None),
                          ("attn_scale", None), ("attn_softcap", None), ("final_softcap", None)):
        if getattr(config, name) != default:
            extra[name] = getattr(config, name)
    return extra
