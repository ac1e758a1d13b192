"""The pca codec everywhere a codec goes besides `compress` (issue 29 item 5), on the real default
model: `capture --codec pca` (with `--store`), the store's `put_sequence` and loads, and a reader
without the calibration object (a miss that says why, in one line; the object kept).

The calibration is learned once for the module (`fixtures.learn_calibration`: what `kvtool
calibrate` does, on 640 tokens, with the session's loaded model) and registered for the model in a
folder of the test's own ($KVTOOL_CALIBRATION_DIR)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from kvtool.codecs.pca import QUALITY, params_for
from kvtool.codecs.pca import calibration as calmod

from fixtures import cli, learn_calibration

pytestmark = pytest.mark.model
CHUNK = 256


@pytest.fixture(scope="module")
def learned(tmp_path_factory, default_model):
    """(folder, the calibration folder, digest, a prompt file of ~650 tokens: 2 whole chunks and a part)."""
    folder = tmp_path_factory.mktemp("pca-store")
    digest = learn_calibration(default_model, folder / "calibration")
    prompt = folder / "prompt.txt"  # text the basis never saw
    prompt.write_text(pathlib.Path(json.__file__).read_text()[:1900])
    return folder, folder / "calibration", digest, prompt


@pytest.fixture()
def cal_env(learned, monkeypatch):
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(learned[1]))
    monkeypatch.delenv("KVTOOL_CALIBRATION_PATH", raising=False)
    calmod._loaded.clear()
    yield learned
    calmod._loaded.clear()


def without_calibration(monkeypatch, tmp_path):
    """This process as another machine's: no calibration object anywhere it looks."""
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(tmp_path / "no-calibration"))
    calmod._loaded.clear()


def test_capture_codec_pca_into_a_file_and_the_store(cal_env, capsys, tmp_path, monkeypatch):
    """`capture --codec pca --quality 95 --store`: every chunk pca with the model's registered
    calibration, each recording its first token's position; `verify --replay` holds the file to
    the point's promise; the store's objects load to exactly the file's decoded chunks."""
    from kvtool.format import ContainerReader
    from kvtool.store import open_store

    _, _, digest, prompt = cal_env
    out, store = tmp_path / "p.kvc", tmp_path / "store"
    code, got, err = cli(capsys, "capture", "--prompt-file", prompt, "--codec", "pca", "--quality", "95",
                         "--dtype", "fp32", "-o", out, "--store", store, "--json")
    assert code == 0, err
    assert got["codec"] == "pca" and got["num_chunks"] == 3 and got["store"]["stored"] == 2
    with ContainerReader(out) as reader:
        chunks = reader.manifest.chunks
        assert [c.codec for c in chunks] == ["pca"] * 3
        assert [c.codec_params["position"] for c in chunks] == [0, CHUNK, 2 * CHUNK]
        assert {(c.codec_params["calibration"], c.codec_params["quality"]) for c in chunks} == {(digest, "95")}
        ids, model, decoded = reader.token_ids(), reader.manifest.model, [reader.read_chunk(i) for i in range(3)]
    assert got["stored_bytes"] < 0.25 * got["decoded_bytes"]  # fp32 is 32 bits a value: pca's few

    code, verified, err = cli(capsys, "verify", out, "--replay", "--json")
    assert code == 0, err
    assert verified["replay"]["top1_agreement"] >= QUALITY["95"][1]

    with open_store(str(store)) as s:
        hit = s.for_model(model, CHUNK).get_prefix(ids)
    assert hit.num_tokens == 2 * CHUNK and hit.codecs == ["pca", "pca"] and not hit.refused
    for i in range(2):
        assert torch.equal(hit.chunks[i], decoded[i])  # the same payload, at the same positions


def test_put_sequence_with_pca_at_each_chunks_real_position(cal_env, default_model, tmp_path):
    """`put_sequence(codec="pca")` of a capture's raw KV: each object encodes its chunk at the
    chunk's own first position, so its KV is exactly what `compress --codec pca` of the same file
    decodes (the same step, calibration and positions: the same bytes); the objects record it."""
    from kvtool.format import ContainerReader
    from kvtool.ops.capture import capture
    from kvtool.ops.compress import compress
    from kvtool.store import open_store

    digest, prompt = cal_env[2], cal_env[3]
    ids = default_model.tokenizer.encode(prompt.read_text())[:3 * CHUNK - 40]
    raw = tmp_path / "raw.kvc"
    capture(default_model, ids, raw, chunk_size=CHUNK, kv_dtype=torch.float32)
    compress(raw, tmp_path / "pca.kvc", "pca", quality="89")
    again = compress(tmp_path / "pca.kvc", tmp_path / "again.kvc", "pca", quality="89")
    assert again.chunks_copied == again.num_chunks == 3  # in that encoding already, at each position: not coded twice
    with ContainerReader(raw) as reader:
        kv = torch.cat([reader.read_chunk(i) for i in range(len(reader.chunks))], dim=2)
    with ContainerReader(tmp_path / "pca.kvc") as reader:
        want = [reader.read_chunk(i) for i in range(2)]
    with open_store(str(tmp_path / "store")) as s:
        cache = s.for_model(default_model.identity, CHUNK)
        put = cache.put_sequence(ids, kv, codec="pca", params=params_for(digest, "89"))
        assert put.stored == 2
        hit = cache.get_prefix(ids)
        assert hit.num_tokens == 2 * CHUNK and hit.codecs == ["pca", "pca"]
        for i in range(2):
            assert torch.equal(hit.chunks[i], want[i])
            assert not torch.equal(hit.chunks[i], kv[:, :, i * CHUNK:(i + 1) * CHUNK])  # (lossy: it is pca's)
        for i, name in enumerate(cache.chunk_names(ids)):
            with ContainerReader(tmp_path / "store" / name) as obj:
                assert obj.chunks[0].codec_params["position"] == i * CHUNK == obj.manifest.extensions["store"]["start"]


