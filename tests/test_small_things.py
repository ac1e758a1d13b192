"""Small things a first user trips on (issue 28, "Small things"): each one line, a clear exit."""

from __future__ import annotations

import pytest
import torch

from fixtures import write_kv_file
from kvtool.cli.app import run


@pytest.mark.parametrize("url,meant", [("redis:/127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
                                       ("file:/tmp/x", "file://tmp/x"), ("REDIS:localhost", "REDIS://localhost")])
def test_a_store_url_missing_a_slash_is_named_not_taken_for_a_folder(tmp_path, capsys, url, meant, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["store", "stats", "--store", url]) == 2
    err = capsys.readouterr().err
    assert f"did you mean {meant}?" in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # no folder made of the typo


def test_compress_refuses_to_overwrite_its_own_input(tmp_path, capsys):
    f = write_kv_file(tmp_path / "x.kvc", num_tokens=16, chunk_size=8, dtype=torch.float32)
    before = f.path.read_bytes()
    assert run(["compress", str(f.path), "-o", str(f.path), "--codec", "zstd"]) == 2
    assert "the output is the input" in capsys.readouterr().err
    assert f.path.read_bytes() == before


def test_fsck_counts_in_the_singular(tmp_path, capsys):
    from fixtures import make_identity, make_kv
    from kvtool.store import open_store

    cache = open_store(tmp_path / "s").for_model(make_identity(), chunk_size=8)
    tokens = list(range(16))
    cache.put_sequence(tokens, make_kv(make_identity(), 16, torch.float32))
    cache.backend.put(cache.chunk_names(tokens)[0], b"junk", replace=True)
    assert run(["store", "fsck", "--store", str(tmp_path / "s"), "--no-repair"]) == 1
    assert "1 damaged, foreign or unreadable object (0 removed)" in capsys.readouterr().err


def test_a_put_in_another_codec_says_why_nothing_new_was_stored(tmp_path, capsys):
    """issue 28 #4: a put of a cachegen file after the raw one stores nothing new: say why, and how."""
    from kvtool.cli.app import run as cli

    raw = write_kv_file(tmp_path / "r.kvc", num_tokens=16, chunk_size=8, dtype=torch.float32)
    assert cli(["compress", str(raw.path), "-o", str(tmp_path / "c.kvc"), "--codec", "zstd"]) == 0
    store = str(tmp_path / "s")
    assert cli(["store", "put", str(raw.path), "--store", store]) == 0
    capsys.readouterr()
    assert cli(["store", "put", str(tmp_path / "c.kvc"), "--store", store]) == 0
    out = capsys.readouterr().out
    assert "0 stored, 2 already there" in out and "kept as stored, whatever their codec" in out
    assert "store rm" in out


def test_store_ls_at_80_columns_shows_whole_names_and_the_models_name(tmp_path, capsys, monkeypatch):
    """issue 28 #3: names were cut ('chunks/d795c2699309b8814b2107...') and the model column held a
    hash: now each name is whole (into a pipe, on its row's one line: issue 51 #2), the model named as
    its objects record it."""
    from fixtures import make_identity, make_kv
    from kvtool.cli.app import run as cli
    from kvtool.store import open_store

    monkeypatch.setenv("COLUMNS", "80")
    ident = make_identity(name="tiny-model")
    cache = open_store(tmp_path / "s").for_model(ident, chunk_size=8)
    cache.put_sequence(list(range(16)), make_kv(ident, 16, torch.float32))
    capsys.readouterr()
    assert cli(["store", "ls", "--store", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "tiny-model" in out and "…" not in out
    joined = "".join(line.rstrip() for line in out.splitlines())
    for name in cache.chunk_names(list(range(16))):
        assert name.rsplit("/", 1)[-1] in joined.replace(" ", "")


@pytest.mark.model
def test_every_continuation_stops_at_the_models_end_of_sequence(tmp_path, capsys, default_model):
    """issue 28 #2: a continuation ran on past the model's end of sequence and printed raw special
    tokens ('<|im_end|>\\n<|im_end|><|im_start|>system...'). Now it stops there (the token kept),
    the cached run's and the recompute's alike."""
    import json

    from kvtool.cli.app import run as cli

    path = tmp_path / "q.kvc"
    assert cli(["capture", "--prompt", "What is 2+2? Answer with a number only.", "--chat", "--dtype", "fp32", "-o", str(path),
                "--json"]) == 0
    eos = set(default_model.config.eos_token_ids)
    for compare in ([], ["--compare"]):
        capsys.readouterr()
        assert cli(["replay", str(path), "--continue", "64", *compare, "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        tokens = r["continuation_tokens"]
        assert len(tokens) < 64 and tokens[-1] in eos and not eos & set(tokens[:-1])
        assert r["continue_tokens"] == len(tokens)
        if compare:
            assert r["cached_continuation_tokens"] == tokens  # lossless: the same, stopping at the same place


def test_a_mistyped_store_url_never_shows_its_password(capsys):
    from kvtool.cli.app import run as cli

    assert cli(["store", "stats", "--store", "redis:/admin:hunter2@10.0.0.1:6379/0"]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "admin" not in err and "did you mean redis://***@10.0.0.1:6379/0?" in err


def test_shuffle_and_no_shuffle_together_are_a_usage_error(tmp_path, capsys):
    f = write_kv_file(tmp_path / "f.kvc", num_tokens=8, chunk_size=8)
    assert run(["compress", str(f.path), "-o", str(tmp_path / "o.kvc"), "--codec", "zstd", "--shuffle",
                "--no-shuffle"]) == 2
    assert "--shuffle and --no-shuffle: give one" in capsys.readouterr().err
    assert not (tmp_path / "o.kvc").exists()


@pytest.mark.parametrize("command,most", [(["capture"], 60), (["replay"], 62), (["compress"], 30)])
def test_help_fits_80_columns_without_cut_examples_or_type_names(monkeypatch, capsys, command, most):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("TERM", "dumb")
    assert run([*command, "--help"]) == 0
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= most
    assert "…" not in text and "<str>" not in text and "<function>" not in text


def test_a_value_and_its_unit_are_one_word():
    from kvtool.cli.output import human_bytes, human_rate

    assert (human_bytes(512), human_bytes(23_592_960), human_rate(1005.2), human_rate(2.314)) == \
        ("512B", "22.5MiB", "1005MB/s", "2.31MB/s")
