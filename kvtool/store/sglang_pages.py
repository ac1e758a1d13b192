"""SGLang's HiCache pages in the store (format-spec/store.md §4.8): each page SGLang backs up is a
key/value tensor object (§4.3) whose key names the model, the page size, the writer's shard
(tensor-parallel rank, or the one MLA writer), the store namespace and SGLang's page key. Both the
SGLang backend (`kvtool.integrations.sglang`) and `kvtool store get --sglang-page-size` name pages
here, and read them through `read_pages`: checked (CRC-32C, key, shape, dtype, every value
finite), a damaged or foreign page a miss. Nothing here imports SGLang.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..dtypes import count_nonfinite, dtype_name
from ..errors import ObjectRefused, UnsupportedDtype, UsageError
from . import objects
from .backend import Backend

#: The first segment of every page key: what kind of object, and the version of this key layout.
KEY_PREFIX = "sglang/1"


def page_hashes(token_ids: Sequence[int], page_size: int, seed: str | None = None) -> list[str]:
    """SGLang's page keys of a token sequence's whole pages (64 hex each): page `i`'s key is
    SHA-256 of the previous page's digest (nothing before page 0, or the request namespace's
    seed) and the page's token ids as u32 little-endian. The same chain as SGLang 0.5.23's
    `get_hash_str` for token ids below 2^32."""
    if page_size <= 0:
        raise UsageError(f"page size must be positive, got {page_size}")
    prior = bytes.fromhex(seed) if seed else b""
    keys = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start:start + page_size]
        if any(t < 0 or t >= 1 << 32 for t in page):
            raise UsageError("a token id does not fit in 32 bits")
        prior = hashlib.sha256(prior + struct.pack(f"<{page_size}I", *page)).digest()
        keys.append(prior.hex())
    return keys


def shard_name(*, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1, mla: bool = False) -> str:
    """Who wrote a page's bytes: MLA's KV is the same on every tensor-parallel rank (one writer,
    every rank reads it: `mla`); MHA's is each rank's heads (`tp<r>of<n>`). Pipeline stages hold
    their own layers (`-pp<r>of<n>` when there are several)."""
    name = "mla" if mla else f"tp{tp_rank}of{tp_size}"
    return name + (f"-pp{pp_rank}of{pp_size}" if pp_size > 1 else "")


@dataclass(frozen=True)
class PageKeys:
    """The store keys of one writer's pages: model key (store.md §3), page size, shard, namespace."""

    model_key: str
    page_size: int
    shard: str
    namespace: str = ""

    def key(self, page_hash: str) -> str:
        # the namespace last: any text, and the key is hashed whole into the object's name
        tail = f"/ns/{self.namespace}" if self.namespace else ""
        return f"{KEY_PREFIX}/{self.model_key}/p{self.page_size}/{self.shard}/{page_hash}{tail}"

    def name(self, page_hash: str) -> str:
        return objects.tensor_name(self.key(page_hash))


def check_page(data, name: str, key: str, shape: Sequence[int], dtype=None) -> "torch.Tensor":
    """A stored page after every check: the tensor object's own (§4.3: header, key, CRC-32C), then
    the shape and dtype the reader's pool has (`dtype` None: any floating dtype), then every value
    finite. ObjectRefused otherwise."""
    import torch

    value = objects.check_tensor(data, name, key)
    if dtype is None and value.is_floating_point():
        dtype = value.dtype
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise ObjectRefused(f"{name}: a page of shape {list(value.shape)} {value.dtype}, not {list(shape)} {dtype}")
    if not all_finite(value):
        raise ObjectRefused(f"{name}: the page holds values that are not finite")
    return value


def all_finite(value: "torch.Tensor") -> bool:
    """No NaN or infinity in a contiguous tensor: its exponent bits, counted in numpy (kvtool's
    `count_nonfinite`; torch's isfinite on bfloat16 runs at a few tens of MB/s on a CPU)."""
    import torch

    if not value.is_floating_point():
        return True
    try:
        name = dtype_name(value.dtype)
    except UnsupportedDtype:  # a float type kvtool's files do not hold (fp8 pages): torch's own check
        return bool(torch.isfinite(value.float()).all())
    return count_nonfinite(value.reshape(-1).view(torch.uint8).numpy(), name) == 0


