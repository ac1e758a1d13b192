"""The connector's scheduler side (vLLM's EngineCore process): how many leading prompt tokens the
store holds for a request under its keys (looked up off the scheduler's thread), and once per step
what the worker loads into which blocks and which whole chunks it saves."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ...errors import KvtoolError
from ...store.names import ExtraKeys
from .caches import StoreCaches
from .config import ConnectorConfig
from .groups import KVGroup
from .keys import AdapterDigests, RequestFacts, UnusableKeys, extra_keys, keys_up_to, prompt_tokens, request_facts
from .layout import engine_latent_fault
from .lookups import Lookups
from .metadata import KVToolMetadata, LoadSpec, SaveSpec
from .stats import KVToolConnectorStats, StatsRecorder

log = logging.getLogger("vllm.kvtool")  # under vLLM's logger: its handler and format

#: The id vLLM gives a block it does not keep (vllm/v1/core/block_pool.py, the null block): a
#: sliding-window layer's blocks before its window, once vLLM no longer needs them.
NULL_BLOCK = 0


def kept_from(blocks: list[int], start: int, end: int, block_size: int) -> int:
    """The first token of [start, end) from which vLLM keeps every block up to `end`: just past the
    last null block in that range (`end` when that is the range's last block; `start` when none is
    null). A sliding-window model's tokens before the window have no blocks to load into or read."""
    first, last = start // block_size, (end - 1) // block_size
    for i in range(min(last, len(blocks) - 1), first - 1, -1):
        if blocks[i] == NULL_BLOCK:
            return min(end, (i + 1) * block_size)
    return start


def check_sliding_windows(groups: list[KVGroup], chunk_size: int) -> None:
    """A chunk is read from vLLM's blocks in the step that completes it; vLLM frees a sliding
    layer's blocks before its window as the request goes on, so a window shorter than a chunk could
    free the start of a chunk before the chunk is saved (a chunked prefill). Refused at start."""
    for group in groups:
        if group.window is not None and group.window < chunk_size:
            raise ValueError(f"KVToolConnector: chunk_size {chunk_size} is longer than the model's sliding window "
                             f"of {group.window} tokens (vLLM frees blocks outside it): use a chunk_size of "
                             f"at most {group.window}, a multiple of vLLM's block size")


def check_codec_groups(codec: str, groups: list[KVGroup]) -> None:
    """pca's calibration holds a basis per layer of the whole model; a group's chunks hold some
    of its layers only. Refused at start rather than coded with another layer's basis."""
    if codec == "pca" and len(groups) > 1:
        raise ValueError(f"KVToolConnector: codec pca calibrates every layer of the model together; vLLM serves "
                         f"this one as {len(groups)} KV cache groups (its hybrid allocator): use raw, zstd or "
                         "cachegen, or turn the hybrid allocator off (--disable-hybrid-kv-cache-manager)")


@dataclass(frozen=True)
class LookupResult:
    keys: ExtraKeys | None  # None: the request's keys could not be built; it neither loads nor saves
    stored: int  # leading tokens the store covers under those keys (whole chunks, then blocks)


@dataclass(frozen=True)
class Answer:
    """What vLLM was told for a request, kept until it allocates the request's blocks."""

    keys: ExtraKeys | None
    local: int  # tokens vLLM holds itself (its own prefix cache): ours would start there


@dataclass(frozen=True)
class LoadRange:
    start: int
    end: int


