"""The `kvtool` commands inspect, dump, verify and compress, through `kvtool.cli.app.run`.

Every command is checked in human and `--json` mode; errors must be one line on stderr starting
`kvtool: error:` (and, with --json, `{"ok": false, "error": {...}}` on stdout), never a traceback.
One test runs the real entry point (`python -m kvtool`) in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvtool.cli.app import run
from kvtool.format import ContainerReader, ContainerWriter

from fixtures import (
    make_identity,
    make_kv,
    ref_prefix_hashes,
    same_tensor,
    split_file,
    write_kv_file,
)

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def cli(capsys):
    def call(*args) -> Result:
        capsys.readouterr()
        code = run([str(a) for a in args])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)
    return call


def assert_error(r: Result, code: int, error_type: str | None = None, *, json_mode: bool = False):
    assert r.code == code, (r.code, r.out, r.err)
    assert r.err.startswith("kvtool: error: "), r.err
    assert r.err.endswith("\n") and r.err.count("\n") == 1, r.err
    assert "Traceback" not in r.err + r.out
    if json_mode:
        doc = r.json()
        assert doc["ok"] is False
        assert doc["error"]["exit_code"] == code
        assert doc["error"]["message"] == r.err[len("kvtool: error: "):-1]
        if error_type is not None:
            assert doc["error"]["type"] == error_type
    return r.err


@pytest.fixture
def kv_file(tmp_path):
    """bf16, 2 layers x 2 heads x 8, 5 tokens in chunks of 2, raw, both extras."""
    return write_kv_file(tmp_path / "in.kvc", num_tokens=5, chunk_size=2, extras=True)


def _flip_chunk_byte(path: Path, index: int = 1) -> None:
    ref = split_file(path).manifest["chunks"][index]
    data = bytearray(path.read_bytes())
    data[ref["offset"] + 5] ^= 0x10
    path.write_bytes(bytes(data))


# --- inspect ---------------------------------------------------------------------------------


def test_inspect_human(cli, kv_file):
    r = cli("inspect", kv_file.path)
    assert r.code == 0 and r.err == ""
    text = " ".join(r.out.split())
    assert "synthetic-tiny" in text and "LlamaForCausalLM" in text
    assert "kvtool format 1.0" in text
    assert "5 tokens in 3 chunks of 2" in text
    fingerprint = kv_file.identity.fingerprint()
    assert f"fingerprint {fingerprint[:23]}…{fingerprint[-8:]}" in text  # in full with --wide
    assert "extra hidden_states: bfloat16 [5 x 32], 320B" in text
    assert "extra roi_mask: bool [5], 5B" in text
    assert "BAD" not in text


def test_inspect_json(cli, kv_file):
    r = cli("inspect", kv_file.path, "--json")
    assert r.code == 0 and r.err == ""
    doc = r.json()
    assert doc["path"] == str(kv_file.path)
    assert doc["file_size"] == kv_file.path.stat().st_size
    assert doc["format_version"] == "1.0" and doc["alignment"] == 64
    assert doc["model"]["name"] == "synthetic-tiny"
    assert doc["model"]["fingerprint"] == kv_file.identity.fingerprint()
    assert doc["kv_dtype"] == "bfloat16"
    assert (doc["num_tokens"], doc["chunk_size"], doc["num_chunks"]) == (5, 2, 3)
    assert doc["tokens_checksum"] == "ok"
    hashes = ref_prefix_hashes(kv_file.token_ids, 2)
    for i, c in enumerate(doc["chunks"]):
        tokens = c["end"] - c["start"]
        assert c["index"] == i and c["start"] == 2 * i and c["codec"] == "raw"
        assert c["decoded_bytes"] == 2 * 2 * tokens * 16 * 2 == c["stored_bytes"]
        assert c["ratio"] == 1.0 and c["bits_per_value"] == 16.0
        assert c["checksum"] == "ok" and c["prefix_hash"] == hashes[i]
        assert c["codec_params"] == {"version": 1}
    t = doc["totals"]
    assert t["stored_bytes"] == t["decoded_bytes"] == 5 * 2 * 2 * 16 * 2
    assert t["bad_checksums"] == 0 and t["bits_per_value"] == 16.0
    assert t["file_bits_per_value"] == pytest.approx(8 * doc["file_size"] / (5 * 2 * 2 * 16))
    assert doc["extras"] == {"hidden_states": {"shape": [5, 32], "dtype": "bfloat16", "stored_bytes": 320},
                             "roi_mask": {"shape": [5], "dtype": "bool", "stored_bytes": 5}}
    assert doc["metadata"]["created_by"].startswith("kvtool ")


def test_inspect_json_zstd(cli, tmp_path):
    ident = make_identity()
    kv = torch.zeros(2, 2, 8, 16, dtype=torch.float16)  # very compressible
    f = write_kv_file(tmp_path / "z.kvc", num_tokens=8, chunk_size=4, dtype=torch.float16, kv=kv,
                      identity=ident, codecs_per_chunk=[
                          ("zstd", {"version": 1, "level": 7, "shuffle": "none"}), ("raw", None)])
    doc = cli("inspect", f.path, "--json").json()
    assert doc["kv_dtype"] == "float16"
    c0, c1 = doc["chunks"]
    assert c0["codec"] == "zstd" and c0["codec_params"] == {"version": 1, "level": 7, "shuffle": "none"}
    assert c0["ratio"] > 5 and c0["bits_per_value"] < 3
    assert c1["codec"] == "raw" and c1["ratio"] == 1.0
    assert doc["totals"]["stored_bytes"] == c0["stored_bytes"] + c1["stored_bytes"]


def test_inspect_stats(cli, tmp_path):
    ident = make_identity()
    kv = make_kv(ident, 6, torch.float32, seed=5)  # channel 0 is an outlier (x40)
    f = write_kv_file(tmp_path / "s.kvc", num_tokens=6, chunk_size=4, dtype=torch.float32, kv=kv,
                      codec="zstd")
    doc = cli("inspect", f.path, "--stats", "--json").json()
    stats = {(s["layer"], s["kind"]): s for s in doc["stats"]}
    assert len(stats) == 2 * 2
    x = kv.double()
    for layer in range(2):
        for k, kind in enumerate("KV"):
            s, ref = stats[(layer, kind)], x[k, layer]
            assert s["min"] == pytest.approx(ref.min().item())
            assert s["max"] == pytest.approx(ref.max().item())
            assert s["mean"] == pytest.approx(ref.mean().item(), abs=1e-9)
            assert s["std"] == pytest.approx(ref.std(unbiased=False).item(), rel=1e-6)
            assert 0 in [o["channel"] for o in s["outlier_channels"]]
    human = cli("inspect", f.path, "--stats")
    assert human.code == 0 and "per-layer statistics" in human.out


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_inspect_stats_json_of_nan_kv_has_null_not_nan(tmp_path, capsys):
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


def test_inspect_reports_bad_checksum_but_succeeds(cli, kv_file):
    _flip_chunk_byte(kv_file.path, 1)
    r = cli("inspect", kv_file.path, "--json")
    assert r.code == 0
    doc = r.json()
    assert [c["checksum"] for c in doc["chunks"]] == ["ok", "BAD", "ok"]
    assert doc["totals"]["bad_checksums"] == 1
    human = cli("inspect", kv_file.path)
    assert human.code == 0 and "BAD" in human.out and "1 bad checksum" in human.out


def test_inspect_errors(cli, tmp_path, kv_file):
    r = cli("inspect", tmp_path / "missing.kvc")
    assert "no such file" in assert_error(r, 2)
    r = cli("inspect", tmp_path / "missing.kvc", "--json")
    assert_error(r, 2, "InputFileError", json_mode=True)
    data = kv_file.path.read_bytes()
    (tmp_path / "cut.kvc").write_bytes(data[:-10])
    assert_error(cli("inspect", tmp_path / "cut.kvc", "--json"), 2, "TruncatedFile", json_mode=True)
    (tmp_path / "text.kvc").write_text("hello\n" * 30)
    assert_error(cli("inspect", tmp_path / "text.kvc"), 2)
    assert_error(cli("inspect", tmp_path / "text.kvc", "--json"), 2, "NotAKvtoolFile", json_mode=True)
    assert_error(cli("inspect", tmp_path), 2)  # a directory
    assert_error(cli("inspect"), 2)  # missing argument
    assert_error(cli("inspect", kv_file.path, "--bogus"), 2)


# --- dump ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dump_safetensors_everything(cli, tmp_path, dtype):
    f = write_kv_file(tmp_path / "in.kvc", num_tokens=5, chunk_size=2, dtype=dtype, codec="zstd")
    out = tmp_path / "out" / "kv.safetensors"
    r = cli("dump", f.path, "-o", out)
    assert r.code == 0 and r.err == f"kvtool: notice: created the folder {out.parent} for kv.safetensors\n"
    assert "wrote" in r.out and "5 tokens from 3 chunks, 2 layers" in " ".join(r.out.split())
    tensors = load_file(out)
    assert set(tensors) == {"token_ids", "positions", "layers.0.key", "layers.0.value",
                            "layers.1.key", "layers.1.value"}
    assert tensors["token_ids"].dtype == torch.int64 and tensors["token_ids"].tolist() == f.token_ids
    assert tensors["positions"].tolist() == [0, 1, 2, 3, 4]
    for layer in range(2):
        for k, name in enumerate(("key", "value")):
            t = tensors[f"layers.{layer}.{name}"]
            assert t.shape == (5, 2, 8) and t.dtype == dtype  # [T, H, D]
            assert same_tensor(t, f.kv[k, layer].reshape(5, 2, 8))
    with safe_open(str(out), "pt") as so:
        meta = so.metadata()
    assert meta["model"] == "synthetic-tiny"
    assert meta["fingerprint"] == f.identity.fingerprint()
    assert meta["kv_dtype"] == {torch.bfloat16: "bfloat16", torch.float16: "float16",
                                torch.float32: "float32"}[dtype]


def test_dump_head_split_is_channel_major(cli, tmp_path):
    """channel c = head * head_dim + d (spec §3.2): check with values that encode their channel."""
    ident = make_identity(num_layers=1, num_kv_heads=3, head_dim=4)
    kv = torch.arange(12, dtype=torch.float32).repeat(2, 1, 2, 1)  # [2, 1, 2, 12]
    kv[1] += 100
    f = write_kv_file(tmp_path / "in.kvc", identity=ident, num_tokens=2, chunk_size=2,
                      dtype=torch.float32, kv=kv)
    out = tmp_path / "kv.safetensors"
    assert cli("dump", f.path, "-o", out).code == 0
    t = load_file(out)
    assert t["layers.0.key"][1, 2].tolist() == [8.0, 9.0, 10.0, 11.0]  # token 1, head 2
    assert t["layers.0.value"][0, 0].tolist() == [100.0, 101.0, 102.0, 103.0]


@pytest.mark.parametrize("chunks,layers,positions,layer_ids", [
    ("1-2", "1", [2, 3, 4], [1]),
    ("0,2", None, [0, 1, 4], [0, 1]),
    ("2", "0-", [4], [0, 1]),
    ("1-", "1-1", [2, 3, 4], [1]),
    (None, "0", [0, 1, 2, 3, 4], [0]),
])
def test_dump_selection(cli, kv_file, tmp_path, chunks, layers, positions, layer_ids):
    out = tmp_path / "sel.safetensors"
    args = ["dump", kv_file.path, "-o", out, "--json"]
    if chunks is not None:
        args += ["--chunks", chunks]
    if layers is not None:
        args += ["--layers", layers]
    r = cli(*args)
    assert r.code == 0 and r.err == ""
    doc = r.json()
    assert doc["format"] == "safetensors" and doc["output"] == str(out)
    assert doc["layers"] == layer_ids and doc["num_tokens"] == len(positions)
    assert doc["bytes"] == out.stat().st_size
    tensors = load_file(out)
    assert set(tensors) == {"token_ids", "positions", "hidden_states", "roi_mask"} | {
        f"layers.{i}.{kind}" for i in layer_ids for kind in ("key", "value")}
    assert tensors["positions"].tolist() == positions
    # the file's extras come out at the same tokens, in their own dtypes
    assert same_tensor(tensors["hidden_states"], kv_file.extras["hidden_states"][positions])
    assert tensors["roi_mask"].tolist() == kv_file.extras["roi_mask"][positions].tolist()
    assert tensors["token_ids"].tolist() == [kv_file.token_ids[p] for p in positions]
    for i in layer_ids:
        expected = kv_file.kv[0, i][positions].reshape(len(positions), 2, 8)
        assert same_tensor(tensors[f"layers.{i}.key"], expected)


@pytest.mark.parametrize("dtype,np_dtype", [(torch.bfloat16, np.float32), (torch.float16, np.float16),
                                            (torch.float32, np.float32)])
def test_dump_npy(cli, tmp_path, dtype, np_dtype):
    f = write_kv_file(tmp_path / "in.kvc", num_tokens=5, chunk_size=2, dtype=dtype)
    out = tmp_path / "kv.npy"
    r = cli("dump", f.path, "-o", out, "--chunks", "1-2", "--layers", "1", "--json")
    assert r.code == 0 and r.json()["format"] == "npy"
    arr = np.load(out)
    assert arr.shape == (2, 1, 3, 16) and arr.dtype == np_dtype
    expected = f.kv[:, 1:2, 2:5].float().numpy()  # bf16 -> f32 widening is exact
    assert np.array_equal(arr.astype(np.float32), expected)
    full = tmp_path / "full.npy"
    assert cli("dump", f.path, "-o", full).code == 0
    assert np.load(full).shape == (2, 2, 5, 16)


def test_dump_errors(cli, kv_file, tmp_path):
    bad = tmp_path / "kv.pt"
    assert "safetensors or .npy" in assert_error(cli("dump", kv_file.path, "-o", bad), 2)
    assert not bad.exists()
    out = tmp_path / "x.safetensors"
    for opt, value in [("--chunks", "3"), ("--chunks", "2-1"), ("--chunks", "a"), ("--layers", "2"),
                       ("--layers", "0-9"), ("--chunks", "")]:
        assert_error(cli("dump", kv_file.path, "-o", out, opt, value, "--json"), 2, "UsageError",
                     json_mode=True)
    assert_error(cli("dump", kv_file.path), 2)  # no -o
    assert_error(cli("dump", tmp_path / "nope.kvc", "-o", out), 2)
    assert not out.exists()
    assert list(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


def test_dump_of_corrupt_chunk_fails_and_writes_nothing(cli, kv_file, tmp_path):
    out = tmp_path / "kv.safetensors"
    out.write_bytes(b"previous contents")
    _flip_chunk_byte(kv_file.path, 2)
    r = cli("dump", kv_file.path, "-o", out, "--json")
    assert "CRC" in assert_error(r, 1, "ChecksumMismatch", json_mode=True)
    assert out.read_bytes() == b"previous contents"
    # chunks that are intact can still be exported
    assert cli("dump", kv_file.path, "-o", out, "--chunks", "0-1").code == 0


# --- verify ------------------------------------------------------------------------------------------


def test_verify_ok(cli, kv_file):
    r = cli("verify", kv_file.path)
    assert r.code == 0 and r.err == ""
    text = " ".join(r.out.split())
    assert "3/3 chunks intact" in text and "OK" in text
    r = cli("verify", kv_file.path, "--json")
    assert r.code == 0
    doc = r.json()
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["num_chunks"] == 3 and doc["num_tokens"] == 5
    assert doc["checks"] == {"structure": "ok", "padding": "ok", "token_ids": "ok", "fingerprint": "ok",
                             "extra:hidden_states": "ok", "extra:roi_mask": "ok"}
    assert all(c == {"index": i, "checksum": "ok", "decode": "ok", "finite": "ok", "prefix_hash": "ok"}
               for i, c in enumerate(doc["chunks"]))


def test_verify_checksum_mismatch(cli, kv_file):
    _flip_chunk_byte(kv_file.path, 1)
    r = cli("verify", kv_file.path)
    assert r.code == 1
    text = " ".join(r.out.split())
    assert "FAIL chunk 1" in text and "1 problem" in text and "2/3 chunks intact" in text
    doc = cli("verify", kv_file.path, "--json").json()
    assert doc["ok"] is False and len(doc["problems"]) == 1
    assert doc["chunks"][1]["checksum"] == "BAD"


def test_verify_nan(cli, tmp_path):
    ident = make_identity()
    kv = make_kv(ident, 5)
    kv[0, 0, 0, 0] = float("nan")
    f = write_kv_file(tmp_path / "nan.kvc", num_tokens=5, chunk_size=2, kv=kv)
    r = cli("verify", f.path)
    assert r.code == 1 and "non-finite" in r.out
    doc = cli("verify", f.path, "--json").json()
    assert doc["chunks"][0]["finite"] == "BAD" and doc["chunks"][0]["checksum"] == "ok"


def _perturbed_copy(f, path: Path, delta: float):
    kv = f.kv.clone()
    kv[1, 1, 4, 3] += delta  # one value in the last chunk's V
    return write_kv_file(path, identity=f.identity, num_tokens=5, chunk_size=2, kv=kv,
                         token_ids=f.token_ids)


def test_verify_against(cli, kv_file, tmp_path):
    same = write_kv_file(tmp_path / "same.kvc", num_tokens=5, chunk_size=2, codec="zstd",
                         kv=kv_file.kv, token_ids=kv_file.token_ids)
    r = cli("verify", same.path, "--against", kv_file.path, "--json")
    assert r.code == 0
    cmp = r.json()["comparison"]
    assert cmp["ok"] is True and cmp["max_abs"] == 0.0 and cmp["against"] == str(kv_file.path)
    assert len(cmp["layers"]) == 2 * 2

    lossy = _perturbed_copy(kv_file, tmp_path / "lossy.kvc", 0.5)
    r = cli("verify", lossy.path, "--against", kv_file.path, "--json")
    assert r.code == 1
    doc = r.json()
    assert doc["ok"] is False and doc["comparison"]["ok"] is False
    assert doc["comparison"]["max_abs"] == pytest.approx(0.5, rel=0.1)
    bad = [(x["layer"], x["kind"]) for x in doc["comparison"]["layers"] if not x["ok"]]
    assert bad == [(1, "V")]
    assert any("beyond tolerance" in p for p in doc["problems"])
    human = cli("verify", lossy.path, "--against", kv_file.path)
    assert human.code == 1 and "over tolerance" in human.out
    assert cli("verify", lossy.path, "--against", kv_file.path, "--atol", "0.6").code == 0
    assert cli("verify", lossy.path, "--against", kv_file.path, "--atol", "0.1").code == 1
    assert cli("verify", lossy.path, "--against", kv_file.path, "--rtol", "0.5").code == 0


def test_verify_against_a_different_sequence_or_model(cli, kv_file, tmp_path):
    other = write_kv_file(tmp_path / "other.kvc", num_tokens=5, chunk_size=2,
                          token_ids=[t + 1 for t in kv_file.token_ids])
    assert_error(cli("verify", kv_file.path, "--against", other.path, "--json"), 2, "ModelMismatch",
                 json_mode=True)
    bigger = write_kv_file(tmp_path / "big.kvc", identity=make_identity(num_layers=3), num_tokens=5,
                           chunk_size=2, token_ids=kv_file.token_ids)
    assert_error(cli("verify", kv_file.path, "--against", bigger.path), 2)
    assert_error(cli("verify", kv_file.path, "--against", tmp_path / "nope.kvc"), 2)


def test_verify_exit_2(cli, kv_file, tmp_path):
    r = cli("verify", tmp_path / "missing.kvc")
    assert "missing.kvc" in assert_error(r, 2)
    assert r.out == ""
    assert_error(cli("verify", tmp_path / "missing.kvc", "--json"), 2, "InputFileError", json_mode=True)
    (tmp_path / "cut.kvc").write_bytes(kv_file.path.read_bytes()[:100])
    assert_error(cli("verify", tmp_path / "cut.kvc"), 2)
    assert_error(cli("verify", tmp_path / "cut.kvc", "--json"), 2, "TruncatedFile", json_mode=True)
    (tmp_path / "empty.kvc").write_bytes(b"")
    assert_error(cli("verify", tmp_path / "empty.kvc"), 2)
    assert_error(cli("verify", kv_file.path, "--atol", "abc"), 2)
    assert_error(cli("verify", kv_file.path, "--atol", "abc", "--json"), 2, "UsageError", json_mode=True)
    assert_error(cli("verify", kv_file.path, "--no-such-option"), 2)
    assert_error(cli("verify"), 2)
    assert_error(cli("no-such-command"), 2)


def test_verify_against_a_non_kvtool_file_names_that_file(tmp_path, capsys):
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


# --- compress ----------------------------------------------------------------------------------------


def _chunk_payloads(path) -> list[bytes]:
    with ContainerReader(path) as r:
        return [bytes(r.chunk_payload(i)) for i in range(len(r.chunks))]


def _data_region(path) -> bytes:
    return split_file(path).data


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compress_raw_zstd_raw_preserves_every_bit(cli, tmp_path, dtype):
    ident = make_identity()
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 256, (2 * 2 * 9 * 16 * torch.empty((), dtype=dtype).element_size(),),
                         dtype=torch.uint8, generator=g)
    kv = bits.view(dtype).view(2, 2, 9, 16)  # every bit pattern, NaN payloads included
    f = write_kv_file(tmp_path / "a.kvc", identity=ident, num_tokens=9, chunk_size=4, dtype=dtype,
                      kv=kv, extras=True, alignment=256)
    z = tmp_path / "a.zstd.kvc"
    back = tmp_path / "a.raw.kvc"
    r = cli("compress", f.path, "-o", z, "--json")
    assert r.code == 0 and r.err == ""
    doc = r.json()
    assert doc["codec"] == "zstd" and doc["codec_params"] == {"version": 1, "level": 1, "shuffle": "byteplane"}
    assert doc["num_chunks"] == 3 and doc["chunks_copied"] == 0
    assert doc["input"] == str(f.path) and doc["output"] == str(z)
    assert cli("compress", z, "-o", back, "--codec", "raw").code == 0
    assert _chunk_payloads(back) == _chunk_payloads(f.path)
    assert _data_region(back) == _data_region(f.path)  # same layout, byte for byte
    with ContainerReader(f.path) as a, ContainerReader(z) as b, ContainerReader(back) as c:
        for r_ in (b, c):
            assert r_.model == a.model and r_.kv_dtype == a.kv_dtype
            assert r_.header.alignment == 256
            assert r_.token_ids().tolist() == f.token_ids
            assert [x.prefix_hash for x in r_.chunks] == [x.prefix_hash for x in a.chunks]
            assert same_tensor(r_.read_range(0, 9), kv)
            for name, t in f.extras.items():
                assert same_tensor(r_.read_extra(name), t)
        assert all(x.codec == "zstd" for x in b.chunks)
        assert b.manifest.metadata["compressed_from"] == str(f.path)


def test_compress_options(cli, kv_file, tmp_path):
    out = tmp_path / "o.kvc"
    r = cli("compress", kv_file.path, "-o", out, "--codec", "zstd", "--level", "9", "--no-shuffle", "--json")
    assert r.code == 0
    assert r.json()["codec_params"] == {"version": 1, "level": 9, "shuffle": "none"}
    with ContainerReader(out) as rd:
        assert all(c.codec_params == {"version": 1, "level": 9, "shuffle": "none"} for c in rd.chunks)
    r = cli("compress", kv_file.path, "-o", out, "--level", "-3", "--shuffle")
    assert r.code == 0 and "wrote" in r.out and r.err == ""
    with ContainerReader(out) as rd:
        assert rd.chunks[0].codec_params == {"version": 1, "level": -3, "shuffle": "byteplane"}


def test_compress_json_accounting(cli, tmp_path):
    ident = make_identity()
    kv = torch.zeros(2, 2, 8, 16, dtype=torch.bfloat16)
    f = write_kv_file(tmp_path / "z.kvc", identity=ident, num_tokens=8, chunk_size=4, kv=kv)
    doc = cli("compress", f.path, "-o", tmp_path / "o.kvc", "--json").json()
    with ContainerReader(tmp_path / "o.kvc") as r:
        stored = sum(c.blob.length for c in r.chunks)
    assert doc["input_bytes"] == doc["decoded_bytes"] == 8 * 2 * 2 * 16 * 2
    assert doc["output_bytes"] == stored < doc["input_bytes"]
    assert doc["ratio_vs_decoded"] == pytest.approx(doc["decoded_bytes"] / stored)
    assert doc["bits_per_value"] == pytest.approx(8 * stored / (8 * 2 * 2 * 16))
    assert doc["seconds"] >= 0 and doc["mb_per_s"] > 0


def test_compress_copies_chunks_already_in_the_target_encoding(cli, tmp_path):
    f = write_kv_file(tmp_path / "mixed.kvc", num_tokens=9, chunk_size=2, codecs_per_chunk=[
        ("raw", None), ("zstd", None), ("zstd", {"version": 1, "level": 5, "shuffle": "byteplane"})])
    # chunk codecs: raw, zstd(3), zstd(5), raw, zstd(3)
    out = tmp_path / "out.kvc"
    doc = cli("compress", f.path, "-o", out, "--json").json()
    assert doc["chunks_copied"] == 2
    src, dst = _chunk_payloads(f.path), _chunk_payloads(out)
    assert dst[1] == src[1] and dst[4] == src[4]  # copied as they are
    doc = cli("compress", f.path, "-o", out, "--level", "5", "--json").json()
    assert doc["chunks_copied"] == 1
    doc = cli("compress", f.path, "-o", out, "--codec", "raw", "--json").json()
    assert doc["chunks_copied"] == 2
    with ContainerReader(out) as r:
        assert same_tensor(r.read_range(0, 9), f.kv)


def test_compress_to_same_params_reproduces_the_data(cli, tmp_path):
    """Re-encoding to the parameters a file already has copies every chunk: the data region
    (header, blobs, padding) is identical; only the manifest's metadata differs."""
    for codec, params, args in [("raw", None, ["--codec", "raw"]),
                                ("zstd", {"version": 1, "level": 1, "shuffle": "byteplane"}, []),
                                ("zstd", {"version": 1, "level": 1, "shuffle": "none"},
                                 ["--level", "1", "--no-shuffle"])]:
        f = write_kv_file(tmp_path / f"{codec}.kvc", num_tokens=7, chunk_size=3, codec=codec,
                          params=params, extras=True)
        out = tmp_path / f"{codec}.again.kvc"
        doc = cli("compress", f.path, "-o", out, *args, "--json").json()
        assert doc["chunks_copied"] == doc["num_chunks"] == 3
        assert _data_region(out) == _data_region(f.path)
        a, b = split_file(f.path).manifest, split_file(out).manifest
        assert {k: v for k, v in a.items() if k != "metadata"} == {k: v for k, v in b.items() if k != "metadata"}


