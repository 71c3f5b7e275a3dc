"""``RequestStream``: the outputs of one request, handed from the engine's thread to one event loop.

A consumer that falls behind loses nothing: of cumulative outputs the stream keeps only the newest;
delta outputs (``delta=True``) not read yet are merged into one. An error, or the final output, ends it;
an output put before the error is still handed out first.

vLLM: ``RequestOutputCollector`` in ``vllm/v1/engine/output_processor.py``.
"""

from __future__ import annotations

import asyncio

from shared.outputs import RequestOutput


class RequestStream:
    """``put`` runs on the stream's loop (the producer schedules it there); iterate with ``async for``."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, delta: bool = False):
        self.request_id = request_id
        self.loop = loop
        self.delta = delta
        self.finished = False  # the consumer has seen the final output or an error
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        elif self.delta and self._output is not None:
            self._output = self._output.add(item)
        else:
            self._output = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The newest output not yet returned; raises the stream's error, if any."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id}: stream already finished")
        while self._output is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._output is None:  # outputs put before the error go out first: a failure loses no tokens
            self.finished = True
            raise self._error
        out, self._output = self._output, None
        self.finished = out.finished
        return out

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()

