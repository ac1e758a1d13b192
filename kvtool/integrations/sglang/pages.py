"""SGLang's host pages as kvtool sees them: every host layout read and written through one
canonical view of a page, so that a page backed up from one layout is prefetched into any other,
and `kvtool store get` reads it without knowing the writer's layout.

    MHA  [2, layers, page_size, heads, head_dim]   (K and V: kvtool's KV_BLOB with the heads apart)
    MLA  [layers, page_size, 1, kv_cache_dim]       (the compressed latent and the rope part)

A page's view is a view into the pool's own buffer (no copy): a read copies into it, a write
reads from it.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

#: SGLang's host layouts this backend reads and writes.
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def is_mla(pool) -> bool:
    return isinstance(pool, MLATokenToKVPoolHost)


def check_pool(pool) -> None:
    """A ValueError of one line for a pool this backend does not know (SGLang refuses to start)."""
    if pool.layout not in LAYOUTS:
        raise ValueError(f"kvtool HiCache backend: host layout {pool.layout!r} is not one of {', '.join(LAYOUTS)}")


def page_shape(pool) -> tuple[int, ...]:
    if is_mla(pool):
        return (pool.layer_num, pool.page_size, 1, pool.kv_cache_dim)
    return (2, pool.layer_num, pool.page_size, pool.head_num, pool.head_dim)


def _canonical(pool, page: torch.Tensor) -> torch.Tensor:
    """A page in its host layout's shape (SGLang's `get_data_page(..., flat=False)`) as the
    canonical view."""
    mla = is_mla(pool)
    if pool.layout == "page_first":  # tokens before layers
        return page.transpose(0, 1) if mla else page.transpose(1, 2)
    if pool.layout == "page_first_direct":  # one page of the page axis
        return page[0] if mla else page[:, 0]
    return page


def page_view(pool, index: int) -> torch.Tensor:
    """The canonical view of the page at host index `index` (its first token's slot)."""
    return _canonical(pool, pool.get_data_page(index, flat=False))


def flat_view(pool, flat: torch.Tensor) -> torch.Tensor:
    """The canonical view of a flat page as SGLang's generic interface hands it over (the host
    layout's order: `get_data_page(index)`, `get_dummy_flat_data_page()`)."""
    shape = pool.get_data_page(0, flat=False).shape
    return _canonical(pool, flat.view(shape))


# Copies go through numpy views of the bits: torch's CPU copy of a transposed bfloat16 page (a
# page_first page to the canonical view) runs at ~75 MB/s here, numpy's at ~15 GB/s.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(_BITS[t.element_size()]).numpy()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, bit for bit (a page into its view in the host pool)."""
    _bits(dst)[...] = _bits(src)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a page's view (what is stored)."""
    return torch.from_numpy(np.ascontiguousarray(_bits(t))).view(t.dtype)
