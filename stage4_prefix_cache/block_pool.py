"""The block pool: allocation, reference counts, the prefix cache, eviction.

Stage 2's allocator had two states per block, used or free. With prefix
caching a block has a third: free *but still holding useful KV*. Such a block
sits in the free queue (anyone may take it) and in the hash map (anyone whose
prefix matches may reuse it). Whichever happens first wins: a hit pulls it
back into use; an allocation that reaches it first evicts its hash and
overwrites it.

Invariants this module keeps (checked by tests/stage4):

- ``ref_cnt`` of a block == number of request block tables holding it.
- A block is in ``free_block_queue`` exactly when its ``ref_cnt`` is 0; the
  free queue and the blocks in use partition the pool.
- ``block.block_hash is not None`` exactly when
  ``cached_block_hash_to_block[block.block_hash] is block``: every hash in the
  map names a block that says it holds that content, and vice versa.
- Only full blocks are ever hashed.

vLLM counterpart: ``vllm/v1/core/block_pool.py``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from stage4_prefix_cache.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """All KV blocks, the free queue, and the hash -> block prefix cache.

    Freeing policy (the eviction order):
    - The caller passes blocks in the order they should enter the queue. The
      KV cache manager passes a request's table in REVERSE, so a sequence's
      tail blocks are considered before its prefix blocks: a long suffix is
      less likely to be shared than the prefix it hangs off.
    - A freed block that is cached (has a hash) goes to the TAIL: it is kept
      as long as possible in case another request shares it.
    - A freed block that is not cached (a partial block, or caching off) goes
      to the HEAD: its contents are useless to anyone, reuse it first.
    - Allocation pops from the head.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, shuffle_seed: int | None = None) -> None:
        if type(num_blocks) is not int or num_blocks <= 0:
            raise ValueError(f"num_blocks: must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        # Initially every block is free, in id order (or shuffled: physical order must never matter).
        order = list(self.blocks)
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        self.free_block_queue = FreeKVCacheBlockQueue(order)
        # The prefix cache: content hash -> the block holding that content.
        # A cached block may be in use (ref_cnt > 0) or free (ref_cnt == 0,
        # an eviction candidate still in the free queue).
        #
        # One block per hash. If a request fills a block whose hash is already
        # cached in ANOTHER block (two requests computed the same prefix at the
        # same time, or generated the same tokens), the first block stays the
        # cached one and the newcomer is left unhashed: it still serves its
        # own request, and is reused first once freed. vLLM instead keeps all
        # duplicates (hash -> {block_id: block}) and returns the first; both
        # keep block tables append-only, which is what matters.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    # -- queries -----------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding ``block_hash``'s content, or None on a miss."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_num_free_blocks(self) -> int:
        """Blocks with no user (including free-but-cached ones)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the pool held by requests (cached-but-free counts as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    # -- allocation and release --------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue.

        A popped block that was cached loses its hash (and its map entry)
        before it is handed out: its storage is about to be overwritten, so
        it must stop answering cache lookups first. If fewer than
        ``num_blocks`` are free, raise ValueError and change nothing.
        """
        if type(num_blocks) is not int or num_blocks < 0:
            raise ValueError(f"num_blocks: must be a non-negative integer, got {num_blocks!r}")
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"num_blocks: cannot allocate {num_blocks}, only {self.get_num_free_blocks()} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, f"free block {block.block_id} has users"
            self._evict_cached_hash(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict_cached_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        cached = self.cached_block_hash_to_block.pop(block.block_hash)
        assert cached is block, "hash map and block disagree"
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Record a prefix-cache hit on ``blocks``: one more user each.

        A hit block with no users is sitting in the free queue as an eviction
        candidate; taking it out makes it impossible to evict while in use.
        """
        for block in blocks:
            assert block.block_hash is not None, "only cached blocks can be hit"
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one user from each block, in the given order.

        Blocks that reach zero users enter the free queue one at a time:
        cached ones at the tail, uncached ones at the head (see class doc).
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than used"
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is not None:
                self.free_block_queue.append(block)
            else:
                self.free_block_queue.appendleft(block)

    # -- the prefix cache --------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` in the cache.

        ``blocks`` is one request's block table and ``block_hashes`` its
        chained hashes (at least ``num_full_blocks`` of them). The caller
        guarantees the blocks in that range are full, i.e. every token slot
        in them is being written with the token the hash was computed from.

        A block that already has a hash (it came from a cache hit) keeps it.
        A block whose hash is already cached in another block stays unhashed:
        one block per hash (see ``__init__``).
        """
        if not self.enable_caching:
            return
        if not 0 <= num_cached_blocks <= num_full_blocks <= len(blocks):
            raise ValueError(
                f"num_cached_blocks: need 0 <= num_cached_blocks ({num_cached_blocks}) <= "
                f"num_full_blocks ({num_full_blocks}) <= len(blocks) ({len(blocks)})"
            )
        if len(block_hashes) < num_full_blocks:
            raise ValueError(f"block_hashes: {len(block_hashes)} hashes, need num_full_blocks={num_full_blocks}")
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None:
                assert block.block_hash == block_hash, "a block's content changed"
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue  # a duplicate: the first copy stays the cached one
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def evict_free_cached_blocks(self) -> int:
        """Drop the hash of every free block (after a failed step their KV may never
        have been written); blocks in use keep theirs. Returns how many were dropped."""
        dropped = [b for b in self.free_block_queue if b.block_hash is not None]
        for block in dropped:
            self._evict_cached_hash(block)
        return len(dropped)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update).

        Refuses, returning False and changing nothing, while any block is in
        use: a running request's blocks would otherwise lose their identity
        mid-flight. Returns True once every hash is cleared.
        """
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
