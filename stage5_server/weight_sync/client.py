"""The async front end's side: each utility is a ``UtilityCall`` to every engine core, awaited.

``WeightSyncClient`` is a base of ``engine/frontend.AsyncEngine``; a client subclass sends the call
(``_send_utility``: to the engine thread's queue, or to every live engine-core process) and hands each
``UtilityOutput`` to ``_on_utility_output``. A call to N data-parallel cores resolves with N answers.

The front end also keeps what admission needs: whether the engine sleeps (a new request is refused
here with ``EngineSleepingError``, HTTP 503, before it reaches a core) and the weight version a new
request will run on: the cores' version plus the updates sent and not yet answered (a request sent
after an update is held by the core until the update is done, ``loop.py``).

vLLM: ``AsyncLLM.collective_rpc``, ``sleep``, ``wake_up``, ``is_sleeping``, ``reset_prefix_cache`` in
``vllm/v1/engine/async_llm.py``; ``call_utility_async`` in ``vllm/v1/engine/core_client.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import pickle
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from stage5_server.weight_sync.core import DRAINING, EngineSleepingError
from stage5_server.weight_sync.loader import describe_tensors
from stage5_server.weight_sync.messages import UtilityCall, UtilityOutput

ERROR_TYPES = {"ValueError": ValueError, "TimeoutError": TimeoutError, "EngineSleepingError": EngineSleepingError}
UPDATES = DRAINING - {"sleep"}


class _PendingCall:
    def __init__(self, expected: int):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.expected = expected
        self.answers: dict[int, UtilityOutput] = {}


class WeightSyncClient:
    def _init_weight_sync(self) -> None:
        self._utility_ids = itertools.count()
        self._utility_calls: dict[int, _PendingCall] = {}
        self._utility_lock = threading.Lock()
        self._known_version = 0  # the cores' weight version, as their answers told it
        self._updates_in_flight = 0
        self._refusal: str | None = None  # why no request may run now (asleep), as the core said

    # ---- what a client provides ----------------------------------------------------------------------
    def _send_utility(self, call: UtilityCall) -> int:
        """Send ``call`` to the core(s); the number of answers to wait for."""
        raise NotImplementedError

    # ---- the calls -----------------------------------------------------------------------------------
    async def call_utility(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """``method`` on every engine core, between its steps; each core's result, by rank."""
        call = UtilityCall(next(self._utility_ids), method, pickle.dumps((args, kwargs)))
        with self._utility_lock:
            pending = self._utility_calls[call.call_id] = _PendingCall(0)
            if method in UPDATES:
                self._updates_in_flight += 1
        try:
            pending.expected = self._send_utility(call)
            try:
                answers = await asyncio.wait_for(asyncio.wrap_future(pending.future), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{method}: no answer from the engine within {timeout} s") from None
        finally:
            with self._utility_lock:
                self._utility_calls.pop(call.call_id, None)
                if method in UPDATES:
                    self._updates_in_flight -= 1
        errors = [a for a in answers if a.error is not None]
        if errors:
            raise ERROR_TYPES.get(errors[0].error_type, RuntimeError)(errors[0].error)
        return [pickle.loads(a.result) for a in answers]

    def _on_utility_output(self, output: UtilityOutput) -> None:
        """An answer (on the client's receiving thread)."""
        with self._utility_lock:
            pending = self._utility_calls.get(output.call_id)
            if pending is None:
                return  # its caller gave up waiting
            pending.answers[output.engine_index] = output
            if len(pending.answers) < pending.expected or pending.future.done():
                return
        pending.future.set_result([pending.answers[i] for i in sorted(pending.answers)])

    def _utility_senders_gone(self, why: str) -> None:
        """The core(s) died: every waiting call fails."""
        with self._utility_lock:
            pending = list(self._utility_calls.values())
        for call in pending:
            if not call.future.done():
                call.future.set_exception(RuntimeError(why))

    # ---- the API (vLLM's AsyncLLM names) --------------------------------------------------------------
    async def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                             timeout: float | None = None) -> list:
        """``method`` on every worker of every engine core, the results in (core, rank) order."""
        answers = await self.call_utility("collective_rpc", method, tuple(args), kwargs, timeout=timeout)
        return [result for per_core in answers for result in per_core]

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Tensors by checkpoint name into every rank of every core; the new weight version."""
        return await self._update("update_weights", list(named_tensors))

    async def update_weights_from_path(self, path: str) -> int:
        return await self._update("update_weights_from_path", str(path))

    async def update_weights_from_distributed(self, metadata: list) -> int:
        """Receive a trainer's broadcasts (``group.py``), one per ``(name, dtype, shape)``, once every worker has
        joined the trainer's group: each poll is a quick call between steps, so the update that follows waits on
        no join inside the engine's loop (a join that failed is a ValueError, HTTP 400)."""
        while not all(await self.collective_rpc("weight_update_group_ready")):
            await asyncio.sleep(0.05)
        return await self._update("update_weights_from_distributed", list(metadata))

    async def reload_weights(self) -> int:
        return await self._update("reload_weights")

    async def _update(self, method: str, *args: Any) -> int:
        try:
            versions = await self.call_utility(method, *args)
        finally:
            await self._ask_refusal()
        self._known_version = max([self._known_version, *versions])
        return self._known_version

    async def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 1), and the weights (2), once the requests in flight are done; new ones are
        refused (503) until ``wake_up``. Bytes freed."""
        self._refusal = "The engine is going to sleep; POST /wake_up (AsyncEngine.wake_up) first."
        try:
            return sum(await self.call_utility("sleep", level))
        finally:
            await self._ask_refusal()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Allocate the KV cache again; after level 2, update the weights (or ``reload_weights``) before serving."""
        try:
            return any(await self.call_utility("wake_up", tags))
        finally:
            await self._ask_refusal()

    async def _ask_refusal(self) -> None:
        reasons = [r for r in await self.call_utility("refusal") if r is not None]
        self._refusal = reasons[0] if reasons else None

    async def is_sleeping(self) -> bool:
        return any(await self.call_utility("is_sleeping"))

    async def reset_prefix_cache(self) -> bool:
        return all(await self.call_utility("reset_prefix_cache"))

    @property
    def weight_version(self) -> int:
        """The version a request sent now runs on (updates sent before it are done first)."""
        reported = getattr(getattr(self, "stats", None), "weight_version", 0)
        return max(self._known_version, reported) + self._updates_in_flight

    def check_awake(self) -> None:
        """Refuse a new request while the engine sleeps (HTTP 503)."""
        if self._refusal is not None:
            raise EngineSleepingError(self._refusal)


__all__ = ["WeightSyncClient", "describe_tensors"]
