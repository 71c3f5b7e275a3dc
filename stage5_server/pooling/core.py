"""The engine core of a pooling model: schedule, run, and finish every request whose prompt is now
fully computed, its pooled vector on it. The scheduler is the generating engine's (token budget,
``max_num_seqs``, chunked prefill for a decoder); a pooling request simply never samples, and its KV
blocks go back to the pool in the step that finishes it.

vLLM: ``Scheduler.update_from_output``'s ``pooler_output`` branch in ``vllm/v1/core/sched/scheduler.py``.
"""

from __future__ import annotations

from shared.request import Request, RequestStatus
from stage5_server.core.engine_core import EngineCore
from stage5_server.core.scheduler import Scheduler, SchedulerOutput


class PoolingScheduler(Scheduler):
    def update_from_pooler_output(self, scheduler_output: SchedulerOutput, pooled: dict) -> list[Request]:
        """Advance the scheduled requests; finish those with a pooled vector (their prompt is complete)."""
        super().update_from_output(scheduler_output, {})  # no tokens: counts the prompt tokens computed
        finished = []
        for request_id, vector in pooled.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while its step ran
            request.pooled_output = vector.tolist()
            request.status = RequestStatus.FINISHED_STOPPED
            self.running.remove(request)
            self._free(request)  # its KV is of no further use
            finished.append(request)
        return finished


class PoolingEngineCore(EngineCore):
    def step(self) -> list[Request]:
        output = self.scheduler.schedule()
        if output.total_num_scheduled_tokens == 0:
            return output.aborted_reqs
        runner_input = self.scheduler.runner_input(output)
        try:
            result = self.model_executor.execute_model(runner_input)
        except Exception:
            self.scheduler.runner_input_failed(runner_input)
            self.scheduler.recover_from_failed_step(output)
            raise
        finished = self.scheduler.update_from_pooler_output(output, result.pooler_output)
        if self.stats_logger:
            self.stats_logger.maybe_log(self.stats())
        return output.aborted_reqs + finished