def test_compress_streams_one_chunk_at_a_time(cli, tmp_path, monkeypatch):
    f = write_kv_file(tmp_path / "s.kvc", num_tokens=12, chunk_size=2)
    events: list[tuple[str, int]] = []
    read_chunk, write_chunk = ContainerReader.read_chunk, ContainerWriter.write_chunk

    def spy_read(self, index, **kw):
        events.append(("read", index))
        return read_chunk(self, index, **kw)

    def spy_write(self, kv, *a, **kw):
        events.append(("write", len(self.chunks)))
        return write_chunk(self, kv, *a, **kw)
    monkeypatch.setattr(ContainerReader, "read_chunk", spy_read)
    monkeypatch.setattr(ContainerWriter, "write_chunk", spy_write)
    assert cli("compress", f.path, "-o", tmp_path / "o.kvc", "--json").code == 0
    assert events == [(kind, i) for i in range(6) for kind in ("read", "write")]


def test_compress_human_progress_is_quiet(cli, tmp_path):
    f = write_kv_file(tmp_path / "p.kvc", num_tokens=12, chunk_size=2)  # >= 4 chunks: progress bar
    r = cli("compress", f.path, "-o", tmp_path / "o.kvc")
    assert r.code == 0
    assert "wrote" in r.out and "6 chunks as zstd" in " ".join(r.out.split())
    assert r.err == ""  # no bar, not even its trailing newline, when stderr is not a terminal


