"""The rows' gains of a pca calibration (`kvtool.ops.calibrate`'s module docstring says why):
each row (part, layer) of a few windows' context KV coded alone at one step, the rest exact,
and the model's next-token distributions along each window's continuation judged against the
exact ones (mean KL).

A row changes nothing below its layer, so the continuation is not run from the first layer
each time: the exact run keeps the hidden state that enters every layer, and a row's run starts
at its own layer from there (half the layers' work on average), on one paged cache whose
context KV changes only in the row being judged. Rows are run from the last layer down, so
each run rewrites the continuation's KV of every layer it passes and the layers below it still
hold the exact run's. The logits are those `teacher_forced_eval` gives (the same cache layout,
the same operations on the same inputs), one layer's forward pass at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from ..codecs.pca.calibration import Calibration
from ..engine import LoadedModel
from ..engine import model as engine_model
from .engine_io import new_cache, run_with_query_energy, write_kv

GAIN_STEP = 1.0  # the step at which each row's sensitivity is measured (near quality 97-95)
GAIN_WINDOWS = 3  # calibration windows run for it (each: every row coded alone, 2L + 1 runs)
# tokens per window: the coded context, the judged continuation (KL, smoother than top-1, needs
# fewer; each run costs the continuation's forward pass from the row's layer up)
GAIN_CONTEXT, GAIN_CONTINUATION = 384, 32
GAIN_LIMIT = 4.0  # gains within [1/4, 4] before the rescale: the square-root rule is a high-rate estimate

Window = tuple[list[int], list[int]]  # (context, continuation)


def gain_windows(token_lists: list[list[int]]) -> list[Window]:
    """Up to GAIN_WINDOWS (context, continuation) pairs from the calibration sequences, spread
    over them (the last of each sequence's tokens continue its first)."""
    usable = [ids for ids in token_lists if len(ids) >= 2 * GAIN_CONTINUATION]
    picked = usable[::max(1, len(usable) // GAIN_WINDOWS)][:GAIN_WINDOWS]
    return [(ids[:GAIN_CONTEXT + GAIN_CONTINUATION][:-GAIN_CONTINUATION],
             ids[:GAIN_CONTEXT + GAIN_CONTINUATION][-GAIN_CONTINUATION:]) for ids in picked]


def sensitivity_runs(model: LoadedModel, windows: list[Window]) -> int:
    """How many forward passes `row_sensitivity` makes (its progress' total)."""
    return len(windows) * (2 * model.config.num_layers + 1)


def row_sensitivity(model: LoadedModel, cal: Calibration, windows: list[Window], step: float = GAIN_STEP,
                    on_run: Callable[[], None] | None = None) -> np.ndarray:
    """[2, L]: the mean KL (nats per judged token) of the model's next-token distributions along
    each window's continuation, from the exact context KV's, when only that row (part, layer) of
    the context KV is coded with `cal` at `step` (kvtool's own coder, sinks as the codec keeps
    them). `on_run()` after each forward pass."""
    from .compare import compare_logits

    L = model.config.num_layers
    total = np.zeros((2, L))
    for context, continuation in windows:
        kv, _ = run_with_query_energy(model, context)  # [2, L, T, C] bfloat16
        coded = coded_blob(kv, cal, step)
        runs = ContinuationRuns(model, context, continuation, kv)
        exact = runs.exact()
        if on_run:
            on_run()
        for layer in reversed(range(L)):  # from the top: see the module docstring
            for part in range(2):
                got = runs.with_row_coded(part, layer, coded)
                total[part, layer] += compare_logits(exact, got, continuation)["kl_mean"]
                if on_run:
                    on_run()
    return total / max(1, len(windows))


def coded_blob(kv: torch.Tensor, cal: Calibration, step: float) -> torch.Tensor:
    """KV_BLOB `kv` coded and decoded by the pca coder at `step` (bfloat16, its shape)."""
    from ..codecs.pca import DEFAULT_SINKS, native

    raw = kv.view(torch.int16).numpy().view(np.uint16)
    coder = native.coder()
    payload = coder.encode_chunk(raw, "bfloat16", cal, step, DEFAULT_SINKS, 0)
    decoded = coder.decode_chunk(payload, tuple(raw.shape), "bfloat16", cal, step, 0)
    return torch.from_numpy(np.ascontiguousarray(decoded).view(np.int16)).view(torch.bfloat16)


class ContinuationRuns:
    """The teacher-forced continuation after a context whose KV comes from a KV_BLOB (as
    `teacher_forced_eval(..., kv=kv)` runs it: the context's last token and the continuation
    but its last are computed, at positions len(context) - 1 ...), rerun with one row of the
    context KV replaced, from that row's layer up."""

    def __init__(self, model: LoadedModel, context: list[int], continuation: list[int], kv: torch.Tensor):
        self.model, self.kv = model, kv
        self.start = len(context) - 1
        total = len(context) + len(continuation)
        # teacher_forced_eval's cache: bfloat16, blocks of 16, shuffled with seed 3
        self.cache, seq = new_cache(model, total, torch.bfloat16, 16, seed=3)
        slots = seq.slot_mapping(total, device=model.device)
        write_kv(model, self.cache, seq, kv[:, :, :self.start], slots, 256)
        self.tokens = torch.tensor(context[self.start:] + continuation[:-1], dtype=torch.long, device=model.device)
        end = self.start + len(self.tokens)
        self.context_slots, self.write_slots, self.read_slots = slots[:self.start], slots[self.start:end], slots[:end]
        self.judged = len(continuation)
        self.entering: list[torch.Tensor] = []  # the exact run's hidden state entering each layer
        self.plans = self._plans()

    def _plans(self) -> list[tuple]:
        """Each layer's (cos, sin, mask, causal), as `engine.model.forward` makes them."""
        cfg = self.model.config
        tables = engine_model.rope_tables(cfg, self.model.weights.embed.device)
        dtype = self.model.weights.embed.dtype
        positions = torch.arange(self.start, self.start + len(self.tokens), device=self.model.device)
        t = self.start + len(self.tokens)
        by_window: dict[int | None, tuple] = {}
        for layer in range(cfg.num_layers):
            window = cfg.layer_window(layer)
            if window not in by_window:
                cos, sin = engine_model.rope_cos_sin(engine_model.layer_inv_freq(cfg, layer, tables), positions, dtype)
                by_window[window] = (cos, sin, *engine_model.attention_plan(positions, t, window, dtype, square=False))
        return [by_window[cfg.layer_window(layer)] for layer in range(cfg.num_layers)]

    @torch.inference_mode()
    def exact(self) -> torch.Tensor:
        """Logits [N, V] along the continuation from the exact context KV; keeps each layer's input."""
        x = engine_model.embed(self.model.weights, self.model.config, self.tokens)
        self.entering = []
        return self._run_from(0, x, keep=True)

    @torch.inference_mode()
    def with_row_coded(self, part: int, layer: int, coded: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] with row (part, layer) of the context KV taken from `coded` (a KV_BLOB
        like the exact one); the row is exact again afterwards. Call after `exact`, rows from
        the last layer down (the module docstring)."""
        self._write_context_row(layer, coded if part == 0 else self.kv, coded if part == 1 else self.kv)
        try:
            return self._run_from(layer, self.entering[layer].clone(), keep=False)
        finally:
            self._write_context_row(layer, self.kv, self.kv)

    def _write_context_row(self, layer: int, k_from: torch.Tensor, v_from: torch.Tensor) -> None:
        cfg = self.model.config
        shape = (self.start, cfg.num_kv_heads, cfg.head_dim)
        k = k_from[0, layer, :self.start].reshape(shape).to(self.model.device)
        v = v_from[1, layer, :self.start].reshape(shape).to(self.model.device)
        engine_model.write_kv(self.cache.kv_caches[layer], self.context_slots, k, v)

    def _run_from(self, first: int, x: torch.Tensor, keep: bool) -> torch.Tensor:
        weights, cfg = self.model.weights, self.model.config
        for layer in range(first, cfg.num_layers):
            if keep:
                self.entering.append(x.clone())  # layer_forward updates x in place
            cos, sin, mask, causal = self.plans[layer]
            x = engine_model.layer_forward(x, weights.layers[layer], cfg, cos, sin, self.cache.kv_caches[layer],
                                           self.write_slots, self.read_slots, mask, causal)
        x = engine_model.rms_norm(x, weights.norm, cfg.rms_norm_eps)
        return engine_model.logits_from_hidden(weights, x, cfg.final_softcap)[-self.judged:]


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
