"""Paged KV cache: block allocator, per-sequence block tables, slot mappings.

Layout (per layer, one tensor, flash-attention / vLLM <= 0.22 style):

    kv_caches[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]
                       K at index 0, V at index 1

A token at position `pos` of a sequence lives in block `block_table[pos // block_size]`
at offset `pos % block_size`; its *slot* is `block * block_size + offset`, an index into
the flattened `[2, num_blocks * block_size, num_kv_heads, head_dim]` view.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

import torch

from ..devices import host_memory_bytes
from ..errors import OutOfMemory, UsageError

if TYPE_CHECKING:  # pragma: no cover
    from .model import ModelConfig


class BlockAllocator:
    """Hands out block ids from a free list.

    With `shuffle_seed` the free list is shuffled once (seeded), so sequences get
    non-contiguous, out-of-order blocks, as in a long-running engine. Tests use it
    to make sure nothing silently assumes contiguous blocks.
    """

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None):
        if num_blocks <= 0:
            raise UsageError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(free)
        free.reverse()  # pop() from the end hands out free[0] first
        self._free = free

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise UsageError(f"KV cache out of blocks: need {n}, {len(self._free)} free "
                             f"of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class Sequence:
    """One sequence's block table and length in a paged cache."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self.block_table: list[int] = []
        # Tokens whose K/V are in the cache (positions 0..num_tokens-1).
        self.num_tokens = 0

    @property
    def capacity(self) -> int:
        return len(self.block_table) * self.block_size

    def reserve(self, num_tokens: int) -> None:
        """Make sure blocks for positions 0..num_tokens-1 are allocated."""
        need = -(-num_tokens // self.block_size) - len(self.block_table)
        if need > 0:
            self.block_table.extend(self.allocator.allocate(need))

    def block_table_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.block_table, dtype=torch.long, device=device)

    def slot_mapping(self, num_tokens: int, start: int = 0,
                     device: torch.device | str = "cpu") -> torch.Tensor:
        """Slots (LongTensor [num_tokens - start]) of positions start..num_tokens-1.

        `slot = block_table[pos // block_size] * block_size + pos % block_size`.
        """
        if not 0 <= start <= num_tokens <= self.capacity:
            raise UsageError(f"slot_mapping({num_tokens}, start={start}) outside the "
                             f"{self.capacity} reserved slots")
        pos = torch.arange(start, num_tokens, dtype=torch.long, device=device)  # [n]
        blocks = self.block_table_tensor(device)[pos // self.block_size]  # [n]
        return blocks * self.block_size + pos % self.block_size  # [n]

    def free(self) -> None:
        self.allocator.free(self.block_table)
        self.block_table = []
        self.num_tokens = 0


def _check_host_memory(nbytes: int, device: torch.device) -> None:
    """Refuse, in one line, a CPU cache larger than the machine's memory: torch reports a failed
    host allocation only as a RuntimeError with a message, which kvtool never parses."""
    if device.type != "cpu":
        return  # a device allocation fails as torch.OutOfMemoryError, a type the CLI knows
    total = host_memory_bytes()
    if total is not None and nbytes > total:
        raise OutOfMemory(f"a paged KV cache of {nbytes / 2**30:.1f} GiB does not fit in this machine's "
                          f"{total / 2**30:.1f} GiB")


class PagedKVCache:
    """Per-layer paged K/V buffers plus the allocator that owns their blocks."""

    def __init__(self, config: "ModelConfig", num_blocks: int, block_size: int = 16,
                 kv_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 shuffle_seed: int | None = None):
        if kv_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise UsageError(f"kv_dtype must be float32, float16 or bfloat16, got {kv_dtype}")
        if block_size <= 0:
            raise UsageError(f"block_size must be positive, got {block_size}")
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.device = torch.device(device)
        shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        _check_host_memory(config.num_layers * math.prod(shape) * torch.empty((), dtype=kv_dtype).element_size(),
                           self.device)
        self.kv_caches: list[torch.Tensor] = [
            torch.zeros(shape, dtype=kv_dtype, device=self.device)
            for _ in range(config.num_layers)
        ]
        self.allocator = BlockAllocator(num_blocks, shuffle_seed)

    @classmethod
    def for_tokens(cls, config: "ModelConfig", num_tokens: int, block_size: int = 16,
                   kv_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   shuffle_seed: int | None = None, spare_blocks: int = 0) -> "PagedKVCache":
        """A cache just big enough for one sequence of `num_tokens` (plus spare blocks)."""
        num_blocks = max(1, -(-num_tokens // block_size)) + spare_blocks
        return cls(config, num_blocks, block_size, kv_dtype, device, shuffle_seed)

    def new_sequence(self, num_tokens: int = 0) -> Sequence:
        """A new sequence with blocks reserved for `num_tokens` positions."""
        seq = Sequence(self.allocator, self.block_size)
        seq.reserve(num_tokens)
        return seq

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)
