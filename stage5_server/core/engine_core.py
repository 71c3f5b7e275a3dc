"""The engine core: schedule, execute on the workers, update, once per step.

``step()`` is the whole loop of vLLM V1 in four lines: the scheduler decides what runs
(``SchedulerOutput``), the executor runs it on every worker (``ModelRunnerInput`` in,
``ModelRunnerOutput`` out: a list of tokens per request), the logprobs the runner computed are
put on their requests, and the scheduler appends the tokens, rolls back rejected drafts and
finishes what must stop. With speculative decoding on, the proposer then drafts the next tokens of
each request that goes on, as many as its recent acceptance says pay at this batch size
(``spec_decode/policy.py``). Where the workers live (this process, or one process per rank) is the
executor's business; the core is the same.

Under pipeline parallelism (``parallel/pipeline.py``) one batch would keep one stage busy at a
time, so ``step`` keeps a queue of up to P batches in flight (``step_with_batch_queue``): it sends
a batch and schedules the next from the requests not in flight before it waits for the oldest.

A step whose execution raises fails the requests in it (the scheduler frees their KV) and the
error goes up to the caller; the core itself can step again, unless the executor is dead.

vLLM: ``EngineCore.step`` and ``step_with_batch_queue`` in ``vllm/v1/engine/core.py``.
"""

from __future__ import annotations

from collections import deque

from shared.request import Request
from stage3_continuous.engine import SchedulerFacade
from stage5_server.config import EngineConfig
from stage5_server.core.scheduler import Scheduler, SchedulerOutput
from stage5_server.executor import Executor, PendingStep
from stage5_server.spec_decode import NgramProposer
from stage5_server.spec_decode.metrics import LoggingStatLogger
from stage5_server.spec_decode.policy import DraftPolicy
from stage5_server.worker import ModelRunnerInput, ModelRunnerOutput


