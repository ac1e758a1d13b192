"""Build the pca version-2 test vectors in this folder (python format-spec/vectors/pca/v2/make_pca_v2_vectors.py).

Version 2 (format-spec/pca.md section 11) codes the same coefficients as version 1 in independent
units. These vectors code the inputs of the version-1 vectors (`../NAME.in.bin`, their parameters
but for `unit` in place of `lanes`) and one longer chunk with many units, with kvtool's reference
coder of version 2 (`kvtool/codecs/pca/reference2.py`), over the calibration objects in `..`.
For each vector NAME this writes NAME.json (shape, dtype, parameters, the payload's SHA-256, and
every unit's row, first symbol and symbol count, and every pair's region length), NAME.in.bin, NAME.payload.bin,
NAME.out.bin and NAME.rope.bin (section 11.5's float32 tables of the coded tokens: cos [L][Tc][D/2],
then sin; absent when Tc = 0). tests/test_pca_v2_vectors.py checks the coder against them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
V1 = HERE.parent
sys.path.insert(0, str(HERE.parents[3]))

from kvtool.codecs.pca import calibration as calmod  # noqa: E402
from kvtool.codecs.pca import reference2 as v2  # noqa: E402

STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}
FROM_V1 = ("walk_bf16", "bf16_sinks", "fp16_position", "fp32_lanes1", "fp32_far", "bf16_sinks_only")
UNIT = 64  # the smallest unit, so these small chunks have rows of more than one unit
MANY = "bf16_many_units"  # 2 layers, 199 tokens from position 300, step 0.5: dozens of units, escapes


def calibration(digest: str) -> calmod.Calibration:
    return calmod.from_bytes((V1 / f"{digest}.kvcal").read_bytes())


def many_units_input(cal: calmod.Calibration) -> np.ndarray:
    """Deterministic bf16 noise [2, 2, 199, 8] with a few large values (escapes)."""
    rng = np.random.default_rng(38)
    x = (rng.standard_normal((2, cal.layers, 199, cal.channels)) * 3).astype(np.float32)
    x[0, 1, 17, 3] = 250.0
    x[1, 0, 150, 6] = -300.0
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def inputs() -> dict[str, tuple[dict, np.ndarray]]:
    out = {}
    for name in FROM_V1:
        meta = json.loads((V1 / f"{name}.json").read_text())
        raw = np.fromfile(V1 / f"{name}.in.bin", STORAGE[meta["dtype"]]).reshape(meta["shape"])
        params = {k: v for k, v in meta["params"].items() if k != "lanes"}
        out[name] = (dict(meta, params=dict(params, version=2, unit=UNIT)), raw)
    main = json.loads((V1 / "bf16_sinks.json").read_text())["params"]["calibration"]
    raw = many_units_input(calibration(main))
    params = {"version": 2, "calibration": main, "step": 0.5, "sinks": 4, "unit": UNIT, "position": 300}
    out[MANY] = ({"shape": list(raw.shape), "dtype": "bfloat16", "params": params}, raw)
    return out


def build() -> None:
    for name, (meta, raw) in inputs().items():
        p = meta["params"]
        cal = calibration(p["calibration"])
        payload = v2.encode_chunk(raw, meta["dtype"], cal, p["step"], p["sinks"], p["position"],
                                  p["unit"])
        out = v2.decode_chunk(payload, raw.shape, meta["dtype"], cal, p["step"], p["position"])
        lay = v2.parse(payload, raw.shape, meta["dtype"])
        record = {"shape": list(raw.shape), "dtype": meta["dtype"], "params": p,
                  "payload_sha256": hashlib.sha256(payload).hexdigest(),
                  "units": lay.spans.tolist(), "regions": [int(n) for n in lay.reg_len]}
        (HERE / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        (HERE / f"{name}.in.bin").write_bytes(np.ascontiguousarray(raw).tobytes())
        (HERE / f"{name}.payload.bin").write_bytes(payload)
        (HERE / f"{name}.out.bin").write_bytes(np.ascontiguousarray(out).tobytes())
        rope = HERE / f"{name}.rope.bin"
        if lay.Tc:
            cos, sin = v2.rope_tables(cal, p["position"] + lay.n_sink, lay.Tc)
            rope.write_bytes(cos.astype("<f4").tobytes() + sin.astype("<f4").tobytes())
        elif rope.exists():
            rope.unlink()
        print(f"{name}: {len(payload)} bytes, {len(lay.spans)} units")


if __name__ == "__main__":
    build()
