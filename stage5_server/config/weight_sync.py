"""Weight sync's settings (``weight_sync/``): whether the engine takes weight updates and sleeps, and the
worker extension that gives every rank the methods for it, by qualified name (each rank builds it over its
worker: ``executor/abstract.make_worker``), so this package imports nothing of the room.

vLLM: ``ParallelConfig.worker_extension_cls`` (``vllm/config/parallel.py``) and ``enable_sleep_mode``
(``vllm/config/model.py``).
"""

from __future__ import annotations

from typing import Any

WORKER_EXTENSION = "stage5_server.weight_sync.worker:WeightSyncWorker"


def check_weight_sync(enabled: Any) -> bool:
    if not isinstance(enabled, bool):
        raise ValueError(f"enable_weight_sync: must be a bool, got {enabled!r}")
    return enabled


def weight_sync_extension(enabled: bool) -> str | None:
    """The worker extension of an engine with weight sync ``enabled``; None: none."""
    return WORKER_EXTENSION if enabled else None
