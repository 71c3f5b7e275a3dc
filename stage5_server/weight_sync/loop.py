"""Utilities in the engine core's busy loop: run between steps, draining first when they change weights.

``UtilityLoop`` is a base of ``core/busy_loop.EngineCoreLoop``. A ``UtilityCall`` is queued when it
arrives; the loop runs the queue's head after handling its inputs and after each step. A call in
``DRAINING`` (a weight update, a sleep) waits until the core has no unfinished request; meanwhile each
new request is *held* in arrival order, not given to the scheduler, and admitted after the call has
run (on the new weights). Any other utility runs at once, still between steps. A held request that is
aborted is dropped. While the engine sleeps a new request is refused at once (the front end refuses it
first; this is the last word, for a request already on its way).

vLLM: ``EngineCoreProc._handle_client_request`` (``UTILITY`` requests) in ``vllm/v1/engine/core.py``; the
hold-and-resume is ``pause_generation(mode="wait")`` / ``resume_generation`` of ``vllm/v1/engine/async_llm.py``.
"""

from __future__ import annotations

import logging
import pickle
from collections import deque
from typing import Any

from stage5_server.weight_sync.core import DRAINING
from stage5_server.weight_sync.messages import UtilityCall, UtilityOutput

logger = logging.getLogger("stagedserve")


class UtilityLoop:
    core: Any  # the EngineCore (core/engine_core.py), whose busy loop this is a base of

    def init_utilities(self) -> None:
        self.utility_calls: deque[UtilityCall] = deque()
        self.held_requests: list = []  # AddRequest messages (core/messages.py) that arrived while an update drains

    # ---- what a transport provides -------------------------------------------------------------------
    def publish_utility(self, output: UtilityOutput, client_id: str | None) -> None:
        raise NotImplementedError

    # ---- the queue -----------------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return any(call.method in DRAINING for call in self.utility_calls)

    def hold_or_add(self, message: Any) -> bool:
        """Hold ``message`` while an update drains the core (True); False: the caller adds it now."""
        if self.draining:
            self.held_requests.append(message)
            return True
        return False

    def forget_held(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        self.held_requests = [m for m in self.held_requests if m.request.request_id not in ids]

    def run_due_utilities(self) -> None:
        """Run the queued calls that may run now, in order; then admit the requests held for them."""
        while self.utility_calls:
            call = self.utility_calls[0]
            if call.method in DRAINING and self.core.has_unfinished_requests():
                return  # the requests in the core finish on the old weights first
            self.utility_calls.popleft()
            self.publish_utility(self.run_utility(call), call.client_id)
        held, self.held_requests = self.held_requests, []
        for message in held:
            self.handle([message])

    def run_utility(self, call: UtilityCall) -> UtilityOutput:
        try:
            args, kwargs = pickle.loads(call.payload)
            result = self.core.weight_sync.run_utility(call.method, tuple(args), dict(kwargs))
            return UtilityOutput(call.call_id, pickle.dumps(result))
        except Exception as exc:  # the caller gets it; the engine goes on
            logger.warning("engine utility %s failed: %s", call.method, exc)
            return UtilityOutput(call.call_id, error=str(exc), error_type=type(exc).__name__)
