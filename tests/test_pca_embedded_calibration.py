"""A file may carry its pca calibration object (issue 50 item 2, format-spec/pca.md §3.3):
`compress --embed-calibration` (and `capture`'s) writes it into the file under the manifest's
`calibrations`, a reader without the object decodes the file from it (and keeps it in its own
calibration folder), `inspect` states its cost in bits per value, `verify` checks it.

The calibration is the test vectors' (format-spec/vectors/pca: 2 layers, one KV head of 8)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fixtures import cli, make_identity, rebuild, write_kv_file
from kvtool.codecs.pca import calibration as calmod
from pca_hosts import DIGEST, VECTORS, as_reader_host, writer_host  # noqa: F401  (a fixture)
from kvtool.errors import ManifestInvalid, UsageError

IDENTITY = make_identity(num_layers=2, num_kv_heads=1, head_dim=8)


def pca_file(capsys, tmp_path: Path, *extra: str) -> Path:
    raw = write_kv_file(tmp_path / "raw.kvc", identity=IDENTITY, num_tokens=12, chunk_size=4).path
    out = tmp_path / "p.kvc"
    code, _, err = cli(capsys, "compress", raw, "-o", out, "--codec", "pca", "--calibration", DIGEST, *extra)
    assert code == 0, err
    return out


def test_a_file_carrying_its_calibration_reads_where_the_object_is_not(writer_host, tmp_path, capsys, monkeypatch):
    """Before: `verify` on a host without the object failed ("calibration object ... not found")."""
    plain = pca_file(capsys, tmp_path)
    carrying = tmp_path / "carrying.kvc"
    assert cli(capsys, "compress", tmp_path / "raw.kvc", "-o", carrying, "--codec", "pca", "--calibration", DIGEST,
               "--embed-calibration")[0] == 0
    size = (VECTORS / f"{DIGEST}.kvcal").stat().st_size
    assert carrying.stat().st_size >= plain.stat().st_size + size
    folder = as_reader_host(monkeypatch, tmp_path)
    code, _, err = cli(capsys, "verify", plain)
    assert code == 1 and "not found" in err  # the file without it: as before
    calmod._loaded.clear()
    code, report, err = cli(capsys, "verify", carrying, "--json")
    assert code == 0, err
    assert hashlib.sha256((folder / f"{DIGEST}.kvcal").read_bytes()).hexdigest() == DIGEST  # kept
    calmod._loaded.clear()
    code, summary, _ = cli(capsys, "inspect", carrying, "--json")
    values = 12 * 2 * 2 * 8  # tokens x K/V x layers x channels
    assert code == 0 and summary["calibrations"] == [
        {"digest": DIGEST, "stored_bytes": size, "bits_per_value": 8 * size / values, "checksum": "ok"}]
    code, text, _ = cli(capsys, "inspect", carrying)
    assert f"calibration {DIGEST[:16]}... carried" in text and "bits/value" in text


def test_damaged_carried_calibration_is_refused(writer_host, tmp_path, capsys, monkeypatch):
    """A flipped byte in the carried object: its CRC-32C fails, verify says so (exit 1), and the
    chunks do not decode from it."""
    import kvtool

    carrying = pca_file(capsys, tmp_path, "--embed-calibration")
    with kvtool.open(carrying) as r:
        blob = r.manifest.calibrations[DIGEST]
    data = bytearray(carrying.read_bytes())
    data[blob.offset + blob.length - 1] ^= 1
    carrying.write_bytes(bytes(data))
    as_reader_host(monkeypatch, tmp_path)
    code, _, err = cli(capsys, "verify", carrying)
    assert code == 1 and "calibration" in err


@pytest.mark.parametrize("value, words", [
    ([], "calibrations"), ({"abc": {}}, "SHA-256"), ({DIGEST: 5}, "must be an object"),
    ({DIGEST: {"offset": 64, "length": 0, "crc32": 0}}, "holds 0 bytes"),
    ({DIGEST: {"offset": 1, "length": 10, "crc32": 0}}, "outside the data region"),
])
def test_a_hostile_calibrations_entry_is_one_line(writer_host, tmp_path, capsys, value, words):
    carrying = pca_file(capsys, tmp_path, "--embed-calibration")

    def edit(doc):
        doc["calibrations"] = value

    bad = tmp_path / "bad.kvc"
    bad.write_bytes(rebuild(carrying, edit))
    code, out, err = cli(capsys, "inspect", bad)
    assert code == 2 and err.count("\n") == 1 and words in err and "Traceback" not in out + err, err


def test_embed_calibration_is_pca_s(writer_host, tmp_path, capsys):
    raw = write_kv_file(tmp_path / "raw.kvc", identity=IDENTITY, num_tokens=12, chunk_size=4).path
    code, _, err = cli(capsys, "compress", raw, "-o", tmp_path / "z.kvc", "--codec", "zstd", "--embed-calibration")
    assert code == 2 and "--embed-calibration" in err and err.count("\n") == 1
    from kvtool.ops.requests import CaptureRequest

    with pytest.raises(UsageError, match="--embed-calibration"):
        CaptureRequest(tmp_path / "o.kvc", codec="zstd", embed_calibration=True)


def test_a_hostile_entry_is_manifest_invalid_for_the_library_too(writer_host, tmp_path, capsys):
    import kvtool

    carrying = pca_file(capsys, tmp_path, "--embed-calibration")
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(rebuild(carrying, lambda doc: doc.__setitem__("calibrations", {"x" * 64: {}})))
    with pytest.raises(ManifestInvalid, match="SHA-256"):
        kvtool.open(bad)
