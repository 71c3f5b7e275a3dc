"""The engine core's busy loop, the same wherever the core runs.

    take every queued input (block while idle) -> core.step() -> publish its outputs

Subclasses say only where inputs come from and outputs go: a queue on a thread
(``engine/thread_client.py``), two ZeroMQ sockets in a process (``core_proc.py``). Decided here, once:
the core's outputs go out as they come (the scheduler made them, each with only what is new); a step
that raises fails its own requests (the core freed their KV) and the rest go on, while an
``EngineDeadError`` fails all and ends the loop; with nothing schedulable (KV full of waiting prompts)
it waits briefly instead of spinning. The loop keeps no table of requests: the scheduler's is the one.
Utility calls (``collective_rpc``, and what a system registered: ``utilities.py``) wait in its queue for a
gap between steps: the loop runs the queue's head after handling its inputs and after each step. A call that
*drains* (a weight update, a sleep) waits until the core has no unfinished request; meanwhile each new request
is held, in arrival order, and admitted once the call has run (an aborted one is dropped).

vLLM: ``EngineCoreProc.run_busy_loop`` and ``_handle_client_request`` in ``vllm/v1/engine/core.py``; the
hold-and-resume is ``pause_generation(mode="wait")`` of ``vllm/v1/engine/async_llm.py``.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections import deque
from typing import TYPE_CHECKING

from shared.request import RequestStatus
from stage5_server.core.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FailedRequests,
    Shutdown,
    UtilityCall,
    UtilityOutput,
)
from stage5_server.core.stats import SchedulerStats
from stage5_server.errors import EngineDeadError, StepFailed

if TYPE_CHECKING:
    from stage5_server.core.engine_core import EngineCore

logger = logging.getLogger("stagedserve")

IDLE_POLL_S = 0.2  # while idle, wake this often (to notice a vanished parent, to log stats)
NOTHING_SCHEDULABLE_WAIT_S = 0.005


class EngineCoreLoop:
    def __init__(self, core: EngineCore, idle_poll_s: float = IDLE_POLL_S):
        self.core = core
        self.utility_calls: deque[UtilityCall] = deque()  # waiting for a gap between steps
        self.held_requests: list[AddRequest] = []  # arrived while a queued call drains the core
        self.idle_poll_s = idle_poll_s
        self.stopping = False
        self.dead = False  # the core cannot step again
        self._published_stats: SchedulerStats | None = None

    # ---- the transport: what a subclass provides -------------------------------------------------
    def receive(self, timeout_s: float) -> list[EngineCoreInput]:
        """Every input already queued, waiting up to ``timeout_s`` for the first."""
        raise NotImplementedError

    def publish(self, outputs: EngineCoreOutputs) -> None:
        raise NotImplementedError

    def publish_utility(self, output: UtilityOutput, client_id: str | None) -> None:
        raise NotImplementedError

    def keep_running(self) -> bool:
        """Checked once an iteration: False ends the loop (the process was orphaned, say)."""
        return True

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping:
            busy = self.core.has_unfinished_requests()
            self.handle(self.receive(0.0 if busy else self.idle_poll_s))
            if self.stopping or not self.keep_running():
                break
            self.run_due_utilities()
            if self.core.has_unfinished_requests():
                self.step()
                self.run_due_utilities()
            elif self.core.stats() != self._published_stats:
                self.send([])  # an abort changed the counts: keep the front end's /metrics current

    def handle(self, messages: list[EngineCoreInput]) -> None:
        for message in messages:
            if isinstance(message, AddRequest):
                if self.draining:
                    self.held_requests.append(message)
                else:
                    self.add(message.request)
            elif isinstance(message, AbortRequests):
                if self.held_requests:
                    aborted = set(message.request_ids)
                    self.held_requests = [m for m in self.held_requests if m.request.request_id not in aborted]
                self.abort(message.request_ids)
            elif isinstance(message, UtilityCall):
                self.utility_calls.append(message)
            elif isinstance(message, Shutdown):
                self.stopping = True

    # ---- utility calls, between steps ---------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return any(self.core.utilities.drains(call.method) for call in self.utility_calls)

    def run_due_utilities(self) -> None:
        """Run the queued calls that may run now, in order; then admit the requests held for them."""
        while self.utility_calls:
            call = self.utility_calls[0]
            if self.core.utilities.drains(call.method) and self.core.has_unfinished_requests():
                return  # the requests in the core finish first
            self.utility_calls.popleft()
            self.publish_utility(self.run_utility(call), call.client_id)
        held, self.held_requests = self.held_requests, []
        self.handle(held)

    def run_utility(self, call: UtilityCall) -> UtilityOutput:
        try:
            args, kwargs = pickle.loads(call.payload)
            result = self.core.utilities.run(call.method, tuple(args), dict(kwargs))
            return UtilityOutput(call.call_id, pickle.dumps(result))
        except Exception as exc:  # the caller gets it; the engine goes on
            logger.warning("engine utility %s failed: %s", call.method, exc)
            return UtilityOutput(call.call_id, error=str(exc), error_type=type(exc).__name__)

    # ---- requests ----------------------------------------------------------------------------------
    def add(self, wire: EngineCoreRequest) -> None:
        refusal = self.core.refusal()
        if refusal is not None:  # an admission check says no (asleep): refused at once, never left waiting
            self.send([], FailedRequests([wire.request_id], refusal))
            return
        try:
            request = self.core.preprocess_add_request(wire)  # its grammar builds in the background
            request.timeline.queued = time.monotonic()
            self.core.add_request(request)
        except ValueError as exc:  # the front end checked it first; this is the core's last word
            self.send([], FailedRequests([wire.request_id], str(exc)))

    def abort(self, request_ids: list[str]) -> None:
        self.core.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:
            self.fail_step(exc)
            return
        if outputs or self.core.stats() != self._published_stats:
            self.send(outputs)
        if not outputs and self.core.stats().num_running == 0:
            self.handle(self.receive(NOTHING_SCHEDULABLE_WAIT_S))  # nothing fits: do not spin

    def fail_step(self, exc: Exception) -> None:
        """A step raised: fail the requests it ran (the core aborted them), or every request when the core is
        dead or nothing says which requests the failure concerned."""
        cause = exc.cause if isinstance(exc, StepFailed) else exc
        dead = isinstance(cause, EngineDeadError)
        failed = list(exc.request_ids) if isinstance(exc, StepFailed) else []
        if dead or not failed:
            everyone = self.core.unfinished_request_ids()
            self.core.finish_requests(everyone, RequestStatus.FINISHED_ABORTED)
            failed += everyone
        logger.error("engine step failed; failing %d in-flight request(s)", len(failed), exc_info=cause)
        error = str(cause) if dead else f"the engine failed while running this request ({type(cause).__name__})"
        self.send([], FailedRequests(failed, error, engine_dead=dead))
        if dead:  # it cannot step again: leave the loop; the front end turns unhealthy
            self.dead = self.stopping = True

    def send(self, outputs: list[EngineCoreOutput], failed: FailedRequests | None = None) -> None:
        self._published_stats = self.core.stats()
        self.publish(EngineCoreOutputs(outputs, self._published_stats, failed))

