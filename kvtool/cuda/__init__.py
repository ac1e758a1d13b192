"""kvtool's CUDA backend: the fused paged gather/scatter kernel and the CacheGen GPU coder.

Built on first use with nvcc (see `_build`), only where torch sees a CUDA
device; everywhere else kvtool runs its CPU paths and this package never
looks for a compiler.

* Importing this package on a CUDA machine registers the paged kernel with
  ``kvtool.connectors.register_device_impl("cuda", ...)``. The registration is
  lazy: the kernel is built/loaded at the first CUDA gather/scatter; if that
  fails, kvtool prints a one-line notice and keeps using the torch path.
* `backend_status()` is the line `kvtool info` shows.
* `gather_paged` / `scatter_paged`: direct calls (also accept a pinned host blob).
* `cachegen_encode` / `cachegen_decode` (and the batched `_chunks` forms):
  the CacheGen coder on the GPU, byte-identical to the CPU coder.

Environment: ``KVTOOL_CUDA=0`` (off), ``KVTOOL_CUDA_CACHE`` (build cache),
``KVTOOL_NVCC`` / ``CUDA_HOME`` (compiler), ``KVTOOL_CUDA_ARCH`` (e.g. 90),
``KVTOOL_KERNELS_DIR`` (sources).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch

from . import _build
from ._build import CudaUnavailable

_notified: set[str] = set()


def notice(what: str, reason: str) -> None:
    """One line on stderr, once per `what`: the CUDA path fell back to the CPU path."""
    if what in _notified:
        return
    _notified.add(what)
    print(f"kvtool: CUDA {what} unavailable ({reason}); using the CPU/torch path", file=sys.stderr)


def available() -> bool:
    """True when the CUDA kernels may be used here (torch sees a GPU, not disabled)."""
    return not _build.disabled() and torch.cuda.is_available()


def backend_status(build: bool = False) -> str:
    """One line for `kvtool info`: which CUDA backend kvtool uses. With
    build=False this never compiles (it reports a cached build, or that the
    kernels will be built on first use)."""
    if _build.disabled():
        return "CUDA kernels disabled (KVTOOL_CUDA=0): CPU/torch paths"
    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if not torch.version.cuda else "no CUDA device visible"
        return f"no CUDA ({why}): CPU paths only"
    dev = torch.cuda.get_device_name(0)
    arch = _build.gpu_arch()
    names = ("paged_copy", "cachegen_cuda")
    if build:
        for n in names:
            try:
                _build.load(n)
            except CudaUnavailable:
                pass
    parts = []
    for n in names:
        if n in _build._built:
            parts.append(f"{n} loaded")
        elif _build.load_error(n):
            parts.append(f"{n} FAILED ({_build.load_error(n)}; CPU fallback)")
        elif _build.cached_path(n) is not None:
            parts.append(f"{n} built")
        elif _build.find_nvcc() is None:
            parts.append(f"{n} unavailable (no nvcc; CPU fallback)")
        else:
            parts.append(f"{n} not built yet (nvcc builds it on first use)")
    return f"{dev} (sm_{arch}): " + ", ".join(parts)


# ---- paged gather/scatter ---------------------------------------------------

def gather_paged(kv_caches: Sequence[Any], layout: Any, slots: torch.Tensor, out_blob: torch.Tensor) -> None:
    """The fused kernel (raises CudaUnavailable if it cannot be loaded). out_blob:
    a CUDA tensor on the buffers' device, or a pinned host tensor."""
    from . import paged

    paged.gather(kv_caches, layout, slots, out_blob)


def scatter_paged(blob: torch.Tensor, kv_caches: Sequence[Any], layout: Any, slots: torch.Tensor) -> None:
    """The fused kernel, blob -> paged buffers (blob on the device or pinned host)."""
    from . import paged

    paged.scatter(blob, kv_caches, layout, slots)


def _lazy_gather(kv_caches, layout, slots, out_blob) -> None:
    from ..connectors import paged_copy

    if _ensure_paged():
        gather_paged(kv_caches, layout, slots, out_blob)
    else:
        paged_copy._torch_gather(kv_caches, paged_copy.PagedLayout.parse(layout), slots, out_blob)


def _lazy_scatter(blob, kv_caches, layout, slots) -> None:
    from ..connectors import paged_copy

    if _ensure_paged():
        scatter_paged(blob, kv_caches, layout, slots)
    else:
        paged_copy._torch_scatter(blob, kv_caches, paged_copy.PagedLayout.parse(layout), slots)


def _ensure_paged() -> bool:
    try:
        from . import paged

        paged.library()
        return True
    except CudaUnavailable as exc:
        notice("paged copy kernel", str(exc))
        return False


def register(lazy: bool = True) -> bool:
    """Route CUDA `gather_paged`/`scatter_paged` to the fused kernel. lazy=False
    loads (builds) it now and returns whether that worked; registration is
    skipped (False) where CUDA is unavailable."""
    from ..connectors import register_device_impl

    if not available():
        return False
    if not lazy and not _ensure_paged():
        return False
    register_device_impl("cuda", _lazy_gather, _lazy_scatter)
    return True


def unregister() -> None:
    from ..connectors import unregister_device_impl

    unregister_device_impl("cuda")


# ---- CacheGen ------------------------------------------------------------------

def cachegen_encode(kv: torch.Tensor, params: dict | None = None) -> tuple[bytes, dict]:
    """Encode one [2, L, T, C] CUDA chunk on the GPU; same bytes as the CPU coder."""
    from . import cachegen

    return cachegen.encode(kv, params)


def cachegen_decode(payload: Any, shape: Any, dtype: torch.dtype, params: dict, device: Any = "cuda") -> torch.Tensor:
    """Decode one payload on the GPU into a new CUDA tensor of `shape`."""
    from . import cachegen

    return cachegen.decode(payload, shape, dtype, params, device=device)


register()

__all__ = [
    "CudaUnavailable", "available", "backend_status", "register", "unregister", "gather_paged", "scatter_paged",
    "cachegen_encode", "cachegen_decode", "notice",
]
