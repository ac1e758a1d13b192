"""kvtool's built-in engine: a small runner of the Llama family and its relatives (Mistral,
Qwen2/3, Gemma 2/3, Phi-3, OLMo 2: `families.py`) on a real paged KV cache.

Public API::

    load_model(path: str | Path | None = None, dtype=torch.float32, device="cpu") -> LoadedModel
        A local HF folder (config.json, *.safetensors, tokenizer.json); None = the
        embedded default model (SmolLM2-135M-Instruct, converted once from GGUF).
        LoadedModel: .config (ModelConfig) .weights .tokenizer (.encode/.decode)
        .identity (kvtool.identity.ModelIdentity) .max_position_embeddings

    default_model_path() -> Path
        The cached HF folder of the default model (converts it on first use).

    PagedKVCache(config, num_blocks, block_size=16, kv_dtype=torch.float32,
                 device="cpu", shuffle_seed=None)
    PagedKVCache.for_tokens(config, num_tokens, block_size=16, kv_dtype=..., shuffle_seed=None)
        .kv_caches: list[Tensor], one per layer, [2, num_blocks, block_size, Hkv, D]
        (K at index 0, V at 1); .allocator: BlockAllocator; .new_sequence(num_tokens=0)

    Sequence: .block_table (list[int]), .num_tokens, .reserve(n),
        .slot_mapping(num_tokens, start=0) -> LongTensor of
        block_table[pos // block_size] * block_size + pos % block_size

    Runner(model, cache)
        .prefill(seq, tokens, start_pos=0, prefill_chunk=2048, logits="all") -> Tensor [n, V]
            Positions 0..start_pos-1 must already be in the cache.
        .decode_step(seq, token) -> Tensor [V]
        .generate(seq, prompt_tokens, max_new_tokens, prefill_chunk=2048,
                  stop_tokens=None, start_pos=0) -> list[int]   (greedy)

Blended prefill (CacheBlend; kvtool/engine/blend.py)::

    Segment(tokens, kv=None, stored_start=0, identity=None)
        kv: KV_BLOB [2, L, T, C] of the tokens computed alone from stored_start; None = uncached
    capture_segment(model, tokens, kv_dtype=torch.float32) -> Segment
    blend_prefill(runner, seq, segments, question_tokens=(), recompute_ratio=0.15,
                  check_layer=1) -> BlendResult
        .logits [V] (the last position; Runner.decode_step continues), .tokens, .cached [n],
        .prefix, .recomputed (positions run from the check layer on), .deviation [n],
        .recomputed_cached, .recompute_fraction

What the operations need of an engine (kvtool/engine/protocol.py; kvtool's runner is adapted in
`kvtool.ops.engines`, transformers in `kvtool.integrations.hf.engine`)::

    Engine: .name .identity .config .tokenizer .device .dtype .max_position_embeddings
        .kind ("kvtool" or "hf") .run_metadata(block_size) .capture_steps(...) -> CaptureSteps
        .new_sequence(total, kv_dtype, block_size, seed) -> CachedSequence
        .recompute(tokens, continue_tokens, ...) -> Reference (logits, tokens, ttft_s)
    CachedSequence: .load(load, num_tokens) .prefill(tokens, start, logits, prefill_chunk)
        .generate(tokens, start, max_new_tokens, first, prefill_chunk) .continue_from(tokens, keep, n)

Typical capture::

    model = load_model(None)
    cache = PagedKVCache.for_tokens(model.config, len(ids), kv_dtype=torch.bfloat16, shuffle_seed=0)
    seq = cache.new_sequence(len(ids))
    Runner(model, cache).prefill(seq, ids, logits="last")
    connector.save(cache.kv_caches, seq.slot_mapping(len(ids)))
"""

from ..lazy import lazy_attributes

# Loaded on first use, so that `kvtool.engine.default_model` (which `kvtool info` reads)
# does not import torch.
_EXPORTS = {
    "default_model_path": "default_model",
    "SUPPORTED_ARCHITECTURES": "loader", "LoadedModel": "loader", "Tokenizer": "loader", "load_model": "loader",
    "ModelConfig": "model", "logits_from_hidden": "model",
    "BlockAllocator": "paged", "PagedKVCache": "paged", "Sequence": "paged",
    "Runner": "runner",
    "BlendResult": "blend", "Segment": "blend", "blend_prefill": "blend", "capture_segment": "blend",
    "CachedSequence": "protocol", "CaptureSteps": "protocol", "Engine": "protocol", "Reference": "protocol",
}


__getattr__, __dir__ = lazy_attributes(__name__, {name: f".{module}" for name, module in _EXPORTS.items()})

__all__ = sorted(_EXPORTS)
