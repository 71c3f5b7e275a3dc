"""Physical KV blocks and the per-request tables that map logical blocks onto them.

A sequence's token at position ``p`` lives in logical block ``p // block_size``; the
table says which physical block that is. Blocks are taken from the allocator only when
the sequence grows into them, and any free block will do: they need not be adjacent.

vLLM: ``vllm/v1/core/block_pool.py`` (the free list; stage4 adds caching to it) and
``vllm/v1/worker/block_table.py`` (block tables and slot mapping).
"""

from __future__ import annotations

import random
from collections import deque


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than were asked for; nothing was allocated."""


class BlockAllocator:
    def __init__(self, num_blocks: int, shuffle_seed: int | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        ids = list(range(num_blocks))
        if shuffle_seed is not None:  # physical order must never matter; tests shuffle it
            random.Random(shuffle_seed).shuffle(ids)
        self._free: deque[int] = deque(ids)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int = 1) -> list[int]:
        """Take ``num_blocks`` free blocks, all or none."""
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
        assert len(self._free) <= self.num_blocks, "a block was freed twice"


class BlockTable:
    """One request's logical -> physical block map."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.block_ids: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.block_ids) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Extra blocks required so that ``num_tokens`` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(self.block_ids))

    def grow(self, num_tokens: int, allocator: BlockAllocator) -> list[int]:
        """Allocate blocks until ``num_tokens`` tokens fit; return the new block ids."""
        new = allocator.allocate(self.blocks_needed(num_tokens))
        self.block_ids.extend(new)
        return new

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Cache slots for positions ``start .. end - 1``."""
        return slot_mapping(self.block_ids, self.block_size, start, end)


def slot_mapping(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slots of positions ``start .. end - 1`` of a sequence whose blocks are ``block_ids``:
    position ``p`` is slot ``block_ids[p // block_size] * block_size + p % block_size``. Every later
    stage addresses K/V through this one function."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
