"""What the CLI prints for people, from hostile or unusual files (issue 46): fields from a file or
a store never reach the terminal as control characters (finding 4), a file mixing codecs is
inspected per codec (finding 2), NaN chunks are dumped without numpy's warnings (finding 7).
Real files written by the real writer, the real CLI in this process."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures import make_identity, make_kv, rebuild, write_kv_file
from kvtool.cli.app import run


def call(capsys, *args):
    capsys.readouterr()
    code = run([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- NaN chunks: no numpy warning (finding 7) ---------------------------------------------------

#: A signaling NaN of each KV dtype: bits a file may hold (valid CRC), which numpy's float casts
#: turn quiet with an "invalid value encountered in cast" RuntimeWarning.
SIGNALING_NAN = {torch.bfloat16: (0x7F81, torch.int16), torch.float16: (0x7D01, torch.int16),
                 torch.float32: (0x7F800001, torch.int32)}


@pytest.mark.parametrize("dtype", list(SIGNALING_NAN), ids=str)
def test_nan_chunks_are_dumped_and_inspected_without_warnings(tmp_path, capsys, dtype):
    bits, as_int = SIGNALING_NAN[dtype]
    kv = make_kv(make_identity(), 8, dtype)
    kv.view(as_int)[:, :, 4:] = bits
    kv[:, :, 6:] = float("nan")
    f = write_kv_file(tmp_path / "nan.kvc", kv=kv, num_tokens=8, chunk_size=4, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for out in ("out.npy", "out.safetensors"):
            code, _, err = call(capsys, "dump", f.path, "-o", tmp_path / out)
            assert code == 0 and err == ""
        assert call(capsys, "inspect", "--stats", f.path)[0] == 0
        assert call(capsys, "verify", f.path)[0] == 1  # (NaN is refused by verify, said in its report)
    assert [str(w.message) for w in caught] == []
    dumped = np.load(tmp_path / "out.npy")  # bit for bit: a bfloat16 is the high half of its float32
    stored = kv.view(as_int).numpy().astype(np.int64) & (0xFFFF if as_int == torch.int16 else 0xFFFFFFFF)
    if dtype == torch.bfloat16:
        assert np.array_equal(dumped.view(np.uint32) >> 16, stored.reshape(dumped.shape))
    else:
        assert np.array_equal(dumped.view(np.uint16 if dtype == torch.float16 else np.uint32),
                              stored.reshape(dumped.shape))


# ---- a file mixing codecs (finding 2: KeyError 'bpv_sinks') -------------------------------------

@pytest.fixture()
def pca_params(tmp_path, monkeypatch):
    """pca parameters over a small calibration fitted on random data (as tests/test_pca.py's)."""
    from test_pca import small_calibration

    from kvtool.codecs.pca import QUALITY, params_for
    from kvtool.codecs.pca import calibration as calmod

    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(tmp_path / "cal"))
    monkeypatch.delenv("KVTOOL_CALIBRATION_PATH", raising=False)
    calmod._loaded.clear()
    saved = small_calibration().save(tmp_path / "cal")
    yield params_for(getattr(saved, "digest", saved), next(iter(QUALITY)))
    calmod._loaded.clear()


@pytest.mark.parametrize("order", [("cachegen", "pca", "zstd", "raw"), ("pca", "raw", "cachegen", "zstd")],
                         ids=["cachegen-first", "pca-first"])
def test_inspect_a_file_mixing_codecs_shows_each_codecs_parts(tmp_path, capsys, pca_params, order):
    """What `store get` writes when a prefix was stored in several codecs: each codec's bits by
    part on a line of its own (their parts differ), the totals over all."""
    params = {"pca": pca_params}
    f = write_kv_file(tmp_path / "mixed.kvc", identity=make_identity(num_layers=2, num_kv_heads=2, head_dim=8),
                      num_tokens=16, chunk_size=4, codecs_per_chunk=[(c, params.get(c)) for c in order])
    for args in ((), ("--stats",), ("--wide",)):
        code, out, err = call(capsys, "inspect", *args, f.path)
        text = " ".join(out.split())
        assert code == 0 and err == ""
        lines = {line.split(" chunks:")[0].rsplit(" ", 1)[-1]: line for line in text.split("bits/value by part, ")[1:]}
        assert set(lines) == {"cachegen", "pca"}
        assert " scales " in lines["cachegen"] and " side " in lines["pca"]  # each codec's own parts
    assert call(capsys, "verify", f.path)[0] == 0
    one = write_kv_file(tmp_path / "one.kvc", num_tokens=8, chunk_size=4, codec="cachegen")
    code, out, _ = call(capsys, "inspect", one.path)
    assert code == 0 and "bits/value by part: header" in " ".join(out.split())  # one codec: as before


