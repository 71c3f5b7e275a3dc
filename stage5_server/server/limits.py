"""Request bodies are capped: 413 by Content-Length up front, or counted as the body arrives.

vLLM has no such limit of its own (uvicorn reads any body); a server that tokenizes what it
reads needs one.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stage5_server.server.errors import APIError, send_json

DEFAULT_MAX_BODY_BYTES = 4 << 20


class BodySizeLimitMiddleware:
    """413 for a body over ``max_bytes``: by Content-Length up front, or counted as it arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"Request body exceeds the limit of {self.max_bytes} bytes.",
                             code="request_too_large")
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit():
                    return await send_json(send, 400, APIError(400, "Invalid Content-Length header.").body())
                if int(value) > self.max_bytes:
                    return await send_json(send, 413, too_large.body())
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # raised inside the app: its HTTP-error handler answers
                    raise StarletteHTTPException(413, too_large.message)
            return message

        await self.app(scope, limited_receive, send)
