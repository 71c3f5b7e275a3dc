"""The engine core: schedule, execute, update, once per step.

vLLM: ``vllm/v1/engine/core.py`` (``EngineCore.step``).
"""

from __future__ import annotations

import logging
import time

import torch

from shared.metrics import SchedulerStats
from shared.model import DecoderModel
from shared.model_runner import ModelRunner, ScheduledBatch, prepare_inputs
from shared.request import Request, RequestStatus
from stage2_paged.attention import PagedAttentionBackend, build_paged_metadata
from stage2_paged.block_table import slot_mapping
from stage2_paged.kv_cache import PagedKVCache
from stage3_continuous.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger("stagedserve")


class SchedulerFacade:
    """What an engine core answers from its scheduler alone (stage 5's engine core answers the same way)."""

    scheduler: Scheduler

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_manager.usage

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def live_block_ids(self) -> dict[str, list[int]]:
        manager = self.scheduler.kv_cache_manager
        return {r.request_id: manager.get_block_ids(r.request_id) for r in self.scheduler.running}


class EngineCore(SchedulerFacade):
    def __init__(self, model: DecoderModel, scheduler: Scheduler, kv_cache: PagedKVCache, device: torch.device,
                 seed: int = 0, stats_logger: LoggingStatLogger | None = None):
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.max_model_len = scheduler.max_model_len
        self.device = device
        self.runner = ModelRunner(model, device, seed)
        model.set_attention_backend(PagedAttentionBackend(kv_cache))
        self.stats_logger = stats_logger
        self.step_trace: list[dict[str, int]] | None = None  # set to [] to record tokens per request per step

    def step(self) -> list[Request]:
        output = self.scheduler.schedule()
        if self.step_trace is not None:
            self.step_trace.append(dict(output.num_scheduled_tokens))
        if output.total_num_scheduled_tokens == 0:
            return output.aborted_reqs
        try:
            sampled = self.execute_model(output)
        except Exception:
            self.scheduler.recover_from_failed_step(output)  # free their KV, then let the caller know
            raise
        updated = self.scheduler.update_from_output(output, {rid: [t] for rid, t in sampled.items()})
        if self.stats_logger:
            self.stats_logger.maybe_log(self.stats())
        return output.aborted_reqs + updated  # aborted: refused at admission (their grammar failed)

    def execute_model(self, output: SchedulerOutput) -> dict[str, int]:
        batch = scheduled_batch(output)
        inputs = prepare_inputs(batch, self.device)
        slots, tables = kv_layout(batch, output.block_tables, self.kv_cache.block_size)
        meta = build_paged_metadata(slots, inputs.query_start_loc, inputs.seq_lens, tables, self.device)
        return self.runner.execute(batch, inputs, meta)


def scheduled_batch(output: SchedulerOutput) -> ScheduledBatch:
    """The step's ``(request, num_new_tokens)`` pairs, running requests first, as the runner takes them."""
    return [(r, output.num_scheduled_tokens[r.request_id]) for r in output.scheduled_reqs]


def kv_layout(batch: ScheduledBatch, block_tables: dict[str, list[int]],
              block_size: int) -> tuple[list[int], list[list[int]]]:
    """Where this step's new K/V go (one slot per token) and each sequence's block table."""
    slots: list[int] = []
    tables = []
    for request, num_new in batch:
        table = block_tables[request.request_id]
        start = request.num_computed_tokens
        slots.extend(slot_mapping(table, block_size, start, start + num_new))
        tables.append(table)
    return slots, tables


class LoggingStatLogger:
    """A periodic line like vLLM's ``LoggingStatLogger`` (``vllm/v1/metrics/loggers.py``).

    Throughput covers the last interval; preemptions are cumulative. An idle interval logs
    at DEBUG, so a quiet engine stays quiet. A later stage adds its own numbers by
    overriding ``fields``.
    """

    def __init__(self, interval: float, log: logging.Logger = logger):
        if not isinstance(interval, (int, float)) or interval <= 0:
            raise ValueError(f"log_stats_interval: must be > 0 seconds, got {interval!r}")
        self.interval = interval
        self.log = log
        self.last_time = time.monotonic()
        self.last = SchedulerStats()

    def maybe_log(self, stats: SchedulerStats, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        if now < self.last_time + self.interval:  # not now - last_time: that difference can round below it
            return None
        line = self.format_line(self.last, stats, now - self.last_time)
        idle = (stats.num_running == stats.num_waiting == 0
                and stats.num_prompt_tokens_computed == self.last.num_prompt_tokens_computed
                and stats.num_generation_tokens == self.last.num_generation_tokens)
        self.log.log(logging.DEBUG if idle else logging.INFO, line)
        self.last, self.last_time = stats, now
        return line

    @classmethod
    def format_line(cls, before: SchedulerStats, after: SchedulerStats, seconds: float) -> str:
        return ", ".join(cls.fields(before, after, max(seconds, 1e-9)))

    @staticmethod
    def fields(before: SchedulerStats, after: SchedulerStats, seconds: float) -> list[str]:
        prompt = (after.num_prompt_tokens_computed - before.num_prompt_tokens_computed) / seconds
        generation = (after.num_generation_tokens - before.num_generation_tokens) / seconds
        return [f"Avg prompt throughput: {prompt:.1f} tokens/s",
                f"Avg generation throughput: {generation:.1f} tokens/s", f"Running: {after.num_running} reqs",
                f"Waiting: {after.num_waiting} reqs",
                f"KV cache usage: {100 * after.kv_cache_usage:.1f}%", f"Preemptions: {after.num_preemptions}"]


format_stats_line = LoggingStatLogger.format_line
