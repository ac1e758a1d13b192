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
the gains live in the calibration's `weight`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codecs.pca.calibration import Calibration
from ..codecs.pca.fit import Moments, fit, key_metric, value_metric
from ..engine import LoadedModel, PagedKVCache, Runner
from ..engine import model as engine_model
from ..errors import UsageError
from .engine_io import paged_connector
from .requests import CalibrateRequest
from .result import Result

DEFAULT_BASIS = "layer"  # principal axes per layer: fewer bits; "head" codes faster (bench/RESULTS.md §34)
DEFAULT_KSCALE = 16.0  # keys' weight against values' (bench/RESULTS.md §24: 16 of 1, 4, 16, 64)
MIN_TOKENS = 512
WINDOW = 1024  # tokens per calibration sequence
MAX_SEQUENCES = 24  # ~25k tokens: the basis no longer moves with more (a minute on one core)
GAIN_STEP = 1.0  # the step at which each row's sensitivity is measured (near quality 97-95)
GAIN_WINDOWS = 3  # calibration windows run for it (each: every row coded alone, 2L + 1 runs)
# tokens per window: the coded context, the judged continuation (KL, smoother than top-1, needs
# fewer; each run costs the continuation's forward pass: SmolLM2-135M, 61 runs, ~15 s a window)
GAIN_CONTEXT, GAIN_CONTINUATION = 384, 32
GAIN_LIMIT = 4.0  # gains within [1/4, 4] before the rescale: the square-root rule is a high-rate estimate

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
                    text_files: list[pathlib.Path] | None = None, **options: Any) -> CalibrateResult:
    """`kvtool calibrate`: learn the pca codec's calibration object for a model on text files
    (default: Python's own documentation and modules), save it in kvtool's calibration folder
    and make it the model's default. A `CalibrateRequest`, or its fields (`model_path`:
    deprecated, `model`)."""
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
    started = time.perf_counter()
    model = load_model(model_path)
    texts = [read_text_file(p) for p in text_files] if text_files else default_texts()
    sequences = calibration_sequences(model, texts)
    cal, gains = learn(model, sequences, kscale, basis=basis)
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


def gather(model: LoadedModel, token_lists: list[list[int]], kscale: float = DEFAULT_KSCALE) -> Samples:
    """Run the model on each token sequence (each from position 0) and collect `Samples`."""
    if sum(len(t) for t in token_lists) < MIN_TOKENS:
        raise UsageError(f"calibration needs at least {MIN_TOKENS} tokens of text")
    cfg = model.config
    tables = engine_model.rope_tables(cfg)
    inv_freq = torch.stack([engine_model.layer_inv_freq(cfg, layer, tables).float().cpu()
                            for layer in range(cfg.num_layers)])  # [L, D/2]
    C = cfg.num_kv_heads * cfg.head_dim
    energy, seen = torch.zeros(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64), 0
    keys, values = Moments(cfg.num_layers, C), Moments(cfg.num_layers, C)
    for ids in token_lists:
        kv, q_energy = run_with_query_energy(model, ids)
        energy += q_energy
        seen += len(ids)
        keys.add(before_rope(kv[0].float(), inv_freq, cfg.num_kv_heads, cfg.head_dim))
        values.add(kv[1].float())
    wo = torch.stack([layer.wo.float().cpu() for layer in model.weights.layers])
    return Samples(keys, values, key_metric((energy / seen).float(), kscale),
                   value_metric(wo, cfg.num_kv_heads, cfg.head_dim), inv_freq)


def learn(model: LoadedModel, token_lists: list[list[int]], kscale: float = DEFAULT_KSCALE,
          gains: bool = True, basis: str = DEFAULT_BASIS) -> tuple[Calibration, np.ndarray]:
    """`calibrate`'s object and its rows' gains ([2, L]; ones without `gains`)."""
    s = gather(model, token_lists, kscale)
    cal = fit(s.keys, s.values, s.metric_k, s.metric_v, s.inv_freq, model.config.head_dim,
              model.identity.fingerprint(), basis)
    if not gains:
        return cal, np.ones((2, model.config.num_layers))
    g = row_gains(row_sensitivity(model, cal, gain_windows(token_lists)))
    return with_gains(cal, g), g


