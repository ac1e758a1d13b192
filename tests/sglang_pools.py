"""Real SGLang 0.5.23 KV pools on the CPU for the SGLang backend's tests and bench: a device pool
(`MHATokenToKVPool` / `MLATokenToKVPool` on device "cpu") and the host pool SGLang builds over it
(`pin_memory=False`), in the geometry of kvtool's default model (SmolLM2-135M: 30 layers, 3 KV
heads of 64) for MHA, and a small DeepSeek-like latent for MLA. `import_sglang()` skips a test
module cleanly where SGLang cannot be imported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

LAYERS, HEADS, HEAD_DIM = 30, 3, 64  # the default model's KV
MLA_LAYERS, KV_LORA_RANK, ROPE_DIM = 4, 64, 16


#: where `make test` puts torchvision for SGLang alone (Makefile, `.sglang`): outside site-packages,
#: so that vLLM's engines never import it
TORCHVISION_DIR = Path(sys.prefix) / "sglang-torchvision"


def import_torchvision_beside_cpu_torch() -> None:
    """SGLang imports `torchvision.transforms` (for image models' constants) on the way to its cache
    controller. PyPI's torchvision 0.28.0 is CUDA's build: beside torch 2.13.0+cpu its native
    operators (nms, roi_align, ...) do not exist, and its import stops where it registers their
    shape functions. Those registrations are skipped here, for that one import, so that the rest
    of torchvision (nothing of which the KV pools or the controller run) loads."""
    if "torchvision" in sys.modules or not TORCHVISION_DIR.is_dir():
        return
    sys.path.append(str(TORCHVISION_DIR))
    import torch.library

    register_fake = torch.library.register_fake

    def where_the_operator_exists(op, *args, **kwargs):
        try:
            register = register_fake(op, *args, **kwargs)
        except RuntimeError:  # "operator torchvision::nms does not exist"
            return lambda fn: fn

        def apply(fn):
            try:
                return register(fn)
            except RuntimeError:
                return fn
        return apply

    torch.library.register_fake = where_the_operator_exists
    try:
        import torchvision  # noqa: F401
    finally:
        torch.library.register_fake = register_fake


def import_sglang() -> None:
    """Skip the calling module where SGLang (make test installs it) cannot be imported; in CI, fail."""
    try:
        import_torchvision_beside_cpu_torch()
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
        import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
    except Exception as err:  # ImportError, or a dependency that fails to load
        if os.environ.get("CI") == "true":  # CI installs it: a skip there would hide a broken install
            raise RuntimeError(f"CI must run the SGLang tests: SGLang cannot be imported ({err})") from err
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