# ---- terminal escapes from files and stores (finding 4) -----------------------------------------

#: Clear the screen, retitle the window (OSC ... BEL), hide what follows; a C1 CSI, a CR, a
#: backspace, DEL and a bidirectional override.
HOSTILE = "evil\x1b[2J\x1b]0;title\x07\x1b[8m\x9b31m\r\x08\x7f\u202e"
#: Any character a terminal acts on (newline and tab aside).
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def hostile_file(tmp_path) -> Path:
    """A valid file whose manifest names its model HOSTILE (the name is not in the fingerprint:
    the manifest CRC recomputed, it verifies)."""
    f = write_kv_file(tmp_path / "plain.kvc", num_tokens=8, chunk_size=4)
    path = tmp_path / "hostile.kvc"
    path.write_bytes(rebuild(f.path, lambda doc: doc["model"].__setitem__("name", HOSTILE)))
    return path


def shown(capsys, *args) -> tuple[int, str]:
    """Run a command; its exit code and everything it printed, stdout and stderr."""
    code, out, err = call(capsys, *args)
    return code, out + err


def test_fields_from_a_file_reach_the_terminal_escaped(tmp_path, capsys):
    path = hostile_file(tmp_path)
    for args in (("inspect", path), ("inspect", "--wide", path), ("inspect", "--stats", path), ("verify", path),
                 ("dump", path, "-o", tmp_path / "out.npy")):
        code, text = shown(capsys, *args)
        assert code == 0 and not CONTROLS.search(text), (args, text)
    code, text = shown(capsys, "inspect", path)
    assert "evil\\x1b[2J\\x1b]0;title\\x07\\x1b[8m\\x9b31m\\x0d\\x08\\x7f\\u202e" in text
    code, out, _ = call(capsys, "inspect", path, "--json")
    assert code == 0 and json.loads(out)["model"]["name"] == HOSTILE  # --json: the raw value


def test_fields_from_a_store_reach_the_terminal_escaped(tmp_path, capsys):
    path, store = hostile_file(tmp_path), tmp_path / "s"
    assert call(capsys, "store", "put", path, "--store", store)[0] == 0
    (store / "chunks" / f"{HOSTILE}.txt").write_text("a foreign file named to attack the terminal")
    for args in (("store", "ls"), ("store", "stats"), ("store", "fsck", "--no-repair"), ("store", "put", path)):
        code, text = shown(capsys, *args, "--store", store)
        assert code in (0, 1) and not CONTROLS.search(text), (args, text)
    code, out, _ = call(capsys, "store", "ls", "--store", store, "--json")
    names = {o["name"] for o in json.loads(out)["objects"]} | {o.get("model_name") for o in json.loads(out)["objects"]}
    assert f"chunks/{HOSTILE}.txt" in names and HOSTILE in names  # --json: the raw values


def test_an_error_line_and_a_notice_are_escaped(tmp_path, capsys):
    code, text = shown(capsys, "inspect", tmp_path / f"{HOSTILE}.kvc")  # no such file: named in the error
    assert code == 2 and text.startswith("kvtool: error: ") and len(text.splitlines()) == 1
    assert not CONTROLS.search(text) and "\\x1b[2J" in text
    from kvtool.notices import forget, notice

    forget()
    notice(f"about {HOSTILE}")
    err = capsys.readouterr().err
    assert not CONTROLS.search(err) and err.endswith("\\u202e\n")
