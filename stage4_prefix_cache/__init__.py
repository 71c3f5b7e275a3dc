"""Stage 4: automatic prefix caching. Full KV blocks are named by a chained hash of their
tokens and context, so a prompt that starts like an earlier one reuses its blocks.

A block's hash covers its parent's hash, its tokens and tagged extra keys (cache salt,
adapter), so equal tokens after different prefixes, or under different salts, never
match. Reference counts keep shared blocks alive; freed blocks wait in an LRU free queue
with their contents intact until an allocation evicts them. Changed from stage3: the KV
cache manager (and the block pool under it); the scheduler loop is stage3's, which
already asked for computed blocks. vLLM: ``vllm/v1/core/kv_cache_utils.py``,
``vllm/v1/core/block_pool.py``, ``vllm/v1/core/kv_cache_manager.py``.
"""

from stage3_continuous import *  # noqa: F403  (re-export the whole surface of the stage before)
from stage3_continuous import __all__ as _stage3_all
from stage4_prefix_cache.block_pool import BlockPool
from stage4_prefix_cache.kv_cache_manager import KVCacheManager, PrefixCacheStats
from stage4_prefix_cache.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
)
from stage4_prefix_cache.scheduler import CacheConfig, LoggingStatLogger, Scheduler, format_stats_line

_OVERRIDDEN = ("Scheduler", "CacheConfig", "KVCacheManager", "LoggingStatLogger", "format_stats_line")
# ``LLM`` (``llm.py``) loads on first use (``__getattr__`` below): importing the stage loads its engine alone. It is in
# no ``__all__``, so the next stage's ``import *`` takes the rest of the surface and gives its own ``LLM``.
__all__ = [n for n in _stage3_all if n not in _OVERRIDDEN] + [
    "BlockPool", "CacheConfig", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager",
    "PrefixCacheStats", "Scheduler", "LoggingStatLogger", "format_stats_line", "get_hash_fn", "hash_block_tokens",
    "hash_request_tokens",
]


def __getattr__(name: str):
    if name == "LLM":  # the offline front end over this stage's engine (``llm.py``), loaded on first use
        from stage4_prefix_cache.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
