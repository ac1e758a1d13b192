"""One rule for exit codes (README, "Exit codes"; issue 27 item 9): 2 when the input cannot be
read as a kvtool container at all (a usage error, a file that cannot be opened, a broken header,
trailer or manifest: the manifest's own checksum included, since nothing past it can be trusted
to find the chunks); 1 when the container reads and its data fails a check (a chunk's or the
tokens' checksum, a decode, a value that is not finite, a tolerance). Each case through the CLI,
on a real file."""

from __future__ import annotations

import pytest
import torch

from fixtures import flip_byte, put, split_file, write_kv_file
from kvtool.cli.app import run


@pytest.fixture
def good(tmp_path):
    return write_kv_file(tmp_path / "good.kvc", num_tokens=24, chunk_size=8, dtype=torch.float32)


def exit_of(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_a_manifest_checksum_mismatch_exits_2(tmp_path, capsys, good):
    parts = split_file(good.path)
    data = flip_byte(good.path.read_bytes(), parts.manifest_offset + 10, 0x01)
    code, err = exit_of(capsys, "verify", put(tmp_path, data))
    assert code == 2 and "manifest checksum mismatch" in err and err.count("\n") == 1


def test_a_chunk_checksum_mismatch_exits_1(tmp_path, capsys, good):
    parts = split_file(good.path)
    entry = parts.manifest["chunks"][1]
    data = flip_byte(good.path.read_bytes(), entry["offset"] + 3, 0x10)
    code, _ = exit_of(capsys, "verify", put(tmp_path, data))
    assert code == 1


def test_not_a_kvtool_file_and_usage_exit_2(tmp_path, capsys):
    assert exit_of(capsys, "verify", put(tmp_path, b"not a kvtool file at all" * 10))[0] == 2
    assert exit_of(capsys, "verify", tmp_path / "missing.kvc")[0] == 2
    assert exit_of(capsys, "verify", "--no-such-option")[0] == 2


def test_the_rule_is_written_in_the_readme():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "manifest's own checksum" in readme


def test_a_writer_refuses_more_chunks_than_a_file_holds_before_writing(tmp_path):
    from fixtures import make_identity
    from kvtool.errors import UsageError
    from kvtool.format import ContainerWriter
    from kvtool.format.layout import MAX_CHUNKS

    with pytest.raises(UsageError, match=f"at most {MAX_CHUNKS}"):
        ContainerWriter(tmp_path / "big.kvc", make_identity(), list(range(MAX_CHUNKS + 1)), chunk_size=1)
    assert not list(tmp_path.iterdir())  # nothing written, not even a temp file
