"""The engine core's busy loop, the same wherever the core runs.

    take every queued input (block while idle) -> core.step() -> publish what changed

Subclasses say only where inputs come from and outputs go: a queue on a thread
(``thread_client.py``), two ZeroMQ sockets in a process (``core_proc.py``). Decided here, once:
an output carries only tokens not yet published; a step that raises fails its own requests (the
core freed their KV) and the rest go on, while an ``EngineDeadError`` fails all and ends the loop;
with nothing schedulable (KV full of waiting prompts) it waits briefly instead of spinning.

vLLM: ``EngineCoreProc.run_busy_loop`` in ``vllm/v1/engine/core.py``.
"""

from __future__ import annotations

import logging
import time

from shared.llm_base import EngineCore
from shared.metrics import SchedulerStats
from shared.request import Request, RequestStatus
from shared.structured_output import StructuredOutputManager
from stage5_server.core.errors import EngineDeadError
from stage5_server.core.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FailedRequests,
    Shutdown,
)

logger = logging.getLogger("stagedserve")

IDLE_POLL_S = 0.2  # while idle, wake this often (to notice a vanished parent, to log stats)
NOTHING_SCHEDULABLE_WAIT_S = 0.005


class EngineCoreLoop:
    def __init__(self, core: EngineCore, idle_poll_s: float = IDLE_POLL_S, *,
                 grammars: StructuredOutputManager | None = None):
        self.core = core
        self.grammars = grammars  # builds a structured-output request's grammar as it arrives
        self.idle_poll_s = idle_poll_s
        self.requests: dict[str, Request] = {}  # in the core and not finished, by id
        self.num_sent: dict[str, int] = {}  # request id -> output tokens already published
        self.stopping = False
        self.dead = False  # the core cannot step again
        self._published_stats: SchedulerStats | None = None

    # ---- the transport: what a subclass provides -------------------------------------------------
    def receive(self, timeout_s: float) -> list[EngineCoreInput]:
        """Every input already queued, waiting up to ``timeout_s`` for the first."""
        raise NotImplementedError

    def publish(self, outputs: EngineCoreOutputs) -> None:
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
            if self.core.has_unfinished_requests():
                self.step()
            elif self.core.stats() != self._published_stats:
                self.send([])  # an abort changed the counts: keep the front end's /metrics current

    def handle(self, messages: list[EngineCoreInput]) -> None:
        for message in messages:
            if isinstance(message, AddRequest):
                self.add(message.request)
            elif isinstance(message, AbortRequests):
                self.abort(message.request_ids)
            elif isinstance(message, Shutdown):
                self.stopping = True

    def add(self, wire: EngineCoreRequest) -> None:
        request = wire.to_request()
        request.timeline.queued = time.monotonic()
        if self.grammars is not None:
            self.grammars.grammar_init(request)  # in the background: the scheduler waits for it, the loop does not
        try:
            self.core.add_request(request)
        except ValueError as exc:  # the front end checked it first; this is the core's last word
            self.send([], FailedRequests([request.request_id], str(exc)))
            return
        self.requests[request.request_id] = request
        self.num_sent[request.request_id] = 0

    def abort(self, request_ids: list[str]) -> None:
        known = [rid for rid in request_ids if self.requests.pop(rid, None) is not None]
        for rid in known:
            del self.num_sent[rid]
        self.core.finish_requests(known, RequestStatus.FINISHED_ABORTED)

    def step(self) -> None:
        try:
            updated = self.core.step()
        except Exception as exc:
            self.fail_step(exc)
            return
        outputs = []
        for request in updated:
            num_sent = self.num_sent.get(request.request_id)
            if num_sent is None:
                continue  # aborted meanwhile
            outputs.append(EngineCoreOutput.from_request(request, num_sent))
            if request.is_finished:
                del self.requests[request.request_id], self.num_sent[request.request_id]
            else:
                self.num_sent[request.request_id] = request.num_output_tokens
        if outputs or self.core.stats() != self._published_stats:
            self.send(outputs)
        if not updated and self.core.stats().num_running == 0:
            self.handle(self.receive(NOTHING_SCHEDULABLE_WAIT_S))  # nothing fits: do not spin

    def fail_step(self, exc: Exception) -> None:
        dead = isinstance(exc, EngineDeadError)
        failed = [rid for rid, request in self.requests.items() if request.is_finished]  # the core aborted them
        if dead or not failed:
            failed = list(self.requests)
            self.core.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        logger.error("engine step failed; failing %d of %d in-flight request(s)", len(failed), len(self.requests),
                     exc_info=exc)
        for rid in failed:
            del self.requests[rid], self.num_sent[rid]
        error = str(exc) if dead else f"the engine failed while running this request ({type(exc).__name__})"
        self.send([], FailedRequests(failed, error, engine_dead=dead))
        if dead:  # it cannot step again: leave the loop; the front end turns unhealthy
            self.dead = self.stopping = True

    def send(self, outputs: list[EngineCoreOutput], failed: FailedRequests | None = None) -> None:
        self._published_stats = self.core.stats()
        self.publish(EngineCoreOutputs(outputs, self._published_stats, failed))
