"""Streaming: server-sent events, and noticing a client that left.

``data: {json}`` events, a blank line after each, ending with ``data: [DONE]``; the engine's
delta outputs carry the text not sent yet (a possible stop string already held back). A client
that disconnects, before its first token or mid-stream, aborts its request.

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
from stage5_server.engine.stream import RequestStream
from stage5_server.errors import EngineError


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


async def final_output(stream: RequestStream) -> RequestOutput:
    async for output in stream:
        if output.finished:
            return output
    raise EngineError("the request ended without a final output")
