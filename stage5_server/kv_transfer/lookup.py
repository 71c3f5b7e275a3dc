"""Where a connector's blocks enter the pool: during a waiting request's prefix lookup.

Stage 3 admits a waiting request with ``get_computed_blocks`` (the cached run from its start) followed by
``allocate_slots``. A connector's blocks join that run without changing either: past the local hit, the
blocks the connector can supply are taken from the free queue, given their hashes and handed straight back
as free cached blocks, the connector noting which block each goes to (``update_state_after_alloc``). The
lookup then finds them as ordinary hits, and the worker fills them at the start of the next step, before any
forward reads them. ``filled_blocks`` names, once a step is scheduled, the blocks it completes: what a
connector copies or sends after the forward.

vLLM: the connector's calls in ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``:
``get_num_new_matched_tokens``, then ``allocate_slots`` with the external tokens, then
``update_state_after_alloc``).
"""

from __future__ import annotations

from typing import Any

from stage4_prefix_cache.block_pool import BlockPool
from stage4_prefix_cache.kv_cache_utils import BlockHash, KVCacheBlock
from stage5_server.kv_transfer.base import FilledBlock, KVConnectorBase


def take_connector_blocks(pool: BlockPool, connector: KVConnectorBase, request: Any, block_hashes: list[BlockHash],
                          block_size: int) -> None:
    """The blocks ``connector`` supplies past the local hit of ``block_hashes`` (the request's full blocks a hit
    may cover) become cached blocks of ``pool``."""
    local = []
    for block_hash in block_hashes:
        block = pool.get_cached_block(block_hash)
        if block is None:
            break
        local.append(block)
    num_blocks = connector.get_num_new_matched_tokens(request, len(local) * block_size, block_hashes) // block_size
    if num_blocks == 0:
        return
    pool.touch(local)  # the allocation below must not evict the local hit
    num_blocks = min(num_blocks, pool.get_num_free_blocks())
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(blocks, block_hashes[len(local):len(local) + num_blocks], 0, num_blocks)
    connector.update_state_after_alloc(request, blocks, num_blocks * block_size)
    pool.free_blocks(reversed(local + blocks))  # cached and free: the lookup that follows hits them


def filled_blocks(block_hashes: list[BlockHash], table: list[KVCacheBlock], num_computed_tokens: int,
                  num_new_tokens: int, num_known_tokens: int, block_size: int,
                  transfer_id: str | None = None) -> list[FilledBlock]:
    """The blocks of known tokens whose K/V the next ``num_new_tokens`` positions complete (``transfer_id``: the
    request's, ``base.transfer_id_of``)."""
    start = num_computed_tokens // block_size
    end = min(num_computed_tokens + num_new_tokens, num_known_tokens) // block_size
    return [FilledBlock(block_hashes[i], table[i].block_id, transfer_id) for i in range(start, end)]
