"""Writes into a folder store never leave it (issue 46, finding 3): a link (or a file) in place of
any folder on the way to an object, of the object's own name, or of a writer's temp file is never
followed by `store put`, `put_sequence`, `store rm`, the cap's eviction (`store gc`) or the temp
file sweep. A put says so in one notice and stores nothing there; nothing is created, changed or
removed where the link points. Real folders and links, the real CLI."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from fixtures import make_identity, make_kv, write_kv_file
from kvtool.cli.app import run
from kvtool.store import local, open_store

L, H, D, CS = 2, 2, 8, 8
TOKENS = list(range(100, 132))  # 4 whole chunks
LEVELS = ["namespace", "model", "chunk size", "two digits"]  # the folders on the way to a chunk object


def identity():
    return make_identity(num_layers=L, num_kv_heads=H, head_dim=D)


def call(capsys, *args):
    capsys.readouterr()
    code = run([str(a) for a in args])
    out = capsys.readouterr()
    return code, " ".join(out.out.split()), out.err  # (stdout as words: rich wraps it at 80 columns)


def everything_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def victim(tmp_path) -> Path:
    """The folder a hostile link points to: nothing of the store may ever land or change in it."""
    folder = tmp_path / "victim"
    folder.mkdir()
    return folder


def link_in_place(store_root: Path, name: str, level: int, victim: Path) -> Path:
    """The folder `level` on the way to object `name` (0: its namespace) made a link to `victim`."""
    folder = store_root / "/".join(name.split("/")[:level + 1])
    shutil.rmtree(folder)
    folder.symlink_to(victim)
    return folder


@pytest.mark.parametrize("level", range(4), ids=LEVELS)
def test_store_put_never_writes_through_a_linked_folder(tmp_path, capsys, victim, level):
    f = write_kv_file(tmp_path / "a.kvc", identity=identity(), num_tokens=CS, chunk_size=CS)
    root = tmp_path / "s"
    assert call(capsys, "store", "put", f.path, "--store", root)[0] == 0
    [name] = [o.name for o in open_store(str(root)).backend.scan()]
    link = link_in_place(root, name, level, victim)
    code, out, err = call(capsys, "store", "put", f.path, "--store", root)
    assert code == 0 and "0 of 1 chunk stored" in out
    assert len(err.splitlines()) == 1 and "never followed: nothing written through it" in err
    assert everything_under(victim) == [] and link.is_symlink()


@pytest.mark.parametrize("level", range(4), ids=LEVELS)
def test_put_sequence_never_writes_through_a_linked_folder(tmp_path, victim, level):
    cache = open_store(str(tmp_path / "s")).for_model(identity(), chunk_size=CS)
    kv = make_kv(identity(), 32, torch.float32)
    cache.put_sequence(TOKENS, kv)
    name = cache.chunk_names(TOKENS)[1]
    link_in_place(tmp_path / "s", name, level, victim)
    put = cache.put_sequence(TOKENS, kv)
    assert put.stored == 0 and cache.store.counters.refused >= 1
    assert everything_under(victim) == []


def test_block_entries_never_written_through_a_linked_folder(tmp_path, victim):
    """At a block size, a put also writes block index entries (`.../<chunk size>/blocks/...`,
    written without fsync): that folder made a link, they are refused too, and the chunks
    themselves are still stored."""
    store = open_store(str(tmp_path / "s"))
    store.for_model(identity(), chunk_size=CS).put_sequence(TOKENS, make_kv(identity(), 32, torch.float32))
    name = store.for_model(identity(), chunk_size=CS).chunk_names(TOKENS)[0]
    (tmp_path / "s" / Path(name).parents[1] / "blocks").symlink_to(victim)
    tokens = list(range(200, 236))
    put = store.for_model(identity(), chunk_size=CS, block_size=4).put_sequence(
        tokens, make_kv(identity(), 36, torch.float32))
    assert put.stored == 4 and put.block_entries == 0
    assert everything_under(victim) == []


def test_a_linked_folder_is_removed_by_fsck_then_a_put_stores_the_chunk(tmp_path, capsys, victim):
    f = write_kv_file(tmp_path / "a.kvc", identity=identity(), num_tokens=CS, chunk_size=CS)
    root = tmp_path / "s"
    call(capsys, "store", "put", f.path, "--store", root)
    [name] = [o.name for o in open_store(str(root)).backend.scan()]
    link = link_in_place(root, name, 3, victim)
    (victim / "mine.txt").write_text("keep")
    code, out, _ = call(capsys, "store", "fsck", "--store", root)
    assert code == 0 and "removed 1" in out and not os.path.lexists(link)
    assert (victim / "mine.txt").read_text() == "keep"
    code, out, _ = call(capsys, "store", "put", f.path, "--store", root)
    assert code == 0 and "1 of 1 chunk stored" in out and (root / name).is_file()


def test_a_link_at_the_object_name_is_replaced_not_followed(tmp_path, victim):
    cache = open_store(str(tmp_path / "s")).for_model(identity(), chunk_size=CS)
    kv = make_kv(identity(), 32, torch.float32)
    cache.put_sequence(TOKENS, kv)
    path = tmp_path / "s" / cache.chunk_names(TOKENS)[2]
    path.unlink()
    path.symlink_to(victim / "planted.kvc")  # dangling: a followed write would create it
    assert cache.put_sequence(TOKENS, kv).stored == 1
    assert path.is_file() and not path.is_symlink() and everything_under(victim) == []


def test_a_link_at_the_temp_file_name_is_never_followed(tmp_path, victim, monkeypatch):
    """A link planted at the name a writer picks for its temp file (forced here: the names are
    random) is never opened; the writer takes a fresh name and the object is stored."""
    cache = open_store(str(tmp_path / "s")).for_model(identity(), chunk_size=CS)
    kv = make_kv(identity(), 32, torch.float32)
    cache.put_sequence(TOKENS, kv)
    path = tmp_path / "s" / cache.chunk_names(TOKENS)[0]
    path.unlink()
    planted = path.parent / f".{path.name}.planted.tmp"
    planted.symlink_to(victim / "planted")
    names = iter([planted.name])
    fresh = local._temp_name
    monkeypatch.setattr(local, "_temp_name", lambda leaf: next(names, None) or fresh(leaf))
    assert cache.put_sequence(TOKENS, kv).stored == 1
    assert path.is_file() and planted.is_symlink() and everything_under(victim) == []


def test_store_rm_never_removes_through_a_linked_folder(tmp_path, capsys, victim):
    cache = open_store(str(tmp_path / "s")).for_model(identity(), chunk_size=CS)
    cache.put_sequence(TOKENS, make_kv(identity(), 32, torch.float32))
    name = cache.chunk_names(TOKENS)[0]
    folder = tmp_path / "s" / Path(name).parent
    shutil.copytree(folder, victim, dirs_exist_ok=True)  # a copy of the object where the link points
    link_in_place(tmp_path / "s", name, 3, victim)
    kept = everything_under(victim)
    code, out, err = call(capsys, "store", "rm", name, "--store", tmp_path / "s")
    assert code == 2 and "no object" in err  # behind a link is not in the store: named as such, nothing removed
    assert cache.delete(TOKENS[:CS]) == 0
    assert everything_under(victim) == kept and kept


def test_gc_never_evicts_nor_sweeps_through_a_linked_namespace(tmp_path, capsys, victim):
    """`chunks` made a link to a folder holding what looks like objects and a dead writer's temp
    file: the listing may show them, but eviction and the sweep remove nothing there."""
    cache = open_store(str(tmp_path / "s")).for_model(identity(), chunk_size=CS)
    cache.put_sequence(TOKENS, make_kv(identity(), 32, torch.float32))
    chunks = tmp_path / "s" / "chunks"
    shutil.copytree(chunks, victim, dirs_exist_ok=True)
    some_folder = next(p for p in victim.rglob("*") if p.is_dir())
    stale = some_folder / ".x.kvc.0.tmp"
    stale.write_bytes(b"half")
    old = time.time() - 10 * local.STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    shutil.rmtree(chunks)
    chunks.symlink_to(victim)
    kept = everything_under(victim)
    code, out, _ = call(capsys, "store", "gc", "--max-bytes", "0", "--store", tmp_path / "s")
    assert code == 0 and "0 temp files" in out
    assert everything_under(victim) == kept
