"""Stage 4 prefix-cache invariants under random workloads (hypothesis).

A state machine plays scheduler: it admits requests (taking prefix hits),
runs chunked prefill and decode steps, finishes and preempts requests, and
resets the cache. A test-side model records which tokens were written into
every physical block, so the checks go beyond bookkeeping: a cache hit must
hand out a block whose contents really are the request's prefix.
"""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from stage4_prefix_cache.kv_cache_manager import KVCacheManager
from stage4_prefix_cache.kv_cache_utils import encode_block, hash_request_tokens
from tests.stage4.fake_request import FakeRequest

# Few distinct tokens and shared stems make prefix hits frequent.
STEMS = [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 1, 1], [3, 2, 1, 0, 0, 1, 2, 3], []]
prompts = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from(STEMS),
    st.lists(st.integers(0, 3), max_size=7),
).filter(len)


class PrefixCacheMachine(RuleBasedStateMachine):
    manager_class = KVCacheManager

    def identity(self, request: FakeRequest) -> tuple:
        """The extra keys a block's hash must include: the salt. Spelled out here rather than taken from the
        module, so dropping it from the real hash makes a hit serve another identity's KV and fail."""
        return () if request.cache_salt is None else (("salt", request.cache_salt),)

    @initialize(
        block_size=st.sampled_from([2, 4]),
        num_blocks=st.integers(3, 12),
        hash_fn=st.sampled_from(["sha256", "fast"]),
    )
    def setup(self, block_size: int, num_blocks: int, hash_fn: str) -> None:
        self.block_size = block_size
        self.kv = self.manager_class(block_size, num_blocks, hash_fn=hash_fn)
        self.running: dict[str, FakeRequest] = {}
        self.preempted: dict[str, FakeRequest] = {}
        # What each physical block holds: (reuse identity, tokens of the
        # whole sequence up to this block's last written slot).
        self.content: dict[int, tuple[tuple, tuple[int, ...]]] = {}
        self.next_id = 0

    # -- helpers --------------------------------------------------------------

    def _write(self, request: FakeRequest, start: int, end: int) -> None:
        """Model the step: KV for positions [start, end) lands in the table's blocks."""
        table = self.kv.get_block_ids(request.request_id)
        extra = self.identity(request)
        for pos in range(start, end):
            block_id = table[pos // self.block_size]
            self.content[block_id] = (extra, tuple(request.all_token_ids[: pos + 1]))

    def _check_hits(self, request: FakeRequest, hits: list) -> None:
        extra = self.identity(request)
        for i, block in enumerate(hits):
            prefix = tuple(request.all_token_ids[: (i + 1) * self.block_size])
            assert self.content[block.block_id] == (extra, prefix), "a hit served wrong KV"

    def _schedule(self, request: FakeRequest, chunk: int) -> bool:
        """One scheduler step for ``request``; False if the pool said no."""
        hits, num_hit = [], 0
        if not self.kv.get_block_ids(request.request_id):
            hits, num_hit = self.kv.get_computed_blocks(request)
            self._check_hits(request, hits)
            assert num_hit < request.num_tokens
        start = request.num_computed_tokens + num_hit
        num_new = min(chunk, request.num_tokens - start)
        before = self._snapshot()
        new_blocks = self.kv.allocate_slots(request, num_new, num_hit, hits)
        if new_blocks is None:
            assert self._snapshot() == before, "a failed allocation changed state"
            return False
        self._write(request, start, start + num_new)
        request.num_computed_tokens = start + num_new
        if request.num_computed_tokens == request.num_tokens:
            request.all_token_ids.append(request.num_tokens % 4)  # "sampled"
        return True

    def _snapshot(self) -> tuple:
        pool = self.kv.block_pool
        return (
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue],
            dict(pool.cached_block_hash_to_block),
            {rid: self.kv.get_block_ids(rid) for rid in self.kv.req_to_blocks},
        )

    # -- rules ----------------------------------------------------------------

    @rule(prompt=prompts, salt=st.sampled_from([None, "tenant-A"]), chunk=st.integers(1, 12))
    def add_request(self, prompt, salt, chunk) -> None:
        self._add(FakeRequest(f"r{self.next_id}", list(prompt), cache_salt=salt), chunk)

    def _add(self, request: FakeRequest, chunk: int) -> None:
        self.next_id += 1
        if self._schedule(request, chunk):
            self.running[request.request_id] = request
        else:
            self.kv.free(request)  # stays waiting; drops its cached hashes

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def step(self, data, chunk) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        self._schedule(self.running[request_id], chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kv.free(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.preempted[request.request_id] = request

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def resume(self, data, chunk) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.preempted)))
        request = self.preempted[request_id]
        if self._schedule(request, chunk):
            self.running[request_id] = self.preempted.pop(request_id)

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll: int) -> None:
        if roll != 7:  # reset rarely, so the cache has time to fill between resets
            return
        before = self._snapshot()
        done = self.kv.reset_prefix_cache()
        assert done == (not self.running)
        if done:
            assert not self.kv.block_pool.cached_block_hash_to_block
        else:
            assert self._snapshot() == before

    # -- invariants -----------------------------------------------------------

    @invariant()
    def ref_cnt_equals_number_of_live_requests_holding_the_block(self) -> None:
        holders: dict[int, int] = {}
        for request_id in self.running:
            for block_id in self.kv.get_block_ids(request_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.kv.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
        assert set(self.kv.req_to_blocks) == set(self.running)

    @invariant()
    def free_queue_and_held_blocks_partition_the_pool(self) -> None:
        pool = self.kv.block_pool
        free = [b.block_id for b in pool.free_block_queue]
        held = {b.block_id for b in pool.blocks if b.ref_cnt > 0}
        assert len(free) == len(set(free)) == pool.get_num_free_blocks()
        assert set(free).isdisjoint(held)
        assert set(free) | held == set(range(pool.num_blocks))

    @invariant()
    def tables_cover_exactly_the_computed_tokens(self) -> None:
        for request_id, request in self.running.items():
            num_blocks = -(-request.num_computed_tokens // self.block_size)
            assert len(self.kv.get_block_ids(request_id)) == num_blocks

    @invariant()
    def every_cached_hash_names_a_full_block_with_that_content(self) -> None:
        pool = self.kv.block_pool
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
            extra, tokens = self.content[block.block_id]
            assert len(tokens) % self.block_size == 0, "a partial block is hashed"
            expected = hash_request_tokens(self.block_size, list(tokens), extra, self.kv.hash_fn)
            assert expected[-1] == block_hash
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.cached_block_hash_to_block[block.block_hash] is block


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


# -- the hash input encoding is injective --------------------------------------


def _decode(data: bytes) -> tuple:
    """Read ``encode_block``'s format back; a round trip proves it unambiguous."""
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        chunk = data[pos : pos + n]
        assert len(chunk) == n
        pos += n
        return chunk

    def u32() -> int:
        return struct.unpack(">I", take(4))[0]

    parent = take(u32()) if take(1) == b"\x01" else None
    tokens = list(struct.unpack(f">{(n := u32())}Q", take(8 * n)))
    extra = []
    for _ in range(u32()):
        tag = take(u32()).decode()
        kind, raw = take(1), take(u32())
        if kind == b"s":
            value = raw.decode()
        elif kind == b"i":
            value = int(raw)
        else:
            assert kind == b"b"
            value = raw
        extra.append((tag, value))
    assert pos == len(data), "trailing bytes"
    return parent, tokens, tuple(extra)


extra_values = st.one_of(st.text(max_size=6), st.binary(max_size=6), st.integers())


@settings(max_examples=200, deadline=None)
@given(
    parent=st.none() | st.binary(min_size=8, max_size=32),
    tokens=st.lists(st.integers(0, 2**64 - 1), max_size=6),
    extra=st.lists(st.tuples(st.sampled_from(["salt", "lora", "mm"]), extra_values), max_size=3),
)
def test_block_encoding_round_trips_so_distinct_identities_never_share_hash_input(parent, tokens, extra):
    assert _decode(encode_block(parent, tokens, tuple(extra))) == (parent, tokens, tuple(extra))
