"""Stage 4 prefix-cache core: hashing, the block pool, and the KV cache manager.

Each test pins one rule. Token ids stand for letters: "ABCD" is [0, 1, 2, 3].
Block size is 4 throughout, as in the course text's R0/R1 example.
"""

from __future__ import annotations

import os
import string

import pytest

from stage4_prefix_cache.block_pool import BlockPool
from stage4_prefix_cache.kv_cache_manager import KVCacheManager
from stage4_prefix_cache.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    encode_block,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
)
from tests.stage4.fake_request import FakeRequest

BLOCK_SIZE = 4


def ids(letters: str) -> list[int]:
    return [string.ascii_uppercase.index(c) for c in letters]


def req(request_id: str, letters: str, **kwargs) -> FakeRequest:
    return FakeRequest(request_id, ids(letters), **kwargs)


def admit(kv: KVCacheManager, request: FakeRequest) -> int:
    """Schedule the request's whole prompt in one step, as a scheduler would."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    new_blocks = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    assert new_blocks is not None, "test setup: pool too small"
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def free_queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue]


def snapshot(kv: KVCacheManager) -> tuple:
    """Everything allocation may change."""
    pool = kv.block_pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        free_queue_ids(pool),
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        {rid: kv.get_block_ids(rid) for rid in kv.req_to_blocks},
        dict(kv.num_cached_block),
    )


# -- hashing ----------------------------------------------------------------


def test_only_full_blocks_are_hashed():
    assert len(hash_request_tokens(BLOCK_SIZE, ids("ABCDEFGHI"))) == 2
    assert hash_request_tokens(BLOCK_SIZE, ids("ABC")) == []

    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r = req("r", "ABCDEFGHI")
    admit(kv, r)
    blocks = kv.get_blocks("r")
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert len(kv.block_pool.cached_block_hash_to_block) == 2


def test_only_full_blocks_are_reused():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    admit(kv, req("r0", "ABCDEF"))  # ABCD full, EF partial
    _, hit = kv.get_computed_blocks(req("r1", "ABCDEFGHIJ"))
    assert hit == 4  # the partial EF block is not shared, even though EF matches


def test_chained_hash_distinguishes_identical_block_tokens_after_different_prefixes():
    a = hash_request_tokens(BLOCK_SIZE, ids("ABCDEFGH"))
    b = hash_request_tokens(BLOCK_SIZE, ids("WXYZEFGH"))
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens EFGH, different prefix
    assert hash_request_tokens(BLOCK_SIZE, ids("ABCDWXYZ"))[0] == a[0]

    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    admit(kv, req("r0", "WXYZEFGHI"))
    assert kv.get_computed_blocks(req("r1", "ABCDEFGHI")) == ([], 0)


def test_hash_is_the_parent_then_tokens_then_extra_keys():
    parent = hash_block_tokens(None, ids("ABCD"))
    assert hash_block_tokens(parent, ids("EFGH")) == hash_request_tokens(BLOCK_SIZE, ids("ABCDEFGH"))[1]
    assert hash_block_tokens(None, ids("ABCD")) != hash_block_tokens(None, ids("ABCD"), (("salt", "s"),))


def test_two_sources_with_the_same_value_hash_differently():
    as_salt = (("salt", "tenant-A"),)
    as_lora = (("lora", "tenant-A"),)  # how stage 5 keys an adapter of that name
    # The hash INPUTS differ, not merely the digests: untagged extra keys
    # would make both ("tenant-A",), and no hash function could separate them.
    assert encode_block(None, ids("ABCD"), as_salt) != encode_block(None, ids("ABCD"), as_lora)
    for name in ("sha256", "fast"):
        hash_fn = get_hash_fn(name)
        assert hash_block_tokens(None, ids("ABCD"), as_salt, hash_fn) != hash_block_tokens(
            None, ids("ABCD"), as_lora, hash_fn
        )



def test_encoding_separates_value_types_and_token_boundaries():
    assert encode_block(None, [1], (("salt", "1"),)) != encode_block(None, [1], (("salt", 1),))
    assert encode_block(None, [1, 2], ()) != encode_block(None, [1], ())
    assert encode_block(None, [], (("salt", "ab"),)) != encode_block(None, [], (("salt", "a"), ("salt", "b")))


def test_cache_salt_changes_reuse_identity():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=16)
    admit(kv, req("a0", "ABCDEFGHI", cache_salt="tenant-A"))
    assert kv.get_computed_blocks(req("b0", "ABCDEFGHI", cache_salt="tenant-B")) == ([], 0)
    assert kv.get_computed_blocks(req("n0", "ABCDEFGHI")) == ([], 0)
    _, hit = kv.get_computed_blocks(req("a1", "ABCDEFGHI", cache_salt="tenant-A"))
    assert hit == 8


def test_fast_hash_option_works():
    fast = get_hash_fn("fast")
    digest = hash_block_tokens(None, ids("ABCD"), None, fast)
    assert isinstance(digest, bytes) and len(digest) == 8
    assert digest == hash_block_tokens(None, ids("ABCD"), None, fast)
    assert len(hash_block_tokens(None, ids("ABCD"))) == 32  # sha256 by default

    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8, hash_fn="fast")
    admit(kv, req("r0", "ABCDEFGHI"))
    assert admit(kv, req("r1", "ABCDEFGHZ")) == 8


def test_unknown_hash_function_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="hash_fn"):
        get_hash_fn("md5")
    with pytest.raises(ValueError, match="hash_fn"):
        KVCacheManager(BLOCK_SIZE, num_blocks=8, hash_fn="xxhash")


def test_bad_hash_inputs_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="extra_keys"):
        hash_block_tokens(None, ids("ABCD"), (("not a tag", "x"),))
    with pytest.raises(ValueError, match="extra_keys"):
        hash_block_tokens(None, ids("ABCD"), (("salt", 1.5),))
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(None, [-1, 0, 0, 0])
    with pytest.raises(ValueError, match="parent_hash"):
        hash_block_tokens(3, ids("ABCD"))
    with pytest.raises(ValueError, match="block_size"):
        hash_request_tokens(0, ids("ABCD"))


# -- the hit: capped, rounded to whole blocks ---------------------------------


@pytest.mark.parametrize(
    ("prompt", "shared", "expected_hit"),
    [
        ("ABCDEFXYZ", 6, 4),  # shared 6 of 9: only ABCD is a full identical block
        ("ABCDEFGXY", 7, 4),  # shared 7 of 9: EFGX != EFGH, still one block
        ("ABCDEFGHZ", 8, 8),  # shared 8 of 9: both blocks, compute the last token
        ("ABCDEFGH", 8, 4),  # shared 8 of 8: cap at 7 rounds down to one block
        ("A", 1, 0),  # shared 1 of 1: nothing to reuse
    ],
)
def test_hit_is_capped_at_prompt_minus_one_and_rounded_down_to_whole_blocks(prompt, shared, expected_hit):
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=16)
    admit(kv, req("r0", "ABCDEFGH"))  # R0's two blocks are cached
    r1 = req("r1", prompt)
    assert os.path.commonprefix([prompt, "ABCDEFGH"]) == prompt[:shared]
    blocks, hit = kv.get_computed_blocks(r1)
    assert hit == expected_hit
    assert blocks == kv.get_blocks("r0")[: hit // BLOCK_SIZE]
    # The course text's formula agrees with the real lookup.
    assert hit == (min(shared, len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE


def test_prefix_cache_stats_count_queried_and_hit_tokens():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=16)
    admit(kv, req("r0", "ABCDEFGH"))
    admit(kv, req("r1", "ABCDEFXYZ"))
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 8 + 9, 0 + 4)
    assert stats.hit_rate == pytest.approx(4 / 17)


def test_caching_disabled_finds_nothing_counts_nothing_and_hashes_nothing():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8, enable_caching=False)
    admit(kv, req("r0", "ABCDEFGHI"))
    assert kv.get_computed_blocks(req("r1", "ABCDEFGHI")) == ([], 0)
    assert kv.prefix_cache_stats.requests == 0 and kv.prefix_cache_stats.queries == 0
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in kv.block_pool.blocks)


# -- reference counts and the free queue --------------------------------------


def test_hit_increments_ref_counts_of_blocks_in_use():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    admit(kv, req("r0", "ABCDEFGHI"))
    admit(kv, req("r1", "ABCDEFGHZ"))
    r0_blocks = kv.get_blocks("r0")
    assert [b.ref_cnt for b in r0_blocks] == [2, 2, 1]
    assert kv.get_block_ids("r1")[:2] == [b.block_id for b in r0_blocks[:2]]


def test_hit_takes_free_but_cached_blocks_out_of_the_free_queue():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r0 = req("r0", "ABCDEFGHI")
    admit(kv, r0)
    abcd, efgh, _ = kv.get_blocks("r0")
    kv.free(r0)
    assert abcd.ref_cnt == 0 and abcd.block_id in free_queue_ids(kv.block_pool)
    assert kv.block_pool.get_cached_block(abcd.block_hash) is abcd  # free, still cached

    assert admit(kv, req("r1", "ABCDEFGHZ")) == 8
    assert (abcd.ref_cnt, efgh.ref_cnt) == (1, 1)
    assert abcd.block_id not in free_queue_ids(kv.block_pool)
    assert efgh.block_id not in free_queue_ids(kv.block_pool)
    assert kv.num_free_blocks == 8 - 3


def test_free_releases_in_reverse_table_order_cached_to_tail_uncached_to_head():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r0 = req("r0", "ABCDEFGHIJ")
    admit(kv, r0)
    assert kv.get_block_ids("r0") == [0, 1, 2]  # 0, 1 cached; 2 partial
    assert free_queue_ids(kv.block_pool) == [3, 4, 5, 6, 7]
    kv.free(r0)
    # Reverse order: 2 (uncached) to the head, then 1 and 0 (cached) to the tail.
    assert free_queue_ids(kv.block_pool) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert kv.get_block_ids("r0") == []


def test_allocation_pops_the_head_and_drops_its_hash_before_reuse():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=2)
    r0 = req("r0", "ABCDEFGH")
    admit(kv, r0)
    abcd, efgh = kv.get_blocks("r0")
    efgh_hash = efgh.block_hash
    kv.free(r0)
    assert free_queue_ids(kv.block_pool) == [efgh.block_id, abcd.block_id]

    admit(kv, req("r2", "WXYZ"))  # one block: the head, EFGH
    assert kv.get_block_ids("r2") == [efgh.block_id]
    assert efgh_hash not in kv.block_pool.cached_block_hash_to_block
    assert efgh.block_hash == hash_request_tokens(BLOCK_SIZE, ids("WXYZ"))[0]
    assert kv.get_computed_blocks(req("r3", "ABCDEFGHZ"))[1] == 4  # ABCD survives


def test_seed_scenario_release_order_on_the_real_pool():
    # The course text's figure uses physical slots 12, 41, 73, 90; on a
    # four-block pool the same roles get ids 0..3.
    slot = {12: 0, 41: 1, 73: 2, 90: 3}
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=4)
    pool = kv.block_pool
    r0, r1 = req("R0", "ABCDEFGH"), req("R1", "ABCDEFXYZ")
    admit(kv, r0)
    assert admit(kv, r1) == 4  # R1 shares R0's ABCD block
    assert kv.get_block_ids("R0") == [slot[12], slot[41]]  # ABCD, EFGH
    assert kv.get_block_ids("R1") == [slot[12], slot[73], slot[90]]  # ABCD, EFXY, Z
    assert pool.blocks[slot[12]].ref_cnt == 2
    assert pool.blocks[slot[90]].block_hash is None  # partial: never hashed
    assert all(pool.blocks[slot[s]].block_hash is not None for s in (12, 41, 73))

    kv.free(r0)
    # 41 (EFGH, cached) -> tail; 12 still used by R1.
    assert free_queue_ids(pool) == [slot[41]]
    assert pool.blocks[slot[12]].ref_cnt == 1
    assert pool.blocks[slot[41]].block_hash is not None  # free yet still reusable

    kv.free(r1)
    # Reverse table order: 90 (partial) -> head, 73 (EFXY) -> tail, 12 (ABCD) -> tail.
    # Full queue, head to tail: R1's partial Z block, R0's EFGH block (freed
    # first, so nearest the head among cached blocks), R1's EFXY suffix, the
    # shared ABCD prefix.
    assert free_queue_ids(pool) == [slot[90], slot[41], slot[73], slot[12]]


def test_seed_scenario_with_r2_reusing_the_freed_suffix_block():
    # The course text's exact script: release R0, R2 takes one block, release R1.
    slot = {12: 0, 41: 1, 73: 2, 90: 3}
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=4)
    pool = kv.block_pool
    r0, r1 = req("R0", "ABCDEFGH"), req("R1", "ABCDEFXYZ")
    admit(kv, r0)
    admit(kv, r1)

    before = snapshot(kv)
    assert kv.allocate_slots(req("R9", "Q"), 1) is None  # no fifth block
    with pytest.raises(ValueError, match="num_blocks"):
        pool.get_new_blocks(1)
    assert snapshot(kv) == before

    kv.free(r0)
    efgh_hash = pool.blocks[slot[41]].block_hash
    admit(kv, req("R2", "Q"))
    assert kv.get_block_ids("R2") == [slot[41]]
    assert efgh_hash not in pool.cached_block_hash_to_block
    kv.free(r1)
    assert free_queue_ids(pool) == [slot[90], slot[73], slot[12]]
    assert pool.blocks[slot[41]].ref_cnt == 1  # R2's live block stays out


def test_pool_with_no_spare_blocks_refuses_a_fifth_block_and_changes_nothing():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=4)
    admit(kv, req("R0", "ABCDEFGH"))
    admit(kv, req("R1", "ABCDEFXYZ"))
    assert kv.num_free_blocks == 0 and kv.usage == 1.0
    before = snapshot(kv)
    assert kv.allocate_slots(req("R2", "QRSTU"), 5) is None
    assert snapshot(kv) == before


def test_a_hit_block_is_never_the_one_evicted_for_the_same_requests_new_blocks():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=2)
    ra, rb = req("a", "ABCD"), req("b", "WXYZ")
    admit(kv, ra)
    admit(kv, rb)
    kv.free(ra)
    kv.free(rb)
    abcd = kv.block_pool.blocks[0]
    assert free_queue_ids(kv.block_pool) == [0, 1]  # the hit block is at the head

    r1 = req("r1", "ABCDQ")
    hits, n = kv.get_computed_blocks(r1)
    assert hits == [abcd] and n == 4
    new_blocks = kv.allocate_slots(r1, 1, n, hits)
    assert [b.block_id for b in new_blocks] == [1]  # not block 0
    assert kv.get_block_ids("r1") == [0, 1]
    assert kv.block_pool.get_cached_block(abcd.block_hash) is abcd


def test_allocation_counts_free_cached_hits_against_the_free_pool():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=1)
    ra = req("a", "ABCD")
    admit(kv, ra)
    kv.free(ra)
    r1 = req("r1", "ABCDQ")
    hits, n = kv.get_computed_blocks(r1)
    assert n == 4
    before = snapshot(kv)
    # One free block, but it IS the hit: the new block has nowhere to come from.
    assert kv.allocate_slots(r1, 1, n, hits) is None
    assert snapshot(kv) == before


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=5)
    admit(kv, req("r0", "ABCDEFGHI"))  # 3 blocks
    r1 = req("r1", "ABCDEFGHJKLMNOPQRSTU")  # hits 2 blocks, needs 3 more, 2 free
    hits, n = kv.get_computed_blocks(r1)
    assert n == 8
    before = snapshot(kv)
    assert kv.allocate_slots(r1, r1.num_tokens - n, n, hits) is None
    assert snapshot(kv) == before
    assert "r1" not in kv.req_to_blocks


def test_get_new_blocks_failure_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    before = ([b.ref_cnt for b in pool.blocks], free_queue_ids(pool))
    with pytest.raises(ValueError, match="num_blocks"):
        pool.get_new_blocks(2)
    assert ([b.ref_cnt for b in pool.blocks], free_queue_ids(pool)) == before


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r0 = req("r0", "ABCDEFGHI")
    admit(kv, r0)
    before = snapshot(kv)
    assert kv.reset_prefix_cache() is False
    assert snapshot(kv) == before


def test_reset_prefix_cache_clears_every_hash_when_nothing_is_in_use():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r0 = req("r0", "ABCDEFGHI")
    admit(kv, r0)
    kv.free(r0)
    assert kv.reset_prefix_cache() is True
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.get_computed_blocks(req("r1", "ABCDEFGHI")) == ([], 0)


# -- growing requests ---------------------------------------------------------


def test_a_block_filled_by_generated_tokens_is_cached():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r0 = req("r0", "ABCDEF")
    admit(kv, r0)
    assert kv.get_blocks("r0")[1].block_hash is None
    for letter in "GH":  # decode: the sampled token is the next step's input
        r0.all_token_ids.append(ids(letter)[0])
        assert kv.allocate_slots(r0, 1) == []  # still fits in block 1
        r0.num_computed_tokens += 1
    assert kv.get_blocks("r0")[1].block_hash == hash_request_tokens(BLOCK_SIZE, ids("ABCDEFGH"))[1]
    assert admit(kv, req("r1", "ABCDEFGHZ")) == 8


def test_chunked_prefill_caches_each_block_as_it_fills():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r0 = req("r0", "ABCDEFGHIJ")
    assert len(kv.allocate_slots(r0, 6)) == 2
    r0.num_computed_tokens = 6
    assert [b.block_hash is not None for b in kv.get_blocks("r0")] == [True, False]
    assert len(kv.allocate_slots(r0, 4)) == 1
    assert [b.block_hash is not None for b in kv.get_blocks("r0")] == [True, True, False]


def test_slots_beyond_the_known_tokens_are_not_cached():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r0 = req("r0", "ABCDEF")
    kv.allocate_slots(r0, 8)  # lookahead: 2 slots past the last known token
    assert [b.block_hash is not None for b in kv.get_blocks("r0")] == [True, False]


def test_duplicate_full_block_keeps_the_first_cached_copy():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r0 = req("r0", "ABCDEFGH")
    kv.allocate_slots(r0, 4)  # first chunk: ABCD
    r0.num_computed_tokens = 4
    admit(kv, req("r1", "ABCDEFGHZ"))  # hits ABCD, computes its own EFGH
    r1_efgh = kv.get_blocks("r1")[1]
    kv.allocate_slots(r0, 4)  # r0's second chunk fills an identical EFGH
    r0.num_computed_tokens = 8
    r0_efgh = kv.get_blocks("r0")[1]
    assert r0_efgh is not r1_efgh
    assert kv.block_pool.get_cached_block(r1_efgh.block_hash) is r1_efgh
    assert r0_efgh.block_hash is None  # the duplicate stays unhashed...
    kv.free(r0)
    assert free_queue_ids(kv.block_pool)[0] == r0_efgh.block_id  # ...and is reused first


def test_invalid_arguments_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(0, num_blocks=8)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(BLOCK_SIZE, num_blocks=0)
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=8)
    r0 = req("r0", "ABCDEFGH")
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(r0, 0)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        kv.allocate_slots(r0, 4, num_new_computed_tokens=4)
    r0.num_computed_tokens = 4  # claims KV it has no blocks for
    with pytest.raises(ValueError, match="num_computed_tokens"):
        kv.allocate_slots(r0, 4)


def test_free_of_a_request_without_blocks_is_harmless():
    kv = KVCacheManager(BLOCK_SIZE, num_blocks=4)
    r = req("r", "ABCDE")
    kv.get_computed_blocks(r)  # computes and keeps its hashes
    kv.free(r)
    assert kv.num_free_blocks == 4 and "r" not in kv.req_to_block_hashes


# -- the free queue itself ----------------------------------------------------


def test_free_queue_supports_head_tail_and_middle_operations():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])  # from the middle
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 1, 3, 4, 0]
    assert queue.num_free_blocks == len(queue) == 5


def test_free_queue_rejects_popleft_from_empty_and_foreign_blocks():
    queue = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    block = queue.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)
    queue.append(block)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(block)


def test_block_repr_and_equality_ignore_free_queue_links():
    a, b = KVCacheBlock(0), KVCacheBlock(0)
    FreeKVCacheBlockQueue([a])
    assert a == b
    assert "free_block" not in repr(a)
