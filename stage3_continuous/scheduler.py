"""One token budget per step, spent decode-first; requests join and leave every step.

Each call to ``schedule()`` decides the next forward pass:

1. Running requests first, in the order they were admitted. Each asks for the tokens it
   still lacks: one for a decode, the rest of its prompt (up to the budget) for a
   request in the middle of a chunked prefill. If the KV cache cannot back those tokens,
   the scheduler preempts the lowest-priority, newest request (by recompute: its blocks
   are freed, its generated tokens are kept, and it goes back to the front of the
   waiting queue to re-prefill prompt + output later) and tries again.
2. Whatever budget is left admits waiting requests in policy order, each with as much of
   its prompt as fits (chunked prefill), or only if the whole prompt fits (chunking off).

The budget counts input positions computed, not tokens emitted: a prefill chunk costs its
length, a decode costs one. Nothing here touches a model: tests drive it with token ids.

vLLM: ``vllm/v1/core/sched/scheduler.py`` and ``sched/output.py``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

from shared.metrics import SchedulerStats
from shared.request import Request, RequestStatus, check_stop
from stage3_continuous.config import CacheConfig, SchedulerConfig
from stage3_continuous.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerOutput:
    """The hand-off from scheduler to model runner for one step."""

    scheduled_new_reqs: list[Request]  # admitted this step (first time, or resumed after preemption)
    scheduled_running_reqs: list[Request]  # were already running
    num_scheduled_tokens: dict[str, int]  # request id -> input positions to compute this step
    total_num_scheduled_tokens: int
    block_tables: dict[str, list[int]]  # request id -> its physical block ids, in logical order
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)  # finished since the previous step
    aborted_reqs: list[Request] = field(default_factory=list)  # refused this step: their grammar failed

    @property
    def scheduled_reqs(self) -> list[Request]:
        return self.scheduled_running_reqs + self.scheduled_new_reqs


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, max_model_len: int = 1 << 30):
        self.config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.kv_cache_manager = self._make_kv_cache_manager(cache_config)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.counters = SchedulerStats()

    def _make_kv_cache_manager(self, cache_config: CacheConfig):
        return KVCacheManager(cache_config.block_size, cache_config.num_blocks, cache_config.shuffle_seed)

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the scheduler")
        blocks = -(-min(request.num_prompt_tokens + 1, self.max_model_len) // self.cache_config.block_size)
        if blocks > self.cache_config.num_blocks:
            raise ValueError(f"prompt: {request.num_prompt_tokens} tokens need {blocks} KV blocks, "
                             f"the pool has {self.cache_config.num_blocks}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finish (typically abort) requests wherever they are; their blocks return to the pool."""
        assert status.is_finished
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request in self.waiting:
                self.waiting.remove(request)
            else:
                self.running.remove(request)
            request.status = status
            self._free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        s = self.counters
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_cache_usage = self.kv_cache_manager.usage
        return replace(s)  # a snapshot: later steps do not change it

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: set[str] = set()

        # 1. Running requests: decodes and unfinished prefill chunks, in admission order.
        index, running, max_num_seqs = 0, self.running, self.config.max_num_seqs
        allocate_slots = self.kv_cache_manager.allocate_slots
        while index < len(running) and budget > 0 and len(num_scheduled) < max_num_seqs:
            request = running[index]
            num_new = min(self._num_tokens_to_compute(request), budget)
            while allocate_slots(request, num_new) is None:
                # Victims come from the requests not yet granted tokens this step (this one
                # included): a granted request's new blocks must stay for this forward pass.
                victim = max(running[index:], key=lambda r: (r.priority, r.arrival_time))
                running.remove(victim)
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled_running.append(request)
                num_scheduled[request.request_id] = num_new
                budget -= num_new
                index += 1

        # 2. Waiting requests, with the budget that is left (none if we just had to preempt).
        aborted: list[Request] = []
        while (self.waiting and budget > 0 and not preempted and len(num_scheduled) < self.config.max_num_seqs
               and self._num_running() < self.config.running_cap):
            request = self._peek_waiting()
            if request is None:
                break  # only requests whose grammar is still compiling
            if request.grammar_failed:
                self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
                continue
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                break  # the whole prompt must fit in one step
            num_new = min(num_new, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, num_computed, computed_blocks) is None:
                break  # no room; it stays first in line
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = num_computed
            if request.timeline.first_scheduled is None:
                request.timeline.first_scheduled = time.monotonic()
            scheduled_new.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        output = SchedulerOutput(
            scheduled_new_reqs=scheduled_new,
            scheduled_running_reqs=scheduled_running,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            block_tables=self._block_tables(num_scheduled),
            preempted_req_ids=preempted,
            finished_req_ids=self.finished_req_ids,
            aborted_reqs=aborted,
        )
        self.finished_req_ids = set()
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[Request]:
        """Advance every scheduled request; append sampled tokens; finish what must stop.

        A request still in the middle of its prefill gets an empty list. Returns the
        requests that gained a token or finished.
        """
        updated = []
        now = time.monotonic()
        num_prompt_computed = num_sampled = 0
        for rid, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue  # aborted while its step ran
            if request.num_computed_tokens < request.num_prompt_tokens:
                num_prompt_computed += min(num_new, request.num_prompt_tokens - request.num_computed_tokens)
            request.num_computed_tokens += num_new
            tokens = sampled_token_ids.get(rid)
            if not tokens:
                continue  # mid-prefill: nothing sampled
            for token in tokens:
                request.append_output_token(token, now)
                num_sampled += 1
                if check_stop(request, self.max_model_len):
                    self.running.remove(request)
                    self._free(request)
                    break
            updated.append(request)
        self.counters.num_prompt_tokens_computed += num_prompt_computed
        self.counters.num_generation_tokens += num_sampled
        self.counters.observe_step(num_prompt_computed + num_sampled)  # vLLM's iteration tokens
        return updated

    def recover_from_failed_step(self, output: SchedulerOutput) -> None:
        """The forward pass for ``output`` raised: its requests cannot continue, abort them."""
        self.finish_requests(list(output.num_scheduled_tokens), RequestStatus.FINISHED_ABORTED)

    # ---- helpers ---------------------------------------------------------------------------
    def _block_tables(self, request_ids) -> dict[str, list[int]]:
        return {rid: self.kv_cache_manager.get_block_ids(rid) for rid in request_ids}

    def _num_running(self) -> int:
        """Requests holding a place in the running set."""
        return len(self.running)

    def _num_tokens_to_compute(self, request: Request) -> int:
        """Input positions a running request still lacks: one for a decode, the prompt's rest mid-prefill."""
        return request.num_tokens - request.num_computed_tokens

    def _peek_waiting(self) -> Request | None:
        """The next waiting request in policy order; one whose grammar is still compiling waits
        without holding up the others (vLLM's ``WAITING_FOR_FSM``)."""
        ready = (r for r in self.waiting if not r.waiting_for_grammar)
        if self.config.policy == "priority":
            return min(ready, key=lambda r: (r.priority, r.arrival_time), default=None)
        return next(ready, None)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        if request.timeline.finished is None:
            request.timeline.finished = time.monotonic()
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
