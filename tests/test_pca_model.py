"""The pca codec on the real default model, from the command line a user types: `kvtool calibrate`
on text, `capture`, `compress --codec pca`, `verify --replay` against the point's promise, `inspect`,
and the one-line refusals (a missing calibration, a wrong quality, no calibration for the model)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from kvtool.codecs.pca import QUALITY
from kvtool.codecs.pca import calibration as calmod

from fixtures import cli

# ~1,100 tokens of Python's own documentation: one calibration sequence (the real default texts
# take minutes; the codec's behaviour does not depend on how much text the basis saw)
CALIBRATION_TOPICS = ("numbers", "exceptions")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, default_model):
    from pydoc_data.topics import topics

    folder = tmp_path_factory.mktemp("pca")
    text = folder / "cal.txt"
    text.write_text("\n".join(topics[t] for t in CALIBRATION_TOPICS))
    prompt = folder / "prompt.txt"  # another text: the codec is judged on what it was not fitted to
    prompt.write_text(pathlib.Path(__import__("argparse").__file__).read_text()[:4000])
    return folder, text, prompt


@pytest.fixture()
def cal_dir(calibrated, monkeypatch):
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(calibrated[0] / "calibration"))
    monkeypatch.delenv("KVTOOL_CALIBRATION_PATH", raising=False)
    calmod._loaded.clear()
    yield calibrated[0] / "calibration"
    calmod._loaded.clear()


def chunk_payloads(path) -> list[tuple[bytes, dict]]:
    from kvtool.format import ContainerReader

    with ContainerReader(path) as reader:
        return [(bytes(reader.chunk_payload(c.index)), c.codec_params) for c in reader.chunks]


@pytest.mark.model
def test_calibrate_capture_compress_verify(calibrated, cal_dir, capsys):
    folder, text, prompt = calibrated
    code, out, err = cli(capsys, "calibrate", "--text", text, "--json")
    assert code == 0, err
    # stderr is not a terminal here: one line per stage as it starts, the last the saving
    stages = err.splitlines()
    assert len(stages) == 5 and all(line.startswith("kvtool calibrate: [") for line in stages)
    assert "1/5 loading the model" in stages[0] and "5/5 saving" in stages[-1]
    digest = out["digest"]
    assert (cal_dir / f"{digest}.kvcal").stat().st_size == out["bytes"] and out["tokens"] >= 512
    assert calmod.for_model(out["model_fingerprint"]) == digest
    assert out["basis"] == "layer" and calmod.axes(calmod.find(digest)) == "layer"  # the default: fewest bits
    # the rows' sensitivity is measured on the model: never equal (the first values matter most)
    assert out["gains_low"] < 1 < out["gains_high"] <= 16 * out["gains_low"] * (1 + 1e-6)
    raw = folder / "p.kvc"
    code, _, err = cli(capsys, "capture", "--prompt-file", prompt, "-o", raw)
    assert code == 0, err
    packed = folder / "p.pca.kvc"
    code, out, err = cli(capsys, "compress", raw, "-o", packed, "--codec", "pca", "--quality", "89", "--json")
    assert code == 0, err
    assert 1.0 < out["bits_per_value"] < 3.0  # bf16 is 16: a real reduction, nowhere near raw
    code, out, err = cli(capsys, "inspect", packed, "--json")
    parts = out["chunks"][0]["codec_stats"]["bits_per_value_by_part"]
    assert code == 0 and parts["rans"] > 0 and out["chunks"][0]["codec_params"]["calibration"] == digest
    code, out, err = cli(capsys, "verify", packed, "--replay", "--json")
    assert code == 0, err
    assert out["replay"]["continue_tokens"] == 64
    assert out["replay"]["top1_agreement"] >= QUALITY["89"][1]
    code, out, err = cli(capsys, "verify", packed, "--against", raw, "--rtol", "10", "--atol", "10")
    assert code == 0, err
    # --bitstream 2: the same quality point in version 2's independent units (pca.md §11), the
    # same quantizer, so the same values as version 1's file wherever §11.5's tables are libm's
    packed2 = folder / "p.pca2.kvc"
    code, out, err = cli(capsys, "compress", raw, "-o", packed2, "--codec", "pca", "--quality", "89",
                         "--bitstream", "2", "--json")
    assert code == 0 and out["codec_params"]["version"] == 2 and out["codec_params"]["unit"] == 768, err
    code, out, err = cli(capsys, "inspect", packed2, "--json")
    assert code == 0 and out["chunks"][0]["codec_params"]["version"] == 2
    assert out["chunks"][0]["codec_stats"]["bits_per_value_by_part"]["regions"] > 0
    code, _, err = cli(capsys, "verify", packed2, "--against", packed)
    assert code == 0, err
    # a version-1 file to version 2 and back: its coefficients re-laid, never decoded to values
    # (decoded and encoded again, they would be rounded twice): each chunk the bytes the writer
    # gives the same KV in that version, the values unchanged
    relaid = folder / "p.relaid2.kvc"
    code, out, err = cli(capsys, "compress", packed, "-o", relaid, "--codec", "pca", "--quality", "89",
                         "--bitstream", "2", "--json")
    assert code == 0 and out["chunks_relaid"] == out["num_chunks"] and out["chunks_copied"] == 0, err
    code, out, err = cli(capsys, "compress", relaid, "-o", folder / "p.back1.kvc", "--codec", "pca", "--quality",
                         "89", "--bitstream", "1")
    assert code == 0 and "re-laid in the new layout, not decoded: no second rounding" in " ".join(out.split()), err
    assert chunk_payloads(relaid) == chunk_payloads(packed2)
    assert chunk_payloads(folder / "p.back1.kvc") == chunk_payloads(packed)

    # the default point (97) on a text bench_rd never measures: its own verify --replay passes
    licence = pathlib.Path("/usr/share/common-licenses/Artistic")
    if licence.is_file():
        other = folder / "artistic.txt"
        other.write_text(licence.read_text(encoding="utf-8")[:6000])
        code, _, err = cli(capsys, "capture", "--prompt-file", other, "-o", folder / "a.kvc")
        assert code == 0, err
        code, _, err = cli(capsys, "compress", folder / "a.kvc", "-o", folder / "a.pca.kvc", "--codec", "pca")
        assert code == 0, err
        code, out, err = cli(capsys, "inspect", folder / "a.pca.kvc", "--json")
        assert code == 0 and out["chunks"][0]["codec_params"]["quality"] == "97"
        code, out, err = cli(capsys, "verify", folder / "a.pca.kvc", "--replay", "--json")
        assert code == 0 and out["replay"]["top1_agreement"] >= QUALITY["97"][1], (out["replay"], err)

    # the calibration gone: one line naming it, exit 1 (the file's data cannot be decoded here)
    calmod._loaded.clear()
    (cal_dir / f"{digest}.kvcal").rename(folder / "moved.kvcal")
    try:
        code, out, err = cli(capsys, "verify", packed)
        assert code == 1 and digest[:16] in err and "Traceback" not in err
        assert err.strip().count("\n") == 0
    finally:
        (folder / "moved.kvcal").rename(cal_dir / f"{digest}.kvcal")


@pytest.mark.model
@pytest.mark.parametrize("args, message", [
    (["--quality", "98"], "--quality '98': choose 99, 97, 95, 89"),
    (["--calibration", "f" * 64], "not found"),
    (["--calibration", "xyz"], "SHA-256"),
    (["--bitstream", "3"], "--bitstream 3: choose 1 (the default) or 2"),
])
def test_bad_pca_options_are_one_line(calibrated, cal_dir, capsys, tmp_path, args, message):
    from fixtures import write_kv_file

    f = write_kv_file(tmp_path / "a.kvc", num_tokens=8)
    out_path = tmp_path / "o.kvc"
    code, _, err = cli(capsys, "compress", f.path, "-o", out_path, "--codec", "pca", *args)
    assert code == 2 and message in err and err.strip().count("\n") == 0 and "Traceback" not in err
    assert not out_path.exists()


def test_an_unknown_basis_is_one_line(capsys):
    code, _, err = cli(capsys, "calibrate", "--basis", "channel")
    assert code == 2 and "--basis must be one of head, layer" in err and err.strip().count("\n") == 0


def test_no_calibration_for_the_model_is_one_line(capsys, tmp_path, monkeypatch):
    from fixtures import write_kv_file

    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(tmp_path / "none"))
    f = write_kv_file(tmp_path / "a.kvc", num_tokens=8)
    code, _, err = cli(capsys, "compress", f.path, "-o", tmp_path / "o.kvc", "--codec", "pca")
    assert code == 2 and "run `kvtool calibrate`" in err and err.strip().count("\n") == 0
    code, _, err = cli(capsys, "compress", f.path, "-o", tmp_path / "o.kvc", "--codec", "zstd", "--quality", "97")
    assert code == 2 and "apply to the pca codec only" in err
    code, _, err = cli(capsys, "compress", f.path, "-o", tmp_path / "o.kvc", "--codec", "zstd", "--bitstream", "2")
    assert code == 2 and "apply to the pca codec only" in err and err.strip().count("\n") == 0


@pytest.mark.model
def test_axes_per_head_on_the_real_model(default_model):
    """`kvtool calibrate --basis head`'s object (here learned on 640 tokens, without the rows'
    gains): zero outside each KV head's 64 x 64 block, so the C coder multiplies head by head,
    and on the model's own KV the payload and the values are the reference's to the byte."""
    from pydoc_data.topics import topics

    from kvtool.codecs.pca import native
    from kvtool.codecs.pca import reference as ref
    from kvtool.ops.calibrate import calibrate, run_with_query_energy

    ids = default_model.tokenizer.encode(topics["numbers"] + topics["exceptions"] + topics["formatstrings"],
                                         add_special_tokens=False)
    cal = calmod.remember(calibrate(default_model, [ids[:640]], gains=False, basis="head"))
    assert calmod.axes(cal) == "head" and native.block_diagonal(cal.basis, cal.head_dim) == 64
    kv, _ = run_with_query_energy(default_model, ids[640:640 + 72])  # [2, L, 72, C] bf16: text the basis never saw
    raw = kv.view(torch.int16).numpy().view(np.uint16)
    for step in (0.3, 2.3):
        want = ref.encode_chunk(raw, "bfloat16", cal, step, 4, 0, 16)
        assert native.encode_chunk(raw, "bfloat16", cal, step, 4, 0, 16) == want
        got = native.decode_chunk(want, raw.shape, "bfloat16", cal, step, 0)
        assert np.array_equal(got, ref.decode_chunk(want, raw.shape, "bfloat16", cal, step, 0))


@pytest.mark.parametrize("bitstream", [True, 2.0, 0, 3])
def test_a_bitstream_other_than_1_or_2_is_refused_through_the_python_api(tmp_path, bitstream):
    """`bitstream` True or 2.0 equal 1 and 2 in Python; the request refuses them (and 0, 3) in one
    line before any calibration is looked for or any chunk written."""
    from fixtures import write_kv_file

    from kvtool.errors import UsageError
    from kvtool.ops.compress import compress

    f = write_kv_file(tmp_path / "a.kvc", num_tokens=8)
    with pytest.raises(UsageError, match="--bitstream"):
        compress(f.path, tmp_path / "o.kvc", "pca", bitstream=bitstream)
    assert not (tmp_path / "o.kvc").exists()