def test_compress_errors(cli, kv_file, tmp_path):
    out = tmp_path / "o.kvc"
    assert "zstd" in assert_error(cli("compress", kv_file.path, "-o", out, "--codec", "raw", "--level", "3"), 2)
    assert_error(cli("compress", kv_file.path, "-o", out, "--codec", "raw", "--no-shuffle", "--json"), 2,
                 "UsageError", json_mode=True)
    assert_error(cli("compress", kv_file.path, "-o", out, "--codec", "lz4", "--json"), 2, "UnknownCodec",
                 json_mode=True)
    assert_error(cli("compress", kv_file.path, "-o", out, "--level", "99", "--json"), 2,
                 "CodecParamsInvalid", json_mode=True)
    assert_error(cli("compress", kv_file.path, "-o", out, "--level", "x"), 2)
    assert_error(cli("compress", kv_file.path), 2)  # no -o
    assert_error(cli("compress", tmp_path / "nope.kvc", "-o", out), 2)
    assert not out.exists()


def test_compress_corrupt_input_leaves_output_untouched(cli, kv_file, tmp_path):
    out = tmp_path / "o.kvc"
    out.write_bytes(b"old output")
    _flip_chunk_byte(kv_file.path, 2)
    r = cli("compress", kv_file.path, "-o", out, "--json")
    assert_error(r, 1, "ChecksumMismatch", json_mode=True)
    assert out.read_bytes() == b"old output"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_compress_never_replaces_its_input(cli, kv_file):
    """-o naming the input is refused (issue 28: it silently replaced the input, and a lossy codec
    would have destroyed the only lossless copy): one line, exit 2, the file as it was."""
    before = kv_file.path.read_bytes()
    r = cli("compress", kv_file.path, "-o", kv_file.path, "--json")
    assert r.code == 2 and kv_file.path.read_bytes() == before
    with ContainerReader(kv_file.path) as rd:
        assert same_tensor(rd.read_range(0, 5), kv_file.kv)