class EngineCore(SchedulerFacade):
    def __init__(self, config: EngineConfig, scheduler: Scheduler, model_executor: Executor,
                 stats_logger: LoggingStatLogger | None = None, proposer: NgramProposer | None = None,
                 draft_policy: DraftPolicy | None = None):
        self.config = config
        self.proposer = proposer  # drafts for the next step, from each request's tokens (spec_decode/)
        self.draft_policy = draft_policy  # how many of them; None: always the proposer's k
        self.scheduler = scheduler
        self.model_executor = model_executor
        self.max_model_len = scheduler.max_model_len
        self.stats_logger = stats_logger
        self.step_trace: list[dict[str, int]] | None = None  # set to [] to record tokens per request per step
        # Pipeline parallelism: up to one batch in flight per stage (step_with_batch_queue).
        self.max_batches_in_flight = config.parallel.pipeline_parallel_size
        self.batch_queue: deque[tuple[SchedulerOutput, ModelRunnerInput, PendingStep]] = deque()
        self.most_batches_in_flight = 0  # the deepest the queue has been: 2 shows two stages busy at once

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.cache_config.num_blocks

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.model_executor.shutdown()

    def step(self) -> list[Request]:
        if self.max_batches_in_flight > 1:
            return self.step_with_batch_queue()
        output = self.scheduler.schedule()
        if self.step_trace is not None:
            self.step_trace.append(dict(output.num_scheduled_tokens))
        if output.total_num_scheduled_tokens == 0:
            return output.aborted_reqs
        runner_input = self.runner_input(output)
        try:
            result = self.model_executor.execute_model(runner_input)
        except Exception:
            self.step_failed(output, runner_input)
            raise
        return output.aborted_reqs + self.update(output, result)

    def step_with_batch_queue(self) -> list[Request]:
        """One step of a pipeline: send a new batch while there is room in the queue and work to send,
        else wait for the oldest batch in flight and take its tokens. With P stages and P batches in
        flight, each stage works on a different batch."""
        queue, scheduler = self.batch_queue, self.scheduler
        aborted: list[Request] = []
        if len(queue) < self.max_batches_in_flight:
            output = scheduler.schedule()
            aborted = output.aborted_reqs
            if output.total_num_scheduled_tokens:
                if self.step_trace is not None:
                    self.step_trace.append(dict(output.num_scheduled_tokens))
                runner_input = self.runner_input(output)
                try:
                    pending = self.model_executor.execute_model_async(runner_input)
                except Exception:
                    self.step_failed(output, runner_input)
                    raise
                queue.append((output, runner_input, pending))
                scheduler.in_flight.update(output.num_scheduled_tokens)
                self.most_batches_in_flight = max(self.most_batches_in_flight, len(queue))
                if len(queue) < self.max_batches_in_flight:
                    return aborted  # room for one more: schedule it before waiting
        if not queue:
            return aborted
        output, runner_input, pending = queue.popleft()
        scheduler.in_flight.difference_update(output.num_scheduled_tokens)
        try:
            result = pending.result()
        except Exception:
            self.step_failed(output, runner_input)
            raise
        return aborted + self.update(output, result)

    def runner_input(self, output: SchedulerOutput) -> ModelRunnerInput:
        runner_input = self.scheduler.runner_input(output)
        if self.proposer is None and self.draft_policy is not None:  # a draft model drafts on the workers
            policy, batch_size = self.draft_policy, len(self.scheduler.running)
            runner_input.num_drafts_to_propose = {r.request_id: policy.num_drafts(r.request_id, batch_size)
                                                   for r in output.scheduled_reqs}
        return runner_input

    def step_failed(self, output: SchedulerOutput, runner_input: ModelRunnerInput) -> None:
        self.scheduler.runner_input_failed(runner_input)
        self.scheduler.recover_from_failed_step(output)  # free their KV, then let the caller know

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Put a step's tokens and logprobs on its requests; the requests that gained tokens or finished."""
        requests = {r.request_id: r for r in output.scheduled_reqs}
        add_logprobs(requests, result)
        updated = self.scheduler.update_from_output(output, result.by_request())
        for request_id in result.logprobs:  # a stop inside a list of tokens drops the tokens after it
            request = requests[request_id]
            del request.logprobs[request.num_output_tokens:]
        if self.proposer is not None or self.config.speculative is not None:
            self.observe_acceptance(output.scheduled_spec_decode_tokens, result.by_request())
            self.propose_drafts(updated, result.draft_token_ids)
        if self.stats_logger:
            self.stats_logger.maybe_log(self.stats())
        return updated

    def propose_drafts(self, requests: list[Request], from_workers: dict[str, list[int]]) -> None:
        """Drafts for each request that gained tokens this step and runs on (the proposer's here, or a draft
        model's ``from_workers``); the scheduler verifies them in the request's next decode, inside the
        token budget (``core/scheduler.py``)."""
        policy, batch_size = self.draft_policy, len(self.scheduler.running)
        for request in requests:
            if request.is_finished:
                if policy is not None:
                    policy.forget(request.request_id)
                continue
            if self.proposer is None:  # the workers drafted as many as the policy said before the step
                drafts = from_workers.get(request.request_id, [])
            else:  # k None: the proposer's own k
                k = None if policy is None else policy.num_drafts(request.request_id, batch_size)
                drafts = self.proposer.propose(request.all_token_ids, k)
            if drafts:
                self.scheduler.add_draft_tokens(request, drafts)

    def observe_acceptance(self, drafts: dict[str, list[int]], sampled: dict[str, list[int]]) -> None:
        """Tell the draft policy how many of each request's drafts were kept this step."""
        policy = self.draft_policy
        if policy is None:
            return
        for request_id, tokens in drafts.items():
            if sampled.get(request_id):  # none: aborted while its step ran
                policy.observe(request_id, len(tokens), len(sampled[request_id]) - 1)
        if len(policy.requests) > 2 * len(self.scheduler.requests) + 64:  # aborted requests' entries
            for request_id in [r for r in policy.requests if r not in self.scheduler.requests]:
                policy.forget(request_id)


def add_logprobs(requests: dict[str, Request], result: ModelRunnerOutput) -> None:
    for request_id, entries in result.prompt_logprobs.items():
        requests[request_id].prompt_logprobs.extend(entries)
    for request_id, entries in result.logprobs.items():
        requests[request_id].logprobs.extend(entries)
