"""The connector's worker side (vLLM's worker process): fills a request's blocks from checked store
objects before the forward pass, and copies each completed chunk out of vLLM's blocks after it,
to be encoded, checksummed and stored on a background thread. Every load and save is keyed by the
request's keys, which the scheduler side sent with it."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from ...connectors import PagedLayout
from ...connectors.paged_layout import HOST_PAGE_LAYOUTS
from ...errors import KvtoolError
from ...load import SavePipeline
from ..engine_blocks import EngineBlocks, LatentBlocks, SaveBuffers
from .caches import StoreCaches
from .config import ConnectorConfig
from .groups import KVGroup, refuse_split_kv_sinks
from .layout import check_cpu_pages, check_latent_pages, cpu_pages_layout, engine_latent_fault, engine_layout
from .metadata import KVToolMetadata, LoadSpec, SaveSpec
from .stats import KVToolConnectorStats, StatsRecorder

log = logging.getLogger("vllm.kvtool")


class WorkerSide:
    def __init__(self, config: ConnectorConfig, vllm_config, groups: list[KVGroup]):
        self.config = config
        self.groups = groups
        self.caches = StoreCaches(config, vllm_config.model_config.model, groups, engine_latent_fault(vllm_config))
        self.stats = StatsRecorder()  # the saving thread adds to it too
        self._vllm_config = vllm_config
        self._blocks: list[EngineBlocks | LatentBlocks] = []  # one per served KV cache group, in `groups`' order
        self._save_buffers = SaveBuffers(keep=6)  # SavePipeline holds at most 4 pending saves
        self._saving: SavePipeline | None = None  # encode + write of gathered chunks, off the step
        self._load_errors: set[int] = set()
        #: req_id -> the first token whose load failed: vLLM ran the step over blocks that were never
        #: loaded, so nothing past it is saved until the scheduler says the request was rescheduled
        #: from there (`meta.recovered`): KV built on a failed load never reaches the store
        self._tainted: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        refuse_split_kv_sinks(self._vllm_config, self.groups)  # before any request: vLLM's decode would be wrong
        layout = engine_layout(self._vllm_config)
        layers = list(kv_caches.values())  # in model order
        if layout.latent:  # MLA: one latent row per token and layer, stored as mla_latent chunks (one group)
            self._blocks = [LatentBlocks([kv_caches[name] for name in group.layer_names] if group.layer_names
                                         else layers, self.config.block_size) for group in self.groups]
            check_latent_pages(self._blocks[0], self._vllm_config.model_config.hf_text_config.kv_lora_rank)
            fault = engine_latent_fault(self._vllm_config)
            if fault:  # vLLM serves its own latent back consistently: kept under its own identity (caches.py)
                log.warning("kvtool: %s; its chunks are stored apart, for engines that compute the same", fault)
            log.info("kvtool: store %s, codec %s, chunks of %d tokens, %s, vLLM's latent KV (%s) as kvtool layout "
                     "'mla_latent'", self.caches.url, self.config.codec, self.config.chunk_size, self.config.role,
                     layout.backend)
            return
        if layout.paged is PagedLayout.VLLM_CPU:  # which page layout: that of the isa vLLM's attention picks
            layout = replace(layout, paged=cpu_pages_layout(layers[0]))
        # each group's layers, in model order (a group of the hybrid allocator shares its tensors
        # with the other groups' layers, each group addressing its own blocks in them)
        self._blocks = [EngineBlocks([kv_caches[name] for name in group.layer_names] if group.layer_names else layers,
                                     self.config.block_size, layout.paged) for group in self.groups]
        if layout.paged in HOST_PAGE_LAYOUTS:
            check_cpu_pages(self._blocks[0])
        log.info("kvtool: store %s, codec %s, chunks of %d tokens, %s, vLLM's KV (%s, %s) in kvtool layout %r%s",
                 self.caches.url, self.config.codec, self.config.chunk_size, self.config.role, layout.backend,
                 layout.cache_layout, layout.paged.value,
                 "" if len(self.groups) == 1 else f", {len(self.groups)} KV cache groups: "
                 + "; ".join(group.describe() for group in self.groups))

    # --- loads, before the forward pass --------------------------------------------------

    def start_load(self, meta: KVToolMetadata) -> None:
        for req_id in (*meta.recovered, *meta.ended):  # recomputed from its first failed block on, or gone
            self._tainted.pop(req_id, None)
        loaded: dict[str, tuple[int, int]] = {}  # request -> (first token, end) loaded in any group
        for load in meta.loads:
            done = self._load(load)
            if done > load.start:
                first, end = loaded.get(load.req_id, (load.start, done))
                loaded[load.req_id] = (min(first, load.start), max(end, done))
        self.stats.add(loaded_tokens=sum(end - first for first, end in loaded.values()))

    def _load(self, load: LoadSpec) -> int:
        """kvtool.load's pipeline: fetch, check, decode and scatter chunk by chunk into the blocks
        from load.start on (vLLM's own blocks before it, perhaps shared, are never written)."""
        began = time.perf_counter()
        refused, read, healed = 0, 0, 0
        try:
            target = self._blocks[load.group].target(load.block_ids, load.end)
            hit = self.caches.cache(load.keys, load.group).load_prefix(load.token_ids, target, max_tokens=load.end,
                                                                        from_token=load.start)
            done, why = min(hit.num_tokens, load.end), "; ".join(hit.refused + hit.unreadable) or "missing"
            refused, read, healed = len(hit.refused), hit.stored_bytes, len(hit.healed)
        except KvtoolError as err:  # e.g. the store went away: a load failure, never a crash
            done, why = load.start, str(err)
        seconds = time.perf_counter() - began
        self.stats.add(loaded_bytes=read, load_seconds=seconds, refusals=refused, load_failures=int(done < load.end),
                       healed=healed)
        if done < load.end:  # missing or refused: never wrong KV; vLLM's policy decides
            first, last = done // self.config.block_size, (load.end - 1) // self.config.block_size
            self._load_errors.update(load.block_ids[first:last + 1])
            failed_from = first * self.config.block_size
            self._tainted[load.req_id] = min(self._tainted.get(load.req_id, failed_from), failed_from)
            log.warning("kvtool: request %s: only %d of %d tokens could be loaded from %s%s (%s)", load.req_id,
                        done, load.end, self.caches.url, self._which(load.group), why)
        else:
            log.info("kvtool: request %s: loaded tokens %d..%d (%d bytes) in %.1f ms%s", load.req_id, load.start,
                     done, read, 1e3 * seconds, self._which(load.group))
        return done

    def _which(self, group: int) -> str:
        """A log line's group, where vLLM serves several."""
        return f" ({self.groups[group].describe()})" if len(self.groups) > 1 else ""

    def block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves, after the forward pass ---------------------------------------------------

    def wait_for_save(self, meta: KVToolMetadata) -> None:
        """Copy each completed chunk out of vLLM's blocks now (vLLM may free them once this
        returns); encode, checksum and store it on the saving thread while vLLM goes on."""
        for save in meta.saves:
            tainted = self._tainted.get(save.req_id)
            if tainted is not None and save.end > tainted:  # computed over blocks that were never loaded
                log.warning("kvtool: request %s: tokens %d..%d not saved: this step computed them over tokens from "
                            "%d whose load failed (saved once recomputed)", save.req_id, save.start, save.end, tainted)
                self.stats.add(unsaved_after_failure=1)
                continue
            began = time.perf_counter()
            blocks = self._blocks[save.group]
            numel = blocks.paged.get_shape(save.end - save.start).numel()
            kv = blocks.read(save.block_ids, save.start, save.end, into=self._save_buffers.take(numel, blocks.dtype))
            gathered = time.perf_counter() - began
            if self._saving is None:
                self._saving = SavePipeline(max_pending=4, name="kvtool-vllm-save")
            self._saving.submit(lambda save=save, kv=kv, gathered=gathered: self._store_chunks(save, kv, gathered))
        if self.config.saves_before_reply and self._saving is not None:
            self._saving.drain()  # kv_producer: vLLM sends this step's output (a first token) after its chunks are stored

    def _store_chunks(self, save: SaveSpec, kv: torch.Tensor, gathered: float) -> None:
        """On the saving thread."""
        began = time.perf_counter()
        try:
            result = self.caches.cache(save.keys, save.group).put_sequence(save.token_ids, kv, codec=self.config.codec,
                                                               params=self.config.params, start=save.start)
        except KvtoolError as err:  # the store is unreachable or full: serving goes on, unsaved
            log.warning("kvtool: request %s: tokens %d..%d not saved to %s (%s)", save.req_id, save.start,
                        save.end, self.caches.url, err)
            return
        finally:  # stored (the store keeps its own bytes) or given up: the buffer is free again
            self._save_buffers.give(kv)
        seconds = gathered + time.perf_counter() - began
        self.stats.add(saved_chunks=result.stored + result.pieces, saved_bytes=result.stored_bytes,
                       save_seconds=seconds)
        log.info("kvtool: request %s: saved %d chunks%s (%d bytes) in %.1f ms (%.1f ms in vLLM's step)%s",
                 save.req_id, result.stored, f" and {result.pieces} piece" if result.pieces else "", result.stored_bytes,
                 1e3 * seconds, 1e3 * gathered, self._which(save.group))

    # --- stats, the end -------------------------------------------------------------------

    def take_stats(self) -> KVToolConnectorStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        """vLLM's worker is shutting down: finish the saves that are still being written."""
        if self._saving is not None:
            self._saving.close()
            self._saving = None
        self.caches.close()
