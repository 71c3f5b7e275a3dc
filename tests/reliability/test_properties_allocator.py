"""Stage 2's block allocator and stage 3's KV cache manager under random operation sequences.

(Stage 4's block pool and prefix-caching manager have their own state machine in
tests/stage4/test_prefix_cache_properties.py; the schedulers over both managers are driven
in test_properties_scheduler.py.)

A model of the pool (which request holds which blocks) is kept beside the real one; after
every operation the free list plus the held blocks is exactly the pool, no block is held
twice, an allocation is all or nothing, and a request's table covers its tokens.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stage2_paged.block_table import BlockAllocator, OutOfBlocksError
from stage3_continuous.kv_cache_manager import KVCacheManager
from tests.reliability.figures import count
from tests.reliability.settings import machine_settings
from tests.stage3.scheduler_driver import make_request


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), seed=st.one_of(st.none(), st.integers(0, 3)))
    def setup(self, num_blocks, seed):
        self.allocator = BlockAllocator(num_blocks, shuffle_seed=seed)
        self.num_blocks = num_blocks
        self.held: list[list[int]] = []
        count("block_allocator", "runs")

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        count("block_allocator", "operations")
        free_before = self.allocator.num_free
        if n > free_before:
            with pytest.raises(OutOfBlocksError):
                self.allocator.allocate(n)
            assert self.allocator.num_free == free_before, "a failed allocation took blocks"
            return
        blocks = self.allocator.allocate(n)
        assert len(blocks) == n
        self.held.append(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        count("block_allocator", "operations")
        index = data.draw(st.integers(0, len(self.held) - 1))
        self.allocator.free(self.held.pop(index))

    @invariant()
    def free_plus_held_is_the_pool(self):
        held = [b for blocks in self.held for b in blocks]
        assert sorted(list(self.allocator._free) + held) == list(range(self.num_blocks))


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Requests grow step by step, fail to grow when the pool is short, and are freed."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 10))
    def setup(self, block_size, num_blocks):
        self.kv = KVCacheManager(block_size, num_blocks, shuffle_seed=0)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.requests = {}
        self.next_id = 0
        count("kv_cache_manager_stage3", "runs")

    @rule(prompt_len=st.integers(1, 12), chunk=st.integers(1, 12))
    def admit(self, prompt_len, chunk):
        request = make_request(f"r{self.next_id}", prompt_len)
        self.next_id += 1
        self._grow(request, min(chunk, prompt_len))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def grow(self, data, chunk):
        request = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        request.append_output_token(0)
        self._grow(request, chunk)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data):
        count("kv_cache_manager_stage3", "operations")
        request = self.requests.pop(data.draw(st.sampled_from(sorted(self.requests))))
        self.kv.free(request)
        assert self.kv.get_block_ids(request.request_id) == []

    def _grow(self, request, num_new):
        count("kv_cache_manager_stage3", "operations")
        before = (self.kv.num_free_blocks, self.kv.get_block_ids(request.request_id))
        total = request.num_computed_tokens + num_new
        needed = max(0, math.ceil(total / self.block_size) - len(before[1]))
        new = self.kv.allocate_slots(request, num_new)
        if needed > before[0]:
            assert new is None
            assert (self.kv.num_free_blocks, self.kv.get_block_ids(request.request_id)) == before
            return
        assert new is not None and len(new) == needed
        request.num_computed_tokens = total
        self.requests[request.request_id] = request

    @invariant()
    def tables_cover_their_tokens_and_partition_the_pool(self):
        held = []
        for rid, request in self.requests.items():
            table = self.kv.get_block_ids(rid)
            assert len(table) == math.ceil(request.num_computed_tokens / self.block_size)
            held += table
        assert set(self.kv.tables) == set(self.requests)
        assert sorted(list(self.kv.allocator._free) + held) == list(range(self.num_blocks))
        assert self.kv.usage == pytest.approx(len(held) / self.num_blocks)

    def teardown(self):
        for request in list(getattr(self, "requests", {}).values()):
            self.kv.free(request)
        if hasattr(self, "kv"):
            assert self.kv.num_free_blocks == self.num_blocks and self.kv.usage == 0


TestBlockAllocator = AllocatorMachine.TestCase
TestBlockAllocator.settings = machine_settings(max_examples=100, steps=40)
TestKVCacheManager = KVCacheManagerMachine.TestCase
TestKVCacheManager.settings = machine_settings(max_examples=100, steps=40)
