"""``LLM`` for stage3: the shared front end over the continuous-batching engine core."""

from __future__ import annotations

from shared.llm_base import BaseLLM
from stage2_paged.llm import PAGED_ARGS, make_paged_cache, resolve_num_blocks
from stage3_continuous.config import CacheConfig, SchedulerConfig
from stage3_continuous.engine import EngineCore, LoggingStatLogger
from stage3_continuous.scheduler import Scheduler

CONTINUOUS_ARGS = {
    **PAGED_ARGS,
    "max_num_batched_tokens": 512,
    "max_num_active_seqs": None,
    "enable_chunked_prefill": True,
    "scheduling_policy": "fcfs",
    "log_stats_interval": None,  # seconds between stats lines in the log; None: off
}


class LLM(BaseLLM):
    stage = "stage3_continuous"
    engine_args = CONTINUOUS_ARGS
    stats_logger_class = LoggingStatLogger  # a later stage logs more by naming its own

    def _scheduler_config(self) -> SchedulerConfig:
        a = self.args
        return SchedulerConfig(max_num_batched_tokens=a["max_num_batched_tokens"], max_num_seqs=a["max_num_seqs"],
                               max_num_active_seqs=a["max_num_active_seqs"],
                               enable_chunked_prefill=a["enable_chunked_prefill"], policy=a["scheduling_policy"])

    def _cache_config(self, block_size: int, num_blocks: int) -> CacheConfig:
        return CacheConfig(block_size, num_blocks, shuffle_seed=self.args["block_shuffle_seed"])

    def _make_scheduler(self, cache_config) -> Scheduler:
        return Scheduler(self._scheduler_config(), cache_config, self.max_model_len)

    def _stats_logger(self) -> LoggingStatLogger | None:
        interval = self.args["log_stats_interval"]
        return self.stats_logger_class(interval) if interval else None

    def _build_engine(self) -> EngineCore:
        block_size, num_blocks = resolve_num_blocks(self)
        scheduler = self._make_scheduler(self._cache_config(block_size, num_blocks))
        check_budget_takes_a_whole_prompt(self.args, self.max_model_len)
        kv_cache = make_paged_cache(self, block_size, num_blocks)
        return EngineCore(self.model, scheduler, kv_cache, self.device, self.args["seed"],
                          stats_logger=self._stats_logger())


def check_budget_takes_a_whole_prompt(args: dict, max_model_len: int) -> None:
    """Without chunked prefill a prompt runs in one step, so the budget must fit the longest one."""
    if not args["enable_chunked_prefill"] and args["max_num_batched_tokens"] < max_model_len:
        raise ValueError("max_num_batched_tokens: without chunked prefill it must be >= max_model_len "
                         f"({max_model_len}), or long prompts could never be scheduled")
