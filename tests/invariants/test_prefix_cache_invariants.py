"""Promises of every prefix-caching stage (4 and later)."""

from __future__ import annotations

from collections import Counter

from shared import SamplingParams
from tests.invariants.prompts import PROMPTS

MIN_STAGE = 4
SYSTEM = "A serving engine turns prompts into tokens, schedules them, and streams text back. "
OVERLAPPING = [SYSTEM + p for p in PROMPTS] + [SYSTEM, SYSTEM + PROMPTS[1], PROMPTS[1], PROMPTS[1]]


def check_pool_invariants(engine):
    manager = engine.scheduler.kv_cache_manager
    pool = manager.block_pool
    holders = Counter(b for blocks in engine.live_block_ids().values() for b in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}"
    free = [b.block_id for b in pool.free_block_queue]
    assert len(free) == len(set(free)) and not set(free) & set(holders)
    assert set(free) | set(holders) == set(range(pool.num_blocks))
    for request in engine.scheduler.running:  # a cached block holds what its hash says
        hashes = manager.req_to_block_hashes.get(request.request_id, [])
        for index, block in enumerate(manager.get_blocks(request.request_id)):
            if block.block_hash is not None:
                assert index < len(hashes) and block.block_hash == hashes[index]
                assert pool.get_cached_block(block.block_hash) is block


def test_caching_on_gives_the_same_tokens_as_caching_off_under_preemption(stage, tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    off = stage.make_llm(tiny_llama, enable_prefix_caching=False).generate(OVERLAPPING, params, use_tqdm=False)
    llm = stage.make_llm(tiny_llama, num_kv_blocks=48, max_num_batched_tokens=32, max_model_len=192)
    for p in OVERLAPPING:
        llm.add_request(p, params)
    outputs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out
        check_pool_invariants(llm.engine)
    on = [outputs[str(i)] for i in range(len(OVERLAPPING))]
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in on) > 0
    assert llm.engine.kv_cache_usage() == 0


def test_repeated_prompt_is_served_from_cache_with_identical_output(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = llm.generate(SYSTEM, params, use_tqdm=False)[0]
    second = llm.generate(SYSTEM, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_n_samples_share_the_prompt_blocks_and_cost_one_prefill(stage, tiny_llama):
    """n = 8 children of one prompt: child 0 computes the prompt and caches its full blocks; each of
    the other seven finds them and computes only the last block, which must run for its logits."""
    llm = stage.make_llm(tiny_llama)
    block = llm.args["block_size"]
    prompt = llm.tokenizer.encode(SYSTEM)
    length = len(prompt)
    [out] = llm.generate(prompt, SamplingParams(n=8, temperature=1.0, max_tokens=4, seed=0), use_tqdm=False)
    assert len(out.outputs) == 8
    stats = llm.engine.stats()
    cached = (length - 1) // block * block  # a hit never covers the last prompt token
    assert stats.prefix_cache_queries == 8 * length
    assert stats.prefix_cache_hits == 7 * cached
    assert stats.num_prompt_tokens_computed == length + 7 * (length - cached)
    assert stats.num_prompt_tokens_computed < 2 * length


def test_prompt_logprobs_skip_the_cache_read_and_are_the_same_as_uncached(stage, tiny_llama):
    """A cache hit keeps K/V, not the logits of the prompt positions it skips: a request that wants
    prompt logprobs does not read the cache (as vLLM's ``skip_reading_prefix_cache``)."""
    llm = stage.make_llm(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    first = llm.generate(SYSTEM, params, use_tqdm=False)[0]
    before = llm.engine.stats()
    second = llm.generate(SYSTEM, params, use_tqdm=False)[0]
    after = llm.engine.stats()
    assert second.num_cached_tokens == 0 and after.prefix_cache_queries == before.prefix_cache_queries
    assert second.prompt_logprobs == first.prompt_logprobs and len(first.prompt_logprobs) == len(first.prompt_token_ids)
    plain = llm.generate(SYSTEM, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0  # its blocks entered the cache all the same
    assert plain.outputs[0].token_ids == first.outputs[0].token_ids
