"""Learning the pca codec's calibration object for a model (format-spec/pca.md §3).

A few thousand tokens of the caller's text are run through kvtool's engine; the keys (turned
back to before RoPE) and values of every layer are the samples; the queries that read each key
channel and the o_proj columns that read each value channel give the weights. The fit itself
is `kvtool.codecs.pca.fit`.

Then each layer's K and V get a gain (`row_gains`): those weights say how much an error moves
that layer's attention, not how much it moves the model's answer, and layers differ there by
100x or more (bench/RESULTS.md §32: the first layers' values matter most, the last layers'
hardly at all). The model is run on a few calibration windows with one row at a time coded at
one step, the rest exact; the row's mean KL from the exact answer is its sensitivity s, and its
weights are scaled by sqrt(s / mean s) (geometric mean), within 4x either way. A larger weight
is a finer step there (the step is divided by it): the quantizer's error in a row goes as the
step squared, so this equalises what a bit buys in every row (for a high-rate quantizer,
distortion times rate slope is equal where s * step^2 is). The file format does not change:
the gains live in the calibration's `weight`. They are measured in `kvtool.ops.calibration_gains`.

Most of the time goes to the model's forward passes (the text's ~25k tokens, then the rows' runs);
`calibrate_model` tells a `Progress` each stage and step, which `kvtool calibrate` shows.
"""

from __future__ import annotations

import pathlib
import sysconfig
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codecs.pca.calibration import Calibration
from ..codecs.pca.fit import Moments, fit, key_metric, value_metric
from ..engine import LoadedModel
from ..engine import model as engine_model
from ..errors import UsageError
from .calibration_gains import gain_windows, row_gains, row_sensitivity, sensitivity_runs, with_gains
from .engine_io import run_with_query_energy
from .requests import CalibrateRequest
from .result import Result

__all__ = ["CalibrateResult", "Progress", "calibrate", "calibrate_model", "calibration_sequences", "default_texts",
           "gain_windows", "gather", "learn", "row_gains", "row_sensitivity", "run_with_query_energy", "with_gains"]

#: `progress(stage, done, total)`: a stage's name (STAGES) and how far it is (total 0: one step,
#: not counted); called as each stage starts and as each of its steps ends.
Progress = Callable[[str, int, int], None]
STAGES = ("loading the model", "running the model over the text", "fitting the principal axes",
          "measuring each layer's sensitivity", "saving")

DEFAULT_BASIS = "layer"  # principal axes per layer: fewer bits; "head" codes faster (bench/RESULTS.md §34)
DEFAULT_KSCALE = 16.0  # keys' weight against values' (bench/RESULTS.md §24: 16 of 1, 4, 16, 64)
MIN_TOKENS = 512
WINDOW = 1024  # tokens per calibration sequence
MAX_SEQUENCES = 24  # ~25k tokens: the basis no longer moves with more (a minute on one core)

# The default calibration text: what every Python installation holds, none of it a text
# bench/bench_rd.py measures on (its windows: other reference sections, other modules).
DEFAULT_TOPICS = ("numbers", "formatstrings", "specialnames", "exceptions", "typesseq", "bltin-code-objects")
DEFAULT_MODULES = ("json/decoder.py", "shutil.py", "calendar.py", "difflib.py")


def default_texts() -> list[str]:
    from pydoc_data.topics import topics

    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts = [topics[name] for name in DEFAULT_TOPICS if name in topics]
    for name in DEFAULT_MODULES:
        try:
            texts.append((stdlib / name).read_text(encoding="utf-8"))
        except OSError:
            pass
    return texts


@dataclass
class CalibrateResult(Result):
    digest: str
    path: str
    model: str
    model_fingerprint: str
    sequences: int
    tokens: int
    basis: str  # the principal axes: per KV 'head' or per 'layer' (kvtool.codecs.pca.fit.principal_axes)
    bytes: int
    gains_low: float  # the smallest and largest row gain (`row_gains`): how unequal the rows' sensitivity was
    gains_high: float
    seconds: float


def calibrate_model(model: str | pathlib.Path | CalibrateRequest | None = None,
                    text_files: list[pathlib.Path] | None = None, *, progress: Progress | None = None,
                    **options: Any) -> CalibrateResult:
    """`kvtool calibrate`: learn the pca codec's calibration object for a model on text files
    (default: Python's own documentation and modules), save it in kvtool's calibration folder
    and make it the model's default. A `CalibrateRequest`, or its fields (`model_path`:
    deprecated, `model`). `progress`: told each stage and step (`Progress`)."""
    from ..codecs.pca.calibration import default_dir, register
    from ..engine import load_model
    from ..fsutil import read_text_file

    if "model_path" in options:
        warnings.warn("calibrate_model(model_path=...) is deprecated: use model=...", DeprecationWarning,
                      stacklevel=2)
        model = options.pop("model_path")
    request = model if isinstance(model, CalibrateRequest) else CalibrateRequest(model, text_files, **options)
    model_path, text_files, basis = request.model, request.text_files, request.basis
    kscale = DEFAULT_KSCALE if request.kscale is None else request.kscale
    report = progress or (lambda stage, done, total: None)
    started = time.perf_counter()
    report(STAGES[0], 0, 0)
    model = load_model(model_path)
    texts = [read_text_file(p) for p in text_files] if text_files else default_texts()
    sequences = calibration_sequences(model, texts)
    cal, gains = learn(model, sequences, kscale, basis=basis, progress=report)
    report(STAGES[4], 0, 0)
    cal = cal.save(default_dir())
    fingerprint = model.identity.fingerprint()
    register(fingerprint, cal.digest)
    path = default_dir() / f"{cal.digest}.kvcal"
    return CalibrateResult(digest=cal.digest, path=str(path), model=model.name, model_fingerprint=fingerprint,
                           sequences=len(sequences), tokens=sum(len(s) for s in sequences), basis=basis,
                           bytes=path.stat().st_size, gains_low=float(gains.min()), gains_high=float(gains.max()),
                           seconds=time.perf_counter() - started)


