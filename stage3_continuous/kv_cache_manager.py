"""Blocks on demand for exactly the tokens a step schedules.

The scheduler asks, per request and per step, for slots for ``num_new_tokens`` more
tokens; the manager grows the request's block table from stage2's allocator, or says
no (``None``) and changes nothing, which is the scheduler's cue to preempt.
Its interface is the one stage4's prefix-caching manager keeps, so the scheduler does
not change when caching arrives. A block here is what stage2's allocator hands out, a bare
block id; stage4's blocks become ``KVCacheBlock`` objects (with a reference count and a
hash), and the scheduler never looks inside either: it only asks whether the answer is
``None``. vLLM: ``vllm/v1/core/kv_cache_manager.py``.
"""

from __future__ import annotations

from shared.request import Request
from stage2_paged.block_table import BlockAllocator, BlockTable


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, shuffle_seed: int | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks, shuffle_seed)
        self.tables: dict[str, BlockTable] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """Without a prefix cache, nothing is ever computed before the request runs."""
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list | None = None) -> list[int] | None:
        """The new blocks (ids) backing ``num_new_tokens`` more tokens, or None (nothing changed)."""
        table = self.tables.setdefault(request.request_id, BlockTable(self.block_size))
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if table.blocks_needed(total) > self.allocator.num_free:
            if not table.block_ids:
                del self.tables[request.request_id]
            return None
        return table.grow(total, self.allocator)

    def free(self, request: Request) -> None:
        table = self.tables.pop(request.request_id, None)
        if table is not None:
            self.allocator.free(list(reversed(table.block_ids)))

    def get_block_ids(self, request_id: str) -> list[int]:
        table = self.tables.get(request_id)
        return list(table.block_ids) if table else []

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def usage(self) -> float:
        return 1 - self.allocator.num_free / self.num_blocks