def test_compress_to_a_directory_names_the_directory_not_a_temp_file(tmp_path, capsys):
    f = write_kv_file(tmp_path / "a.kvc")
    (tmp_path / "d").mkdir()
    capsys.readouterr()
    assert run(["compress", str(f.path), "-o", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory" in err and ".tmp" not in err


def test_compress_records_the_source_path_and_its_creation_time(tmp_path):
    f = write_kv_file(tmp_path / "a.kvc")
    out = tmp_path / "b.kvc"
    assert run(["compress", str(f.path), "-o", str(out), "--codec", "zstd"]) == 0
    with ContainerReader(f.path) as a, ContainerReader(out) as b:
        assert b.manifest.metadata["source_created_at"] == a.manifest.metadata["created_at"]
        assert b.manifest.metadata["compressed_from"] == str(f.path)


# --- rich markup in human output: text from files and paths is printed literally ------------------


def test_human_output_escapes_markup_from_the_file(cli, tmp_path):
    ident = make_identity(name="evil[/red] [bold]name")
    f = write_kv_file(tmp_path / "m.kvc", identity=ident, num_tokens=3)
    r = cli("inspect", f.path)
    assert r.code == 0 and "evil[/red] [bold]name" in r.out


def test_human_output_escapes_markup_in_paths(cli, tmp_path):
    d = tmp_path / "runs["
    d.mkdir()
    f = write_kv_file(d / "x].kvc", num_tokens=3)
    assert str(f.path).endswith("runs[/x].kvc")
    r = cli("verify", f.path)
    assert r.code == 0 and "runs[/x].kvc" in r.out


def test_replay_human_output_prints_markup_in_the_continuation_and_path_literally(capsys):
    from kvtool.cli.output import emit
    from kvtool.ops.replay import ReplayResult

    result = ReplayResult(file="[b]x.kvc", model="m", num_tokens=2, reused_tokens=1, computed_tokens=1,
                          chunks_loaded=1, codecs=["raw"], device="cpu", model_dtype="float32",
                          first_token_from="prefill", weights="same weights", load_s=0.05, ttft_cached_s=0.1, continue_tokens=1,
                          continuation_tokens=[1], continuation="[i]italic[/i], [u]under[/u], [link](http://x)")
    emit(result, False)
    out = capsys.readouterr().out.replace("\n", "")
    assert "'[i]italic[/i], [u]under[/u], [link](http://x)'" in out and "[b]x.kvc" in out


# --- the real entry point ----------------------------------------------------------------------------


def test_python_dash_m_kvtool(tmp_path):
    f = write_kv_file(tmp_path / "e.kvc", num_tokens=5, chunk_size=2)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    script = (
        "import subprocess, sys, json\n"
        "procs = [subprocess.Popen([sys.executable, '-m', 'kvtool', *a], stdout=subprocess.PIPE,\n"
        "                          stderr=subprocess.PIPE, text=True) for a in json.loads(sys.argv[1])]\n"
        "outs = [p.communicate() for p in procs]\n"
        "print(json.dumps([[p.returncode, o, e] for p, (o, e) in zip(procs, outs)]))\n"
    )
    # each `python -m kvtool` is a real process; they run side by side (torch imports are slow)
    argsets = [["inspect", str(f.path), "--json"],
               ["verify", str(tmp_path / "missing.kvc"), "--json"]]
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(argsets)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (ok_code, ok_out, ok_err), (bad_code, bad_out, bad_err) = json.loads(proc.stdout)
    assert ok_code == 0 and ok_err == ""
    assert json.loads(ok_out)["num_chunks"] == 3
    assert bad_code == 2
    assert bad_err.startswith("kvtool: error: ") and bad_err.count("\n") == 1
    assert "Traceback" not in bad_err
    assert json.loads(bad_out) == {"ok": False, "error": {
        "type": "InputFileError", "message": bad_err[len("kvtool: error: "):-1], "exit_code": 2}}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_not_waited_on(cli, tmp_path):
    fifo = tmp_path / "pipe.kvc"
    os.mkfifo(fifo)
    for command in ("inspect", "verify", "dump"):
        args = [command, fifo] + (["-o", tmp_path / "d.npy"] if command == "dump" else [])
        r = cli(*args)
        assert r.code == 2 and "not a regular file" in r.err and r.err.count("\n") == 1, (command, r.err)


def test_special_and_linked_outputs_are_refused_and_left_alone(cli, kv_file, tmp_path):
    link = tmp_path / "link.kvc"
    target = tmp_path / "target.kvc"
    target.write_bytes(b"keep me")
    link.symlink_to(target)
    r = cli("compress", kv_file.path, "-o", link)
    assert r.code == 2 and "symbolic link" in r.err and r.err.count("\n") == 1
    assert link.is_symlink() and target.read_bytes() == b"keep me"
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "out.fifo"
        os.mkfifo(fifo)
        r = cli("compress", kv_file.path, "-o", fifo)
        assert r.code == 2 and "not a regular file" in r.err
        assert not fifo.is_file() and fifo.exists()
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("args,message", [
    (["--against", "SELF", "--atol", "-1"], "--atol -1.0: expected a finite number >= 0"),
    (["--against", "SELF", "--rtol", "nan"], "--rtol nan: expected a finite number >= 0"),
    (["--replay", "--min-top1", "2"], "--min-top1 2.0: expected a fraction in [0, 1]"),
    (["--replay", "--max-kl", "-1"], "--max-kl -1.0: expected a finite number >= 0"),
    (["--continue", "-3"], "--continue must be at least 1"),
])
def test_verify_tolerances_and_thresholds_are_checked(cli, kv_file, args, message):
    args = [kv_file.path if a == "SELF" else a for a in args]
    r = cli("verify", kv_file.path, *args)
    assert r.code == 2 and r.err == f"kvtool: error: {message}\n"


def test_verify_flags_token_ids_outside_the_recorded_vocabulary(cli, tmp_path):
    f = write_kv_file(tmp_path / "oov.kvc", num_tokens=6, chunk_size=4, token_ids=[1, 2, 3, 4, 5, 5000])
    r = cli("verify", f.path, "--json")
    assert r.code == 1 and r.json()["checks"]["token_ids"] == "BAD"
    assert "token id 5000 is outside the model's vocabulary [0, 1000)" in r.json()["problems"]


def test_dump_refuses_a_selection_larger_than_memory(cli, kv_file, tmp_path, monkeypatch):
    """A small file may declare up to 1024x its size in KV; dump says so instead of swapping."""
    pages = {"SC_PHYS_PAGES": 4, "SC_PAGE_SIZE": 64}  # a 256-byte machine
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    out = tmp_path / "d.npy"
    r = cli("dump", kv_file.path, "-o", out)
    assert r.code == 2 and "GiB of memory" in r.err and "select fewer --chunks" in r.err  # (a chunk decodes whole)
    assert r.err.count("\n") == 1 and not out.exists()


# --- the app itself ------------------------------------------------------------------------


def test_every_command_is_registered_and_listed_in_help(cli):
    """Command modules are imported, not tried: a broken one fails the start, never vanishes."""
    from kvtool.cli.app import app

    names = [c.name for c in app.registered_commands]
    assert names == ["capture", "compress", "inspect", "verify", "replay", "dump", "info", "calibrate"]
    r = cli("--help")
    assert r.code == 0 and all(name in r.out for name in names)


def test_version_prints_the_package_version(cli):
    import kvtool

    r = cli("--version")
    assert (r.code, r.out, r.err) == (0, f"kvtool {kvtool.__version__}\n", "")


def test_quiet_silences_notices_but_not_errors(cli, tmp_path, monkeypatch):
    from kvtool import notices
    from kvtool.codecs.cachegen import native

    monkeypatch.setattr(native.EXTENSION, "_loaded", True)  # the native coder "missing": a notice per process
    monkeypatch.setattr(native.EXTENSION, "_module", None)
    monkeypatch.setattr(native.EXTENSION, "error", "not built")
    f = write_kv_file(tmp_path / "c.kvc", num_tokens=5, chunk_size=4, codec="cachegen")
    notices.forget()
    r = cli("verify", f.path)
    assert r.code == 0 and r.err.count("kvtool: notice: native CacheGen coder unavailable") == 1
    notices.forget()
    r = cli("--quiet", "verify", f.path)
    assert r.code == 0 and r.err == ""
    r = cli("--quiet", "verify", tmp_path / "missing.kvc")
    assert r.code == 2 and r.err.startswith("kvtool: error: ")
    notices.set_quiet(False)


# --- human output at terminal widths -----------------------------------------------------------


def human_output(*argv, columns: int) -> list[str]:
    """A command's human output as a pipe of `columns` columns would show it (a fresh process)."""
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "kvtool", *map(str, argv)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize("columns", [80, 120])
def test_inspect_fits_the_width_with_one_line_per_chunk(tmp_path, columns):
    f = write_kv_file(tmp_path / "many.kvc", num_tokens=40, chunk_size=3, codec="zstd", extras=True)
    lines = human_output("inspect", f.path, columns=columns)
    assert max(len(line) for line in lines) <= columns
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "tokens"])
    rows = lines[header + 1:header + 15]
    assert [row.split()[0] for row in rows] == [str(i) for i in range(14)]  # no row wraps in two
    assert all(row.split()[2] == "zstd" and row.split()[-2] == "ok" for row in rows)
    assert any(line.strip().startswith("fingerprint sha256:") and "…" in line for line in lines)
    assert not any("{" in line for line in lines)  # rope is words, not a Python dict
    assert any("rope theta 10000" in line for line in lines)


