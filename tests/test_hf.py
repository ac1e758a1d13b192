"""Hugging Face transformers in and out (`kvtool.hf`, `capture --engine hf`, `replay --engine hf`).

On tiny random models saved with `save_pretrained` (Llama; Qwen2, whose q/k/v have biases), with a
byte-level tokenizer and a chat template, and on the default model where it is cheap:

- a transformers cache -> a kvtool file -> a transformers cache: the same tensors;
- a kvtool capture (either engine) -> `to_cache` -> `generate`: the tokens transformers' own greedy
  `generate` gives; the cache holds all but the prompt's last token (transformers' convention);
- a store's prefix and a dump as sources; every refusal in one line;
- the commands, and what the file and the dump record of how the prompt became tokens.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import cli, save_tiny_model
import torch

transformers = pytest.importorskip("transformers")

import kvtool  # noqa: E402
import kvtool.hf  # noqa: E402
from kvtool.errors import ModelMismatch, NotAPrefixCache, UnsupportedCache, UsageError  # noqa: E402
from kvtool.format import ContainerReader, ContainerWriter  # noqa: E402
from kvtool.format.segment import segment_extension  # noqa: E402
from kvtool.integrations.hf.models import HFModel, check_plain_kv, config_digest  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the woods."


def load(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    """(folder, transformers model) of a tiny Llama and a tiny Qwen2."""
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return folder, load(folder)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    return folder, load(folder)


def prompt_ids(model_folder: Path, text: str = PROMPT) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(model_folder).encode(text)


def greedy_reference(model, ids: list[int], new: int) -> list[int]:
    """transformers' own greedy generate from the whole prompt, no cache given."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def prefilled(model, ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True).past_key_values




