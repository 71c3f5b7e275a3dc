"""Block-rounded prefix-cache hits and free-queue order, printed by the real stage4 KVCacheManager.

Block size 4, token ids standing in for letters (A=1, B=2, ...). Part 1: for each
(shared prefix, prompt length) an earlier request R0 leaves its blocks cached, then R1's
lookup reports how many tokens it may skip. Part 2: the four-block pool story of R0, R1
and R2 (allocation refused, release order, eviction).

Run: .venv/bin/python docs/snippets/prefix_cache_demo.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, however this is run

from shared import Request, SamplingParams  # noqa: E402
from stage4_prefix_cache import KVCacheManager  # noqa: E402

P = SamplingParams(max_tokens=4)
LETTERS = " ABCDEFGHXYZ"


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, P)


def reusable(shared: int, prompt_len: int) -> int:
    kv = KVCacheManager(block_size=4, num_blocks=16)
    common = list(range(1, shared + 1))
    r0 = req("R0", common + [500 + i for i in range(12 - shared)])  # 12 tokens: three full blocks cached
    kv.allocate_slots(r0, r0.num_tokens)
    kv.free(r0)  # its blocks stay cached in the free queue
    r1 = req("R1", common + [300 + i for i in range(prompt_len - shared)])
    _, num_computed = kv.get_computed_blocks(r1)
    return num_computed


print("part 1: block-rounded hits (block_size=4)")
print("shared prefix  prompt  skipped (hit)  computed")
for shared, length in [(6, 9), (7, 9), (8, 9), (8, 8), (1, 1)]:
    hit = reusable(shared, length)
    print(f"{shared:13d}  {length:6d}  {hit:13d}  {length - hit:8d}")

print()
print("part 2: a four-block pool")
kv = KVCacheManager(block_size=4, num_blocks=4)
queue = lambda: [b.block_id for b in kv.block_pool.free_block_queue]  # head -> tail
r0 = req("R0", [1, 2, 3, 4, 5, 6, 7, 8])  # A B C D E F G H
kv.allocate_slots(r0, 8)
r1 = req("R1", [1, 2, 3, 4, 5, 6, 9, 10, 11])  # A B C D E F X Y Z
hits, n = kv.get_computed_blocks(r1)
kv.allocate_slots(r1, r1.num_tokens - n, n, hits)
print(f"R0 table {kv.get_block_ids('R0')}, R1 table {kv.get_block_ids('R1')} (R1 hit {n} tokens)")
print(f"ref counts {[b.ref_cnt for b in kv.block_pool.blocks]}, free queue {queue()}")
r2 = req("R2", [7, 7, 7, 7])
print(f"R2 asks for a block: {kv.allocate_slots(r2, 4)}  (None: every block is live)")
kv.free(r0)
print(f"release R0 -> free queue {queue()}, ref counts {[b.ref_cnt for b in kv.block_pool.blocks]}")
old_hash = kv.block_pool.blocks[1].block_hash
kv.allocate_slots(r2, 4)
new_hash = kv.block_pool.blocks[kv.get_block_ids("R2")[0]].block_hash
print(f"R2 allocates -> table {kv.get_block_ids('R2')}")
print(f"   E F G H hash evicted: {kv.block_pool.get_cached_block(old_hash) is None}, "
      f"block now cached as R2's: {new_hash != old_hash}")
kv.free(r1)
print(f"release R1 -> free queue {queue()}")
print("   head first: the uncached partial block, then the cached tail, then the prefix")
