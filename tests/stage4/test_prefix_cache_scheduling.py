"""Prefix caching seen through the real scheduler and engine."""

from __future__ import annotations

from shared import SamplingParams
from shared.metrics import SchedulerStats
from stage4_prefix_cache import CacheConfig, Scheduler, SchedulerConfig, dry_run_step, format_stats_line
from tests.stage3.scheduler_driver import make_request

A_TO_H = [100, 101, 102, 103, 104, 105, 106, 107]
ABCDEF_XYZ = [100, 101, 102, 103, 104, 105, 200, 201, 202]


def test_seed_r1_enters_with_five_tokens_and_finishes_prefill_in_step_zero():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6),
                      CacheConfig(block_size=4, num_blocks=16, enable_prefix_caching=True), max_model_len=64)
    r0 = make_request("R0", 0)
    r0.prompt_token_ids[:] = A_TO_H[:5]
    r0.all_token_ids[:] = A_TO_H[:5]
    sched.add_request(r0)
    dry_run_step(sched, token=A_TO_H[5])  # R0 prefill of A..E, samples F
    dry_run_step(sched, token=A_TO_H[6])
    dry_run_step(sched, token=A_TO_H[7])  # R0 has now computed A..G and holds A..H: its blocks are full
    assert r0.all_token_ids == A_TO_H
    r1 = make_request("R1", 0)
    r1.prompt_token_ids[:] = ABCDEF_XYZ
    r1.all_token_ids[:] = ABCDEF_XYZ
    sched.add_request(r1)
    out = dry_run_step(sched)
    assert r1.num_cached_tokens == 4  # only the full, identical block A B C D
    assert out.num_scheduled_tokens == {"R0": 1, "R1": 5}  # 9 - 4 = 5 tokens of prefill
    assert r1.num_output_tokens == 1  # prefill finished in step 0: it already sampled
    shared_block = sched.kv_cache_manager.get_block_ids("R0")[0]
    assert sched.kv_cache_manager.get_block_ids("R1")[0] == shared_block
    assert sched.kv_cache_manager.block_pool.blocks[shared_block].ref_cnt == 2


def test_same_salt_shares_prefix_blocks_and_different_salts_share_nothing(tiny_llama):
    from stage4_prefix_cache import LLM

    llm = LLM(model=str(tiny_llama), block_size=4, max_model_len=128)
    prompt = "Prompts that start the same way share their cached blocks: a system prompt"
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached_tokens(salt):
        rid = llm.add_request(prompt, params, cache_salt=salt)
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.request_id == rid and out.finished:
                    result = out
        return result.num_cached_tokens

    assert cached_tokens("tenant-A") == 0
    assert cached_tokens("tenant-A") > 0
    assert cached_tokens("tenant-B") == 0
    assert cached_tokens(None) == 0


def test_reset_prefix_cache_clears_hits(tiny_llama):
    from stage4_prefix_cache import LLM

    llm = LLM(model=str(tiny_llama), block_size=4, max_model_len=128)
    prompt = "Prompts that start the same way share their cached blocks"
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0


def test_the_stats_line_adds_the_prefix_cache_hit_rate_of_the_interval():
    before = SchedulerStats(num_prompt_tokens_computed=100, num_generation_tokens=10, prefix_cache_queries=0)
    after = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions=1,
                           prefix_cache_queries=200, prefix_cache_hits=50, num_prompt_tokens_computed=300,
                           num_generation_tokens=50)
    line = format_stats_line(before, after, 2.0)
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%, "
                    "Preemptions: 1")