def gain_windows(token_lists: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """Up to GAIN_WINDOWS (context, continuation) pairs from the calibration sequences, spread
    over them (the last of each sequence's tokens continue its first)."""
    usable = [ids for ids in token_lists if len(ids) >= 2 * GAIN_CONTINUATION]
    picked = usable[::max(1, len(usable) // GAIN_WINDOWS)][:GAIN_WINDOWS]
    return [(ids[:GAIN_CONTEXT + GAIN_CONTINUATION][:-GAIN_CONTINUATION], ids[:GAIN_CONTEXT + GAIN_CONTINUATION][-GAIN_CONTINUATION:])
            for ids in picked]


def row_sensitivity(model: LoadedModel, cal: Calibration, windows, step: float = GAIN_STEP) -> np.ndarray:
    """[2, L]: the mean KL (nats per judged token) of the model's next-token distributions along
    each window's continuation, from the exact context KV's, when only that row (part, layer) of
    the context KV is coded with `cal` at `step` (kvtool's own coder, sinks as the codec keeps them)."""
    from ..codecs.pca import DEFAULT_SINKS, native
    from .compare import compare_logits, teacher_forced_eval

    L = model.config.num_layers
    total = np.zeros((2, L))
    for context, continuation in windows:
        kv, _ = run_with_query_energy(model, context)  # [2, L, T, C] bfloat16
        raw = kv.view(torch.int16).numpy().view(np.uint16)
        coder = native.coder()
        payload = coder.encode_chunk(raw, "bfloat16", cal, step, DEFAULT_SINKS, 0)
        coded = torch.from_numpy(np.ascontiguousarray(coder.decode_chunk(payload, tuple(raw.shape), "bfloat16", cal,
                                                                          step, 0)).view(np.int16)).view(torch.bfloat16)
        exact = teacher_forced_eval(model, context, continuation, kv=kv)
        for part in range(2):
            for layer in range(L):
                mixed = kv.clone()
                mixed[part, layer] = coded[part, layer]
                got = teacher_forced_eval(model, context, continuation, kv=mixed)
                total[part, layer] += compare_logits(exact, got, continuation)["kl_mean"]
    return total / max(1, len(windows))


def row_gains(sensitivity: np.ndarray, limit: float = GAIN_LIMIT) -> np.ndarray:
    """[2, L] gains: sqrt(s / geometric mean of s), clipped to [1/limit, limit], then scaled to a
    geometric mean of 1 (so a step means about the same rate with or without them)."""
    s = np.maximum(np.asarray(sensitivity, np.float64), 1e-12)
    g = np.clip(np.sqrt(s / np.exp(np.log(s).mean())), 1 / limit, limit)
    return g / np.exp(np.log(g).mean())


def with_gains(cal: Calibration, gains: np.ndarray) -> Calibration:
    """`cal` with each row's weights times its gain (the basis is unchanged: scaling a layer's
    weights scales its weighted covariance, not its eigenvectors)."""
    weight = (cal.weight.astype(np.float64) * gains[:, :, None]).astype(np.float32)
    return dataclasses.replace(cal, weight=weight, digest="")


def run_with_query_energy(model: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """KV_BLOB [2, L, T, C] (bfloat16) of `ids`, and the summed squared queries [L, Hkv, D] (over
    tokens and the query heads of each KV head). The queries are seen by wrapping the engine's
    attention function for the length of this call (the engine keeps no hook for it)."""
    cfg = model.config
    energy = torch.zeros(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
    calls = [0]
    real = engine_model.attention

    def seeing_queries(q, *args, **kwargs):
        layer = calls[0] % cfg.num_layers
        group = cfg.num_heads // cfg.num_kv_heads
        energy[layer] += q.float().pow(2).view(q.shape[0], cfg.num_kv_heads, group, cfg.head_dim).sum((0, 2)).double().cpu()
        calls[0] += 1
        return real(q, *args, **kwargs)

    n = len(ids)
    cache = PagedKVCache.for_tokens(cfg, n, kv_dtype=torch.bfloat16, device=model.device, shuffle_seed=0)
    seq = cache.new_sequence(n)
    engine_model.attention = seeing_queries
    try:
        Runner(model, cache).prefill(seq, ids, prefill_chunk=n, logits="none")
    finally:
        engine_model.attention = real
    connector = paged_connector(model)
    memory = connector.allocate(n, torch.bfloat16, model.device)
    connector.from_gpu(memory, 0, n, kvcaches=cache.kv_caches, slot_mapping=seq.slot_mapping(n))
    return memory.tensor.cpu().clone(), energy


def before_rope(keys: torch.Tensor, inv_freq: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Keys [L, T, Hkv*D] turned back by their positions 0..T-1 (rotate-half pairs (i, i+D/2))."""
    layers, tokens, _ = keys.shape
    angle = torch.arange(tokens, dtype=torch.float64)[None, :, None] * inv_freq.double()[:, None, :]  # [L, T, D/2]
    cos, sin = angle.cos().float()[:, :, None, :], angle.sin().float()[:, :, None, :]
    x = keys.view(layers, tokens, kv_heads, head_dim)
    a, b = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return torch.cat([a * cos + b * sin, b * cos - a * sin], -1).reshape(layers, tokens, -1)
