"""`KVToolConnector`, the class vLLM loads: one object per role, each delegating to its side."""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                  KVConnectorRole, SupportsHMA)

from .config import read_config
from .groups import refuse_state_layers, serving_groups
from .metadata import KVToolMetadata
from .scheduler import SchedulerSide
from .stats import KVToolConnectorStats, build_stats
from .worker import WorkerSide


class KVToolConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM builds it twice, in two processes: with the scheduler role (`SchedulerSide`) and with
    the worker role (`WorkerSide`); each object holds only its own side. It serves every KV cache
    group (`SupportsHMA`: vLLM keeps its hybrid allocator on, a sliding layer only its window)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        refuse_state_layers(vllm_config.model_config)
        config = self.config = read_config(vllm_config)
        groups = serving_groups(kv_cache_config)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(config, vllm_config, groups)
        else:
            self.worker_side = WorkerSide(config, self._vllm_config, groups)

    # --- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        matched, is_async = self.scheduler_side.matched_tokens(request, num_computed_tokens)
        if matched and not self.config.loads:  # kv_producer: its lookup gave the keys its saves need; it never loads
            return 0, False
        return matched, is_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler_side.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = self.scheduler_side.build_meta(scheduler_output)
        if not self.config.saves:  # kv_consumer: loads only
            meta.saves.clear()
        return meta

    def update_connector_output(self, connector_output) -> None:
        """After each step: blocks the worker could not load (vLLM has rescheduled their requests)."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self.scheduler_side.failed_blocks(set(invalid))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`'s end of a request, every group's blocks at once (`request_finished`: one group's)."""
        self.scheduler_side.held(request.request_id, block_ids)
        self.scheduler_side.forget(request.request_id)
        return False, None  # saves gather synchronously: vLLM may free the blocks now

    # --- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker_side.start_load(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: start_load_kv filled every layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves happen in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.block_ids_with_load_errors()

    def _metadata(self) -> KVToolMetadata:
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVToolMetadata) else KVToolMetadata()

    # --- both ------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVToolConnectorStats | None:
        side = self.scheduler_side or self.worker_side
        return side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVToolConnectorStats:
        return build_stats(data)

    def shutdown(self) -> None:
        for side in (self.scheduler_side, self.worker_side):
            if side is not None:
                side.shutdown()
