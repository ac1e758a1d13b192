"""`kvtool info` in both output modes, and the native coder being present where it must be."""

from __future__ import annotations

import json
import os

import pytest

import torch

from kvtool.cli.app import run


def test_info_json_lists_codecs_and_backends(capsys):
    assert run(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ok"] is True
    assert [c["name"] for c in info["codecs"]][:2] == ["raw", "zstd"]
    assert {c["id"] for c in info["codecs"]} >= {0, 1}
    assert info["writes_format"] == "1.1" and info["reads_formats"] == ["1.x"]
    layouts = {kind["name"]: kind for kind in info["layouts"]}  # the layout kinds it reads and writes
    assert list(layouts) == ["kv_blob", "mla_latent"]
    assert layouts["mla_latent"]["since"] == "1.1" and layouts["mla_latent"]["codecs"] == ["raw", "zstd"]
    assert all(kind["reads"] and kind["writes"] for kind in layouts.values())
    assert "cachegen" in info["backends"] and info["devices"] == {}  # no torch without --devices
    assert info["backends"]["pca"].startswith("native C coder (")  # its widest path: AVX-512 VNNI, AVX2, ...
    assert info["torch"].startswith("2.")


def test_info_devices_asks_torch_about_cuda(capsys):
    assert run(["info", "--devices", "--json"]) == 0
    devices = json.loads(capsys.readouterr().out)["devices"]
    assert "cuda" in devices and "paged copy" in devices
    expected = "cuda:" if torch.cuda.is_available() else "cpu"
    assert devices["engine"].startswith("--device auto runs the model on " + expected)


def test_info_human(capsys):
    assert run(["info"]) == 0
    out = capsys.readouterr().out
    assert "writes format 1.1" in out and "zstd (1, lossless)" in out
    assert "layout     mla_latent (1.1, one latent per token and layer (MLA)): raw, zstd" in out


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="only CI must have the native coder built")
def test_ci_builds_the_native_cachegen_coder():
    """A silent fallback to the Python reference would hide a broken C build in CI."""
    from kvtool.codecs.cachegen import native_available

    assert native_available()
