"""The model families of kvtool's engine against transformers (issue 30): every architecture it runs.

Each family is a tiny random-weight model made with transformers' own config class (seeded; 4
layers, 4 query heads over 2 KV heads, a head_dim other than hidden/heads where the family allows
it, sliding windows of 8 so that they matter on 40-token prompts) and saved as a folder, which
kvtool's loader reads as it reads any model. transformers runs it in float32 with eager attention
(the reference that soft-caps), its cache a plain DynamicCache, so it keeps every token of every
layer as kvtool does. Held to:

- kvtool's K and V of every layer within 1e-5 relative of transformers', and the logits;
- a file written by `capture` with the raw and with the zstd codec holds every token's KV for every
  layer (sliding layers included) and `replay` continues from it with transformers' own greedy tokens;
- each family switch matters on these models (turned off, the KV or logits leave transformers');
- CacheBlend: each layer's cached keys, re-rotated, equal the keys of the same text run at the new
  positions (the re-rotation holds), and a blend recomputing every token is a full prefill;
- what the engine does not run is refused in one line.

CacheGen and bf16 files are reported (printed, `-s` shows them), not held to a number.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvtool
from kvtool.engine import PagedKVCache, Runner, load_model
from kvtool.engine.blend import Segment, blend_prefill, capture_segment, check_segment
from kvtool.engine.families import FAMILIES, identity_extra
from kvtool.engine.loader import config_from_hf
from kvtool.engine.model import attention_mask, embed, layer_forward, layer_inv_freq, read_kv, rerotate_keys, \
    rope_cos_sin
from kvtool.errors import ModelError, RopeMismatch

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS, PROMPT, NEW = 128, 4, 40, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=VOCAB - 1, pad_token_id=0)


def _hf_config(kind: str):
    if kind == "llama":  # llama3 RoPE scaling, head_dim 32
        return transformers.LlamaConfig(**COMMON, head_dim=32, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**COMMON)
    if kind == "qwen3":  # head_dim 32 != 64 / 4; the last two layers slide (max_window_layers)
        return transformers.Qwen3Config(**COMMON, head_dim=32, use_sliding_window=True, sliding_window=8,
                                        max_window_layers=2)
    if kind == "gemma2":  # alternating sliding/global layers, soft-capping small enough to bite
        return transformers.Gemma2Config(**COMMON, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if kind == "gemma3":  # sliding layers with their own RoPE base; linear scaling on the global ones
        return transformers.Gemma3TextConfig(
            **COMMON, head_dim=32, sliding_window=8, query_pre_attn_scalar=24, rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    if kind == "phi3":  # fused qkv_proj and gate_up_proj; a window on every layer (as Phi-3-mini-4k's 2047)
        return transformers.Phi3Config(**COMMON, sliding_window=8)
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=8)
    assert kind == "olmo2"
    return transformers.Olmo2Config(**COMMON)


KINDS = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mistral", "olmo2"]
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
        "phi3": "Phi3ForCausalLM", "mistral": "MistralForCausalLM", "olmo2": "Olmo2ForCausalLM"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second thread only adds hand-offs (on a busy 2-core machine, half
    of this file's time). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclasses.dataclass
class Built:
    hf: object  # transformers' model
    model: object  # kvtool's LoadedModel of the same folder
    ids: list[int]
    ref: object  # transformers' output on ids: logits and a full DynamicCache
    greedy: list[int] | None = None  # transformers' own greedy continuation (`_hf_greedy`), once


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> Built, each made once per module (seeded)."""
    from tokenizers import Tokenizer, models

    done: dict[str, Built] = {}

    def make(kind: str) -> Built:
        if kind not in done:
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(_hf_config(kind), attn_implementation="eager")
            hf = hf.float().eval()
            gemma = kind.startswith("gemma")  # (1 + w) norms: random around 0, the others around 1
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    norm = "norm" in name
                    p.copy_(torch.randn_like(p) * (0.1 if norm else 0.3) + (1.0 if norm and not gemma else 0.0))
            folder = tmp_path_factory.mktemp(kind)
            hf.save_pretrained(folder)
            Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
            ids = torch.randint(2, VOCAB - 1, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
            with torch.inference_mode():
                ref = hf(torch.tensor([ids]), use_cache=True, past_key_values=transformers.DynamicCache())
            done[kind] = Built(hf, load_model(folder), ids, ref)
        return done[kind]

    return make


def _hf_kv(ref, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' K and V of one layer, [T, Hkv, D] each."""
    cache = ref.past_key_values.layers[layer]
    return cache.keys[0].transpose(0, 1), cache.values[0].transpose(0, 1)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _assert_within(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """Relative to the reference: its norm (the whole tensor) and its largest magnitude (each value)."""
    assert got.shape == want.shape, what
    assert _rel(got, want) < rel, f"{what}: relative error {_rel(got, want):.3g}"
    worst = ((got - want).abs().max() / want.abs().max()).item()
    assert worst < rel, f"{what}: largest error {worst:.3g} of the largest value"


def _prefill(model, ids, config=None, prefill_chunk: int = 17):
    """kvtool's logits [T, V] and the cache: blocks of 3 shuffled, the prompt in chunks of 17 (so
    later chunks start mid-window). `config` replaces the model's (a switch turned off)."""
    if config is not None:
        model = dataclasses.replace(model, config=config)
    cache = PagedKVCache.for_tokens(model.config, len(ids), block_size=3, shuffle_seed=4)
    seq = cache.new_sequence()
    logits = Runner(model, cache).prefill(seq, ids, prefill_chunk=prefill_chunk)
    kv = [read_kv(c, seq.slot_mapping(len(ids)), torch.float32) for c in cache.kv_caches]
    return logits, kv


# --- the KV and the logits -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_kv_of_every_layer_matches_transformers_fp32(built, kind):
    b = built(kind)
    assert b.model.config.architecture == ARCH[kind]
    logits, kv = _prefill(b.model, b.ids)
    for layer, (k, v) in enumerate(kv):
        hk, hv = _hf_kv(b.ref, layer)
        assert hk.shape[0] == PROMPT  # transformers kept every token too
        _assert_within(k, hk, 1e-5, f"{kind} K of layer {layer}")
        _assert_within(v, hv, 1e-5, f"{kind} V of layer {layer}")
    _assert_within(logits, b.ref.logits[0], 1e-5, f"{kind} logits")


def test_the_families_are_what_their_configs_say(built):
    """The switches each family's config turns on (and the head_dim taken from the config)."""
    cfg = {kind: built(kind).model.config for kind in KINDS}
    assert cfg["llama"].head_dim == 32 and cfg["llama"].rope_scaling["rope_type"] == "llama3"
    assert built("qwen2").model.weights.layers[0].bqkv is not None and cfg["qwen2"].sliding_window is None
    assert cfg["qwen3"].head_dim == 32 and cfg["qwen3"].qk_norm == "head"
    assert (cfg["qwen3"].sliding_window, cfg["qwen3"].sliding_layers) == (8, (2, 3))
    assert cfg["gemma2"].sliding_layers == (0, 2) and cfg["gemma2"].attn_softcap == 5.0
    assert cfg["gemma2"].final_softcap == 3.0 and cfg["gemma2"].attn_scale == 24 ** -0.5
    assert cfg["gemma2"].embed_scale == 8.0 and cfg["gemma2"].activation == "gelu_tanh"
    assert cfg["gemma3"].sliding_layers == (0, 1, 3) and cfg["gemma3"].rope_local_theta == 100.0
    assert cfg["gemma3"].rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg["gemma3"].rope_theta == 1e6 and cfg["gemma3"].attn_softcap is None
    assert cfg["phi3"].sliding_window == 8 and cfg["phi3"].sliding_layers is None  # every layer
    assert cfg["olmo2"].qk_norm == "full" and cfg["olmo2"].sliding_window is None
    olmo = built("olmo2").model.weights.layers[0]
    assert olmo.attn_norm is None and olmo.mlp_norm is None and olmo.k_norm.shape == (2 * 16,)
    gemma = built("gemma2").model.weights.layers[0]
    assert gemma.attn_post_norm.dtype == torch.float32 and gemma.mlp_post_norm is not None


# Each switch, turned back to Llama's: the result must leave transformers' (so the tests above see it).
SWITCHES = [("qwen3", "qk_norm", None), ("qwen3", "sliding_layers", None), ("gemma2", "sliding_window", None),
            ("gemma2", "attn_softcap", None), ("gemma2", "final_softcap", None), ("gemma2", "attn_scale", None),
            ("gemma2", "embed_scale", None), ("gemma2", "activation", "silu"), ("gemma3", "rope_local_theta", None),
            ("gemma3", "sliding_window", None), ("phi3", "sliding_window", None), ("mistral", "sliding_window", None),
            ("olmo2", "qk_norm", None)]


@pytest.mark.parametrize("kind, field, value", SWITCHES, ids=[f"{k}-{f}" for k, f, _ in SWITCHES])
def test_each_switch_matters_on_these_models(built, kind, field, value):
    b = built(kind)
    logits, kv = _prefill(b.model, b.ids, dataclasses.replace(b.model.config, **{field: value}))
    if field == "final_softcap":  # the KV stays; only the logits change
        assert _rel(logits, b.ref.logits[0]) > 1e-2
        return
    worst = max(_rel(k, _hf_kv(b.ref, layer)[0]) for layer, (k, _) in enumerate(kv))
    assert worst > 1e-3, f"{field} turned off leaves the KV within {worst:.3g}: the test cannot see it"


# --- files: raw and zstd hold every token's KV, and continue as transformers does -----------------


def _hf_greedy(b: Built) -> list[int]:
    if b.greedy is None:
        with torch.inference_mode():
            out = b.hf.generate(torch.tensor([b.ids]), max_new_tokens=NEW, do_sample=False, num_beams=1,
                                pad_token_id=0, eos_token_id=VOCAB - 1)
        b.greedy = out[0, len(b.ids):].tolist()
    return b.greedy


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_continuation_from_a_file_equals_transformers(built, kind, codec, tmp_path):
    b = built(kind)
    path = tmp_path / f"{kind}.kvc"
    kvtool.capture(b.model, b.ids, path, codec=codec, chunk_size=16, kv_dtype=torch.float32)
    with kvtool.open(path) as f:  # every token of every layer, sliding layers included
        kv = f.read_range(0, PROMPT)  # [2, L, T, C]
        assert tuple(kv.shape) == (2, LAYERS, PROMPT, b.model.config.num_kv_heads * b.model.config.head_dim)
        assert f.model["architecture"] == ARCH[kind]
    for layer in range(LAYERS):
        hk, hv = _hf_kv(b.ref, layer)
        _assert_within(kv[0, layer], hk.flatten(1), 1e-5, f"{kind} file K of layer {layer}")
        _assert_within(kv[1, layer], hv.flatten(1), 1e-5, f"{kind} file V of layer {layer}")
    result = kvtool.replay(path, b.model, continue_tokens=NEW, device="cpu")
    assert result.reused_tokens == PROMPT - 1 or result.reused_tokens == PROMPT
    want = _hf_greedy(b)
    assert result.continuation_tokens == want, (kind, codec, result.continuation_tokens, want)
    assert len(want) == NEW or want[-1] == VOCAB - 1


@pytest.mark.parametrize("kind", KINDS)
def test_lossy_files_are_reported(built, kind, tmp_path):
    """CacheGen and bf16 files of each family: they verify and replay; their agreement with the
    recompute is printed, not asserted (a random tiny model is no measure of a codec)."""
    b = built(kind)
    lines = []
    for label, codec, dtype in (("cachegen", "cachegen", torch.bfloat16), ("raw bf16", "raw", torch.bfloat16)):
        path = tmp_path / f"{label.replace(' ', '-')}.kvc"
        kvtool.capture(b.model, b.ids, path, codec=codec, chunk_size=16, kv_dtype=dtype)
        assert kvtool.verify(path).ok
        r = kvtool.replay(path, b.model, continue_tokens=NEW, compare=True, device="cpu")
        assert r.top1_agreement is not None and 0.0 <= r.top1_agreement <= 1.0 and r.kl_mean >= 0.0
        lines.append(f"{label}: top-1 {r.top1_agreement:.2f}, mean KL {r.kl_mean:.3g}, "
                     f"{r.greedy_identical_tokens}/{NEW} greedy tokens as the recompute's")
    print(f"\n{kind}: " + "; ".join(lines))


# --- CacheBlend -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_rerotated_keys_of_every_layer_equal_the_text_run_at_the_new_positions(built, kind):
    """A segment captured at 0.., its keys re-rotated to s.. (each layer with its own table), equal
    the keys of the same text with nothing before it run at s..: attention sees relative positions
    only, so the re-rotation is exact wherever the key is RoPE's last step (k-norms come before it)."""
    b = built(kind)
    model, cfg, w = b.model, b.model.config, b.model.weights
    tokens, s = b.ids[:24], 37
    seg = capture_segment(model, tokens)
    n = len(tokens)
    cache = PagedKVCache.for_tokens(cfg, n, block_size=16, shuffle_seed=3)
    slots = cache.new_sequence(n).slot_mapping(n)
    runner = Runner(model, cache)
    pos = torch.arange(s, s + n)
    x = embed(w, cfg, torch.tensor(tokens))
    with torch.inference_mode():
        for layer, (lw, kv_cache) in enumerate(zip(w.layers, cache.kv_caches)):
            cos, sin = rope_cos_sin(layer_inv_freq(cfg, layer, runner.rope_tables), pos, torch.float32)
            mask = attention_mask(pos, pos, cfg.layer_window(layer), torch.float32)  # its own keys only
            x = layer_forward(x, lw, cfg, cos, sin, kv_cache, slots, slots, mask, False)
    for layer in range(cfg.num_layers):
        k_at_s, v_at_s = read_kv(cache.kv_caches[layer], slots, torch.float32)
        k0 = seg.kv[0, layer].view(n, cfg.num_kv_heads, cfg.head_dim)
        moved = rerotate_keys(k0, layer_inv_freq(cfg, layer, runner.rope_tables), pos - s, pos)
        assert _rel(moved, k0) > 0.1  # the move matters
        assert _rel(moved, k_at_s) < 1e-5, f"{kind} layer {layer}: {_rel(moved, k_at_s):.3g}"
        assert _rel(seg.kv[1, layer].view_as(v_at_s), v_at_s) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_a_blend_recomputing_every_token_is_a_full_prefill(built, kind):
    b = built(kind)
    model = b.model
    a, c, question = b.ids[:14], b.ids[14:32], b.ids[32:]
    segments = [capture_segment(model, a), capture_segment(model, c)]
    cache = PagedKVCache.for_tokens(model.config, PROMPT, block_size=3, shuffle_seed=2)
    full = Runner(model, cache).prefill(cache.new_sequence(), b.ids, logits="last")[0]
    kls = {}
    for ratio in (1.0, 0.15, 0.0):
        cache = PagedKVCache.for_tokens(model.config, PROMPT, block_size=3, shuffle_seed=2)
        result = blend_prefill(Runner(model, cache), cache.new_sequence(), segments, question,
                               recompute_ratio=ratio)
        kls[ratio] = torch.nn.functional.kl_div(result.logits.log_softmax(-1), full.log_softmax(-1),
                                                log_target=True, reduction="sum").item()
        if ratio == 1.0:
            _assert_within(result.logits, full, 1e-5, f"{kind} blend at ratio 1")
            _assert_within(result.logits, b.ref.logits[0, -1], 1e-5, f"{kind} blend at ratio 1 vs transformers")
    print(f"\n{kind}: KL of the blend's next token from the full prefill's: "
          + ", ".join(f"ratio {r}: {v:.3g}" for r, v in kls.items()))


def test_a_gemma3_segment_with_another_local_base_is_refused(built):
    b = built("gemma3")
    seg = capture_segment(b.model, b.ids[:8])
    other = dataclasses.replace(seg.identity, rope={**seg.identity.rope, "rope_local_theta": 10000.0})
    assert seg.identity.rope["local_layers"] == [0, 1, 3]
    with pytest.raises(RopeMismatch):
        check_segment(Segment(seg.tokens, seg.kv, 0, other), b.model, 0)


def test_llama_mistral_qwen2_keep_the_fingerprints_they_had():
    """The new switches enter `model.extra` only where they differ from Llama's, so files written
    before them keep their fingerprint; the new families' switches are fingerprinted."""
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        hf = {**COMMON, "architectures": [arch], "sliding_window": 16, "use_sliding_window": False}
        assert identity_extra(config_from_hf(hf)) == {}
    gemma = config_from_hf(_hf_config("gemma2").to_dict() | {"architectures": ["Gemma2ForCausalLM"]})
    assert identity_extra(gemma) == {"sliding_window": 8, "sliding_layers": [0, 2], "activation": "gelu_tanh",
                                     "embed_scale": 8.0, "attn_scale": 24 ** -0.5, "attn_softcap": 5.0,
                                     "final_softcap": 3.0}


def test_transformers_4_config_spellings_read_as_the_5_ones():
    """Configs saved by transformers 4.x (Gemma 3 1B's, Qwen3's on the Hub) spell RoPE and the
    layer layout differently: rope_theta / rope_local_base_freq / rope_scaling, and no layer_types
    (Gemma's sliding_window_pattern, Qwen's max_window_layers). They read as the 5.x spelling."""
    def v4(kind: str, **layout) -> dict:
        hf = _hf_config(kind).to_dict() | {"architectures": [ARCH[kind]]}
        return {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")} | layout

    g3 = _hf_config("gemma3").to_dict() | {"architectures": ["Gemma3ForCausalLM"],
                                           "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert config_from_hf(v4("gemma3", rope_theta=1e6, rope_local_base_freq=100.0, sliding_window_pattern=2,
                             rope_scaling={"type": "linear", "factor": 4.0})) == config_from_hf(g3)
    g2 = _hf_config("gemma2").to_dict() | {"architectures": ["Gemma2ForCausalLM"]}
    assert config_from_hf(v4("gemma2", rope_theta=10000.0)) == config_from_hf(g2)
    q3 = _hf_config("qwen3").to_dict() | {"architectures": ["Qwen3ForCausalLM"]}
    assert config_from_hf(v4("qwen3", rope_theta=10000.0)) == config_from_hf(q3)
    assert config_from_hf(v4("gemma3", rope_theta=1e6)).sliding_layers == (0, 1, 2, 3)  # pattern 6: 5 of 6


def test_every_family_states_whether_blending_holds():
    assert set(ARCH.values()) == set(FAMILIES)
    for family in FAMILIES.values():
        assert family.blend.startswith("holds")


# --- refusals: one line, naming what the engine runs ------------------------------------------------


def _refused(kind: str, **changes) -> str:
    hf = _hf_config(kind).to_dict() | {"architectures": [ARCH[kind]]} | changes
    with pytest.raises(ModelError) as err:
        config_from_hf(hf, "m")
    message = str(err.value)
    assert "\n" not in message
    return message


def test_what_the_engine_does_not_run_is_refused_in_one_line():
    gemma3_vlm = _refused("gemma3", architectures=["Gemma3ForConditionalGeneration"])
    assert "text-only" in gemma3_vlm and "Gemma 3 (Gemma3ForCausalLM)" in gemma3_vlm
    assert "Qwen3 (Qwen3ForCausalLM)" in _refused("qwen3", architectures=["Qwen3MoeForCausalLM"])
    longrope = _refused("phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                 "original_max_position_embeddings": 64})
    assert "longrope" in longrope and "plain RoPE" in longrope
    assert "partial rotary" in _refused("phi3", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                  "partial_rotary_factor": 0.5})
    assert "bidirectional" in _refused("gemma3", use_bidirectional_attention=True)
    assert "gelu_pytorch_tanh" in _refused("gemma2", hidden_activation="gelu")
    assert "yarn" in _refused("qwen3", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    local = _refused("gemma3", rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1e4}})
    assert "sliding layers" in local
    assert "layer_types" in _refused("gemma2", layer_types=["sliding_attention"])



# --- transformers: a kvtool file continues in transformers' generate; transformers' own capture ---


@pytest.mark.parametrize("kind", KINDS)
def test_a_kvtool_file_continues_in_transformers_generate(built, kind, tmp_path):
    """The README's family table, `--engine hf` column: a file of kvtool's engine becomes a
    transformers cache (kvtool.hf.to_cache) that `generate` continues as transformers' own run."""
    import kvtool.hf

    b = built(kind)
    path = tmp_path / f"{kind}.kvc"
    kvtool.capture(b.model, b.ids, path, codec="raw", chunk_size=16, kv_dtype=torch.float32)
    folder_model = transformers.AutoModelForCausalLM.from_pretrained(b.model.path, attn_implementation="eager").float()
    cache, input_ids = kvtool.hf.to_cache(path, folder_model)
    with torch.inference_mode():
        out = folder_model.generate(input_ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False, num_beams=1,
                                    pad_token_id=0, eos_token_id=VOCAB - 1)
    assert out[0, len(b.ids):].tolist() == _hf_greedy(b)


@pytest.mark.parametrize("kind", [k for k in KINDS if k in ("llama", "qwen2", "olmo2")])
def test_transformers_captures_what_kvtools_engine_captures(built, kind, tmp_path):
    """`capture --engine hf` on the families whose cache keeps every token here (no sliding layer):
    the same model identity and the same KV within 1e-5 as kvtool's engine."""
    b = built(kind)
    ours, theirs = tmp_path / "ours.kvc", tmp_path / "hf.kvc"
    kvtool.capture(b.model, b.ids, ours, codec="raw", chunk_size=16, kv_dtype=torch.float32)
    folder_model = transformers.AutoModelForCausalLM.from_pretrained(b.model.path, attn_implementation="eager").float()
    kvtool.capture(folder_model, b.ids, theirs, codec="raw", chunk_size=16, kv_dtype=torch.float32)
    with kvtool.open(ours) as a, kvtool.open(theirs) as h:
        assert a.model == h.model
        _assert_within(h.read_range(0, PROMPT), a.read_range(0, PROMPT), 1e-5, f"{kind}: hf capture")
