"""Scheduler and cache settings (vLLM: ``vllm/config/scheduler.py``, ``vllm/config/cache.py``)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # the token budget of one step
    max_num_seqs: int = 16  # requests scheduled in one step
    max_num_active_seqs: int | None = None  # cap on the RUNNING set (defaults to max_num_seqs)
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        active = self.max_num_active_seqs
        if active is not None and (not isinstance(active, int) or not 1 <= active <= self.max_num_seqs):
            raise ValueError(f"max_num_active_seqs: must be an integer in [1, max_num_seqs], got {active!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill: must be a bool, got {self.enable_chunked_prefill!r}")

    @property
    def running_cap(self) -> int:
        return self.max_num_active_seqs or self.max_num_seqs


@dataclass
class CacheConfig:
    block_size: int
    num_blocks: int
    shuffle_seed: int | None = None  # shuffle the free list (physical order must not matter)

    def __post_init__(self):
        for name in ("block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
