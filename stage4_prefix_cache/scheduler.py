"""Stage3's scheduler with a prefix-caching KV cache manager plugged in.

The scheduling loop does not change: it already asks ``get_computed_blocks`` before
admitting a waiting request and starts the request at that many computed tokens. In
stage3 the answer was always "none"; here it is the longest run of cached full blocks.
What this file adds is the configuration, the cache counters in the stats (and the hit
rate in the periodic stats line), and one rule for failures: blocks hashed for a step whose
forward pass raised may hold no K/V, so their hashes are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.metrics import SchedulerStats
from stage3_continuous.config import CacheConfig as _PagedCacheConfig
from stage3_continuous.engine import LoggingStatLogger as _ContinuousStatLogger
from stage3_continuous.scheduler import Scheduler as _ContinuousScheduler
from stage3_continuous.scheduler import SchedulerOutput
from stage4_prefix_cache.kv_cache_manager import KVCacheManager


@dataclass
class CacheConfig(_PagedCacheConfig):
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # or "fast": see kv_cache_utils.fast_hash for the trade-off


class Scheduler(_ContinuousScheduler):
    kv_cache_manager: KVCacheManager

    def _make_kv_cache_manager(self, cache_config: CacheConfig) -> KVCacheManager:
        if not isinstance(cache_config, CacheConfig):  # a stage3 config: caching stays off
            cache_config = CacheConfig(cache_config.block_size, cache_config.num_blocks,
                                       cache_config.shuffle_seed, enable_prefix_caching=False)
        return KVCacheManager(cache_config.block_size, cache_config.num_blocks,
                              enable_caching=cache_config.enable_prefix_caching,
                              hash_fn=cache_config.prefix_caching_hash_algo, shuffle_seed=cache_config.shuffle_seed)

    def stats(self) -> SchedulerStats:
        stats = super().stats()
        cache = self.kv_cache_manager.prefix_cache_stats
        stats.prefix_cache_queries, stats.prefix_cache_hits = cache.queries, cache.hits
        return stats

    def recover_from_failed_step(self, output: SchedulerOutput) -> None:
        super().recover_from_failed_step(output)
        self.kv_cache_manager.block_pool.evict_free_cached_blocks()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()


class LoggingStatLogger(_ContinuousStatLogger):
    """Stage 3's stats line with the prefix-cache hit rate of the interval (tokens found / looked up)."""

    @staticmethod
    def fields(before: SchedulerStats, after: SchedulerStats, seconds: float) -> list[str]:
        fields = _ContinuousStatLogger.fields(before, after, seconds)
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        fields.insert(-1, f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
        return fields


format_stats_line = LoggingStatLogger.format_line
