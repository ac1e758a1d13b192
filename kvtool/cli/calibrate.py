"""`kvtool calibrate [--model M] [--text FILE ...]`: learn the pca codec's calibration object."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from ..ops.requests import CalibrateRequest
from .commands import request_command
from .output import emit, human_bytes, renders, stage_progress

if TYPE_CHECKING:
    from ..ops.calibrate import CalibrateResult


def run(request: CalibrateRequest, json: bool) -> None:
    from ..ops.calibrate import STAGES, calibrate_model

    with stage_progress("calibrate", STAGES) as update:
        result = calibrate_model(request, progress=update)
    emit(result, json)


command = request_command(CalibrateRequest, run,
                          "Learn the pca codec's calibration object for a model (once per model and machine).")


@renders("CalibrateResult")
def render(console: Console, r: CalibrateResult) -> None:
    console.print(f"calibration {r.digest} for {r.model}: {r.tokens} tokens in {r.sequences} sequences, "
                  f"axes per {r.basis}, {human_bytes(r.bytes)}, {r.seconds:.1f}s")
    console.print(f"layers' K and V weighted by how much the model feels their errors: {r.gains_low:.2f}x to "
                  f"{r.gains_high:.2f}x")
    console.print(f"saved as {r.path}; `--codec pca` now uses it for this model")
