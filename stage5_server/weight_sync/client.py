"""The async front end's side: weight updates and sleep as utility calls to every engine core, awaited.

``WeightSyncClient`` is a member of ``engine/frontend.AsyncEngine`` (``engine.weight_sync``) when the engine
runs with weight sync on. Each call goes through the front end's ``UtilityClient``
(``engine/utility_client.py``: to the engine thread, or to every live engine-core process); a call to N
data-parallel cores resolves with N answers.

It also keeps what admission needs: whether the engine sleeps (a new request is refused here with
``EngineSleepingError``, HTTP 503, before it reaches a core) and the weight version a new request will
run on: the cores' version plus the updates sent and not yet answered (a request sent after an update is
held by the core until the update is done, ``core/busy_loop.py``).

vLLM: ``AsyncLLM.sleep``, ``wake_up``, ``is_sleeping`` in ``vllm/v1/engine/async_llm.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import torch

from stage5_server.errors import EngineSleepingError
from stage5_server.weight_sync.core import DRAINING
from stage5_server.weight_sync.loader import describe_tensors

UPDATES = DRAINING - {"sleep"}


class WeightSyncClient:
    def __init__(self, utilities: Any, stats: Callable[[], Any]):
        self.utilities = utilities  # the front end's UtilityClient (engine/utility_client.py)
        self.stats = stats  # the cores' latest stats
        self._known_version = 0  # the cores' weight version, as their answers told it
        self._updates_in_flight = 0
        self._refusal: str | None = None  # why no request may run now (asleep), as the core said

    async def call_utility(self, method: str, *args: Any) -> list:
        if method not in UPDATES:
            return await self.utilities.call(method, *args)
        self._updates_in_flight += 1  # counted before it is sent: a request sent after it runs on its weights
        try:
            return await self.utilities.call(method, *args)
        finally:
            self._updates_in_flight -= 1

    # ---- the API (vLLM's AsyncLLM names) --------------------------------------------------------------
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Tensors by checkpoint name into every rank of every core; the new weight version."""
        return await self._update("update_weights", list(named_tensors))

    async def update_weights_from_path(self, path: str) -> int:
        return await self._update("update_weights_from_path", str(path))

    async def update_weights_from_distributed(self, metadata: list) -> int:
        """Receive a trainer's broadcasts (``group.py``), one per ``(name, dtype, shape)``, once every worker has
        joined the trainer's group: each poll is a quick call between steps, so the update that follows waits on
        no join inside the engine's loop (a join that failed is a ValueError, HTTP 400)."""
        while not all(ready for per_core in await self.utilities.call("collective_rpc", "weight_update_group_ready",
                                                                      (), None)
                      for ready in per_core):
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
        self._refusal = "The engine is going to sleep; POST /wake_up (engine.weight_sync.wake_up) first."
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

    @property
    def weight_version(self) -> int:
        """The version a request sent now runs on (updates sent before it are done first)."""
        return max(self._known_version, self.stats().weight_version) + self._updates_in_flight

    def check_awake(self) -> None:
        """Refuse a new request while the engine sleeps (HTTP 503)."""
        if self._refusal is not None:
            raise EngineSleepingError(self._refusal)


__all__ = ["WeightSyncClient", "describe_tensors"]
