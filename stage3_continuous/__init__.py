"""Stage 3: continuous batching. One token budget per step, spent decode-first.

Every step the scheduler gives each running request its next token, then spends what is
left of ``max_num_batched_tokens`` on chunks of waiting prompts, so requests join and
leave between steps instead of waiting for a whole batch; when KV blocks run out it
preempts the newest request and recomputes it later. Changed from stage2: the static
batch loop is replaced by ``Scheduler`` + ``EngineCore``; blocks, tables and paged
attention are stage2's, imported. vLLM: ``vllm/v1/core/sched/scheduler.py``,
``vllm/v1/core/kv_cache_manager.py``, ``vllm/v1/engine/core.py``, ``vllm/v1/request.py``.
"""

from stage2_paged import *  # noqa: F403  (re-export the whole surface of the stage before)
from stage2_paged import __all__ as _stage2_all
from stage3_continuous.config import CacheConfig, SchedulerConfig
from stage3_continuous.dry_run import describe_step, dry_run_step
from stage3_continuous.engine import EngineCore, LoggingStatLogger, format_stats_line
from stage3_continuous.kv_cache_manager import KVCacheManager
from stage3_continuous.scheduler import Scheduler, SchedulerOutput

# ``LLM`` (``llm.py``) loads on first use (``__getattr__`` below): importing the stage loads its engine alone. It is in
# no ``__all__``, so the next stage's ``import *`` takes the rest of the surface and gives its own ``LLM``.
__all__ = _stage2_all + [
    "CacheConfig", "EngineCore", "KVCacheManager", "Scheduler", "SchedulerConfig", "SchedulerOutput",
    "LoggingStatLogger", "describe_step", "dry_run_step", "format_stats_line",
]


def __getattr__(name: str):
    if name == "LLM":  # the offline front end over this stage's engine (``llm.py``), loaded on first use
        from stage3_continuous.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
