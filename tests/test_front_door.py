"""What a new user meets first (issue 51): each mistake one line that names the way out."""

from __future__ import annotations

import pytest
import torch

from fixtures import write_kv_file
from kvtool.cli.app import run


@pytest.mark.parametrize("typo,meant", [("cachgen", "cachegen"), ("ZST", "zstd"), ("pac", "pca")])
def test_a_codec_one_slip_away_is_named(tmp_path, capsys, typo, meant):
    f = write_kv_file(tmp_path / "x.kvc", num_tokens=16, chunk_size=8, dtype=torch.float32)
    assert run(["compress", str(f.path), "-o", str(tmp_path / "y.kvc"), "--codec", typo]) == 2
    err = capsys.readouterr().err
    assert f"unknown codec '{typo}' (did you mean {meant}?)" in err and err.count("\n") == 1
    assert not (tmp_path / "y.kvc").exists()


def test_a_codec_far_from_every_name_gets_no_guess(tmp_path, capsys):
    f = write_kv_file(tmp_path / "x.kvc", num_tokens=16, chunk_size=8, dtype=torch.float32)
    assert run(["compress", str(f.path), "-o", str(tmp_path / "y.kvc"), "--codec", "lz4"]) == 2
    err = capsys.readouterr().err
    assert "unknown codec 'lz4'; this build knows raw (0)" in err and "did you mean" not in err


def test_an_unsupported_dtype_answers_in_the_flags_own_words(capsys):
    assert run(["capture", "--prompt", "hi", "-o", "x.kvc", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "expected bf16, fp16 or fp32" in err and err.count("\n") == 1


def test_a_failed_put_into_a_new_folder_leaves_no_store_behind(tmp_path, capsys):
    (tmp_path / "junk.kvc").write_bytes(b"not a kvtool file at all")
    store = tmp_path / "new-store"
    assert run(["store", "put", str(tmp_path / "junk.kvc"), "--store", str(store)]) == 2
    assert "not a kvtool file" in capsys.readouterr().err
    assert not store.exists()
