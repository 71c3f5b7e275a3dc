"""The front end's side of the engine core's utilities: each is a ``UtilityCall`` to every engine core, awaited.

``UtilityClient`` is a member of ``frontend.AsyncEngine`` (``engine.utilities``). It sends each call through
the client's ``send`` (to the engine thread's queue, or to every live engine-core process), which says how
many answers to wait for, and takes each ``UtilityOutput`` the client receives (``on_output``): a call to
N data-parallel cores resolves with N answers, by rank. A call's error comes back as the same kind of
exception the core raised (``ValueError`` for the caller's mistake), and every waiting call fails once the
cores are gone.

vLLM: ``call_utility_async`` in ``vllm/v1/engine/core_client.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import pickle
import threading
from collections.abc import Callable
from typing import Any

from stage5_server.core.messages import UtilityCall, UtilityOutput
from stage5_server.errors import EngineSleepingError

ERROR_TYPES = {"ValueError": ValueError, "TimeoutError": TimeoutError, "EngineSleepingError": EngineSleepingError}


class _PendingCall:
    def __init__(self, expected: int):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.expected = expected
        self.answers: dict[int, UtilityOutput] = {}


class UtilityClient:
    def __init__(self, send: Callable[[UtilityCall], int]):
        self.send = send  # to the core(s); returns the number of answers to wait for
        self._ids = itertools.count()
        self._calls: dict[int, _PendingCall] = {}
        self._lock = threading.Lock()

    async def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """``method`` on every engine core, between its steps; each core's result, by rank."""
        call = UtilityCall(next(self._ids), method, pickle.dumps((args, kwargs)))
        with self._lock:
            pending = self._calls[call.call_id] = _PendingCall(0)
        try:
            pending.expected = self.send(call)
            try:
                answers = await asyncio.wait_for(asyncio.wrap_future(pending.future), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{method}: no answer from the engine within {timeout} s") from None
        finally:
            with self._lock:
                self._calls.pop(call.call_id, None)
        errors = [a for a in answers if a.error is not None]
        if errors:
            raise ERROR_TYPES.get(errors[0].error_type, RuntimeError)(errors[0].error)
        return [pickle.loads(a.result) for a in answers]

    def on_output(self, output: UtilityOutput) -> None:
        """An answer (on the client's receiving thread)."""
        with self._lock:
            pending = self._calls.get(output.call_id)
            if pending is None:
                return  # its caller gave up waiting
            pending.answers[output.engine_index] = output
            if len(pending.answers) < pending.expected or pending.future.done():
                return
        pending.future.set_result([pending.answers[i] for i in sorted(pending.answers)])

    def senders_gone(self, why: str) -> None:
        """The core(s) died: every waiting call fails."""
        with self._lock:
            pending = list(self._calls.values())
        for call in pending:
            if not call.future.done():
                call.future.set_exception(RuntimeError(why))
