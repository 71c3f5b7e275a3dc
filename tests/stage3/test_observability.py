"""The periodic stats line and the counters behind it."""

from __future__ import annotations

import logging

from shared import SamplingParams
from shared.metrics import SchedulerStats
from stage3_continuous import format_stats_line


def test_stats_line_reports_rates_over_the_interval():
    before = SchedulerStats(num_prompt_tokens_computed=100, num_generation_tokens=10, prefix_cache_queries=0)
    after = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions=1,
                           prefix_cache_queries=200, prefix_cache_hits=50, num_prompt_tokens_computed=300,
                           num_generation_tokens=50)
    line = format_stats_line(before, after, 2.0)
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Preemptions: 1")


def test_engine_logs_stats_lines_and_counts_tokens(tiny_llama, caplog):
    from stage3_continuous import LLM

    llm = LLM(model=str(tiny_llama), max_model_len=128, log_stats_interval=1e-9)
    with caplog.at_level(logging.INFO, logger="stagedserve"):
        outs = llm.generate(["Hello, world!", "x"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Avg prompt throughput")]
    assert lines and "Running:" in lines[0]
    stats = llm.engine.stats()
    assert stats.num_generation_tokens == 10
    assert stats.num_prompt_tokens_computed == sum(len(o.prompt_token_ids) for o in outs)