def test_inspect_wide_prints_hashes_and_parameters_in_full(tmp_path):
    f = write_kv_file(tmp_path / "w.kvc", num_tokens=7, chunk_size=3, codec="zstd")
    lines = human_output("inspect", "--wide", f.path, columns=80)
    with ContainerReader(f.path) as reader:
        hashes, fingerprint = [c.prefix_hash for c in reader.chunks], reader.fingerprint
    text = "\n".join(lines)
    assert all(h in text for h in hashes) and fingerprint in text
    assert "level=1, shuffle=byteplane" in text


def test_inspect_stats_fits_80_columns(tmp_path):
    f = write_kv_file(tmp_path / "s.kvc", num_tokens=9, chunk_size=4)
    lines = human_output("inspect", "--stats", f.path, columns=80)
    assert max(len(line) for line in lines) <= 80
    assert "per-layer statistics (outliers: channel, absmax / median)" in lines


def test_a_url_is_named_as_given_and_refused_in_one_line(cli):
    r = cli("inspect", "https://example.com/runs/x.kvc")
    assert_error(r, 2, "InputFileError")
    assert "https://example.com/runs/x.kvc: a URL" in r.err


def test_an_output_folder_that_does_not_exist_is_created_and_said(cli, kv_file, tmp_path):
    out = tmp_path / "new" / "dir" / "z.kvc"
    r = cli("compress", kv_file.path, "-o", out)
    assert r.code == 0 and out.is_file()
    assert r.err == f"kvtool: notice: created the folder {out.parent} for z.kvc\n"


