"""The engine core: schedule, execute on the workers, update, once per step.

``step()`` is the whole loop of vLLM V1: the scheduler decides what runs and describes it for the
workers (``SchedulerOutput``), the executor runs it on every worker (``ModelRunnerOutput`` back: a list
of tokens per request), and the scheduler appends the tokens, finishes what must stop and returns the
``EngineCoreOutput`` of every request that changed. With speculative decoding on, the core's drafter
then proposes the next drafts of each request that goes on (``spec_decode/drafter.py``). Where the
workers live (this process, one process per rank, Ray actors) is the executor's business; the core is
the same. With ``enable_inspector`` the core holds a step observer (``inspector/``) that records every
step for ``GET /inspect``; off, it is None and nothing is recorded.

A request arrives as the front end's ``EngineCoreRequest`` (token ids, never text);
``preprocess_add_request`` makes the core's ``Request`` of it and starts building its structured-output
grammar, off the step loop: the scheduler passes the request over until the grammar is ready.

Under pipeline parallelism (``parallel/pipeline.py``) one batch would keep one stage busy at a
time, so ``step`` keeps a queue of up to P batches in flight (``step_with_batch_queue``): it sends
a batch and schedules the next from the requests not in flight before it waits for the oldest.

A step whose execution raises fails the requests in it (the scheduler frees their KV): ``StepFailed``
names them; the core can step again, unless the executor is dead.

Between steps the core runs its utilities (``utilities.py``: ``collective_rpc``, and the calls a system
registered when it is on, such as weight updates and sleep, ``weight_sync/``, which the builder attaches as
the member ``weight_sync``).

vLLM: ``EngineCore.step``, ``step_with_batch_queue`` and ``preprocess_add_request`` in
``vllm/v1/engine/core.py``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.structured_output import StructuredOutputManager
from stage3_continuous.engine import SchedulerFacade
from stage5_server.core.messages import EngineCoreOutput, EngineCoreRequest
from stage5_server.core.request import Request
from stage5_server.core.scheduler import Scheduler
from stage5_server.core.stats import LoggingStatLogger, SchedulerStats
from stage5_server.core.step_log import StepLog
from stage5_server.core.utilities import Utilities
from stage5_server.errors import EngineSleepingError, StepFailed
from stage5_server.executor import Executor, PendingStep
from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig
    from stage5_server.inspector.observer import StepObserver
    from stage5_server.spec_decode.drafter import Drafter
    from stage5_server.weight_sync import WeightSync


class EngineCore(SchedulerFacade):
    def __init__(self, config: EngineConfig, scheduler: Scheduler, model_executor: Executor,
                 structured_output_manager: StructuredOutputManager | None = None,
                 stats_logger: LoggingStatLogger | None = None, drafter: Drafter | None = None):
        self.config = config
        self.scheduler = scheduler
        self.model_executor = model_executor
        self.structured_output_manager = structured_output_manager  # builds grammars off the step loop
        self.drafter = drafter  # speculative decoding's next drafts (spec_decode/); None: off
        self.max_model_len = scheduler.max_model_len
        self.stats_logger = stats_logger
        self.step_trace: list[dict[str, int]] | None = None  # set to [] to record tokens per request per step
        self.step_log = StepLog.from_env()  # each step's contents and times, for a profile (step_log.py)
        # Pipeline parallelism: up to one batch in flight per stage (step_with_batch_queue).
        self.max_batches_in_flight = config.parallel.pipeline_parallel_size
        self.batch_queue: deque[tuple[SchedulerOutput, PendingStep]] = deque()
        self.most_batches_in_flight = 0  # the deepest the queue has been: 2 shows two stages busy at once
        self.utilities = Utilities(self)  # calls between steps: collective_rpc, and what a system registers
        self.admission_checks: list[Callable[[], str | None]] = []  # each: why no new request may run now, or None
        self.weight_sync: WeightSync | None = None  # weight updates and sleep (weight_sync/), set by the builder
        self.inspector: StepObserver | None = None  # records each step (inspector/), set by the builder; None: off

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.cache_config.num_blocks

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """The core's ``Request`` for the front end's; a grammar starts building (``add_request`` takes it)."""
        core_request = request.to_request()
        if self.structured_output_manager is not None:
            self.structured_output_manager.grammar_init(core_request)
        return core_request

    def refusal(self) -> str | None:
        """Why no new request may run now (the first admission check that says so: asleep), or None."""
        for check in self.admission_checks:
            reason = check()
            if reason is not None:
                return reason
        return None

    def check_admission(self) -> None:
        reason = self.refusal()
        if reason is not None:
            raise EngineSleepingError(reason)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        stats = super().stats()
        if self.weight_sync is not None:
            stats.weight_version, stats.sleep_level = self.weight_sync.version, self.weight_sync.sleep_level
        return stats

    def shutdown(self) -> None:
        self.model_executor.shutdown()
        self.scheduler.shutdown()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()

    def step(self) -> list[EngineCoreOutput]:
        if self.max_batches_in_flight > 1:
            return self.step_with_batch_queue()
        started = time.perf_counter()
        output = self.schedule()
        if output.total_num_scheduled_tokens == 0:
            return self.finished_outside_step()
        scheduled = time.perf_counter()
        try:
            result = self.model_executor.execute_model(output)
        except Exception as exc:
            raise StepFailed(self.scheduler.step_failed(output), exc) from exc
        executed = time.perf_counter()
        outputs = self.update(output, result)
        if self.step_log is not None:
            self.step_log.record(output, started, scheduled, executed, time.perf_counter())
        return outputs

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """One step of a pipeline: send a new batch while there is room in the queue and work to send,
        else wait for the oldest batch in flight and take its tokens. With P stages and P batches in
        flight, each stage works on a different batch."""
        queue, scheduler = self.batch_queue, self.scheduler
        if len(queue) < self.max_batches_in_flight:
            output = self.schedule()
            if output.total_num_scheduled_tokens:
                try:
                    pending = self.model_executor.execute_model_async(output)
                except Exception as exc:
                    raise StepFailed(scheduler.step_failed(output), exc) from exc
                queue.append((output, pending))
                scheduler.in_flight.update(output.num_scheduled_tokens)
                self.most_batches_in_flight = max(self.most_batches_in_flight, len(queue))
                if len(queue) < self.max_batches_in_flight:
                    return self.finished_outside_step()  # room for one more: schedule it before waiting
        if not queue:
            return self.finished_outside_step()
        output, pending = queue.popleft()
        scheduler.in_flight.difference_update(output.num_scheduled_tokens)
        try:
            result = pending.result()
        except Exception as exc:
            raise StepFailed(scheduler.step_failed(output), exc) from exc
        return self.update(output, result)

    def schedule(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        if self.step_trace is not None and output.total_num_scheduled_tokens:
            self.step_trace.append(dict(output.num_scheduled_tokens))
        if self.drafter is not None:
            self.drafter.before_step(output, len(self.scheduler.running))
        if self.inspector is not None:
            self.inspector.scheduled(output, self.scheduler)
        return output

    def finished_outside_step(self) -> list[EngineCoreOutput]:
        """The outputs of requests that finished without a step (refused at admission: their grammar failed)."""
        outputs, self.scheduler.finished_outputs = self.scheduler.finished_outputs, []
        return outputs

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """A step's tokens and logprobs on its requests; the outputs of the requests that changed."""
        outputs = self.scheduler.update_from_output(output, result)
        if self.drafter is not None:
            requests = self.scheduler.requests
            running = [requests[o.request_id] for o in outputs if o.request_id in requests]
            finished = [o.request_id for o in outputs if o.finish_reason is not None]
            for request, drafts in self.drafter.propose(output, result, running, finished, requests,
                                                        len(self.scheduler.running)):
                self.scheduler.add_draft_tokens(request, drafts)
        if self.inspector is not None:
            self.inspector.stepped(output, result, self.scheduler)
        if self.stats_logger:
            self.stats_logger.maybe_log(self.stats())
        return outputs
