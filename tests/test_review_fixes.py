"""Regression tests for defects a review found (each one reproduced first)."""

from __future__ import annotations

import json

import pytest
import torch

from fixtures import make_identity, rebuild, write_kv_file
from kvtool.cli.app import run
from kvtool.errors import CodecParamsInvalid
from kvtool.format import ContainerReader, ContainerWriter


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_replay_render_prints_brackets_literally(capsys):
    from kvtool.cli.output import emit
    from kvtool.cli.replay import render

    result = {"file": "[b]x.kvc", "model": "m", "device": "cpu", "reused_tokens": 1, "num_tokens": 2, "chunks_loaded": 1,
              "codecs": ["raw"], "computed_tokens": 1, "ttft_cached_s": 0.1, "load_s": 0.05,
              "continuation": "[i]italic[/i], [u]under[/u], [link](http://x)", "failures": []}
    emit(result, False, render)
    out = capsys.readouterr().out.replace("\n", "")
    assert "'[i]italic[/i], [u]under[/u], [link](http://x)'" in out and "[b]x.kvc" in out


def test_json_output_never_holds_nan(tmp_path, capsys):
    f = write_kv_file(tmp_path / "ok.kvc", num_tokens=6, chunk_size=3)
    bad = tmp_path / "nan.kvc"
    kv = torch.full((2, 2, 6, 16), float("nan"), dtype=torch.bfloat16)
    with ContainerWriter(bad, make_identity(), f.token_ids, chunk_size=3, alignment=64) as w:
        for s, e in w.chunk_ranges():
            w.write_chunk(kv[:, :, s:e], "raw")
    capsys.readouterr()
    assert run(["inspect", str(bad), "--stats", "--json"]) == 0
    doc = _strict_json(capsys.readouterr().out)
    assert doc["stats"][0]["min"] is None


def test_zstd_params_without_shuffle_are_rejected_not_guessed(tmp_path):
    f = write_kv_file(tmp_path / "z.kvc", num_tokens=6, chunk_size=3, codec="zstd",
                      params={"version": 1, "level": 1, "shuffle": "none"})

    def drop(doc):
        for c in doc["chunks"]:
            del c["codec_params"]["shuffle"]

    mutated = tmp_path / "drop.kvc"
    mutated.write_bytes(rebuild(f.path, drop))
    with pytest.raises(CodecParamsInvalid):
        ContainerReader(mutated)


def test_output_that_is_a_directory_is_named(tmp_path, capsys):
    f = write_kv_file(tmp_path / "a.kvc")
    (tmp_path / "d").mkdir()
    capsys.readouterr()
    assert run(["compress", str(f.path), "-o", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory" in err and ".tmp" not in err


def test_format_errors_name_the_file(tmp_path, capsys):
    f = write_kv_file(tmp_path / "a.kvc")
    other = tmp_path / "notes.txt"
    other.write_text("hello, not a kv file at all, but long enough to have a header and trailer" * 3)
    capsys.readouterr()
    assert run(["verify", str(f.path), "--against", str(other)]) == 2
    assert "notes.txt: not a kvtool file" in capsys.readouterr().err


def test_verify_against_keeps_its_report_when_the_file_is_damaged(tmp_path, capsys):
    good = write_kv_file(tmp_path / "good.kvc", num_tokens=6, chunk_size=3)
    data = bytearray(good.path.read_bytes())
    with ContainerReader(good.path) as r:
        data[r.chunks[1].blob.offset] ^= 0xFF
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(bytes(data))
    capsys.readouterr()
    assert run(["verify", str(bad), "--against", str(good.path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and any("chunk 1" in p for p in doc["problems"])


def test_compressed_file_records_its_own_creation(tmp_path):
    f = write_kv_file(tmp_path / "a.kvc")
    out = tmp_path / "b.kvc"
    assert run(["compress", str(f.path), "-o", str(out), "--codec", "zstd"]) == 0
    with ContainerReader(f.path) as a, ContainerReader(out) as b:
        assert b.manifest.metadata["source_created_at"] == a.manifest.metadata["created_at"]
        assert b.manifest.metadata["compressed_from"] == str(f.path)


@pytest.mark.model
def test_capture_rejects_huge_block_size_and_nested_token_files(tmp_path, capsys, default_model):
    capsys.readouterr()
    assert run(["capture", "--prompt", "hi", "-o", str(tmp_path / "x.kvc"), "--block-size", "100000000000"]) == 2
    nested = tmp_path / "t.json"
    nested.write_text("[" * 100000 + "]" * 100000)
    assert run(["capture", "--tokens", str(nested), "-o", str(tmp_path / "x.kvc")]) == 2
    err = capsys.readouterr().err
    assert err.count("kvtool: error:") == 2 and "Traceback" not in err


def test_spec_rules_from_the_consistency_review(tmp_path):
    """Nesting over 64 levels, a chunk dtype outside the KV dtypes, and a huge unknown codec id
    get the errors container.md section 5 names."""
    from kvtool.errors import ManifestCorrupt, UnknownCodec, UnsupportedDtype

    f = write_kv_file(tmp_path / "a.kvc", num_tokens=6, chunk_size=3)
    cases = [
        (lambda d: d["metadata"].__setitem__("x", "y") or d.__setitem__("deep", [[[[0]]]] * 1) or
         d.__setitem__("deeper", json.loads("[" * 70 + "]" * 70)), ManifestCorrupt),
        (lambda d: d["chunks"][0].__setitem__("dtype", "float64"), UnsupportedDtype),
        (lambda d: d["chunks"][0].__setitem__("codec_id", 2**40), UnknownCodec),
    ]
    for i, (mutate, error) in enumerate(cases):
        path = tmp_path / f"m{i}.kvc"
        path.write_bytes(rebuild(f.path, mutate))
        with pytest.raises(error):
            ContainerReader(path)
