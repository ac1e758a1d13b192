"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) in transformers: an mla_latent file
(format-spec/container.md 3.2) to the cache transformers' DeepSeek implementation keeps, and back.

transformers (5.x) caches MLA as it runs it: per layer the latent, not the heads' keys and values
(`DeepseekV3Attention.forward` updates the cache with `kv_nope` [B, 1, T, kv_lora_rank], after
`kv_a_layernorm`, as the keys and `k_rot` [B, 1, T, qk_rope_head_dim], after RoPE, as the values,
and expands both with the model's own `kv_b_proj` at every step). So the latent moves both ways
with no weights involved; only the rotated part's order differs: transformers' interleaved RoPE
(`rope_interleave`) writes each pair's two members at i and i + P/2, the file (like DeepSeek's
reference code and vLLM) at 2i and 2i + 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from ...engine.loader import latent_identity, weights_digest, weights_files
from ...errors import ModelError, UnsupportedCache, UsageError
from ...format import ContainerReader, ContainerWriter
from ...format.made_by import check_made_by, check_vocabulary
from ...identity import ModelIdentity
from ...load import file_tasks
from ...load.tensors import load_blob


def is_latent_model(model) -> bool:
    """Whether a transformers model (or config) uses multi-head latent attention."""
    config = getattr(model, "config", model)
    if not hasattr(config, "get_text_config"):  # not a transformers model: HFModel.of says so
        return False
    return getattr(config.get_text_config(decoder=True), "kv_lora_rank", None) is not None


def identity_of(model) -> ModelIdentity:
    """The model's identity as vLLM's connector records it (kvtool.engine.loader.latent_identity
    over the folder's config.json and weights), so that files and store chunks of one model meet."""
    import json

    where = Path(str(getattr(model, "name_or_path", "") or "")).expanduser()
    if where.is_dir() and (where / "config.json").is_file():
        config = json.loads((where / "config.json").read_text())
        return latent_identity(config, where.resolve().name, weights_digest(where, weights_files(where)), where)
    return latent_identity(model.config.to_dict(), type(model).__name__, None)


def _check_rope(model) -> tuple[int, int]:
    """(kv_lora_rank, rope_dim); UnsupportedCache where transformers rotates in another convention."""
    text = model.config.get_text_config(decoder=True)
    if not getattr(text, "rope_interleave", True):
        raise UnsupportedCache(f"{type(model).__name__} rotates its latent's RoPE part half-split (rope_interleave "
                               f"False), not in the interleaved pairs an mla_latent file holds")
    return int(text.kv_lora_rank), int(text.qk_rope_head_dim)


def latent_to_cache(reader: ContainerReader, model, prompt: list[int] | None, leave_last: bool,
                    allow_other_weights: bool) -> tuple[DynamicCache, list[int]]:
    """A file's latent of the tokens `prompt` shares with it, as the model's cache."""
    rank, rope_dim = _check_rope(model)
    identity = identity_of(model)
    check_made_by(reader, identity, allow_other_weights=allow_other_weights,
                  other_weights_hint="allow_other_weights=True to load it anyway")
    if reader.manifest.kv_layout != "mla_latent":
        raise UsageError(f"{reader.path} holds K and V ({reader.manifest.kv_layout}), not an MLA latent")
    stored = reader.token_ids().tolist()
    tokens = stored if prompt is None else prompt
    check_vocabulary(tokens, identity.vocab_size)
    shared = next((i for i, (a, b) in enumerate(zip(stored, tokens)) if a != b), min(len(stored), len(tokens)))
    n = min(shared, len(tokens) - 1) if leave_last else shared
    cache = DynamicCache(config=model.config)
    if n == 0:
        return cache, tokens
    with torch.inference_mode(False):  # (a caller's inference mode: the load's threads must write the tensor)
        latent = load_blob(file_tasks(reader, n), (1, identity.num_layers, n, rank + rope_dim), reader.kv_dtype)
    param = next(model.parameters())
    for layer in range(identity.num_layers):
        values = latent[0, layer].to(device=param.device, dtype=param.dtype)
        rot = values[:, rank:]
        k_rot = torch.cat([rot[:, 0::2], rot[:, 1::2]], dim=-1)  # the file's pairs to transformers' halves
        cache.update(values[None, None, :, :rank].contiguous(), k_rot[None, None].contiguous(), layer)
    return cache, tokens


def latent_from_cache(cache, ids: list[int], path, model, *, codec: str = "raw", kv_dtype=None,
                      chunk_size: int = 256, metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """The model's cache (one sequence) as an mla_latent file: transformers keeps the latent
    itself, so nothing is lost (see the module docstring)."""
    rank, rope_dim = _check_rope(model)
    identity = identity_of(model)
    layers = cache.layers
    if len(layers) != identity.num_layers or layers[0].keys is None:
        raise UsageError(f"the cache holds {len(layers)} layers; {identity.name} has {identity.num_layers}")
    keys0 = layers[0].keys
    if keys0.dim() != 4 or keys0.shape[0] != 1 or keys0.shape[1] != 1 or keys0.shape[3] != rank:
        raise UnsupportedCache(f"the cache's layers hold {list(keys0.shape)}, not transformers' MLA latent "
                               f"[1, 1, T, {rank}]: the latent cannot be recovered from it")
    held = keys0.shape[2]
    if len(ids) == held + 1:
        ids = ids[:held]
    elif len(ids) != held:
        raise UsageError(f"the cache holds {held} tokens and token_ids has {len(ids)}")
    check_vocabulary(ids, identity.vocab_size)
    kv_dtype = kv_dtype or (keys0.dtype if keys0.dtype in (torch.float32, torch.float16, torch.bfloat16)
                            else torch.bfloat16)
    half = rope_dim // 2
    with ContainerWriter(path, identity, ids, kv_dtype=kv_dtype, chunk_size=chunk_size,
                         metadata={"engine": "transformers", **(metadata or {})}) as writer:
        for start, end in writer.chunk_ranges():
            chunk = torch.empty(1, identity.num_layers, end - start, rank + rope_dim, dtype=writer.kv_dtype)
            for i, layer in enumerate(layers):
                rot = layer.values[0, 0, start:end]
                chunk[0, i, :, :rank] = layer.keys[0, 0, start:end].cpu()
                chunk[0, i, :, rank::2] = rot[:, :half].cpu()  # transformers' halves back to the file's pairs
                chunk[0, i, :, rank + 1::2] = rot[:, half:].cpu()
            writer.write_chunk(chunk, codec)
    return {"path": str(writer.path), "num_tokens": len(ids), "num_chunks": len(writer.chunks),
            "fingerprint": identity.fingerprint()}


__all__ = ["identity_of", "is_latent_model", "latent_from_cache", "latent_to_cache"]
