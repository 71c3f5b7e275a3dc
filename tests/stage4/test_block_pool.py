"""The block pool's own rules and the request hash chain, each without the KV cache manager.

These pin one piece at a time (so the stage 4 exercises can be solved in order): the hash
chain of a request, then freeing, then touching. Block size 4; token ids stand for letters.
"""

from __future__ import annotations

from stage4_prefix_cache.block_pool import BlockPool
from stage4_prefix_cache.kv_cache_utils import get_hash_fn, hash_block_tokens, hash_request_tokens

A_TO_I = list(range(9))  # A B C D | E F G H | I


def queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue]


def cached_table(pool: BlockPool, num_blocks: int, num_full: int):
    """A request's table of ``num_blocks`` fresh blocks whose first ``num_full`` are full and cached."""
    table = pool.get_new_blocks(num_blocks)
    hashes = hash_request_tokens(4, list(range(4 * num_full)))
    pool.cache_full_blocks(table, hashes, 0, num_full)
    return table, hashes


# -- the request's hash chain -------------------------------------------------------------


def test_request_hashes_chain_full_blocks_and_skip_the_partial_one():
    h = hash_request_tokens(4, A_TO_I)
    first = hash_block_tokens(None, A_TO_I[:4])
    assert h == [first, hash_block_tokens(first, A_TO_I[4:8])]  # I is a partial block: no hash
    assert hash_request_tokens(4, A_TO_I[:3]) == []
    assert hash_request_tokens(4, []) == []
    assert hash_request_tokens(2, A_TO_I[:4]) == [hash_block_tokens(None, [0, 1]),
                                                  hash_block_tokens(hash_block_tokens(None, [0, 1]), [2, 3])]
    fast = get_hash_fn("fast")
    assert hash_request_tokens(4, A_TO_I, None, fast)[0] == hash_block_tokens(None, A_TO_I[:4], None, fast)


def test_extra_keys_change_every_block_hash_of_a_request():
    plain = hash_request_tokens(4, A_TO_I)
    salted = hash_request_tokens(4, A_TO_I, (("salt", "tenant-A"),))
    other = hash_request_tokens(4, A_TO_I, (("salt", "tenant-B"),))
    assert len(salted) == 2 and all(len(set(hs)) == 3 for hs in zip(plain, salted, other))
    assert salted[1] == hash_block_tokens(salted[0], A_TO_I[4:8], (("salt", "tenant-A"),))


# -- freeing ------------------------------------------------------------------------------


def test_freed_blocks_queue_one_by_one_cached_to_the_tail_uncached_to_the_head():
    pool = BlockPool(6)
    table, _ = cached_table(pool, 3, 2)  # blocks 0, 1 full and cached; 2 partial
    assert queue_ids(pool) == [3, 4, 5]
    pool.free_blocks(reversed(table))  # as KVCacheManager.free does: the table's tail first
    assert queue_ids(pool) == [2, 3, 4, 5, 1, 0]
    assert [b.ref_cnt for b in table] == [0, 0, 0]
    assert pool.get_num_free_blocks() == 6


def test_a_freed_cached_block_keeps_its_hash_until_it_is_reused():
    pool = BlockPool(2)
    table, hashes = cached_table(pool, 2, 2)
    pool.free_blocks(table)  # forward order this time: block 0 reaches the tail first
    assert queue_ids(pool) == [0, 1]
    assert pool.get_cached_block(hashes[0]) is table[0] and table[0].block_hash == hashes[0]
    (reused,) = pool.get_new_blocks(1)  # the head: block 0, whose hash is evicted first
    assert reused is table[0] and reused.block_hash is None and pool.get_cached_block(hashes[0]) is None
    assert pool.get_cached_block(hashes[1]) is table[1]


# -- touching -----------------------------------------------------------------------------


def test_touch_adds_a_user_to_a_block_in_use():
    pool = BlockPool(4)
    table, _ = cached_table(pool, 2, 2)
    pool.touch(table[:1])
    assert [b.ref_cnt for b in table] == [2, 1]
    assert pool.get_num_free_blocks() == 2 and queue_ids(pool) == [2, 3]


def test_touch_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(4)
    table, hashes = cached_table(pool, 2, 2)
    pool.free_blocks(reversed(table))
    assert queue_ids(pool) == [2, 3, 1, 0]
    pool.touch([table[1]])  # a hit on a block in the middle of the queue
    assert table[1].ref_cnt == 1 and queue_ids(pool) == [2, 3, 0]
    assert pool.get_cached_block(hashes[1]) is table[1]  # a hit keeps the block's identity
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 0]  # never the touched block


def test_a_touched_block_returns_to_the_queue_only_when_its_last_user_frees_it():
    pool = BlockPool(3)
    table, _ = cached_table(pool, 1, 1)
    pool.touch(table)  # a second request shares the block
    pool.free_blocks(table)
    assert table[0].ref_cnt == 1 and 0 not in queue_ids(pool)
    pool.free_blocks(table)
    assert table[0].ref_cnt == 0 and queue_ids(pool) == [1, 2, 0]