@dataclass
class PageRead:
    pages: list  # per key: the checked tensor, or None (missing, refused)
    refused: list[str]  # why, one line each


def read_pages(backend: Backend, keys: PageKeys, page_hashes_: Sequence[str], shape: Sequence[int], dtype,
               *, heal: bool = True) -> PageRead:
    """The pages of `page_hashes_` (one batch: one round trip on Redis), each checked; a refused
    object is removed (`heal`), so the next backup of its page writes it again."""
    names = [keys.name(h) for h in page_hashes_]
    found = backend.get_many(names)
    pages, refused = [], []
    for h, name, data in zip(page_hashes_, names, found):
        if data is None:
            pages.append(None)
            continue
        try:
            pages.append(check_page(data, name, keys.key(h), shape, dtype))
        except ObjectRefused as err:
            pages.append(None)
            refused.append(str(err))
            if heal:
                backend.delete(name)
    return PageRead(pages, refused)


def put_pages(backend: Backend, keys: PageKeys, items: Sequence[tuple[str, "torch.Tensor"]]) -> list[bool]:
    """Store pages (put-once: a page already stored is kept); per page, whether it is stored now.
    A page with a value that is not finite is never stored."""
    items = [(h, t.contiguous()) for h, t in items]  # (encoding copies a view once, here)
    ok = [all_finite(t) for _, t in items]
    batch = [(keys.name(h), objects.encode_tensor(keys.key(h), t)) for (h, t), good in zip(items, ok) if good]
    if batch:
        backend.put_many(batch)  # "not created": the same page is stored already (content addressed)
    return ok


def pages_container(backend: Backend, identity, token_ids: Sequence[int], page_size: int, output,
                    *, namespace: str = "", tp_size: int = 1) -> tuple[int, list[str]]:
    """`kvtool store get --sglang-page-size`: the longest run of a prompt's whole pages that SGLang
    backed up for `identity` (an MHA model, written by `tp_size` ranks: their heads side by side),
    written as a container of those tokens at `output`: (cached tokens, refusals). Pages are read
    and checked as the backend reads them; the run stops at the first page missing or refused, or
    whose dtype differs from the first's. Nothing is written when no page is stored."""
    import torch

    from ..format import ContainerWriter
    from .names import model_key

    heads = identity.num_kv_heads
    if tp_size <= 0 or heads % tp_size:
        raise UsageError(f"--sglang-tp {tp_size} does not divide {identity.name}'s {heads} KV heads")
    shape = (2, identity.num_layers, page_size, heads // tp_size, identity.head_dim)
    shards = [PageKeys(model_key(identity), page_size, shard_name(tp_rank=r, tp_size=tp_size), namespace)
              for r in range(tp_size)]
    hashes = page_hashes(token_ids, page_size)
    run, refused, dtype = [], [], None
    for at in range(0, len(hashes), 64):
        batch = hashes[at:at + 64]
        reads = [read_pages(backend, keys, batch, shape, dtype, heal=False) for keys in shards]
        refused += [why for r in reads for why in r.refused]
        for per_rank in zip(*(r.pages for r in reads)):
            if any(p is None for p in per_rank) or len({p.dtype for p in per_rank} | ({dtype} - {None})) != 1:
                break
            dtype = per_rank[0].dtype
            run.append(torch.cat(per_rank, dim=3))  # the ranks' heads side by side
        else:
            continue
        break
    if not run:
        return 0, refused
    kv = torch.cat(run, dim=2)  # [2, L, T, H, D]
    n = kv.shape[2]
    kv = kv.reshape(2, identity.num_layers, n, heads * identity.head_dim)
    chunk = page_size * max(1, 256 // page_size)
    with ContainerWriter(output, identity, list(token_ids)[:n], kv_dtype=dtype, chunk_size=chunk) as writer:
        for start in range(0, n, chunk):
            writer.write_chunk(kv[:, :, start:start + chunk].contiguous(), codec="raw")
    return n, refused
