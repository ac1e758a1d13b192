"""Two hosts of a pca calibration in one test process: the writer's, whose calibration folder holds
the object (the test vectors' small calibration: 2 layers of 8 channels), and a reader's, whose
folder starts empty. Shared by the tests of the calibration travelling through a store and in a file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvtool.codecs.pca import calibration as calmod

VECTORS = Path(__file__).resolve().parents[1] / "format-spec" / "vectors" / "pca"
DIGEST = json.loads((VECTORS / "bf16_sinks.json").read_text())["params"]["calibration"]  # L = 2, C = 8


@pytest.fixture()
def writer_host(tmp_path, monkeypatch):
    """This process as the writer's host: the object in its calibration folder only."""
    folder = tmp_path / "cal-writer"
    folder.mkdir()
    shutil.copy(VECTORS / f"{DIGEST}.kvcal", folder)
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(folder))
    monkeypatch.delenv("KVTOOL_CALIBRATION_PATH", raising=False)
    calmod._loaded.clear()
    yield folder
    calmod._loaded.clear()


def as_reader_host(monkeypatch, tmp_path) -> Path:
    """This process as another host: an empty calibration folder of its own."""
    folder = tmp_path / "cal-reader"
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(folder))
    calmod._loaded.clear()
    return folder
