"""A hot prefix's objects opened again skip checks 1-10, never 11-13 (kvtool.store.loading's kept
checks), and a paged target checks its buffers once a load, its slots every chunk. Real folder
stores, real files, their times set as an old object's would be."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from fixtures import make_identity, make_kv
from kvtool.connectors import ConnectorError, PagedMemConnectorV2
from kvtool.store import loading, objects, open_store

L, H, D, CS = 2, 2, 8, 8
TOKENS = list(range(100, 132))  # 4 whole chunks
OLD_NS = 1_600_000_000 * 10**9  # September 2020


def identity():
    return make_identity(num_layers=L, num_kv_heads=H, head_dim=D)


@pytest.fixture(autouse=True)
def nothing_kept():
    loading.forget_checked()
    yield
    loading.forget_checked()


def aged(cache, names=None):
    """Every object of TOKENS (or `names`) as if written long ago."""
    for name in names or cache.chunk_names(TOKENS):
        os.utime(cache.backend._path(name), ns=(OLD_NS, OLD_NS))


def filled(tmp_path):
    cache = open_store(str(tmp_path / "s")).for_model(identity(), chunk_size=CS)
    kv = make_kv(identity(), 32, torch.float32)
    cache.put_sequence(TOKENS, kv)
    return cache, kv


def target(num_tokens: int = 32, slots=None):
    caches = [torch.zeros(2, num_tokens // 4 + 2, 4, H, D) for _ in range(L)]
    connector = PagedMemConnectorV2(H * D, L, layout="flash_attn", num_kv_heads=H, head_dim=D)
    slots = torch.arange(num_tokens) if slots is None else slots
    return connector, caches, connector.target(kvcaches=caches, slot_mapping=slots)


def gathered(connector, caches, num_tokens: int = 32):
    out = connector.allocate(num_tokens, torch.float32)
    connector.from_gpu(out, 0, num_tokens, kvcaches=caches, slot_mapping=torch.arange(num_tokens))
    return out.tensor


def counting_checks(monkeypatch):
    calls = []
    real = objects.check_chunk

    def check(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)
    monkeypatch.setattr(objects, "check_chunk", check)
    return calls


def test_an_old_object_loaded_again_skips_checks_1_to_10_and_loads_the_same_kv(tmp_path, monkeypatch):
    cache, kv = filled(tmp_path)
    aged(cache)
    calls = counting_checks(monkeypatch)
    for _ in range(3):
        connector, caches, dest = target()
        hit = cache.load_prefix(TOKENS, dest)
        assert hit.num_tokens == 32 and not hit.refused and hit.codecs == ["raw"] * 4
        assert torch.equal(gathered(connector, caches), kv)
    assert len(calls) == 4  # the first load only


def test_a_fresh_object_is_checked_in_full_each_time(tmp_path, monkeypatch):
    cache, _ = filled(tmp_path)  # written just now: a change within its clock tick would not show
    calls = counting_checks(monkeypatch)
    cache.load_prefix(TOKENS, target()[2])
    cache.load_prefix(TOKENS, target()[2])
    assert len(calls) == 8


def test_a_kept_object_damaged_in_place_its_time_put_back_is_still_refused(tmp_path):
    """The payload is checked as it is copied against the CRC-32C of the manifest checked first:
    a writer that changes a byte of it and sets the file's time back is still caught."""
    cache, _ = filled(tmp_path)
    aged(cache)
    assert cache.load_prefix(TOKENS, target()[2]).num_tokens == 32  # kept now
    name = cache.chunk_names(TOKENS)[2]
    path = Path(cache.backend._path(name))
    reader = objects.check_chunk(path.read_bytes(), name).reader
    offset = reader.chunks[0].blob.offset
    with open(path, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    os.utime(path, ns=(OLD_NS, OLD_NS))
    hit = cache.load_prefix(TOKENS, target()[2])
    assert hit.num_tokens == 16 and hit.refused


def test_an_object_replaced_at_its_name_is_checked_in_full_again(tmp_path, monkeypatch):
    cache, _ = filled(tmp_path)
    aged(cache)
    cache.load_prefix(TOKENS, target()[2])
    name = cache.chunk_names(TOKENS)[3]
    data = Path(cache.backend._path(name)).read_bytes()
    cache.backend.put(name, data, replace=True)  # a new file (inode) under the name
    aged(cache, [name])
    calls = counting_checks(monkeypatch)
    assert cache.load_prefix(TOKENS, target()[2]).num_tokens == 32
    assert calls == [name]


def test_tokens_changed_in_place_are_refused_once_the_time_moves(tmp_path):
    cache, _ = filled(tmp_path)
    aged(cache)
    cache.load_prefix(TOKENS, target()[2])
    name = cache.chunk_names(TOKENS)[1]
    path = Path(cache.backend._path(name))
    reader = objects.check_chunk(path.read_bytes(), name).reader
    offset = reader.manifest.tokens.offset
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write((7).to_bytes(4, "little"))
    now = time.time_ns() - 5 * 10**9
    os.utime(path, ns=(now, now))  # a write moves the time (here: to 5 s ago, past the racy window)
    hit = cache.load_prefix(TOKENS, target()[2])
    assert hit.num_tokens == CS and hit.refused


def test_only_so_many_objects_are_kept(tmp_path):
    cache, _ = filled(tmp_path)
    cache.backend.kept.max_objects = 2
    aged(cache)
    cache.load_prefix(TOKENS, target()[2])
    assert len(cache.backend.kept) == 2


def test_a_kept_object_is_read_from_its_kept_mapping(tmp_path):
    cache, kv = filled(tmp_path)
    aged(cache)
    cache.load_prefix(TOKENS, target()[2])
    views = cache.backend.kept.views()
    assert len(views) == 4 == len(cache.backend.kept) and all(v.readonly for v in views)
    assert cache.backend.kept.mapped_bytes == sum(v.nbytes for v in views)
    connector, caches, dest = target()
    assert cache.load_prefix(TOKENS, dest).num_tokens == 32
    assert torch.equal(gathered(connector, caches), kv)
    loading.forget_checked()
    assert cache.backend.kept.mapped_bytes == 0 and not len(cache.backend.kept)


def test_kept_mappings_stay_under_their_limit(tmp_path, monkeypatch):
    cache, kv = filled(tmp_path)
    aged(cache)
    payload = 2 * L * CS * H * D * 4  # one chunk's KV, float32
    cache.backend.kept.max_mapped_bytes = payload * 2  # room for two payloads
    connector, caches, dest = target()
    assert cache.load_prefix(TOKENS, dest).num_tokens == 32
    assert torch.equal(gathered(connector, caches), kv)
    kept = cache.backend.kept
    assert 0 < kept.mapped_bytes <= kept.max_mapped_bytes and len(kept) == 2


def test_a_removed_object_is_never_served_from_its_kept_mapping(tmp_path):
    cache, _ = filled(tmp_path)
    aged(cache)
    cache.load_prefix(TOKENS, target()[2])
    os.unlink(cache.backend._path(cache.chunk_names(TOKENS)[2]))
    assert cache.load_prefix(TOKENS, target()[2]).num_tokens == 16  # a miss from there: nothing refused


def test_a_kept_object_cut_short_in_place_its_time_put_back_is_refused(tmp_path):
    cache, _ = filled(tmp_path)
    aged(cache)
    cache.load_prefix(TOKENS, target()[2])
    path = cache.backend._path(cache.chunk_names(TOKENS)[1])
    os.truncate(path, os.path.getsize(path) - 64)
    os.utime(path, ns=(OLD_NS, OLD_NS))
    hit = cache.load_prefix(TOKENS, target()[2])
    assert hit.num_tokens == CS and hit.refused


def test_a_paged_target_checks_each_chunks_slots(tmp_path):
    """The buffers are checked once a load; each chunk's slots every time: a slot repeated in the
    third chunk is the caller's error, said as such (a ConnectorError, not a miss)."""
    cache, _ = filled(tmp_path)
    aged(cache)
    cache.load_prefix(TOKENS, target()[2])  # (the objects kept: the slots are checked all the same)
    slots = torch.arange(32)
    slots[20] = slots[17]
    with pytest.raises(ConnectorError, match="repeats a slot within token range 16..24"):
        cache.load_prefix(TOKENS, target(slots=slots)[2])


def test_a_paged_target_refuses_bad_buffers_at_its_first_chunk(tmp_path):
    cache, _ = filled(tmp_path)
    connector = PagedMemConnectorV2(H * D, L, layout="flash_attn", num_kv_heads=H, head_dim=D)
    wrong = [torch.zeros(2, 10, 4, H + 1, D) for _ in range(L)]
    with pytest.raises(ConnectorError, match="channels"):
        cache.load_prefix(TOKENS, connector.target(kvcaches=wrong, slot_mapping=torch.arange(32)))


def test_a_kept_object_is_never_served_to_another_tenant(tmp_path):
    """Objects kept after a full check are kept by their name, which their extra keys (namespace,
    cache salt) decide: a request of another namespace or salt finds nothing, kept or not; the
    owner's loads skip checks 1-10."""
    from kvtool.store.names import ExtraKeys

    store = open_store(str(tmp_path / "s"))
    kv = make_kv(identity(), 32, torch.float32)
    team_a = store.for_model(identity(), CS, ExtraKeys(namespace="team-a", cache_salt="salt-a"))
    team_a.put_sequence(TOKENS, kv)
    aged(team_a)
    connector, caches, dest = target()
    assert team_a.load_prefix(TOKENS, dest).num_tokens == 32 and len(store.backend.kept) == 4  # kept now
    for keys in (ExtraKeys(namespace="team-b", cache_salt="salt-a"), ExtraKeys(namespace="team-a", cache_salt="b"),
                 ExtraKeys()):
        other = store.for_model(identity(), CS, keys)
        assert other.load_prefix(TOKENS, target()[2]).num_tokens == 0
    connector, caches, dest = target()
    assert team_a.load_prefix(TOKENS, dest).num_tokens == 32
    assert torch.equal(gathered(connector, caches), kv)


def test_a_request_never_shows_its_store_url():
    from kvtool.ops.requests import BlendRequest, CaptureRequest, ReplayRequest

    url = "redis://kv:s3cret-pw@127.0.0.1:6379/0"
    for request in (CaptureRequest("x.kvc", store=url), ReplayRequest(store=url, prompt="p"),
                    BlendRequest(prompt="q", store=url, delimiter=" # # ")):
        assert "s3cret" not in repr(request)


def test_a_kept_object_used_within_the_minute_is_not_opened_again(tmp_path, monkeypatch):
    """Loaded again, a kept object whose name still holds that very file (lstat: device, inode,
    size, time) and whose use was recorded within the minute is read from its kept mapping: no
    file opened. One whose last use is older is opened, through its descriptor, and its use is
    recorded (access time), its modification time kept."""
    cache, kv = filled(tmp_path)
    aged(cache)
    cache.load_prefix(TOKENS, target()[2])  # kept now, each use recorded just now
    opened = []
    real = cache.backend._open_file
    monkeypatch.setattr(cache.backend, "_open_file", lambda name: opened.append(name) or real(name))
    stale = Path(cache.backend._path(cache.chunk_names(TOKENS)[1]))
    os.utime(stale, ns=(time.time_ns() - 61 * 10**9, OLD_NS))
    connector, caches, dest = target()
    hit = cache.load_prefix(TOKENS, dest)
    assert hit.num_tokens == 32 and torch.equal(gathered(connector, caches), kv)
    assert opened == [cache.chunk_names(TOKENS)[1]]
    st = stale.stat()
    assert st.st_mtime_ns == OLD_NS and time.time_ns() - st.st_atime_ns < 10 * 10**9


@pytest.mark.parametrize("ids", [[1, -1], [1, 2**32], [1, 2.5], [1, "2"], [[1, 2]], (3, None)])
def test_token_ids_that_are_not_integers_in_u32_are_a_usage_error(tmp_path, ids):
    """A prompt's ids as a list or tuple (how vLLM and callers hand them over) are checked as they
    are converted: negative, past 2^32 - 1, a float, a string, a nested list: one line, nothing
    looked up."""
    from kvtool.errors import UsageError

    cache, _ = filled(tmp_path)
    with pytest.raises(UsageError, match=r"token ids must be integers in \[0, 2\^32\)"):
        cache.lookup(ids)
    assert cache.lookup([*TOKENS[:8], 2**32 - 1]) == 8  # the largest id is one