def calibration_sequences(model: LoadedModel, texts: list[str]) -> list[list[int]]:
    """The texts' tokens, one stream, cut into sequences of WINDOW (the last at least half of
    one), at most MAX_SEQUENCES."""
    ids = [i for text in texts for i in model.tokenizer.encode(text, add_special_tokens=False)]
    return [ids[s:s + WINDOW] for s in range(0, len(ids) - WINDOW // 2, WINDOW)][:MAX_SEQUENCES]


def calibrate(model: LoadedModel, token_lists: list[list[int]], kscale: float = DEFAULT_KSCALE,
              gains: bool = True, basis: str = DEFAULT_BASIS) -> Calibration:
    """The calibration object learned from these token sequences (each run from position 0);
    `gains`: each row's weights scaled by its sensitivity (`row_gains`, module docstring);
    `basis`: principal axes per 'layer' or per KV 'head' (`kvtool.codecs.pca.fit.principal_axes`)."""
    return learn(model, token_lists, kscale, gains, basis)[0]


@dataclass
class Samples:
    """What a fit needs from a model run (`gather`): the moments of the keys (turned back to
    before RoPE) and values of every layer, the channels' metrics, the RoPE frequencies."""
    keys: Moments
    values: Moments
    metric_k: torch.Tensor  # [L, C]
    metric_v: torch.Tensor  # [L, C]
    inv_freq: torch.Tensor  # [L, D/2]


def gather(model: LoadedModel, token_lists: list[list[int]], kscale: float = DEFAULT_KSCALE,
           on_sequence: Callable[[int], None] | None = None) -> Samples:
    """Run the model on each token sequence (each from position 0) and collect `Samples`;
    `on_sequence(n)` after the n-th."""
    if sum(len(t) for t in token_lists) < MIN_TOKENS:
        raise UsageError(f"calibration needs at least {MIN_TOKENS} tokens of text")
    cfg = model.config
    tables = engine_model.rope_tables(cfg)
    inv_freq = torch.stack([engine_model.layer_inv_freq(cfg, layer, tables).float().cpu()
                            for layer in range(cfg.num_layers)])  # [L, D/2]
    C = cfg.num_kv_heads * cfg.head_dim
    energy, seen = torch.zeros(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64), 0
    keys, values = Moments(cfg.num_layers, C), Moments(cfg.num_layers, C)
    for n, ids in enumerate(token_lists, 1):
        kv, q_energy = run_with_query_energy(model, ids)
        energy += q_energy
        seen += len(ids)
        keys.add(before_rope(kv[0].float(), inv_freq, cfg.num_kv_heads, cfg.head_dim))
        values.add(kv[1].float())
        if on_sequence:
            on_sequence(n)
    wo = torch.stack([layer.wo.float().cpu() for layer in model.weights.layers])
    return Samples(keys, values, key_metric((energy / seen).float(), kscale),
                   value_metric(wo, cfg.num_kv_heads, cfg.head_dim), inv_freq)


def learn(model: LoadedModel, token_lists: list[list[int]], kscale: float = DEFAULT_KSCALE,
          gains: bool = True, basis: str = DEFAULT_BASIS,
          progress: Progress | None = None) -> tuple[Calibration, np.ndarray]:
    """`calibrate`'s object and its rows' gains ([2, L]; ones without `gains`); `progress` as
    `calibrate_model`'s."""
    report = progress or (lambda stage, done, total: None)
    report(STAGES[1], 0, len(token_lists))
    s = gather(model, token_lists, kscale, on_sequence=lambda n: report(STAGES[1], n, len(token_lists)))
    report(STAGES[2], 0, 0)
    cal = fit(s.keys, s.values, s.metric_k, s.metric_v, s.inv_freq, model.config.head_dim,
              model.identity.fingerprint(), basis)
    if not gains:
        return cal, np.ones((2, model.config.num_layers))
    windows = gain_windows(token_lists)
    runs, done = sensitivity_runs(model, windows), [0]

    def one_run() -> None:
        done[0] += 1
        report(STAGES[3], done[0], runs)

    report(STAGES[3], 0, runs)
    g = row_gains(row_sensitivity(model, cal, windows, on_run=one_run))
    return with_gains(cal, g), g


def before_rope(keys: torch.Tensor, inv_freq: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Keys [L, T, Hkv*D] turned back by their positions 0..T-1 (rotate-half pairs (i, i+D/2))."""
    layers, tokens, _ = keys.shape
    angle = torch.arange(tokens, dtype=torch.float64)[None, :, None] * inv_freq.double()[:, None, :]  # [L, T, D/2]
    cos, sin = angle.cos().float()[:, :, None, :], angle.sin().float()[:, :, None, :]
    x = keys.view(layers, tokens, kv_heads, head_dim)
    a, b = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return torch.cat([a * cos + b * sin, b * cos - a * sin], -1).reshape(layers, tokens, -1)
