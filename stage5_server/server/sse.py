"""Streaming: server-sent events, deltas from cumulative outputs, and noticing a client that left.

``data: {json}`` events, a blank line after each, ending with ``data: [DONE]``. ``DeltaTracker``
turns cumulative outputs into the text not sent yet, holding back a possible stop string. A
client that disconnects, before its first token or mid-stream, aborts its request.

vLLM: the ``*_stream_generator`` methods of ``serving_completion.py`` and ``serving_chat.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from stage5_server.engine.errors import EngineError
from stage5_server.engine.stream import RequestStream


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and close the generator (aborting the request), on disconnect."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                task_group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    pass


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``, or raise ``ClientDisconnected`` (cancelling it) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnected


class DeltaTracker:
    """What a stream has not sent yet, from cumulative outputs. Text that could still start a stop string
    is held back until the request finishes, so the streamed text equals the final trimmed text."""

    def __init__(self, params: SamplingParams):
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.sent_chars = 0
        self.sent_tokens = 0

    def advance(self, output: RequestOutput) -> tuple[str, int, int] | None:
        """``(new text, first new token index, end token index)``, or None if nothing to send yet."""
        completion = output.outputs[0]
        text = completion.text
        end = len(text) if output.finished else max(self.sent_chars, len(text) - self.hold)
        delta = text[self.sent_chars:end]
        if not delta and not output.finished:
            return None
        start_token, self.sent_tokens = self.sent_tokens, len(completion.token_ids)
        self.sent_chars = max(self.sent_chars, end)
        return delta, start_token, self.sent_tokens


async def final_output(stream: RequestStream) -> RequestOutput:
    async for output in stream:
        if output.finished:
            return output
    raise EngineError("the request ended without a final output")
