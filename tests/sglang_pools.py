"""Real SGLang 0.5.23 KV pools on the CPU for the SGLang backend's tests and bench: a device pool
(`MHATokenToKVPool` / `MLATokenToKVPool` on device "cpu") and the host pool SGLang builds over it
(`pin_memory=False`), in the geometry of kvtool's default model (SmolLM2-135M: 30 layers, 3 KV
heads of 64) for MHA, and a small DeepSeek-like latent for MLA. `import_sglang()` skips a test
module cleanly where SGLang cannot be imported."""

from __future__ import annotations

import pytest
import torch

LAYERS, HEADS, HEAD_DIM = 30, 3, 64  # the default model's KV
MLA_LAYERS, KV_LORA_RANK, ROPE_DIM = 4, 64, 16


def import_sglang() -> None:
    """Skip the calling module where SGLang (make test installs it) cannot be imported."""
    try:
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
        import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
    except Exception as err:  # ImportError, or a dependency that fails to load (torchvision's ops)
        pytest.skip(f"SGLang cannot be imported ({type(err).__name__}: {str(err)[:120]}); make test installs it",
                    allow_module_level=True)


def device_pool(kind: str, page_size: int, tokens: int = 64, dtype=torch.float32):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind == "mla":
        return MLATokenToKVPool(tokens, page_size, dtype, KV_LORA_RANK, ROPE_DIM, MLA_LAYERS, "cpu", False,
                                start_layer=0, end_layer=MLA_LAYERS)
    return MHATokenToKVPool(tokens, page_size, dtype, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0,
                            end_layer=LAYERS)


def host_pool(device, layout: str, ratio: float = 2.0):
    """SGLang's host pool over `device`, in `layout`, as HiCache builds it (unpinned: a CPU)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    info = device.get_device_pool_infos()[0].buffer_info
    if isinstance(device, MLATokenToKVPool):
        return MLATokenToKVPoolHost(info, ratio, 0, device.page_size, layout, pin_memory=False,
                                    device_capacity_tokens=device.size, start_layer=device.start_layer,
                                    end_layer=device.end_layer, target_layer_num=device.layer_num)
    return MHATokenToKVPoolHost(info, ratio, 0, device.page_size, layout, pin_memory=False,
                                device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer, write_back_staging=device.hicache_write_back_staging)


def fill(pool, seed: int = 0) -> None:
    """Random finite KV in every slot of a host pool."""
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))


def storage_config(*, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, layout: str = "layer_first",
                   model: str | None = None, **extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model,
                                extra_config={"backend_name": "kvtool", "module_path": "kvtool.integrations.sglang",
                                              "class_name": "KVToolHiCacheStorage", "interface_v1": 1, **extra})