@dataclass
class RequestState:
    """A request the connector loads for or saves from, from its allocation to its end."""

    keys: ExtraKeys
    request: Any  # vLLM's Request: its all_token_ids grow as it decodes (save_generated)
    tokens: list[int]  # the prompt's token ids, as chunks of it are named
    #: its blocks in token order, one list per served KV cache group (a sliding group's: the null
    #: block before its window)
    blocks: list[list[int]] = field(default_factory=list)
    saved: int = 0  # whole chunks of tokens [0, saved) are stored
    load: LoadRange | None = None  # tokens to load the next time it is scheduled
    tail_saved: bool = False  # the prompt's block-aligned tokens past its last whole chunk: stored (or loaded)


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, vllm_config, groups: list[KVGroup]):
        check_sliding_windows(groups, config.chunk_size)
        check_codec_groups(config.codec, groups)
        self.config = config
        self.groups = groups
        self.caches = StoreCaches(config, vllm_config.model_config.model, groups, engine_latent_fault(vllm_config))
        self.stats = StatsRecorder()
        self._digests = AdapterDigests()
        self._lookups: Lookups[RequestFacts, LookupResult] = Lookups(self._lookup, config.lookup_wait_s)
        self._answers: dict[str, Answer] = {}
        self._states: dict[str, RequestState] = {}
        self._recovered: set[str] = set()  # told to the worker with the next step (metadata.recovered)
        self._ended: set[str] = set()

    # --- vLLM asks how many tokens the store holds ---------------------------------------

    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens to load beyond vLLM's own `num_computed_tokens`; None while the lookup runs."""
        result = self._lookups.poll(request.request_id, lambda: request_facts(request))
        if result is None:
            return None, False
        usable = 0
        if result.keys is not None:  # whole blocks, and vLLM computes the last prompt token
            last = (request.num_prompt_tokens - 1) // self.config.block_size * self.config.block_size
            usable = min(result.stored, last)
        self._answers[request.request_id] = Answer(result.keys, num_computed_tokens)
        return max(0, usable - num_computed_tokens), False

    def _lookup(self, facts: RequestFacts) -> LookupResult:
        """On a lookup thread: the request's keys, then the store's answer under them. Never
        raises: a failure is a miss (or, without keys, no loads and no saves) with a warning."""
        keys = self._keys(facts)
        if keys is None:
            return LookupResult(None, 0)
        stored = self._stored(facts, keys)
        self.stats.add(lookups=1)
        return LookupResult(keys, stored)

    def _keys(self, facts: RequestFacts) -> ExtraKeys | None:
        try:
            return extra_keys(facts, self.config.namespace, self._digests)
        except UnusableKeys as err:
            why = str(err)
        except Exception as err:  # raised here it would take vLLM's scheduler down with it
            why = f"{type(err).__name__}: {err}"
        log.warning("kvtool: request %s neither loads nor saves: %s", facts.req_id, why)
        return None

    def _stored(self, facts: RequestFacts, keys: ExtraKeys) -> int:
        """The leading tokens every group's chunks cover (a group that holds fewer decides)."""
        try:
            stored = len(facts.tokens)
            for group in range(len(self.groups)):
                stored = min(stored, self.caches.cache(keys, group).lookup(facts.tokens))
                if stored == 0:
                    break
            return stored
        except KvtoolError as err:  # an unreachable store is a miss: the request is computed
            why = str(err)
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
        log.warning("kvtool: request %s: store %s not consulted (%s)", facts.req_id, self.caches.url, why)
        return 0

    def allocated(self, request, num_external_tokens: int) -> None:
        """vLLM gave the request its blocks, `num_external_tokens` of them to fill from the store."""
        answer = self._answers.pop(request.request_id, None)
        if answer is None or answer.keys is None:
            self._states.pop(request.request_id, None)
            return
        state = self._states.get(request.request_id)
        if state is None:  # (a request back from preemption keeps its state: what it saved stays saved)
            state = self._states[request.request_id] = RequestState(answer.keys, request, prompt_tokens(request))
        if num_external_tokens > 0:  # never over vLLM's own cached blocks
            state.load = LoadRange(answer.local, answer.local + num_external_tokens)
            self.stats.add(lookup_hits=1)
            log.info("kvtool: request %s: store hit (%s): tokens %d..%d to load", request.request_id,
                     answer.keys.describe(), state.load.start, state.load.end)

    # --- once per step: the worker's instructions ---------------------------------------

    def build_meta(self, scheduler_output) -> KVToolMetadata:
        meta = KVToolMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is None:
                continue
            state.blocks = self._served(new.block_ids)
            self._take_load(meta, new.req_id, state)
            self._take_saves(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            if state is None:
                continue
            resumed = req_id in cached.resumed_req_ids
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:  # back from preemption: all of its blocks are new
                served = self._served(new_blocks)
                state.blocks = served if resumed else [old + new for old, new in zip(state.blocks, served)]
            if resumed:  # vLLM asked us again: load into the new blocks
                self._take_load(meta, req_id, state)
            self._take_saves(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self.forget(req_id)
        meta.recovered, self._recovered = sorted(self._recovered), set()
        meta.ended, self._ended = sorted(self._ended), set()
        return meta

    def _served(self, block_ids) -> list[list[int]]:
        """vLLM's block ids of a request, one list per KV cache group, cut to the groups served."""
        return [list(block_ids[group.index]) for group in self.groups]

    # --- after a step: loads that failed ------------------------------------------------

    def failed_blocks(self, invalid_block_ids: set[int]) -> None:
        """The worker could not load these blocks and vLLM has already rescheduled (policy
        `recompute`) or failed (`fail`) their requests from the first such block. What the store
        was believed to hold from there is not: a request saves those chunks again once they are
        recomputed (the worker saved nothing built on them meanwhile: its `_tainted`)."""
        for req_id, state in self._states.items():
            first = min((i for blocks in state.blocks for i, block in enumerate(blocks) if block in invalid_block_ids),
                        default=None)  # (vLLM's block ids are one pool's: no group's id is another's)
            if first is None:
                continue
            failed_from = first * self.config.block_size
            state.saved = min(state.saved, failed_from // self.config.chunk_size * self.config.chunk_size)
            if failed_from < self._tail(state)[1]:
                state.tail_saved = False
            self._recovered.add(req_id)
            log.info("kvtool: request %s: its load failed from token %d: recomputed from there, then saved again",
                     req_id, failed_from)

    def _take_load(self, meta: KVToolMetadata, req_id: str, state: RequestState) -> None:
        if state.load is None:
            return
        start, end = state.load.start, state.load.end
        for group, blocks in enumerate(state.blocks):
            kept = kept_from(blocks, start, end, self.config.block_size)
            if kept > start:  # vLLM's blocks before its sliding window are null: nothing to load there
                log.info("kvtool: request %s: tokens %d..%d are before vLLM's sliding window%s: not loaded", req_id,
                         start, kept, self._which(group))
            if kept < end:
                meta.loads.append(LoadSpec(req_id, state.tokens[:end], list(blocks), kept, end,
                                           keys_up_to(state.keys, end), group))
        state.saved = max(state.saved, end // self.config.chunk_size * self.config.chunk_size)  # stored already
        state.tail_saved = state.tail_saved or end >= self._tail(state)[1]  # (the store holds the tail: loaded from it)
        state.load = None

    def _take_saves(self, meta: KVToolMetadata, req_id: str, state: RequestState, computed: int) -> None:
        """Whole chunks computed once this step has run and not saved yet: of the prompt, or with
        `save_generated` of every token (prompt embeddings name the prompt's chunks only)."""
        tokens = state.tokens
        if self.config.save_generated and state.keys.prompt_embeds is None:
            tokens = state.request.all_token_ids
        chunk = self.config.chunk_size
        end = min(computed, len(tokens)) // chunk * chunk
        if end > state.saved:  # from the first whole chunk all of whose blocks vLLM keeps (a sliding window's)
            for group, blocks in enumerate(state.blocks):
                start = -(-kept_from(blocks, state.saved, end, self.config.block_size) // chunk) * chunk
                if start < end:
                    meta.saves.append(SaveSpec(req_id, list(tokens[:end]), list(blocks), start, end,
                                               keys_up_to(state.keys, end), group))
            state.saved = end
        self._take_tail(meta, req_id, state, computed)

    def _tail(self, state: RequestState) -> tuple[int, int]:
        """The prompt's tokens past its last whole chunk, to its last whole block: [start, end)."""
        n = len(state.tokens)
        return n // self.config.chunk_size * self.config.chunk_size, n // self.config.block_size * self.config.block_size

    def _take_tail(self, meta: KVToolMetadata, req_id: str, state: RequestState, computed: int) -> None:
        """Once the prompt is computed, its block-aligned tokens past the last whole chunk are
        saved as a piece (store.md §7), so that a prompt sharing them loads them too."""
        start, end = self._tail(state)
        if state.tail_saved or end <= start or computed < end:
            return
        state.tail_saved = True
        for group, blocks in enumerate(state.blocks):
            if kept_from(blocks, start, end, self.config.block_size) == start:  # (a window kept every block)
                meta.saves.append(SaveSpec(req_id, list(state.tokens[:end]), list(blocks), start, end,
                                           keys_up_to(state.keys, end), group))

    def _which(self, group: int) -> str:
        """A log line's group, where vLLM serves several."""
        return f" ({self.groups[group].describe()})" if len(self.groups) > 1 else ""

    # --- the end of a request, of the engine ----------------------------------------------

    def held(self, req_id: str, block_ids) -> None:
        """At a request's end, the KV memory vLLM holds for it (every group's blocks but the null
        block: a sliding group's window only, with the hybrid allocator on), in the log."""
        held = [sum(1 for block in block_ids[group.index] if block != NULL_BLOCK) if group.index < len(block_ids) else 0
                for group in self.groups]
        memory = sum(n * group.page_bytes * len(group.layers) for n, group in zip(held, self.groups))
        log.info("kvtool: request %s ends holding %d of vLLM's KV blocks (%s), %d bytes", req_id, sum(held),
                 " + ".join(map(str, held)), memory)

    def forget(self, req_id: str) -> None:
        """A finished or aborted request: its lookup, answer and state go."""
        self._lookups.forget(req_id)
        self._answers.pop(req_id, None)
        self._states.pop(req_id, None)
        self._recovered.discard(req_id)
        self._ended.add(req_id)

    def take_stats(self) -> KVToolConnectorStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self._lookups.close()
        self.caches.close()
