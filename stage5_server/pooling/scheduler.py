"""The scheduler of a pooling model: every request whose prompt a step completes finishes in that step,
its pooled vector on it. Scheduling is the generating engine's (token budget, ``max_num_seqs``, chunked
prefill for a decoder); a pooling request simply never samples, and its KV blocks go back to the pool
in the step that finishes it. The engine core is the generating one: it calls ``update_from_output``
either way.

vLLM: ``Scheduler.update_from_output``'s ``pooler_output`` branch in ``vllm/v1/core/sched/scheduler.py``.
"""

from __future__ import annotations

from shared.request import RequestStatus
from stage5_server.core.messages import EngineCoreOutput
from stage5_server.core.scheduler import Scheduler
from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput


class PoolingScheduler(Scheduler):
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance the scheduled requests (no tokens: it counts the prompt tokens computed); finish those with
        a pooled vector (their prompt is complete)."""
        outputs = super().update_from_output(scheduler_output, ModelRunnerOutput([], []))
        for request_id, vector in runner_output.pooler_output.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while its step ran
            request.pooled_output = vector.tolist()
            request.status = RequestStatus.FINISHED_STOPPED
            self.running.remove(request)
            self._free(request)  # its KV is of no further use
            outputs.append(EngineCoreOutput.from_request(request, 0))
        return outputs