def test_layers_written_backwards_say_the_range_is_empty(cli, kv_file, tmp_path):
    r = cli("dump", kv_file.path, "-o", tmp_path / "d.npy", "--layers", "1-0")
    assert_error(r, 2, "UsageError")
    assert "'1-0' is an empty range" in r.err


def test_npy_dump_says_which_layers_chunks_and_tokens_it_holds(cli, kv_file, tmp_path):
    out = tmp_path / "d.npy"
    r = cli("dump", kv_file.path, "-o", out, "--layers", "1", "--chunks", "1-2")
    assert r.code == 0
    about = json.loads(Path(f"{out}.json").read_text())
    assert about["layers"] == [1] and about["chunks"] == [1, 2] and about["positions"] == [2, 3, 4]
    assert about["token_ids"] == list(kv_file.token_ids[2:5]) and about["kv_dtype"] == "bfloat16"
    assert np.load(out).shape == (2, 1, 3, 16)
    hidden = np.load(tmp_path / "d.hidden_states.npy")  # bf16 widened to float32, exactly
    assert hidden.dtype == np.float32 and torch.equal(torch.from_numpy(hidden),
                                                      kv_file.extras["hidden_states"][2:5].float())
    assert np.load(tmp_path / "d.roi_mask.npy").tolist() == kv_file.extras["roi_mask"][2:5].tolist()
    assert about["extras"]["hidden_states"] == {"file": "d.hidden_states.npy", "dtype": "bfloat16",
                                                "array_dtype": "float32"}


