"""The engine core's stats: stage 4's snapshot with the counters of stage 5's systems, and the periodic
stats line that shows them.

A snapshot (``Scheduler.stats()``) crosses to the front end in every ``EngineCoreOutputs``; ``/metrics``
(``server/metrics.py``) and the stats line read it there. Stage 5 adds speculative decoding's counters
(``spec_decode/metrics.py``), always present, all zero while nothing is drafted, the weight version and
sleep level (``weight_sync/``), and a KV connector's counters (``kv_transfer/``).

The KV cache as resolved, for ``/metrics``' ``vllm:cache_config_info``, is ``cache_config_info``.

vLLM: ``SchedulerStats`` in ``vllm/v1/metrics/stats.py`` (its ``spec_decoding_stats``) and
``LoggingStatLogger`` in ``vllm/v1/metrics/loggers.py``; a KV connector's counters (``kv_transfer/``);
``CacheConfig`` in ``vllm/config/cache.py`` (the fields ``cache_config_info`` names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shared.metrics import SchedulerStats as _SchedulerStats
from stage4_prefix_cache.scheduler import LoggingStatLogger as _PrefixCacheStatLogger
from stage5_server.kv_transfer.base import KVConnectorStats
from stage5_server.spec_decode.metrics import SpecDecodingStats


@dataclass
class SchedulerStats(_SchedulerStats):
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    weight_version: int = 0  # weight updates the core has taken (weight_sync/)
    sleep_level: int = 0  # 0: awake
    kv_connector: KVConnectorStats = field(default_factory=KVConnectorStats)  # kv_transfer/; zeros without one

    @property
    def device_prefix_cache_hits(self) -> int:
        """Prefix-cache hit tokens the pool held (the rest a KV connector loaded into it)."""
        return self.prefix_cache_hits - self.kv_connector.external_hit_tokens


class LoggingStatLogger(_PrefixCacheStatLogger):
    """Stage 4's stats line, plus the drafts' acceptance in the interval when any were verified."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.last = SchedulerStats()  # stage 5's zero, so drafts in the very first interval are shown too

    @staticmethod
    def fields(before: _SchedulerStats, after: _SchedulerStats, seconds: float) -> list[str]:
        fields = _PrefixCacheStatLogger.fields(before, after, seconds)
        if isinstance(after, SchedulerStats) and isinstance(before, SchedulerStats):
            fields += after.spec_decoding.log_fields(before.spec_decoding)
        return fields


format_stats_line = LoggingStatLogger.format_line


def cache_config_info(args: dict[str, Any], dtype: torch.dtype, capacity: int | None) -> dict[str, str]:
    """The KV cache as resolved, as strings under the names of vLLM's ``CacheConfig`` fields (those this
    stage has; vLLM's ``cache_dtype`` "auto" is written as the dtype it means), for ``vllm:cache_config_info``.
    ``capacity``: the tokens the cache holds, once known."""
    info = {"cache_dtype": str(dtype).removeprefix("torch."), "kv_cache_size_tokens": str(capacity)}
    block_size = args.get("block_size")
    if block_size and capacity is not None:
        info.update(block_size=str(block_size), num_gpu_blocks=str(capacity // block_size),
                    num_gpu_blocks_override=str(args.get("num_kv_blocks")))
    for name, arg in (("enable_prefix_caching", "enable_prefix_caching"),
                       ("prefix_caching_hash_algo", "prefix_caching_hash_algo"),
                       ("gpu_memory_utilization", "gpu_memory_utilization"),
                       ("kv_cache_memory_bytes", "kv_cache_memory")):
        if arg in args:
            info[name] = str(args[arg])
    return info
