"""Multi-head latent attention in transformers (kvtool.hf, issue 48): a tiny random DeepSeek-V3
(kv_lora_rank 512, qk_rope_head_dim 64, as vLLM's CPU MLA kernel needs; 2 layers, hidden size 128,
the default model's tokenizer) made here from a config and seeded weights. transformers caches
MLA's latent itself (kv_a_layernorm'd kv_nope as the layer's keys, the rotated k_rot as its
values): from_cache writes it as an mla_latent file, to_cache puts it back bit for bit, and a
continuation from the file is transformers' own. tests/test_vllm_mla.py takes the same model into
vLLM."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

import kvtool.hf
from kvtool.errors import UnsupportedCache
from kvtool.format import ContainerReader

RANK, ROPE, LAYERS = 512, 64, 2


def make_deepseek(folder: Path) -> Path:
    """A DeepSeek-V3-shaped folder saved by transformers, float32, every layer dense (no experts:
    first_k_dense_replace covers them), weights drawn seeded and large enough that the greedy
    output depends on the prompt."""
    from kvtool.engine.default_model import default_model_path

    config = transformers.DeepseekV3Config(
        vocab_size=49152, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=RANK, q_lora_rank=None, qk_rope_head_dim=ROPE,
        qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=LAYERS, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=2, rope_interleave=True)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weights in model.named_parameters():
            norm = "norm" in name
            weights.copy_(torch.randn(weights.shape, generator=generator) * (0.1 if norm else 0.3) + (1.0 if norm else 0.0))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / name, folder / name)
    return folder


def load(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[Path, object]:
    folder = make_deepseek(tmp_path_factory.mktemp("models") / "tiny-deepseek-v3")
    return folder, load(folder)


def prefill(model, ids: list[int]):
    with torch.inference_mode():
        return model(torch.tensor([ids]), use_cache=True,
                     past_key_values=transformers.DynamicCache(config=model.config)).past_key_values


IDS = [(i * 37 + 11) % 49000 + 100 for i in range(70)]


def test_a_transformers_latent_goes_to_a_file_and_back_bit_for_bit(deepseek, tmp_path):
    folder, model = deepseek
    cache = prefill(model, IDS)
    assert cache.layers[0].keys.shape == (1, 1, len(IDS), RANK)  # transformers keeps the latent, not the heads
    saved = kvtool.hf.from_cache(cache, IDS, tmp_path / "hf.kvc", model, codec="zstd", chunk_size=32)
    assert saved.num_tokens == len(IDS) and saved.num_chunks == 3
    with ContainerReader(tmp_path / "hf.kvc") as reader:
        assert reader.version == "1.1" and reader.manifest.kv_layout == "mla_latent"
        assert reader.manifest.model["extra"]["kv_lora_rank"] == RANK
        latent = reader.read_range(0, len(IDS))
    # the file's rotated part is in DeepSeek's interleaved pairs; transformers holds the halves
    assert torch.equal(latent[0, 0, :, RANK::2], cache.layers[0].values[0, 0, :, :ROPE // 2])
    again, input_ids = kvtool.hf.to_cache(tmp_path / "hf.kvc", model, leave_last_token=False)
    assert input_ids[0].tolist() == IDS
    for mine, theirs in zip(again.layers, cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_the_files_rotated_part_is_k_pe_turned_in_pairs_at_its_own_position(deepseek, tmp_path):
    """container.md 3.2's k_pe, from the model's own projection: channels R + 2i and R + 2i + 1
    turned by position * inv_freq[i] (rope_theta 10000), at each token's own position, in every
    token (the convention vLLM's native rotary op writes, tests/test_vllm_mla_rope.py)."""
    folder, model = deepseek
    kvtool.hf.from_cache(prefill(model, IDS), IDS, tmp_path / "hf.kvc", model)
    with ContainerReader(tmp_path / "hf.kvc") as reader:
        stored = reader.read_range(0, len(IDS))[0, 0, :, RANK:].double()
    with torch.no_grad():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([IDS])))
        raw = model.model.layers[0].self_attn.kv_a_proj_with_mqa(hidden)[0, :, RANK:].double()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    angle = torch.arange(len(IDS), dtype=torch.float64)[:, None] * inv_freq
    a, b = raw[:, 0::2], raw[:, 1::2]
    turned = torch.stack((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), dim=-1).flatten(-2)
    assert ((stored - turned).norm() / turned.norm()).item() < 1e-5


def test_a_continuation_from_the_file_is_transformers_own(deepseek, tmp_path):
    folder, model = deepseek
    kvtool.hf.from_cache(prefill(model, IDS), IDS, tmp_path / "hf.kvc", model)
    with torch.inference_mode():
        plain = model.generate(torch.tensor([IDS]), max_new_tokens=8, do_sample=False)
        cached = kvtool.hf.generate(model, tmp_path / "hf.kvc", max_new_tokens=8, do_sample=False)
    assert cached.tolist() == plain.tolist()
    assert len(set(plain[0, len(IDS):].tolist())) > 2  # the random model's output is no repeated token


def test_a_cache_without_the_latent_is_refused_in_one_line(deepseek, tmp_path):
    folder, model = deepseek
    heads = transformers.DynamicCache()
    for layer in range(LAYERS):  # keys and values after kv_b_proj: the latent cannot be recovered from them
        heads.update(torch.zeros(1, 4, 5, 96), torch.zeros(1, 4, 5, 32), layer)
    with pytest.raises(UnsupportedCache) as err:
        kvtool.hf.from_cache(heads, IDS[:5], tmp_path / "x.kvc", model)
    assert "the latent cannot be recovered from it" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "x.kvc").exists()


def test_the_kv_blob_engine_still_refuses_mla_naming_the_way_in(deepseek):
    from kvtool.integrations.hf.models import check_plain_kv

    with pytest.raises(UnsupportedCache, match="kvtool.hf.to_cache and from_cache move its latent"):
        check_plain_kv(deepseek[1].config)
