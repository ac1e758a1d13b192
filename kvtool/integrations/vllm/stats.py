"""kvtool's counters in vLLM's own metrics: `KVToolConnectorStats`, which vLLM carries from the worker
and the scheduler to its logger and prints as "KV Transfer metrics: lookups=..., ..." once per
`VLLM_LOG_STATS_INTERVAL`."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class TransferCounts:
    """What the connector did in one interval; the scheduler side counts lookups, the worker the rest."""

    lookups: int = 0  # store lookups finished
    lookup_hits: int = 0  # requests told they have tokens to load
    loaded_tokens: int = 0
    loaded_bytes: int = 0  # stored bytes read for them
    saved_chunks: int = 0
    saved_bytes: int = 0  # stored bytes written
    load_seconds: float = 0.0
    save_seconds: float = 0.0  # gather in vLLM's step plus encode and write on the saving thread
    refusals: int = 0  # stored chunks refused by a check (damaged, or another model's/request's)
    load_failures: int = 0  # loads that fell short of what the scheduler promised vLLM
    healed: int = 0  # stored objects removed because a load refused them or found them gone (and entries naming them)
    unsaved_after_failure: int = 0  # saves skipped: computed over blocks whose load failed (saved once recomputed)


COUNTERS = tuple(f.name for f in dataclasses.fields(TransferCounts))


@dataclass
class KVToolConnectorStats(KVConnectorStats):
    """vLLM's stats object over `TransferCounts`: `data` maps each counter's name to its value
    (what crosses vLLM's process boundaries)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dataclasses.asdict(TransferCounts())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 3) if isinstance(value, float) else value
                for name in COUNTERS for value in [self.data.get(name, 0)]}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTERS)


def build_stats(data: dict | None = None) -> KVToolConnectorStats:
    """vLLM's logger rebuilds the stats from the `data` that crossed from the engine."""
    return KVToolConnectorStats(data=dict(data)) if data is not None else KVToolConnectorStats()


class StatsRecorder:
    """The counts of the current interval, added to from vLLM's thread, the lookup threads and
    the saving thread: every read and write holds the lock."""

    def __init__(self) -> None:
        self._counts = TransferCounts()
        self._lock = threading.Lock()

    def add(self, **increments: int | float) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._counts, name, getattr(self._counts, name) + value)

    def take(self) -> KVToolConnectorStats | None:
        """This interval's counts (None when nothing happened), and a new interval begins."""
        with self._lock:
            counts, self._counts = self._counts, TransferCounts()
        stats = KVToolConnectorStats(data=dataclasses.asdict(counts))
        return None if stats.is_empty() else stats
