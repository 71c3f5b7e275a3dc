"""The step observer: one ``StepRecord`` per engine step, built only when the inspector is on.

``EngineCore`` holds a ``StepObserver`` as its ``inspector`` member (None: off, and then the only cost is
``if self.inspector is not None`` twice a step). The core calls it twice a step:

- ``scheduled(output, scheduler)``, right after ``schedule()``: where each scheduled request stands before
  it runs (its computed positions, its output length), and the blocks the schedule handed out or took back;
- ``stepped(output, result, scheduler)``, once the scheduler has taken the runner's tokens (and the
  drafter has proposed the next drafts): the blocks of the requests that finished, and the step's record,
  appended to a bounded buffer that drops the oldest (``buffer.py``). The busy loop ``drain``s it into each
  ``EngineCoreOutputs``, which carries the records to every API server as it carries the stats
  (``core/busy_loop.py``, ``core/core_proc.py``). A step's duration runs from the first call to the second.

Everything is read from the scheduler's public state and the step contract: ``SchedulerOutput``'s
``num_scheduled_tokens``, ``scheduled_spec_decode_tokens`` and ``preempted_req_ids``, the requests
(``scheduler.requests``, ``running``, ``waiting``), and the KV cache manager's tables and block pool
(``tracker.py``). Under pipeline parallelism several steps are in flight; each is matched by its output.
The same two calls record a stage 3 or 4 scheduler from outside (``recorders.py``): those stages'
schedulers have the same public state, and their ``SchedulerOutput`` the same three fields.

vLLM: the nearest is the per-step ``IterationStats`` built beside ``update_from_output``
(``vllm/v1/engine/core.py``, ``vllm/v1/metrics/stats.py``), which counts what a step did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from stage5_server.inspector.buffer import RecordBuffer
from stage5_server.inspector.records import MAX_WAITING_IDS, FreedBlocks, RequestStep, StepRecord, StepRecords
from stage5_server.inspector.tracker import BlockTracker, token_kinds

if TYPE_CHECKING:  # the step contract, imported in this one place
    from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput

DEFAULT_CAPACITY = 1024  # records the core holds for a busy loop that has not published them yet
Grown = dict[str, tuple[list[int], list[int], list[int], list[int]]]  # BlockTracker.update's first answer


@dataclass
class Begun:
    """A step between ``scheduled`` and ``stepped``: when it started, where each scheduled request stood
    (computed positions, output tokens), and what the schedule did to the pool."""

    started: float
    before: dict[str, tuple[int, int]]
    grown: Grown
    freed: list[FreedBlocks]


def block_tables(manager: Any) -> tuple[Mapping[str, Any], Callable[[Any], int], Callable[[int], Any] | None, bool]:
    """A KV cache manager's tables for ``BlockTracker``: ``(tables, block id of an entry, a block's hash
    (None: not cached; the function None: the pool caches nothing), whether the pool's prefix cache is empty)``.
    Stage 4's and 5's tables hold ``KVCacheBlock``s of a block pool; stage 3's are ``BlockTable``s of bare ids."""
    if hasattr(manager, "req_to_blocks"):
        pool = manager.block_pool
        blocks = pool.blocks
        return (manager.req_to_blocks, attrgetter("block_id"),
                (lambda b: blocks[b].block_hash) if pool.enable_caching else None,
                not pool.cached_block_hash_to_block)
    return {rid: table.block_ids for rid, table in manager.tables.items()}, int, None, True


