"""`kvtool store get --sglang-page-size`: pages stored as the SGLang backend stores them
(format-spec/store.md §4.8, written here through kvtool.store.sglang_pages, no SGLang needed)
become a container of the prompt's leading pages: the heads of several tensor-parallel ranks side
by side, the run stopped at a missing or damaged page, one line and exit 1 when none is stored."""

from __future__ import annotations

import json

import pytest
import torch

from fixtures import cli
from kvtool.format import ContainerReader
from kvtool.store import open_store
from kvtool.store.names import model_key
from kvtool.store.sglang_pages import PageKeys, page_hashes, put_pages, shard_name

PAGE = 8


@pytest.fixture()
def stored(tmp_path, default_model):
    """(store, tokens file, tokens, KV [2, L, T, C]) of 5 pages saved by 3 ranks (one KV head each)."""
    ident = default_model.identity
    tokens = list(range(500, 500 + 5 * PAGE + 3))  # and a partial page, never stored
    kv = torch.randn(2, ident.num_layers, 5 * PAGE, ident.num_kv_heads, ident.head_dim,
                     generator=torch.Generator().manual_seed(0))
    hashes = page_hashes(tokens, PAGE)
    store = open_store(tmp_path / "s")
    for r in range(3):
        keys = PageKeys(model_key(ident), PAGE, shard_name(tp_rank=r, tp_size=3))
        assert all(put_pages(store.backend, keys, [(h, kv[:, :, i * PAGE:(i + 1) * PAGE, r:r + 1].contiguous())
                                                   for i, h in enumerate(hashes)]))
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(tokens))
    return store, path, tokens, kv.reshape(2, ident.num_layers, 5 * PAGE, -1)


def test_the_ranks_pages_are_one_file_of_the_whole_pages(tmp_path, stored, capsys):
    store, path, tokens, kv = stored
    out = tmp_path / "o.kvc"
    code, got, err = cli(capsys, "store", "get", "--store", tmp_path / "s", "--tokens", path,
                         "--sglang-page-size", PAGE, "--sglang-tp", 3, "-o", out, "--json")
    assert code == 0, err
    assert got["cached_tokens"] == 5 * PAGE and got["prompt_tokens"] == len(tokens)
    with ContainerReader(out) as r:
        assert [int(t) for t in r.token_ids()] == tokens[:5 * PAGE]
        assert torch.equal(torch.cat([r.read_chunk(i) for i in range(len(r.chunks))], dim=2), kv)
    assert cli(capsys, "verify", out)[0] == 0
    code, replayed, err = cli(capsys, "replay", out, "--continue", 2, "--json")  # (random KV: any tokens)
    assert code == 0 and replayed["num_tokens"] == 5 * PAGE and replayed["reused_tokens"] > 0, err
    code, shown, _ = cli(capsys, "inspect", out, "--json")
    assert code == 0 and "SmolLM2" in json.dumps(shown)
    # the store's upkeep sees the pages as the tensor objects they are
    code, listed, _ = cli(capsys, "store", "ls", "--store", tmp_path / "s", "--kind", "tensor", "--json")
    assert code == 0 and len(listed["objects"]) == 3 * 5
    code, stats, _ = cli(capsys, "store", "stats", "--store", tmp_path / "s", "--json")
    assert code == 0 and stats["by_kind"] == {"tensor": 15} and stats["foreign"] == 0
    code, checked, _ = cli(capsys, "store", "fsck", "--store", tmp_path / "s", "--json")
    assert code == 0, checked
    # read as pages of one rank: those are other keys (a rank's heads are not the model's), none stored
    code, _, err = cli(capsys, "store", "get", "--store", tmp_path / "s", "--tokens", path,
                       "--sglang-page-size", PAGE, "-o", tmp_path / "one.kvc")
    assert code == 1 and "no SGLang page" in err


def test_the_run_stops_at_a_damaged_page(tmp_path, stored, capsys, default_model):
    store, path, tokens, kv = stored
    keys = PageKeys(model_key(default_model.identity), PAGE, shard_name(tp_rank=1, tp_size=3))
    victim = tmp_path / "s" / keys.name(page_hashes(tokens, PAGE)[2])
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01
    victim.write_bytes(bytes(data))
    out = tmp_path / "o.kvc"
    code, got, err = cli(capsys, "store", "get", "--store", tmp_path / "s", "--tokens", path,
                         "--sglang-page-size", PAGE, "--sglang-tp", 3, "-o", out, "--json")
    assert code == 0, err
    assert got["cached_tokens"] == 2 * PAGE and any("CRC-32C" in why for why in got["refused"])
    with ContainerReader(out) as r:
        assert torch.equal(r.read_chunk(0), kv[:, :, :2 * PAGE])
    code, checked, _ = cli(capsys, "store", "fsck", "--store", tmp_path / "s", "--json")
    assert len(checked["damaged"]) == 1 and checked["intact"] == 14 and not victim.exists()  # found, removed
    assert cli(capsys, "store", "gc", "--store", tmp_path / "s", "--max-bytes", "1")[0] == 0
    code, listed, _ = cli(capsys, "store", "ls", "--store", tmp_path / "s", "--json")
    assert code == 0 and listed["objects"] == []  # gc evicts pages like any object


def test_nothing_stored_is_one_line_and_exit_1(tmp_path, default_model, capsys):
    open_store(tmp_path / "s")
    code, out, err = cli(capsys, "store", "get", "--store", tmp_path / "s", "--prompt", "hello there",
                         "--sglang-page-size", PAGE, "-o", tmp_path / "o.kvc")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "no SGLang page" in err
    assert not (tmp_path / "o.kvc").exists()
