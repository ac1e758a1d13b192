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


# --- store ls: whole names into a pipe, short distinct ids on a terminal; store rm takes either ----


def _store_with_chunks(path, tokens: int = 40):
    from fixtures import make_identity, make_kv
    from kvtool.store import open_store

    cache = open_store(path).for_model(make_identity(), chunk_size=8)
    cache.put_sequence(list(range(tokens)), make_kv(make_identity(), tokens, torch.float32))
    return sorted(o.name for o in cache.backend.scan())


def _kvtool(*argv, stdout=None, env=None):
    import os
    import subprocess
    import sys

    from user_docs import REPO

    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "kvtool", *map(str, argv)], stdout=stdout or subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env, timeout=120)


def _on_a_terminal(*argv, columns: int = 80) -> str:
    """What the command shows on a terminal `columns` wide (a pty), its escapes taken out."""
    import fcntl
    import os
    import pty
    import re
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    shown = bytearray()

    def drain():  # an unread pty's buffer would block the command
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            shown.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = _kvtool(*argv, stdout=slave, env={"TERM": "xterm"})
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    assert proc.returncode == 0, proc.stderr
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode()).replace("\r", "")


def test_store_ls_into_a_pipe_gives_whole_names_one_per_line(tmp_path):
    names = _store_with_chunks(tmp_path / "s")
    out = _kvtool("store", "ls", "--store", tmp_path / "s").stdout.decode()
    rows = [line for line in out.splitlines() if line.startswith("chunk")]
    assert len(rows) == len(names)
    assert sorted(row.split()[-1] for row in rows) == names  # each whole, on its row's one line


def test_store_ls_on_an_80_column_terminal_tells_rows_apart_and_rm_takes_its_ids(tmp_path):
    names = _store_with_chunks(tmp_path / "s")
    shown = _on_a_terminal("store", "ls", "--store", tmp_path / "s", columns=80)
    lines = [line for line in shown.splitlines() if line.strip()]
    assert all(len(line) <= 80 for line in lines), lines
    ids = [line.split()[-1] for line in lines if line.startswith("chunk")]
    assert len(ids) == len(set(ids)) == len(names)
    stems = [n.rsplit("/", 1)[-1].split(".")[0] for n in names]
    assert all(sum(s.startswith(i) for s in stems) == 1 for i in ids)
    # an id from the terminal, and a whole name from the pipe, each remove their object
    assert _kvtool("store", "rm", ids[0], "--store", tmp_path / "s").returncode == 0
    whole = next(n for n in names if not n.rsplit("/", 1)[-1].startswith(ids[0]))
    assert _kvtool("store", "rm", whole, "--store", tmp_path / "s").returncode == 0
    left = _kvtool("store", "ls", "--store", tmp_path / "s").stdout.decode()
    assert len([line for line in left.splitlines() if line.startswith("chunk")]) == len(names) - 2
    assert whole not in left and ids[0] not in left


def test_store_rm_refuses_a_name_that_names_nothing_and_removes_nothing(tmp_path, capsys):
    names = _store_with_chunks(tmp_path / "s")
    assert run(["store", "rm", "ffffffffffffzz", names[0], "--store", str(tmp_path / "s")]) == 2
    assert "no object ffffffffffffzz in the store" in capsys.readouterr().err
    from kvtool.store import open_store

    assert len(list(open_store(tmp_path / "s").backend.scan())) == len(names)  # not even the one named rightly


def test_a_start_several_names_share_is_refused_naming_how_many():
    from kvtool.errors import UsageError
    from kvtool.store.backend import ObjectInfo
    from kvtool.store.upkeep import resolve_names

    infos = [ObjectInfo(name=f"chunks/m/8/ab/abcd{i}.kvc", size=1, last_used=0.0) for i in range(3)]
    with pytest.raises(UsageError, match="abcd is the start of 3 objects' names"):
        resolve_names(["abcd"], infos)
    assert resolve_names(["abcd1"], infos) == [infos[1]]
    with pytest.raises(UsageError, match="no object abc in the store"):  # under 4 characters names nothing
        resolve_names(["abc"], infos)


def test_short_ids_grow_until_they_part():
    from kvtool.store.upkeep import short_ids

    names = ["chunks/m/8/ab/abcdef0123456789aa.kvc", "chunks/m/8/ab/abcdef0123456789bb.kvc",
             "chunks/m/8/12/1234567890abcdef.kvc", "blocks/m/8/12/1234567890abcdef.kvc"]
    ids = short_ids(names)
    assert ids[names[0]] == "abcdef0123456789a" and ids[names[1]] == "abcdef0123456789b"
    assert ids[names[2]] == names[2] and ids[names[3]] == names[3]  # the same stem: whole names


# --- replay: a cache that shares nothing with the prompt is said; a measure over too few tokens --


