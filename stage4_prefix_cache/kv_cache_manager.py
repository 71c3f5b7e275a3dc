"""The KV cache manager: block tables per request, on top of a prefix-caching pool.

Stage 3's manager only handed out blocks. This one first asks "which of this
request's blocks already exist?": it hashes the request's full blocks,
finds the longest cached run from the start (``get_computed_blocks``), lets
the scheduler skip those tokens, and shares the blocks instead of recomputing
them. Every block a request fills is registered so later requests can do the
same.

The scheduler's side of the contract, per step:

    blocks, n = kv.get_computed_blocks(req)       # only when req has no blocks
    new = kv.allocate_slots(req, num_new_tokens, n, blocks)
    if new is None: ... (nothing changed; try later or preempt someone)
    req.num_computed_tokens += n                  # the hit, right away
    ... run the step ...
    req.num_computed_tokens += num_new_tokens     # after the step
    kv.free(req)                                  # finished or preempted

vLLM counterpart: ``vllm/v1/core/kv_cache_manager.py`` (with the single
full-attention group of ``single_type_kv_cache_manager.py`` folded in).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from stage4_prefix_cache.block_pool import BlockPool
from stage4_prefix_cache.kv_cache_utils import (
    BlockHash,
    ExtraKey,
    HashFn,
    KVCacheBlock,
    get_hash_fn,
    hash_block_tokens,
)


class CacheableRequest(Protocol):
    """What the manager reads from a request (``skip_reading_prefix_cache`` is optional)."""

    request_id: str
    all_token_ids: list[int]  # prompt + tokens generated so far
    num_computed_tokens: int  # tokens that already have KV before this step
    cache_salt: str | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens.

    - ``requests``: lookups made (calls to ``get_computed_blocks``).
    - ``queries``: tokens looked up (each request's ``num_tokens``).
    - ``hits``: tokens served from the cache (each lookup's computed tokens).

    As in vLLM, every lookup counts: a request retried after a failed
    allocation, or resumed after preemption, is counted again. ``hits`` is
    therefore "prefill tokens the cache offered", which is what the scheduler
    saved each time it admitted the request.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block tables for every running request, backed by a ``BlockPool``.

    Per request it keeps: the block table (``req_to_blocks``), how many of
    its leading blocks are already registered in the prefix cache
    (``num_cached_block``), and the chained hashes of its full blocks
    (``req_to_block_hashes``, extended as blocks fill). All three are
    dropped by ``free``.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        hash_fn: str | HashFn = "sha256",
        shuffle_seed: int | None = None,
    ) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size: must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn: HashFn = get_hash_fn(hash_fn) if isinstance(hash_fn, str) else hash_fn
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching, shuffle_seed=shuffle_seed)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- read-only views ---------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user, including free-but-cached ones."""
        return self.block_pool.get_num_free_blocks()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (empty if it holds no blocks)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as physical block ids."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    # -- the prefix cache lookup -------------------------------------------

    def get_computed_blocks(self, request: CacheableRequest) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks matching the request from its start.

        Returns the blocks and how many tokens they cover. Call it for a
        request that holds no blocks (new, or resumed after preemption), then
        pass both results to ``allocate_slots``. Nothing is reserved yet: the
        hit blocks may still be evicted until ``allocate_slots`` touches them,
        so call the two back to back.

        The hit is capped at ``num_tokens - 1`` (the prompt length minus one,
        for a new request): the last position must be computed, because its
        output is the logits the next token is sampled from. The cap is
        rounded down to whole blocks, so a fully cached prompt of 8 tokens
        with block size 4 reuses 4 tokens and recomputes the last block.

        A request with ``skip_reading_prefix_cache`` set (it wants prompt
        logprobs, which need every prompt position's logits) gets no hit and
        counts no lookup, as in vLLM; its blocks still enter the cache.
        """
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return [], 0
        block_hashes = self._get_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        num_computed_tokens = len(computed) * self.block_size

        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_computed_tokens
        return computed, num_computed_tokens

    # -- allocation --------------------------------------------------------

    def allocate_slots(
        self,
        request: CacheableRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give the request slots for its next ``num_new_tokens`` tokens.

        After this call the request's table covers
        ``request.num_computed_tokens + num_new_computed_tokens + num_new_tokens``
        tokens: first the prefix-cache hit (``new_computed_blocks``, which
        cover ``num_new_computed_tokens``), then fresh blocks as needed.

        Returns the newly allocated blocks (possibly empty), or None if the
        pool cannot supply them; then nothing has changed (reference counts,
        free queue, cache, tables). Hit blocks that are free-but-cached count
        against the free pool, since using them takes them out of it.

        On success, every block that is now full with known tokens is
        registered in the prefix cache. That happens before the step runs:
        the KV is written during this step, before anything can read it (a
        request that hits these blocks is scheduled in a later step, or later
        in this step's batch where KV writes precede attention). So once this
        succeeds, the step must run: freeing the request before its KV is
        written would leave hashed blocks in the free queue with no KV behind
        them. Preempt only requests not yet scheduled in the current step.
        """
        if type(num_new_tokens) is not int or num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens: must be a positive integer, got {num_new_tokens!r}")
        hits = list(new_computed_blocks) if new_computed_blocks else []
        if num_new_computed_tokens != len(hits) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens: {num_new_computed_tokens} must equal "
                f"len(new_computed_blocks) * block_size = {len(hits) * self.block_size}"
            )
        request_id = request.request_id
        table = self.req_to_blocks.get(request_id, [])
        if hits and (table or request.num_computed_tokens):
            raise ValueError(
                "new_computed_blocks: can only start an empty block table "
                f"(request {request_id!r} already has {len(table)} blocks and "
                f"num_computed_tokens={request.num_computed_tokens})"
            )
        if request.num_computed_tokens > len(table) * self.block_size:
            raise ValueError(
                f"num_computed_tokens: request {request_id!r} has num_computed_tokens="
                f"{request.num_computed_tokens} but blocks for only "
                f"{len(table) * self.block_size} tokens; reset num_computed_tokens "
                "to 0 after free(request)"
            )

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens
        num_required_blocks = -(-num_tokens_need_slot // self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(table) - len(hits))
        if hits or num_new_blocks:
            # A hit on a free-but-cached block takes it out of the free pool too.
            num_evictable_hits = sum(1 for block in hits if block.ref_cnt == 0)
            if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
                return None
            # Touch the hits BEFORE allocating: a free-but-cached hit block could
            # otherwise be popped (and overwritten) as one of this request's own
            # new blocks.
            self.block_pool.touch(hits)
            table = self.req_to_blocks.setdefault(request_id, table)
            if hits:
                table.extend(hits)
                self.num_cached_block[request_id] = len(hits)
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            table.extend(new_blocks)
        else:
            new_blocks = []  # the blocks it holds have room (most decode steps)

        if self.enable_caching:
            # Only tokens whose ids are known can be hashed: scheduling more
            # slots than tokens (lookahead) must not cache the extra ones.
            num_tokens_to_cache = min(num_tokens_need_slot, request.num_tokens)
            self._cache_full_blocks(request, num_tokens_to_cache // self.block_size)
        return new_blocks

    def _cache_full_blocks(self, request: CacheableRequest, num_full_blocks: int) -> None:
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        if num_full_blocks <= num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(
            blocks=self.req_to_blocks[request_id],
            block_hashes=self._get_block_hashes(request),
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
        )
        self.num_cached_block[request_id] = num_full_blocks

    def _get_block_hashes(self, request: CacheableRequest) -> list[BlockHash]:
        """The request's full-block hashes, extended to cover its current tokens."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        num_full_blocks = len(tokens) // self.block_size
        parent = hashes[-1] if hashes else None
        for start in range(len(hashes) * self.block_size, num_full_blocks * self.block_size, self.block_size):
            end = start + self.block_size
            parent = hash_block_tokens(parent, tokens[start:end], self.block_extra_keys(request, start, end),
                                       self.hash_fn)
            hashes.append(parent)
        return hashes

    def block_extra_keys(self, request: CacheableRequest, start: int, end: int) -> tuple[ExtraKey, ...]:
        """The extra keys in the hash of the block holding positions ``[start, end)``: the request's
        cache salt. Every block of a request gets it (vLLM adds it to the first block only; chaining
        carries it into every later hash, so both give the same isolation). A later stage adds its
        own keys here (stage 5: an adapter's, an image's)."""
        return () if request.cache_salt is None else (("salt", request.cache_salt),)

    # -- release -----------------------------------------------------------

    def free(self, request: CacheableRequest) -> None:
        """Release the request's blocks (it finished, was aborted or preempted).

        Blocks are freed in REVERSE table order, so among cached blocks the
        sequence's tail enters the free queue first and is evicted first;
        its shared prefix stays longest. Safe to call for a request holding
        no blocks. The caller must reset ``num_computed_tokens`` to 0 if the
        request will run again.
        """
        request_id = request.request_id
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)
        self.req_to_block_hashes.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; False (and no change) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()
