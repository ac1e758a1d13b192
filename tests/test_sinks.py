"""The writer writes to a sink: memory, a file (atomic), or any object with write/commit/abort."""

from __future__ import annotations

import os

import pytest
import torch

from kvtool.errors import OutputError, UsageError
from kvtool.format import ContainerReader, ContainerWriter, FileSink, MemorySink, Sink, WriterState

from fixtures import make_identity, make_kv, write_kv_file

FIXED = {"created_at": "2024-01-01T00:00:00Z"}  # the same metadata, so the same bytes


def temp_files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


class Collector:
    """A sink of the test's own: keeps the bytes, counts commits and aborts."""

    def __init__(self):
        self.data = bytearray()
        self.commits = 0
        self.aborts = 0

    def write(self, data):
        self.data += bytes(data)

    def commit(self):
        self.commits += 1

    def abort(self):
        self.aborts += 1


def write(target, **kw) -> ContainerWriter:
    ident = make_identity()
    w = ContainerWriter(target, ident, list(range(7)), chunk_size=3, alignment=64, metadata=FIXED, **kw)
    for i, (s, e) in enumerate(w.chunk_ranges()):
        w.write_chunk(make_kv(ident, e - s, torch.bfloat16, seed=i), codec="zstd" if i % 2 else "raw")
    w.write_extra("roi_mask", torch.ones(7, dtype=torch.bool))
    w.finish()
    return w


def test_memory_file_and_custom_sinks_give_the_same_bytes(tmp_path):
    target = tmp_path / "a.kvc"
    write(target)
    on_disk = target.read_bytes()
    assert write(None).getvalue() == on_disk
    memory = MemorySink()
    assert write(memory).getvalue() == on_disk and memory.getvalue() == on_disk
    other = tmp_path / "b.kvc"
    write(FileSink(other))
    assert other.read_bytes() == on_disk
    custom = Collector()
    w = write(custom)
    assert bytes(custom.data) == on_disk and (custom.commits, custom.aborts) == (1, 0)
    assert w.state is WriterState.FINISHED and w.path is None
    w.abort()  # no-op after finish: the sink is not aborted
    assert custom.aborts == 0
    with pytest.raises(UsageError, match="in-memory"):
        w.getvalue()  # the custom sink keeps its own bytes
    assert temp_files(tmp_path) == []
    with ContainerReader(target) as r:
        assert r.num_tokens == 7 and [c.codec for c in r.chunks] == ["raw", "zstd", "raw"]


def test_the_sinks_follow_the_protocol():
    assert isinstance(MemorySink(), Sink) and isinstance(Collector(), Sink)
    assert not isinstance(b"", Sink)
    with pytest.raises(UsageError, match="not int"):
        ContainerWriter(3, make_identity(), [1])


def test_abort_leaves_no_temp_file_and_keeps_the_older_target(tmp_path):
    target = tmp_path / "a.kvc"
    write_kv_file(target, num_tokens=3, chunk_size=3, seed=1)
    before, inode = target.read_bytes(), target.stat().st_ino
    w = ContainerWriter(target, make_identity(), list(range(7)), chunk_size=3, alignment=64)
    w.write_chunk(make_kv(make_identity(), 3, torch.bfloat16))
    assert len(temp_files(tmp_path)) == 1 and target.read_bytes() == before
    w.abort()
    w.abort()  # twice is harmless
    assert w.state is WriterState.ABORTED
    assert temp_files(tmp_path) == []
    assert target.read_bytes() == before and target.stat().st_ino == inode
    sink = FileSink(target)  # a sink on its own: abort, or dropped, leaves nothing either
    sink.write(b"partial")
    sink.abort()
    sink.abort()
    dropped = FileSink(target)
    dropped.write(b"partial")
    del dropped
    assert temp_files(tmp_path) == [] and target.read_bytes() == before


def test_a_custom_sink_is_aborted_once_on_a_failure(tmp_path):
    custom = Collector()
    with pytest.raises(UsageError, match="1 of 3"):
        with ContainerWriter(custom, make_identity(), list(range(7)), chunk_size=3) as w:
            w.write_chunk(make_kv(make_identity(), 3, torch.bfloat16))
    assert (custom.commits, custom.aborts) == (0, 1)
    refused = Collector()
    with pytest.raises(UsageError):  # a writer that refuses its arguments never touches its sink
        ContainerWriter(refused, make_identity(), [])
    assert (refused.data, refused.commits, refused.aborts) == (bytearray(), 0, 0)


def _unwritable_target(tmp_path):
    """A target whose folder cannot be written: read-only, or (as root, where modes do not
    bind) a 'folder' that is a regular file."""
    if os.geteuid() == 0:
        parent = tmp_path / "plain-file"
        parent.write_bytes(b"")
        return parent / "a.kvc", lambda: None
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    return folder / "a.kvc", lambda: folder.chmod(0o755)


def test_an_unwritable_folder_is_one_output_error(tmp_path):
    target, restore = _unwritable_target(tmp_path)
    try:
        with pytest.raises(OutputError) as err:
            write(target)
        with pytest.raises(OutputError) as err_sink:
            FileSink(target)
    finally:
        restore()
    for e in (err, err_sink):
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{target}: cannot write here")
    assert not target.exists()