class StepObserver:
    def __init__(self, num_blocks: int, block_size: int, capacity: int = DEFAULT_CAPACITY, clock: str = "seconds"):
        if clock not in ("seconds", "steps"):
            raise ValueError(f"clock: 'seconds' or 'steps', got {clock!r}")
        self.block_size = block_size
        self.tracker = BlockTracker(num_blocks)
        self.buffer: RecordBuffer[StepRecord] = RecordBuffer(capacity)
        self.clock = clock  # "steps": times count steps, so a run records the same numbers every time
        self.step = 0
        self.requests: dict[str, Any] = {}  # id -> the scheduler's Request, while the observer may need it
        self.in_flight: dict[int, Begun] = {}  # id(output) -> its step, until the scheduler has its tokens
        self.offload = (0, 0)  # the KV connector's loaded and saved blocks, as of the last record
        self.seen_at: dict[str, int] = {}  # on the steps clock: the step each request was first seen in
        self.first_token_at: dict[str, int] = {}  # ... and the step it gained its first token in

    @classmethod
    def for_scheduler(cls, scheduler: Any, **kwargs: Any) -> StepObserver:
        """An observer of ``scheduler``'s pool, which takes the blocks already held as they are."""
        observer = cls(scheduler.cache_config.num_blocks, scheduler.cache_config.block_size, **kwargs)
        observer.track(scheduler)
        return observer

    # ---- the two calls, after ``schedule`` and after ``update_from_output`` ------------------------
    def scheduled(self, output: SchedulerOutput, scheduler: Any) -> None:
        """The blocks the schedule gave (and took back, preempting), and where each scheduled request stood."""
        if not output.total_num_scheduled_tokens:
            return  # nothing runs: no step (what the schedule freed shows in the next record)
        requests, before = scheduler.requests, {}
        for rid in output.num_scheduled_tokens:
            request = self.requests.setdefault(rid, requests[rid])
            before[rid] = (request.num_computed_tokens, request.num_output_tokens)
        grown, freed = self.track(scheduler)
        for gone in freed:
            gone.scheduling = True
        if len(self.in_flight) > 64:  # steps that failed never reach ``stepped``
            self.in_flight.clear()
        self.in_flight[id(output)] = Begun(time.perf_counter(), before, grown, freed)

    def stepped(self, output: SchedulerOutput, result: ModelRunnerOutput | None, scheduler: Any) -> None:
        """The step's record, into the buffer (``result``, the runner's answer, is not needed: the requests
        already hold their tokens)."""
        begun = self.in_flight.pop(id(output), None)
        if begun is not None:
            self.buffer.append(self.end(scheduler, begun, output.num_scheduled_tokens,
                                        getattr(output, "scheduled_spec_decode_tokens", {}), output.preempted_req_ids))

    def drain(self) -> StepRecords | None:
        """The records since the last drain (None: none), with how many the buffer dropped meanwhile."""
        if not len(self.buffer):
            return None
        records, dropped = self.buffer.drain()
        return StepRecords(records, dropped)

    # ---- the record ------------------------------------------------------------------------------
    def track(self, scheduler: Any) -> tuple[Grown, list[FreedBlocks]]:
        manager, tracker = scheduler.kv_cache_manager, self.tracker
        tables, block_id, hash_of, cache_empty = block_tables(manager)
        if tracker.num_cached and cache_empty:
            tracker.forget_cache()  # the prefix cache was reset
        return tracker.update(tables, block_id, self.num_hit_blocks, hash_of, self.why)

    def end(self, scheduler: Any, begun: Begun, num_scheduled_tokens: Mapping[str, int],
            drafts: Mapping[str, list[int]], preempted: Collection[str]) -> StepRecord:
        """After the scheduler took the step's tokens: its record."""
        steps = []
        for rid, num_scheduled in num_scheduled_tokens.items():
            request = self.requests[rid]
            computed, num_output = begun.before[rid]
            num_drafts = len(drafts.get(rid, ()))
            prefill, decode, verify = token_kinds(num_scheduled, num_drafts, computed, request.num_prompt_tokens)
            sampled = request.num_output_tokens - num_output
            step = RequestStep(rid, prefill, decode, verify, max(0, sampled - 1) if verify else 0, sampled,
                               request.num_computed_tokens, request.num_prompt_tokens)
            self.latencies(step, request, num_output)
            steps.append(step)
        grown, freed = self.track(scheduler)  # the blocks of the requests the step finished
        by_id = {step.id: step for step in steps}
        for changes in (begun.grown, grown):
            for rid, (new, hit, loaded, evicted) in changes.items():
                step = by_id.get(rid)
                if step is not None:
                    step.new, step.hit = (*step.new, *new), (*step.hit, *hit)
                    step.loaded, step.evicted = (*step.loaded, *loaded), (*step.evicted, *evicted)
        record = self.record(scheduler, steps, begun.freed + freed, sorted(preempted), begun.started)
        if self.clock == "steps":
            for rid in record.waiting:
                self.seen_at.setdefault(rid, record.step + 1)
        return record

    def latencies(self, step: RequestStep, request: Any, num_output_before: int) -> None:
        """TTFT in the step that gave ``request`` its first token; TPOT and the finish reason in its last."""
        times = request.timeline.token_times
        now = self.step + 1
        if self.clock == "seconds":
            if num_output_before == 0 and step.sampled:
                step.ttft = round(times[0] - request.arrival_time, 6)
            if request.is_finished and len(times) > 1:
                step.tpot = round((times[-1] - times[0]) / (len(times) - 1), 6)
        else:  # in steps: from the step it was first seen in, both counted
            seen = self.seen_at.setdefault(step.id, now)
            if num_output_before == 0 and step.sampled:
                step.ttft = float(now - seen + 1)
                self.first_token_at[step.id] = now
            if request.is_finished and len(times) > 1:
                step.tpot = round((now - self.first_token_at.get(step.id, now)) / (len(times) - 1), 6)
        if request.is_finished:
            step.finish = request.status.finish_reason
            self.seen_at.pop(step.id, None)
            self.first_token_at.pop(step.id, None)

    def record(self, scheduler: Any, steps: list[RequestStep], freed: list[FreedBlocks], preempted: list[str],
               started: float) -> StepRecord:
        for rid in [f.id for f in freed] + [s.id for s in steps if s.finish is not None]:
            request = self.requests.get(rid)
            if request is not None and request.is_finished:
                del self.requests[rid]
        if self.step % 1024 == 1023:  # preempted, then aborted while waiting: never freed again, so forget them here
            self.requests = {rid: r for rid, r in self.requests.items() if not r.is_finished}
        manager, tracker = scheduler.kv_cache_manager, self.tracker
        waiting, running = scheduler.waiting, scheduler.running
        num_free = manager.num_free_blocks
        self.step += 1
        record = StepRecord(
            step=self.step, time=float(self.step) if self.clock == "steps" else round(time.monotonic(), 6),
            duration=1.0 if self.clock == "steps" else round(time.perf_counter() - started, 6),
            budget=scheduler.config.max_num_batched_tokens, num_blocks=tracker.num_blocks,
            block_size=self.block_size, requests=steps, freed=freed, preempted=preempted,
            running=[r.request_id for r in running],
            waiting=[r.request_id for r, _ in zip(waiting, range(MAX_WAITING_IDS))], num_waiting=len(waiting),
            free=num_free, used=tracker.num_blocks - num_free, cached=tracker.num_cached,
            drafts=sum(len(getattr(r, "spec_token_ids", ())) for r in running))
        connector = getattr(scheduler, "kv_connector", None)
        if connector is not None:
            counters = connector.stats()
            loaded, saved = counters.offload_loaded_blocks, counters.offload_saved_blocks
            record.offload_loaded, record.offload_saved = loaded - self.offload[0], saved - self.offload[1]
            self.offload = (loaded, saved)
        return record

    def num_hit_blocks(self, request_id: str) -> int:
        """A newly admitted request's prefix-cache hits, in blocks (its ``num_cached_tokens``)."""
        request = self.requests.get(request_id)
        return 0 if request is None else request.num_cached_tokens // self.block_size

    def why(self, request_id: str) -> str:
        """Why a request's blocks went back: a finished request finished or was aborted; one that goes on
        was preempted."""
        request = self.requests.get(request_id)
        if request is None or not request.is_finished:
            return "preempted"
        return "aborted" if request.status.finish_reason == "abort" else "finished"