@pytest.mark.model
def test_a_cache_that_shares_nothing_with_the_prompt_says_so(tmp_path, capsys, default_model):
    import kvtool

    ids = default_model.tokenizer.encode("Bees carry pollen from flower to flower all summer long.")
    kvtool.capture(default_model, ids, tmp_path / "bees.kvc", chunk_size=8)
    capsys.readouterr()
    code = run(["replay", str(tmp_path / "bees.kvc"), "--prompt", "Tides rise twice a day on most shores.",
                "--continue", "2", "--compare"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "shares no tokens with the prompt: nothing is loaded" in err and err.count("notice") == 1
    flat = " ".join(out.split())
    assert "nothing from the cache (it shares no tokens with the prompt)" in flat
    assert "(0 chunks, )" not in flat and "with the cache" not in flat
    assert "over 2 teacher-forced tokens (too few to judge: 8 at least)" in flat


def test_one_teacher_forced_token_is_singular_and_too_few():
    from kvtool.cli.output import plural
    from kvtool.cli.replay import too_few

    assert plural(1, "teacher-forced token") + too_few(1) == "1 teacher-forced token (too few to judge: 8 at least)"
    assert too_few(64) == ""


def test_store_stats_counts_a_models_objects_in_the_stores_own_words(tmp_path, capsys):
    from fixtures import make_identity, make_kv
    from kvtool.store import open_store

    cache = open_store(tmp_path / "s").for_model(make_identity(), chunk_size=8, block_size=4)
    cache.put_sequence(list(range(20)), make_kv(make_identity(), 20, torch.float32))  # chunks, a piece, blocks
    capsys.readouterr()
    assert run(["store", "stats", "--store", str(tmp_path / "s")]) == 0
    lines = capsys.readouterr().out.splitlines()
    store_kinds = lines[0][lines[0].index("("):]
    assert "chunk" in store_kinds and "object" in lines[0]
    model_line = next(line for line in lines if line.strip().startswith("model "))
    assert store_kinds in model_line  # one model: the same count, in the same words


def test_verify_help_quotes_cachegens_thresholds_from_their_table():
    import re

    from kvtool.codecs.cachegen import EXPECTED_TOP1
    from kvtool.ops.file_requests import VerifyRequest
    from kvtool.ops.fields import flag_of
    import dataclasses

    help_text = flag_of(next(f for f in dataclasses.fields(VerifyRequest) if f.name == "min_top1")).help
    low, high = re.search(r"(\d\.\d\d)-(\d\.\d\d) cachegen", help_text).groups()
    assert (float(low), float(high)) == (min(t for _, t in EXPECTED_TOP1), max(t for _, t in EXPECTED_TOP1))


@pytest.mark.parametrize("flag", ["--chunk-size", "--block-size"])
def test_a_size_out_of_range_names_its_own_flag_alone(capsys, flag):
    assert run(["capture", "--prompt", "hi", "-o", "x.kvc", flag, "0"]) == 2
    err = capsys.readouterr().err
    other = "--block-size" if flag == "--chunk-size" else "--chunk-size"
    assert f"{flag} must be in 1..65536, got 0" in err and other not in err


def test_verify_says_a_problem_of_every_chunk_once(tmp_path, capsys, monkeypatch):
    """A pca file read where its calibration is not: one FAIL line naming the chunks, not one per chunk."""
    import json
    import shutil
    from pathlib import Path

    from fixtures import make_identity
    from kvtool.codecs.pca import calibration as calmod

    vectors = Path(__file__).resolve().parents[1] / "format-spec" / "vectors" / "pca"
    digest = json.loads((vectors / "bf16_sinks.json").read_text())["params"]["calibration"]
    (tmp_path / "cal").mkdir()
    shutil.copy(vectors / f"{digest}.kvcal", tmp_path / "cal")
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(tmp_path / "cal"))
    calmod._loaded.clear()
    raw = write_kv_file(tmp_path / "raw.kvc", identity=make_identity(num_layers=2, num_kv_heads=1, head_dim=8),
                        num_tokens=16, chunk_size=4).path
    assert run(["compress", str(raw), "-o", str(tmp_path / "p.kvc"), "--codec", "pca", "--calibration", digest]) == 0
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(tmp_path / "elsewhere"))
    calmod._loaded.clear()
    capsys.readouterr()
    assert run(["verify", str(tmp_path / "p.kvc")]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith("FAIL chunks 0-3: pca: calibration object") and "4 problems" in out
    calmod._loaded.clear()


def test_grouped_problems_keep_what_differs():
    from kvtool.cli.verify import grouped_problems

    assert grouped_problems(["chunk 0: bad", "chunk 1: bad", "chunk 2: other", "chunk 5: bad", "tokens: crc"]) == [
        "chunks 0-1, 5: bad", "chunk 2: other", "tokens: crc"]
