"""Decoded KV examined a window at a time: statistics, checks and comparisons convert values to
float64 (8 bytes each) or build masks of them, and a whole chunk of them would be 4-8x the chunk
(format-spec/container.md §5, memory: at most twice one chunk's decoded size)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..dtypes import count_nonfinite

#: Values (K and V together) in one window: its float64 copies stay a few MB whatever the chunk.
WINDOW_VALUES = 1 << 20


def kv_windows(shape: tuple[int, ...]) -> Iterator[tuple[slice, slice]]:
    """(layers, tokens) slices covering a KV_BLOB `[2, L, T, C]`, each window about
    WINDOW_VALUES values or fewer (never less than one token of one layer): whole layers while
    they fit, else a layer's tokens a run at a time."""
    _, layers, tokens, channels = shape
    per_layer = 2 * tokens * channels
    if per_layer <= WINDOW_VALUES:
        step = max(1, WINDOW_VALUES // max(per_layer, 1))
        for first in range(0, layers, step):
            yield slice(first, min(first + step, layers)), slice(0, tokens)
        return
    step = max(1, WINDOW_VALUES // (2 * channels))
    for layer in range(layers):
        for first in range(0, tokens, step):
            yield slice(layer, layer + 1), slice(first, min(first + step, tokens))


def count_nonfinite_windowed(values: np.ndarray, dtype: str) -> int:
    """`count_nonfinite` of `values`, a window at a time (its masks are as large as the window)."""
    flat = values.reshape(-1)
    return sum(count_nonfinite(flat[start:start + WINDOW_VALUES], dtype)
               for start in range(0, flat.size, WINDOW_VALUES))