def test_compress_summary_counts_the_whole_file(cli, kv_file, tmp_path):
    r = cli("compress", kv_file.path, "-o", tmp_path / "z.kvc", "--level", "19", "--json")
    doc = json.loads(r.out)
    assert doc["output_file_bytes"] == (tmp_path / "z.kvc").stat().st_size
    assert doc["input_file_bytes"] == Path(kv_file.path).stat().st_size and doc["extras_bytes"] > 0
    human = cli("compress", kv_file.path, "-o", tmp_path / "z2.kvc", "--level", "19").out
    assert "extras" in human and " 0 MB/s" not in human and "3 chunks as zstd" in " ".join(human.split())


@pytest.mark.parametrize("argv", [["verify"], ["inspect", "--stats"], ["compress", "-o", "{tmp}/z.kvc"],
                                  ["dump", "-o", "{tmp}/d.npy"]], ids=lambda a: a[0])
def test_progress_on_a_terminal_never_breaks_a_command(tmp_path, argv):
    """On a terminal's stderr the long waits show progress (rich); the command's result is the same.
    Off a terminal nothing is shown: every other test here checks stderr is empty."""
    import pty

    f = write_kv_file(tmp_path / "p.kvc", num_tokens=40, chunk_size=4, codec="zstd", token_ids=list(range(40)))
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    import threading

    master, slave = pty.openpty()
    shown = bytearray()

    def drain():  # a terminal is read as it is written: an unread pty's buffer (~4 KB) would block the command
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # (the other end closed)
                return
            if not data:
                return
            shown.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm"}
    try:
        proc = subprocess.run([sys.executable, "-m", "kvtool", args[0], str(f.path), *args[1:]],
                              stdout=subprocess.PIPE, stderr=slave, env=env, timeout=300)
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    assert proc.returncode == 0 and proc.stdout


