"""From a KV cache manager's block tables, step after step, to what happened to each block.

The KV cache manager keeps one table per request and changes it in two ways only: it appends blocks (a
prefix-cache hit as the request is admitted, then fresh blocks as it grows) and it drops the whole table
(the request finished, was aborted or preempted). So comparing every live table with its length at the
last step says everything: a table that is gone gave its blocks back; a table that grew took blocks,
the first of a newly admitted request's being its prefix-cache hits. ``BlockTracker`` keeps a reference
count per block, the hash each held block was last seen with, and the hash a free block still holds (its
cached K/V): a block given back is cached by the hash it held then, not by what the pool shows later (the
schedule that freed it may have handed it out again). It turns each step's tables into
the ``new`` / ``hit`` / ``loaded`` / ``evicted`` blocks of ``RequestStep`` and the ``FreedBlocks`` of the
requests that left. A hit on a block that was free with no hash, or with another hash, was filled from
outside the pool (a KV connector's offload tier): it is ``loaded``. The cost per step grows with the live
requests and the blocks that changed, never with the pool.

``token_kinds`` splits a request's scheduled positions into prefill, decode and verify, the way the
step timeline stacks them.

vLLM: the tables are ``req_to_blocks`` of ``vllm/v1/core/single_type_kv_cache_manager.py``; the states are
``ref_cnt`` and ``block_hash`` of ``KVCacheBlock`` in ``vllm/v1/core/kv_cache_utils.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stage5_server.inspector.records import FreedBlocks


def token_kinds(num_scheduled: int, num_drafts: int, computed_before: int,
                num_prompt_tokens: int) -> tuple[int, int, int]:
    """``(prefill, decode, verify)`` positions of a request's step. The draft positions are verified; of the
    rest, one position past everything computed is a decode, anything more (or anything inside the prompt)
    is a prefill chunk. A request resumed after preemption recomputes its prompt and output as a prefill."""
    base = num_scheduled - num_drafts
    if base == 1 and computed_before >= num_prompt_tokens:
        return 0, 1, num_drafts
    return base, 0, num_drafts


class BlockTracker:
    """What the inspector knows of a pool: who holds each block, the hash each held block has been seen with,
    and which free blocks are cached."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.held: dict[str, list[int]] = {}  # request id -> its block ids, as last seen
        self.refs = [0] * num_blocks  # tables holding each block
        self.held_hashes: list[Any] = [None] * num_blocks  # a held block's hash, as last seen
        self.num_hashed: dict[str, int] = {}  # request id -> how many of its first blocks have their hash seen
        self.hashes: list[Any] = [None] * num_blocks  # a free block's hash: its K/V can still be found by it
        self.num_used = 0
        self.num_cached = 0

    def forget_cache(self) -> None:
        """Every cached block is plain free now (the pool's prefix cache was reset)."""
        self.hashes = [None] * self.num_blocks
        self.num_cached = 0

    def update(self, tables: Mapping[str, Sequence[Any]], block_id: Callable[[Any], int],
               num_hit_blocks: Callable[[str], int], hash_of: Callable[[int], Any] | None,
               why: Callable[[str], str]) -> tuple[dict[str, tuple[list[int], list[int], list[int], list[int]]],
                                                   list[FreedBlocks]]:
        """Compare ``tables`` (every live request's blocks now) with the last call. Returns, per request whose
        table grew, ``(new, hit, loaded, evicted)`` block ids, and the blocks of every request that left.

        ``num_hit_blocks(id)``: how many of a newly seen table's first blocks are prefix-cache hits;
        ``hash_of(block id)``: a block's hash in the pool now (None: not cached; ``hash_of`` None: the pool
        caches nothing); ``why(id)``: why a request's table is gone.

        Two phases, because the pool now may not be the pool the blocks were given back to: a schedule that
        preempts a request to make room hands its blocks straight to another, which may evict their K/V or fill
        and hash them, and the blocks of a request aborted between steps may be handed out by the next schedule
        before this call sees them. So a block given back counts as cached by the hash it was last seen holding
        (held blocks only gain a hash, and a preempted or aborted request's blocks gain none in the schedule
        that frees them); and at the end of each call, the hashes the pool gave held blocks since the last
        call are read (from each table's first block without one: a few blocks a request)."""
        freed = []
        for request_id in [rid for rid in self.held if rid not in tables]:
            blocks = self.held.pop(request_id)
            self.num_hashed.pop(request_id, None)
            cached = [b for b in blocks if self._release(b)]
            freed.append(FreedBlocks(request_id, blocks, cached, why(request_id)))
        grown: dict[str, tuple[list[int], list[int], list[int], list[int]]] = {}
        for request_id, table in tables.items():
            have = self.held.get(request_id)
            start = 0 if have is None else len(have)
            if len(table) == start:
                continue
            ids = [block_id(b) for b in table[start:]]
            num_hits = num_hit_blocks(request_id) if have is None else 0
            hit, new = ids[:num_hits], ids[num_hits:]
            # A hit on a free block whose K/V the pool did not hold (no hash, or another one) was loaded into it;
            # a fresh block that was free with a hash had its cached K/V dropped: evicted.
            loaded = [b for b, (was_free, had) in zip(hit, map(self._take, hit))
                      if was_free and (had is None or hash_of is None or had != hash_of(b))]
            evicted = [b for b, (was_free, had) in zip(new, map(self._take, new)) if was_free and had is not None]
            if have is None:
                self.held[request_id] = ids
            else:
                have.extend(ids)
            grown[request_id] = (new, hit, loaded, evicted)
        if hash_of is not None:
            self._see_hashes(hash_of)
        return grown, freed

    def _see_hashes(self, hash_of: Callable[[int], Any]) -> None:
        """Read the hashes held blocks gained. A table's blocks are hashed front to back as they fill, so each
        request is read from its first block seen without a hash; a full block left unhashed (its K/V were
        cached in another block already) keeps the ones after it read each time."""
        seen, num_hashed = self.held_hashes, self.num_hashed
        for request_id, blocks in self.held.items():
            first = num_hashed.get(request_id, 0)
            unhashed = None
            for i in range(first, len(blocks)):
                block = blocks[i]
                if seen[block] is None:
                    seen[block] = hash_of(block)
                if seen[block] is None and unhashed is None:
                    unhashed = i
            num_hashed[request_id] = len(blocks) if unhashed is None else unhashed

    def _take(self, block: int) -> tuple[bool, Any]:
        """One more table holds ``block``. Returns whether it was free, and the hash it had then."""
        refs = self.refs[block]
        self.refs[block] = refs + 1
        if refs:
            return False, None
        self.num_used += 1
        had = self.hashes[block]
        if had is not None:
            self.hashes[block] = None
            self.num_cached -= 1
        return True, had

    def _release(self, block: int) -> bool:
        """One table fewer holds ``block``. Returns whether it is now free and cached (by the hash it was last
        seen holding)."""
        self.refs[block] -= 1
        if self.refs[block]:
            return False
        self.num_used -= 1
        self.hashes[block], self.held_hashes[block] = self.held_hashes[block], None
        if self.hashes[block] is None:
            return False
        self.num_cached += 1
        return True
