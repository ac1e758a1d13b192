"""What the scheduler side tells the worker side once per step (pickled across vLLM's processes):
which tokens to load into which blocks, and which whole chunks the step completes, each with the
request's store keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...store.names import ExtraKeys


@dataclass
class LoadSpec:
    req_id: str
    token_ids: list[int]  # the request's tokens up to `end`
    block_ids: list[int]
    start: int  # tokens [start, end) come from the store ([0, start) vLLM already holds)
    end: int
    keys: ExtraKeys  # the request's store keys (prompt embeddings: rows [0, end) only)
    group: int = 0  # which of the served KV cache groups `block_ids` are (groups.py)


@dataclass
class SaveSpec:
    req_id: str
    token_ids: list[int]  # the request's tokens up to `end`
    block_ids: list[int]
    start: int  # whole chunks [start, end) were completed by this step (or [start, end) is the prompt's tail: a piece)
    end: int
    keys: ExtraKeys
    group: int = 0  # which of the served KV cache groups `block_ids` are (groups.py)


@dataclass
class KVToolMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: requests whose failed load vLLM has seen and rescheduled from the first failed block: the
    #: saves sent from this step on are of recomputed tokens (the worker saves them again)
    recovered: list[str] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # requests finished or aborted since the last step