def test_nan_and_inf_kv_render_for_people_without_warnings(cli, tmp_path):
    """Human output of a file holding NaN and inf: the numbers print as such (JSON has null),
    with no traceback and no numpy warning on stderr."""
    from fixtures import make_identity, make_kv

    ident = make_identity()
    kv = make_kv(ident, 5, torch.bfloat16, seed=3)
    kv[0, 0, 1, 2], kv[1, 1, 3, 0] = float("nan"), float("inf")
    bad = write_kv_file(tmp_path / "nan.kvc", num_tokens=5, chunk_size=2, kv=kv, codec="zstd")
    good = write_kv_file(tmp_path / "ok.kvc", num_tokens=5, chunk_size=2, codec="zstd")
    r = cli("inspect", "--stats", bad.path)
    assert r.code == 0 and r.err == "" and "nan" in r.out and "inf" in r.out
    r = cli("verify", good.path, "--against", bad.path)
    assert r.code == 1 and r.err.count("\n") == 1 and "Traceback" not in r.out
    r = cli("inspect", "--stats", bad.path, "--json")
    assert r.code == 0 and r.err == "" and r.json()["stats"][0]["max"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_verify_device_cuda_without_cuda_is_a_usage_error(cli, kv_file):
    assert_error(cli("verify", kv_file.path, "--device", "cuda"), 2)
