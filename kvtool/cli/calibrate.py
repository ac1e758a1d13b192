"""`kvtool calibrate [--model M] [--text FILE ...]`: learn the pca codec's calibration object."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from .options import JsonOpt, ModelOpt
from .output import emit, human_bytes, renders, stage_progress

if TYPE_CHECKING:
    from ..ops.calibrate import CalibrateResult

TextOpt = Annotated[Optional[list[Path]], typer.Option(
    "--text", metavar="FILE", help="UTF-8 text to learn on (repeatable; default: Python's own documentation "
                                   "and modules, texts no benchmark here measures on).")]


BasisOpt = Annotated[str, typer.Option(
    "--basis", metavar="layer|head", help="principal axes per layer (the default: fewest bits) or per KV "
                                          "head (the coder multiplies head by head: C/D times fewer "
                                          "operations, ~10% more bits; bench/RESULTS.md §34)")]


def command(model: ModelOpt = None, text: TextOpt = None, basis: BasisOpt = "layer", json: JsonOpt = False) -> None:
    """Learn the pca codec's calibration object for a model (once per model and machine)."""
    from ..ops.calibrate import STAGES, calibrate_model

    with stage_progress("calibrate", STAGES) as update:
        result = calibrate_model(model, text, basis=basis, progress=update)
    emit(result, json)


@renders("CalibrateResult")
def render(console: Console, r: CalibrateResult) -> None:
    console.print(f"calibration {r.digest} for {r.model}: {r.tokens} tokens in {r.sequences} sequences, "
                  f"axes per {r.basis}, {human_bytes(r.bytes)}, {r.seconds:.1f}s")
    console.print(f"layers' K and V weighted by how much the model feels their errors: {r.gains_low:.2f}x to "
                  f"{r.gains_high:.2f}x")
    console.print(f"saved as {r.path}; `--codec pca` now uses it for this model")
