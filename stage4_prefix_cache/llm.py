"""``LLM`` for stage4: stage3's engine with automatic prefix caching (on by default, as in vLLM)."""

from __future__ import annotations

from stage3_continuous.llm import CONTINUOUS_ARGS
from stage3_continuous.llm import LLM as _ContinuousLLM
from stage4_prefix_cache.kv_cache_utils import get_hash_fn
from stage4_prefix_cache.scheduler import CacheConfig, LoggingStatLogger, Scheduler

PREFIX_CACHING_ARGS = {**CONTINUOUS_ARGS, "enable_prefix_caching": True, "prefix_caching_hash_algo": "sha256"}


class LLM(_ContinuousLLM):
    stage = "stage4_prefix_cache"
    engine_args = PREFIX_CACHING_ARGS
    stats_logger_class = LoggingStatLogger

    def _cache_config(self, block_size: int, num_blocks: int) -> CacheConfig:
        if not isinstance(self.args["enable_prefix_caching"], bool):
            raise ValueError(f"enable_prefix_caching: must be a bool, got {self.args['enable_prefix_caching']!r}")
        get_hash_fn(self.args["prefix_caching_hash_algo"])  # a clear error for an unknown name
        return CacheConfig(block_size, num_blocks, shuffle_seed=self.args["block_shuffle_seed"],
                           enable_prefix_caching=self.args["enable_prefix_caching"],
                           prefix_caching_hash_algo=self.args["prefix_caching_hash_algo"])

    def _make_scheduler(self, cache_config) -> Scheduler:
        return Scheduler(self._scheduler_config(), cache_config, self.max_model_len)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while requests hold blocks."""
        return self.engine.scheduler.reset_prefix_cache()