def test_a_reader_without_the_calibration_misses_and_says_why(cal_env, default_model, capsys, tmp_path, monkeypatch):
    """The capture put the calibration object in the store (store.md §4.7). Another machine without
    it, once the store has lost it too (an eviction): a load is a miss (nothing served, no refusal)
    whose one-line reason names the digest; `store get` exits 1 with that one line; `fsck` keeps
    the objects (intact: the calibration is elsewhere); with the object back, they load."""
    from kvtool.ops.capture import capture
    from kvtool.store import open_store

    digest, prompt = cal_env[2], cal_env[3]
    ids = default_model.tokenizer.encode(prompt.read_text())[:2 * CHUNK]
    store = tmp_path / "store"
    capture(default_model, ids, None, chunk_size=CHUNK, codec="pca", params=params_for(digest),
            kv_dtype=torch.float32, store=str(store))
    objects = sorted(p for p in store.rglob("*.kvc"))
    assert len(objects) == 2
    (stored,) = store.rglob("*.kvcal")
    assert stored.name == f"{digest}.kvcal" and stored.read_bytes() == (cal_env[1] / stored.name).read_bytes()
    stored.unlink()  # evicted

    without_calibration(monkeypatch, tmp_path)
    with open_store(str(store)) as s:
        hit = s.for_model(default_model.identity, CHUNK).get_prefix(ids)
        assert hit.num_tokens == 0 and hit.chunks == [] and hit.refused == []
        assert len(hit.unreadable) == 1 and digest[:16] in hit.unreadable[0] and "\n" not in hit.unreadable[0]
        assert s.counters.misses == 2 and s.counters.refused == 0
    tokens = tmp_path / "ids.json"
    tokens.write_text(json.dumps(ids))
    code, _, err = cli(capsys, "store", "get", "--store", store, "--tokens", tokens, "-o", tmp_path / "got.kvc")
    assert code == 1 and digest[:16] in err and "Traceback" not in err and err.strip().count("\n") == 0
    assert not (tmp_path / "got.kvc").exists()
    code, out, err = cli(capsys, "store", "fsck", "--store", store, "--json")
    assert sorted(p for p in store.rglob("*.kvc")) == objects  # kept
    assert out["removed"] == 0 and all(d.get("kept") for d in out["damaged"])

    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(cal_env[1]))
    with open_store(str(store)) as s:
        assert s.for_model(default_model.identity, CHUNK).get_prefix(ids).num_tokens == 2 * CHUNK
    # `store get --codec pca`: the model's calibration at the default point, each chunk at its position
    code, got, err = cli(capsys, "store", "get", "--store", store, "--tokens", tokens, "-o", tmp_path / "got.kvc",
                         "--codec", "pca", "--json")
    assert code == 0 and got["codecs"] == ["pca"] and got["cached_tokens"] == 2 * CHUNK, err
    from kvtool.format import ContainerReader

    with ContainerReader(tmp_path / "got.kvc") as reader:
        assert [(c.codec_params["calibration"], c.codec_params["quality"], c.codec_params["position"])
                for c in reader.manifest.chunks] == [(digest, "97", 0), (digest, "97", CHUNK)]


@pytest.mark.parametrize("args, code, message", [
    (["--quality", "98"], 2, "--quality '98': choose 99, 97, 95, 89"),
    (["--calibration", "f" * 64], 2, "not found"),
    (["--calibration", "xyz"], 2, "SHA-256"),
    (["--level", "3"], 2, "--level and --shuffle apply to the zstd codec only"),
])
def test_bad_capture_pca_options_are_one_line(cal_env, capsys, tmp_path, args, code, message):
    out = tmp_path / "o.kvc"
    got, _, err = cli(capsys, "capture", "--prompt", "Hello there.", "--codec", "pca", *args, "-o", out)
    assert got == code and message in err and err.strip().count("\n") == 0 and "Traceback" not in err
    assert not out.exists()


def test_capture_pca_for_a_model_without_a_calibration(capsys, tmp_path, monkeypatch):
    """The model loads, then its calibration is looked for: none registered is one line saying to
    run `kvtool calibrate`, exit 2, and no file (not even a partial one) is left."""
    without_calibration(monkeypatch, tmp_path)
    out = tmp_path / "o.kvc"
    code, _, err = cli(capsys, "capture", "--prompt", "Hello there.", "--codec", "pca", "-o", out,
                       "--store", tmp_path / "store")
    assert code == 2 and "run `kvtool calibrate`" in err and err.strip().count("\n") == 0
    assert list(tmp_path.glob("o.kvc*")) == [] and not list((tmp_path / "store").rglob("*.kvc"))