def one_line_error(err: str) -> str:
    assert err.startswith("kvtool: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --- transformers cache <-> kvtool file ------------------------------------------------------------


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_transformers_cache_round_trips_through_a_file_unchanged(tiny, tmp_path, codec):
    folder, model = tiny
    ids = prompt_ids(folder)
    cache = prefilled(model, ids)
    saved = kvtool.hf.from_cache(cache, ids, tmp_path / "c.kvc", model, codec=codec, chunk_size=16)
    chunks = -(-len(ids) // 16)
    assert (saved.num_tokens, saved.num_chunks, saved.kv_dtype, saved.codec) == (len(ids), chunks, "float32", codec)
    back, input_ids = kvtool.hf.to_cache(tmp_path / "c.kvc", model, leave_last_token=False)
    assert input_ids.tolist() == [ids] and back.get_seq_length() == len(ids)
    for mine, theirs in zip(back.layers, cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    with ContainerReader(tmp_path / "c.kvc") as reader:
        meta = reader.manifest.metadata
        assert reader.fingerprint == HFModel.of(model).identity.fingerprint()
        assert reader.model["weights_digest"].startswith("sha256:")
    assert meta["engine"] == f"transformers {transformers.__version__}"
    assert meta["config_digest"] == config_digest(model.config, type(model).__name__)


def test_from_cache_takes_what_generate_returns(llama, tmp_path):
    """generate's sequences hold one token more than its cache (the newest is not computed yet):
    the file holds the cached ones."""
    folder, model = llama
    ids = prompt_ids(folder)
    out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    saved = kvtool.hf.from_cache(out.past_key_values, out.sequences, tmp_path / "g.kvc", model, kv_dtype="bf16")
    assert saved.num_tokens == len(ids) + 4 and saved.kv_dtype == "bfloat16"
    with ContainerReader(tmp_path / "g.kvc") as reader:
        assert reader.token_ids().tolist() == out.sequences[0, :-1].tolist()


# --- a kvtool capture -> to_cache -> generate ------------------------------------------------------


@pytest.mark.parametrize("engine", ["kvtool", "hf"])
def test_a_capture_continues_in_generate_as_transformers_does(tiny, tmp_path, engine):
    folder, model = tiny
    ids = prompt_ids(folder)
    result = kvtool.capture_prompt(tmp_path / "p.kvc", prompt=PROMPT, model=folder, engine=engine, kv_dtype="fp32",
                                   chunk_size=16, device="cpu")
    assert result.engine == engine and result.num_tokens == len(ids)  # hf: the tokenizer's own encoding
    want = greedy_reference(model, ids, 12)
    cache, input_ids = kvtool.hf.to_cache(tmp_path / "p.kvc", model)
    assert cache.get_seq_length() == len(ids) - 1 and input_ids.shape == (1, len(ids))  # the last left to generate
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert out[0, len(ids):].tolist() == want
    assert kvtool.hf.generate(model, tmp_path / "p.kvc", max_new_tokens=12, do_sample=False)[0, len(ids):].tolist() \
        == want


def test_kvtools_own_transformers_calls_warn_of_nothing(llama, tmp_path, capsys):
    """Every warning an error around kvtool's calls into transformers: `kvtool.hf` (to_cache,
    generate, from_cache) and both commands' runs (a capture's prefill; a replay's teacher-forced
    logits and greedy generate). transformers 5.24 deprecates `past_key_values=` for `cache=` with
    a FutureWarning: kvtool passes the keyword the installed version takes."""
    import warnings

    folder, model = llama
    ids = prompt_ids(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvtool.capture_prompt(tmp_path / "p.kvc", prompt=PROMPT, model=folder, engine="hf", kv_dtype="fp32",
                              chunk_size=16, device="cpu")
        cache, input_ids = kvtool.hf.to_cache(tmp_path / "p.kvc", model)
        kvtool.hf.from_cache(cache, input_ids[:, :-1], tmp_path / "again.kvc", model)
        out = kvtool.hf.generate(model, tmp_path / "p.kvc", max_new_tokens=4, do_sample=False)
        code, r, err = cli(capsys, "replay", tmp_path / "p.kvc", "--engine", "hf", "--model", folder, "--compare",
                           "--continue", "4", "--device", "cpu", "--json")
    assert out[0, len(ids):].tolist() == greedy_reference(model, ids, 4)
    assert code == 0 and r["top1_agreement"] == 1.0, err


def test_both_engines_write_the_same_model_and_kv(llama, tmp_path):
    """A Llama folder gives the same identity in either engine (a file moves between them) and KV
    within float32 rounding."""
    folder, _ = llama
    for engine in ("kvtool", "hf"):
        kvtool.capture_prompt(tmp_path / f"{engine}.kvc", prompt=PROMPT, model=folder, engine=engine, kv_dtype="fp32",
                              chunk_size=16, device="cpu")
    with ContainerReader(tmp_path / "kvtool.kvc") as a, ContainerReader(tmp_path / "hf.kvc") as b:
        assert a.model == b.model and a.token_ids().tolist() == b.token_ids().tolist()
        assert (a.read_range(0, a.num_tokens) - b.read_range(0, b.num_tokens)).abs().max() < 1e-5
        assert a.manifest.metadata["engine"] == "kvtool paged runner"
        assert b.manifest.metadata["attn_implementation"] == "sdpa"


def test_kvtool_capture_takes_a_transformers_model(llama, tmp_path):
    """The Python API: `kvtool.capture` of a transformers model, and `capture_prompt` with one
    (its tokenizer found in the folder it was loaded from)."""
    folder, model = llama
    ids = prompt_ids(folder)
    result = kvtool.capture(model, ids, tmp_path / "c.kvc", kv_dtype=torch.float32, chunk_size=16)
    assert (result.engine, result.block_size, result.num_tokens) == ("hf", len(ids), len(ids))
    assert kvtool.capture_prompt(tmp_path / "p.kvc", prompt=PROMPT, model=model, engine="hf", kv_dtype="fp32",
                                 chunk_size=16).num_tokens == len(ids)
    with ContainerReader(tmp_path / "c.kvc") as a, ContainerReader(tmp_path / "p.kvc") as b:
        assert torch.equal(a.read_range(0, len(ids)), b.read_range(0, len(ids))) and a.model == b.model
    with pytest.raises(UsageError, match="a LlamaForCausalLM runs with engine='hf'"):
        kvtool.capture_prompt(tmp_path / "x.kvc", prompt=PROMPT, model=model)


def test_a_whole_cache_continues_with_more_tokens_and_a_new_prompt_reuses_what_it_shares(llama, tmp_path):
    folder, model = llama
    ids = prompt_ids(folder)
    kvtool.hf.from_cache(prefilled(model, ids), ids, tmp_path / "p.kvc", model, chunk_size=16)
    longer = ids + prompt_ids(folder, " Then it sleeps.")
    cache, input_ids = kvtool.hf.to_cache(tmp_path / "p.kvc", model, prompt_ids=longer, leave_last_token=False)
    assert cache.get_seq_length() == len(ids) and input_ids.shape == (1, len(longer))
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert out[0, len(longer):].tolist() == greedy_reference(model, longer, 8)
    other = ids[:20] + prompt_ids(folder, " cat sat on the mat.")  # shares its first 20 tokens with the file
    cache, _ = kvtool.hf.to_cache(tmp_path / "p.kvc", model, prompt_ids=torch.tensor([other]))
    assert cache.get_seq_length() == 20
    assert kvtool.hf.generate(model, tmp_path / "p.kvc", prompt_ids=other, max_new_tokens=8,
                              do_sample=False)[0, len(other):].tolist() == greedy_reference(model, other, 8)


def test_a_store_prefix_becomes_a_cache(llama, tmp_path):
    folder, model = llama
    ids = prompt_ids(folder)
    kvtool.capture_prompt(None, prompt=PROMPT, model=folder, engine="hf", kv_dtype="fp32", chunk_size=16,
                          store=str(tmp_path / "store"), device="cpu")
    cache, input_ids = kvtool.hf.to_cache(tmp_path / "store", model, prompt_ids=ids)
    assert cache.get_seq_length() == (len(ids) - 1) // 16 * 16  # the whole chunks stored, short of the last token
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert out[0, len(ids):].tolist() == greedy_reference(model, ids, 8)
    with kvtool.open_store(tmp_path / "store") as store:  # an open store, another namespace: nothing stored there
        assert kvtool.hf.to_cache(store, model, prompt_ids=ids, namespace="other").cache.get_seq_length() == 0
    with pytest.raises(UsageError, match="give prompt_ids, the prompt to look up"):
        kvtool.hf.to_cache(tmp_path / "store", model)


def test_a_dump_becomes_a_cache_only_from_position_zero(llama, tmp_path, capsys):
    folder, model = llama
    ids = prompt_ids(folder)
    kvtool.hf.from_cache(prefilled(model, ids), ids, tmp_path / "p.kvc", model, chunk_size=16)
    assert cli(capsys, "dump", tmp_path / "p.kvc", "-o", tmp_path / "all.safetensors")[0] == 0
    assert kvtool.hf.generate(model, tmp_path / "all.safetensors", max_new_tokens=8,
                              do_sample=False)[0, len(ids):].tolist() == greedy_reference(model, ids, 8)
    assert cli(capsys, "dump", tmp_path / "p.kvc", "-o", tmp_path / "tail.safetensors", "--chunks", "1-")[0] == 0
    with pytest.raises(NotAPrefixCache, match="a dump of tokens from position 16 .* holds positions from 0 on"):
        kvtool.hf.to_cache(tmp_path / "tail.safetensors", model)
    assert cli(capsys, "dump", tmp_path / "p.kvc", "-o", tmp_path / "one.safetensors", "--layers", "0")[0] == 0
    with pytest.raises(UsageError, match="a dump without layer 1: a cache needs every layer"):
        kvtool.hf.to_cache(tmp_path / "one.safetensors", model)


# --- refusals, each in one line ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")
    return folder, load(folder)


def test_a_file_of_another_model_or_other_weights_is_refused(llama, qwen2, tmp_path):
    folder, model = llama
    ids = prompt_ids(folder)
    kvtool.hf.from_cache(prefilled(model, ids), ids, tmp_path / "p.kvc", model)
    with pytest.raises(ModelMismatch, match=r"p.kvc was made by 'llama\d*' .*, not by the loaded model 'qwen2\d*'"):
        kvtool.hf.to_cache(tmp_path / "p.kvc", qwen2[1])
    tuned = load(save_tiny_model(tmp_path / "tuned", "llama", seed=1))  # the same config, other weights
    with pytest.raises(ModelMismatch, match=r"other weights than the loaded model's: .* "
                                            r"\(allow_other_weights=True to load it anyway\)"):
        kvtool.hf.to_cache(tmp_path / "p.kvc", tuned)
    assert kvtool.hf.to_cache(tmp_path / "p.kvc", tuned, allow_other_weights=True).cache.get_seq_length() \
        == len(ids) - 1


def test_a_segment_placed_elsewhere_is_not_a_prefix_cache(llama, tmp_path):
    folder, model = llama
    ids = prompt_ids(folder)
    cache = prefilled(model, ids)
    identity = HFModel.of(model).identity
    from kvtool.integrations.hf.caches import gather

    with ContainerWriter(tmp_path / "s.kvc", identity, ids, kv_dtype="float32",
                         extensions=segment_extension(5)) as writer:
        writer.write_chunk(gather(cache, identity, 0, len(ids), torch.float32))
    with pytest.raises(NotAPrefixCache, match="rotated for positions from 5, not a prefix cache"):
        kvtool.hf.to_cache(tmp_path / "s.kvc", model)


CACHE_KINDS = [
    (lambda: transformers.MambaConfig(num_hidden_layers=2, hidden_size=16, vocab_size=256),
     "Mamba's cache holds linear_attention layers 0, 1: linear attention or a recurrent state (no K/V per token)"),
    (lambda: transformers.Qwen3NextConfig(num_hidden_layers=4),
     "Qwen3Next's cache holds linear_attention layers 0, 1, 2: linear attention or a recurrent state (no K/V per "
     "token)"),
    (lambda: transformers.JambaConfig(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1),
     "Jamba's cache holds mamba layers 0, 2: linear attention or a recurrent state (no K/V per token)"),
    (lambda: transformers.DeepseekV3Config(num_hidden_layers=2),
     "DeepseekV3 uses multi-head latent attention (MLA): it caches a compressed latent"),
    (lambda: transformers.T5Config(), "T5 is an encoder-decoder model"),
    (lambda: transformers.Gemma3nTextConfig(num_hidden_layers=4, num_kv_shared_layers=2),
     "cache has 2 layers for 4 decoder layers (layers share KV)"),
]


@pytest.mark.parametrize("make,message", CACHE_KINDS, ids=["mamba", "qwen3-next", "jamba", "deepseek-v3-mla", "t5",
                                                              "gemma3n-shared-kv"])
def test_caches_that_are_not_plain_kv_per_layer_are_refused(make, message):
    with pytest.raises(UnsupportedCache) as err:
        check_plain_kv(make())
    assert message in str(err.value) and "\n" not in str(err.value)


def test_plain_and_windowed_caches_are_held():
    assert check_plain_kv(transformers.LlamaConfig(num_hidden_layers=2)) == [None, None]
    assert check_plain_kv(transformers.Gemma2Config(num_hidden_layers=2, sliding_window=64)) == [64, None]


def test_a_capture_longer_than_the_sliding_window_is_refused(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "mistral", "mistral", sliding_window=8)
    code, _, err = cli(capsys, "capture", "--engine", "hf", "--model", folder, "--prompt", "twelve bytes",
                       "-o", tmp_path / "w.kvc", "--device", "cpu")
    assert code == 2 and "sliding-window layers keep only the last 7 tokens: a prompt of 12 would not be all in " \
        "its cache" in one_line_error(err)
    assert not (tmp_path / "w.kvc").exists()
    assert kvtool.capture_prompt(tmp_path / "s.kvc", prompt="short", model=folder, engine="hf",
                                 device="cpu").num_tokens == 5  # within the window: every token's KV is there
    model = load(folder)
    with pytest.raises(UnsupportedCache, match="sliding-window layer that kept the last 7 of 12 tokens"):
        kvtool.hf.from_cache(prefilled(model, list(range(12))), list(range(12)), tmp_path / "x.kvc", model)


def test_sliding_window_layers_take_a_longer_file_as_transformers_keeps_them(tmp_path):
    """Gemma 2 alternates sliding (window 16) and global layers. kvtool's engine keeps every token
    of a longer prompt; loaded into transformers' cache, each sliding layer keeps what its window
    needs (its own `update`), and generate continues as it does from the whole prompt."""
    folder = save_tiny_model(tmp_path / "gemma2", "gemma2", sliding_window=16, head_dim=16)
    model = load(folder)
    ids = prompt_ids(folder)
    kvtool.capture_prompt(tmp_path / "g.kvc", prompt=PROMPT, model=folder, kv_dtype="fp32", chunk_size=16,
                          device="cpu")
    cache, input_ids = kvtool.hf.to_cache(tmp_path / "g.kvc", model)
    assert [layer.keys.shape[2] for layer in cache.layers] == [15, len(ids) - 1]
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert out[0, len(ids):].tolist() == greedy_reference(model, ids, 8)


def save_tiny_gpt_oss(folder: Path) -> Path:
    """A tiny random gpt-oss (transformers' GptOssConfig): sliding (window 8) and full layers
    alternating, attention sinks, four experts of which two a token, YaRN RoPE as published;
    weights drawn large enough that its greedy tokens vary; the byte-level tokenizer of
    `save_tiny_model`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=8, bos_token_id=None, eos_token_id=None,
                                       pad_token_id=None, layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # (sinks and biases included: they start at zero)
        for name, p in model.named_parameters():
            norm = "norm" in name
            p.copy_(torch.randn_like(p) * (0.1 if norm else 0.3) + (1.0 if norm else 0.0))
    model.save_pretrained(folder)
    alphabet = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=alphabet, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return folder


def test_gpt_oss_sliding_and_full_layers_with_sinks_go_through_a_file(tmp_path, capsys):
    """gpt-oss through transformers (`--engine hf`; kvtool's own engine does not run it): a prompt
    within the window -> a file (from a transformers cache, and by `capture --engine hf`) -> a
    transformers cache again, equal tensor for tensor, from which generate continues past the
    window with transformers' own greedy tokens; a prompt longer than the window is refused in one
    line (its sliding layers no longer hold every token)."""
    folder = save_tiny_gpt_oss(tmp_path / "gpt-oss")
    model = load(folder)
    ids = prompt_ids(folder, "A sunny")  # 7 bytes, within the window of 8
    cache = prefilled(model, ids)
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicSlidingWindowLayer", "DynamicLayer"] * 2
    kvtool.hf.from_cache(cache, ids, tmp_path / "c.kvc", model)
    back, _ = kvtool.hf.to_cache(tmp_path / "c.kvc", model, leave_last_token=False)
    for mine, theirs in zip(back.layers, cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    want = greedy_reference(model, ids, 12)
    assert len(set(want)) > 3, want  # (a model whose tokens vary: the comparison means something)
    code, _, err = cli(capsys, "capture", "--engine", "hf", "--model", folder, "--prompt", "A sunny", "--dtype", "fp32",
                       "-o", tmp_path / "p.kvc", "--device", "cpu")
    assert code == 0, err
    cache, input_ids = kvtool.hf.to_cache(tmp_path / "p.kvc", model)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert out[0, len(ids):].tolist() == want
    code, _, err = cli(capsys, "capture", "--engine", "hf", "--model", folder, "--prompt", "A sunny day", "-o",
                       tmp_path / "long.kvc", "--device", "cpu")
    assert code == 2 and "sliding-window layers keep only the last 7 tokens: a prompt of 11 would not be all in" \
        in one_line_error(err)
    assert not (tmp_path / "long.kvc").exists()


def test_a_model_without_plain_kv_is_refused_by_the_command_before_its_weights_load(tmp_path, capsys):
    config = transformers.MambaConfig(num_hidden_layers=1, hidden_size=16, vocab_size=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mamba")
    code, _, err = cli(capsys, "capture", "--engine", "hf", "--model", tmp_path / "mamba", "--prompt", "hi",
                       "-o", tmp_path / "m.kvc")
    assert code == 2 and "linear attention or a recurrent state (no K/V per token)" in one_line_error(err)


def test_caches_and_ids_that_do_not_fit_are_refused(llama, tmp_path):
    folder, model = llama
    ids = prompt_ids(folder)
    with torch.no_grad():
        batch = model(torch.tensor([ids, ids]), use_cache=True).past_key_values
    with pytest.raises(UsageError, match="the cache holds a batch of 2 sequences; a kvtool file holds one"):
        kvtool.hf.from_cache(batch, ids, tmp_path / "x.kvc", model)
    with pytest.raises(UsageError, match=f"the cache holds {len(ids)} tokens and token_ids has 3"):
        kvtool.hf.from_cache(prefilled(model, ids), ids[:3], tmp_path / "x.kvc", model)
    with pytest.raises(UsageError, match="prompt_ids holds a batch of 2 sequences"):
        kvtool.hf.to_cache(tmp_path / "x.kvc", model, prompt_ids=torch.tensor([ids, ids]))
    with pytest.raises(UsageError, match="expected a transformers model"):
        kvtool.hf.to_cache(tmp_path / "x.kvc", "not a model")
    assert not (tmp_path / "x.kvc").exists()


# --- the commands --------------------------------------------------------------------------------


def test_capture_and_replay_with_transformers(llama, tmp_path, capsys):
    folder, model = llama
    ids = prompt_ids(folder)
    code, r, err = cli(capsys, "capture", "--engine", "hf", "--model", folder, "--prompt", PROMPT, "--chunk-size", "16",
                       "--dtype", "fp32", "--hidden-states", "-o", tmp_path / "p.kvc", "--device", "cpu", "--json")
    assert code == 0, err
    chunks = -(-len(ids) // 16)
    assert (r["engine"], r["num_tokens"], r["block_size"], r["num_chunks"]) == ("hf", len(ids), len(ids), chunks)
    assert r["extras"] == ["hidden_states"]
    code, r, err = cli(capsys, "replay", tmp_path / "p.kvc", "--engine", "hf", "--model", folder, "--compare",
                       "--continue", "8", "--device", "cpu", "--json")
    assert code == 0, err
    assert (r["engine"], r["reused_tokens"], r["computed_tokens"]) == ("hf", len(ids) - 1, 1)
    assert r["top1_agreement"] == 1.0 and r["greedy_identical_tokens"] == 8 and r["weights"] == "same weights"
    assert r["continuation_tokens"] == r["cached_continuation_tokens"] == greedy_reference(model, ids, 8)
    code, r, err = cli(capsys, "replay", tmp_path / "p.kvc", "--model", folder, "--compare", "--continue", "8",
                       "--device", "cpu", "--json")  # kvtool's engine replays what transformers computed
    assert code == 0 and r["engine"] == "kvtool" and r["top1_agreement"] == 1.0, err
    assert r["first_token_from"] == "hidden_states"  # transformers' final hidden states give kvtool's first logits
    code, r, err = cli(capsys, "replay", tmp_path / "p.kvc", "--engine", "hf", "--model", folder, "--suffix",
                       " And", "--continue", "4", "--device", "cpu", "--json")
    assert code == 0 and (r["reused_tokens"], r["num_tokens"]) == (len(ids), len(ids) + 4), err
    assert r["continuation_tokens"] == greedy_reference(model, ids + prompt_ids(folder, " And"), 4)


def test_replay_with_transformers_measures_a_cache_that_parts_from_the_recompute(llama, tmp_path, capsys):
    """A cache of other values (noise): the cached run is measured along the recompute's tokens, then
    goes its own greedy way from where they part, which is what generate makes from that cache."""
    folder, model = llama
    ids = prompt_ids(folder)
    cache = prefilled(model, ids)
    torch.manual_seed(3)
    for layer in cache.layers:
        layer.keys.normal_(0, 3.0)
        layer.values.normal_(0, 3.0)
    kvtool.hf.from_cache(cache, ids, tmp_path / "noise.kvc", model)
    code, r, err = cli(capsys, "replay", tmp_path / "noise.kvc", "--engine", "hf", "--model", folder, "--compare",
                       "--continue", "8", "--device", "cpu", "--json")
    assert code == 0, err
    same = r["greedy_identical_tokens"]
    assert same < 8 and r["top1_agreement"] < 1.0 and r["kl_mean"] > 0
    assert r["continuation_tokens"] == greedy_reference(model, ids, 8)
    own = kvtool.hf.generate(model, tmp_path / "noise.kvc", max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert r["cached_continuation_tokens"] == own and own[:same] == r["continuation_tokens"][:same]


def test_replay_with_transformers_from_the_store(llama, tmp_path, capsys):
    folder, model = llama
    ids = prompt_ids(folder)
    assert cli(capsys, "capture", "--engine", "hf", "--model", folder, "--prompt", PROMPT, "--chunk-size", "16",
               "--store", tmp_path / "store", "--device", "cpu")[0] == 0
    code, r, err = cli(capsys, "replay", "--store", tmp_path / "store", "--engine", "hf", "--model", folder,
                       "--prompt", PROMPT, "--continue", "4", "--device", "cpu", "--json")
    assert code == 0, err
    assert r["reused_tokens"] == (len(ids) - 1) // 16 * 16 and r["codecs"] == ["raw"]
    assert r["continuation_tokens"] == greedy_reference(model, ids, 4)


def test_what_the_engines_refuse_on_the_command_line(llama, tmp_path, capsys):
    folder, _ = llama
    for argv, message in [
        (["capture", "--engine", "vllm", "--prompt", "p", "-o", tmp_path / "x.kvc"],
         "--engine must be one of kvtool, hf, got 'vllm'"),
        (["capture", "--engine", "hf", "--block-size", "32", "--prompt", "p", "-o", tmp_path / "x.kvc"],
         "--block-size is kvtool's paged cache"),
        (["capture", "--no-generation-prompt", "--prompt", "p", "-o", tmp_path / "x.kvc"],
         "--no-generation-prompt applies to --chat"),
        (["replay", "--blend", "a.kvc", "--engine", "hf", "--prompt", "q"],
         "--engine hf does not apply to --blend / --blend-delimiter"),
    ]:
        code, _, err = cli(capsys, *argv)
        assert code == 2 and message in one_line_error(err), err


@pytest.mark.parametrize("engine", ["kvtool", "hf"])
def test_the_file_and_the_dump_record_how_the_prompt_became_tokens(llama, tmp_path, capsys, engine):
    """Item 6: the chat template's digest and the generation-prompt choice (--no-generation-prompt),
    or for plain text whether special tokens were added; the dump carries them on."""
    folder, _ = llama
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    path = tmp_path / "chat.kvc"
    code, _, err = cli(capsys, "capture", "--engine", engine, "--model", folder, "--prompt", "Hi there", "--chat",
                       "--no-generation-prompt", "-o", path, "--device", "cpu")
    assert code == 0, err
    template = (folder / "chat_template.jinja").read_text()
    want = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=False,
                                         tokenize=False)
    with ContainerReader(path) as reader:
        assert reader.token_ids().tolist() == tokenizer.encode(want, add_special_tokens=False)
        meta = reader.manifest.metadata
    assert not want.endswith("<assistant>")
    assert meta["prompt_format"] == "chat template, user message" and meta["add_generation_prompt"] == "false"
    assert meta["chat_template_sha256"] == "sha256:" + hashlib.sha256(template.encode()).hexdigest()
    assert cli(capsys, "dump", path, "-o", tmp_path / "d.safetensors")[0] == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d.safetensors"), "pt") as dump:
        dumped = dump.metadata()
    assert {k: dumped[k] for k in ("prompt_format", "add_generation_prompt", "chat_template_sha256")} \
        == {k: meta[k] for k in ("prompt_format", "add_generation_prompt", "chat_template_sha256")}
    assert dumped["weights_digest"].startswith("sha256:")
    code, r, err = cli(capsys, "replay", path, "--engine", engine, "--model", folder, "--prompt", "Hi there", "--chat",
                       "--no-generation-prompt", "--continue", "2", "--device", "cpu", "--json")
    assert code == 0 and r["reused_tokens"] == r["num_tokens"] - 1, err  # the same tokens: every one reused
    code, _, _ = cli(capsys, "capture", "--engine", engine, "--model", folder, "--prompt", "Hi", "-o",
                     tmp_path / "plain.kvc", "--device", "cpu")
    with ContainerReader(tmp_path / "plain.kvc") as reader:
        plain = reader.manifest.metadata
    assert plain["prompt_format"] == "plain text"
    assert plain["add_special_tokens"] == ("true" if engine == "hf" else "false")


def test_kvtool_and_its_operations_never_import_transformers_unless_asked():
    code = ("import sys, kvtool, kvtool.ops.capture, kvtool.ops.replay, kvtool.cli.app\n"
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False"], out.stderr


def test_engine_hf_without_transformers_is_refused_in_one_line(tmp_path):
    code = ("import sys\n"
            "sys.modules['transformers'] = None  # as if it were not installed\n"
            "from kvtool.cli.app import run\n"
            f"sys.exit(run(['capture', '--engine', 'hf', '--prompt', 'p', '-o', {str(tmp_path / 'x.kvc')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--engine hf needs transformers" in one_line_error(out.stderr)


# --- the default model ---------------------------------------------------------------------------


@pytest.mark.model
def test_a_default_model_capture_generates_in_transformers_as_transformers_does(default_model, hf_reference_model,
                                                                                tmp_path):
    ids = default_model.tokenizer.encode("The KV cache holds the keys and values of every token, so that")
    kvtool.capture(default_model, ids, tmp_path / "d.kvc", kv_dtype=torch.float32, chunk_size=8)
    want = greedy_reference(hf_reference_model, ids, 8)
    assert kvtool.hf.generate(hf_reference_model, tmp_path / "d.kvc", max_new_tokens=8,
                              do_sample=False)[0, len(ids):].tolist() == want
