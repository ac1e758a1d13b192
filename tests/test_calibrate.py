"""`kvtool calibrate`'s own parts: the rows' sensitivity runs (each from its own layer, as fast as
they can be and giving `teacher_forced_eval`'s logits bit for bit), the same calibration twice
from the same text, and what the command says while it runs when stderr is not a terminal."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from kvtool.cli.output import stage_progress


def documentation_ids(model, tokens: int) -> list[int]:
    from pydoc_data.topics import topics

    return model.tokenizer.encode(topics["numbers"] + topics["exceptions"], add_special_tokens=False)[:tokens]


@pytest.mark.model
def test_each_rows_run_from_its_layer_gives_the_whole_runs_logits(default_model):
    """A row coded alone, run from its own layer up on the shared cache (rows from the top down),
    gives the logits of a whole teacher-forced run from a fresh cache holding that mixed KV."""
    from kvtool.codecs.pca.calibration import remember
    from kvtool.ops.calibrate import calibrate
    from kvtool.ops.calibration_gains import ContinuationRuns, coded_blob
    from kvtool.ops.compare import teacher_forced_eval
    from kvtool.ops.engine_io import run_with_query_energy

    ids = documentation_ids(default_model, 640)
    cal = remember(calibrate(default_model, [ids], gains=False))
    context, continuation = ids[:96], ids[96:104]
    kv, _ = run_with_query_energy(default_model, context)
    coded = coded_blob(kv, cal, 1.0)
    assert not torch.equal(coded, kv)  # the coding changes the rows judged here
    runs = ContinuationRuns(default_model, context, continuation, kv)
    assert torch.equal(runs.exact(), teacher_forced_eval(default_model, context, continuation, kv=kv))
    last = default_model.config.num_layers - 1
    for layer in (last, 11, 0):
        for part in range(2):
            mixed = kv.clone()
            mixed[part, layer] = coded[part, layer]
            whole = teacher_forced_eval(default_model, context, continuation, kv=mixed)
            got = runs.with_row_coded(part, layer, coded)
            assert torch.equal(got, whole), (part, layer)


@pytest.mark.model
def test_calibrating_twice_gives_the_same_digest(default_model):
    """The whole calibration, the rows' gains too, is the same object twice from the same text."""
    from kvtool.ops.calibrate import learn

    ids = documentation_ids(default_model, 640)
    first, gains = learn(default_model, [ids])
    second, _ = learn(default_model, [ids])
    assert gains.min() < 1 < gains.max()  # the gains were measured, not left at one
    assert first.to_bytes() == second.to_bytes()


def test_a_stage_is_one_whole_line_when_stderr_is_not_a_terminal(monkeypatch):
    """Not a terminal (a pipe, a CI log): one line as each stage starts, none per step, never
    wrapped; --quiet: nothing."""
    from kvtool import notices

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    names = ("loading the model", "running the model over the text " + "x" * 100)
    with stage_progress("calibrate", names) as update:
        update(names[0], 0, 0)
        for done in range(4):
            update(names[1], done, 3)
    lines = err.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("kvtool calibrate: [0:0") and lines[0].endswith("1/2 loading the model")
    assert lines[1].endswith(f"2/2 {names[1]} (3 steps)")
    monkeypatch.setattr(notices, "_quiet", True)
    with stage_progress("calibrate", names) as update:
        update(names[0], 0, 0)
    assert len(err.getvalue().splitlines()) == 2
