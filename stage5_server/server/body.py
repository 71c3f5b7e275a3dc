"""Request bodies: decoded once, parsed off the event loop when large, checked before they are validated.

JSON text may come as UTF-8, UTF-16 or UTF-32 (RFC 8259 section 8.1; the first bytes tell which).
``CheckedRoute`` reads each body once, decodes it by its own encoding and parses it, on a worker
thread when it is large, so that one big body does not hold up every other client. Then, still
before the route's request model is validated (which costs about 9 microseconds a message on the
event loop), it answers 400 for:

- a string that is not well-formed Unicode: a lone UTF-16 surrogate, spelled as a JSON escape
  (``"\\ud800"``) or sent as raw code units in a UTF-16, UTF-32 or (invalid) UTF-8 body. Python
  would carry it in a ``str`` that no UTF-8 codec (the tokenizer's, the response's) can encode, so
  every later step would fail on it with a 500. The error names the field.
- a list longer than the server's caps allow (``RequestLimits.check_lists``: messages, content
  parts, tools, prompts), so that the cost of validating a body is bounded by the caps, not by
  the body's size.

Then a top-level field the route's model does not define is ignored or refused
(``request_fields.py``); the ones ignored are named in the response's
``X-Stagedserve-Ignored-Fields`` header, whatever the status.

vLLM has neither check: uvicorn hands FastAPI any body, it is parsed and validated on the event
loop, and a lone surrogate fails in the tokenizer with a 500.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from stage5_server.server.limits import RequestLimits
from stage5_server.server.request_fields import (
    IGNORED_FIELDS_HEADER,
    IGNORED_SCOPE_KEY,
    LENIENT_ROUTES,
    field_names,
    note_ignored,
    shown_names,
    sort_fields,
)

OFF_LOOP_BYTES = 64 << 10  # a body larger than this is decoded and parsed on a worker thread (~1 ms of parsing)


class MalformedText(StarletteHTTPException):
    """A 400 for a string that is not well-formed Unicode; ``param``: where it is in the body."""

    def __init__(self, param: str | None):
        where = f"{param}: " if param else ""
        super().__init__(400, f"{where}the string is not well-formed Unicode (it holds a lone UTF-16 surrogate, "
                              "which no UTF-8 text can carry)")
        self.param = param


def malformed_path(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string or key in ``value`` that holds a lone
    surrogate; ``"<root>"`` for the value itself; None when there is none."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _well_formed(item):
                return path or "<root>"
        elif isinstance(item, dict):
            for key, sub in item.items():
                sub_path = f"{path}.{key}" if path else str(key)
                if not _well_formed(key):
                    return path or "<root>"
                stack.append((sub, sub_path))
        elif isinstance(item, list):
            stack.extend((sub, f"{path}[{i}]") for i, sub in enumerate(item))
    return None


def _well_formed(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decode_body(body: bytes) -> str:
    """The body's text in the encoding its first bytes announce. A lone surrogate is let through here
    (``surrogatepass``) so that the parsed value can name the field holding it; bytes that are no text
    of that encoding at all are a 400."""
    encoding = json.detect_encoding(body)
    try:
        return body.decode(encoding, "surrogatepass")
    except UnicodeDecodeError as exc:
        raise StarletteHTTPException(400, f"The request body is not valid {encoding.upper()} text "
                                          f"(at byte {exc.start}).") from None


def parse_body(body: bytes, check_lists: Callable[[Any], None] | None = None) -> Any:
    """The parsed JSON body, checked: ``MalformedText`` if a string in it holds a lone surrogate, and
    ``check_lists(value)`` (the caps on its lists) before anything validates it."""
    text = decode_body(body)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:  # FastAPI's own answer to a body that is not JSON
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}]) from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise StarletteHTTPException(400, "The request body nests too deeply.") from None
    if "\\ud" in text or "\\uD" in text or not _well_formed(text):  # an escape or a raw code unit
        path = malformed_path(value)
        if path is not None:
            raise MalformedText(None if path == "<root>" else path)
    if check_lists is not None:
        check_lists(value)
    return value


class _CheckedRequest(Request):
    """A request whose JSON body ``CheckedRoute`` has already parsed and checked."""

    parsed: Any = None

    async def json(self) -> Any:
        return self.parsed


def _is_json(request: Request) -> bool:
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    return content_type == "application/json" or content_type.endswith("+json")


class CheckedRoute(APIRoute):
    """An ``APIRoute`` whose JSON body is decoded, parsed and checked (``parse_body``) before FastAPI
    validates it against the route's request model: inline when small, on a worker thread when large."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        path = self.path_format
        known = field_names(self.body_field.field_info.annotation) if self.body_field is not None else None
        lenient = known is not None and path in LENIENT_ROUTES

        async def checked(request: Request) -> Response:
            request = _CheckedRequest(request.scope, request.receive)
            body = await request.body()
            if body and _is_json(request):
                config = request.app.state.server_config
                limits: RequestLimits = config.limits
                check_lists = functools.partial(limits.check_lists, path)
                if len(body) > OFF_LOOP_BYTES:
                    request.parsed = await asyncio.to_thread(parse_body, body, check_lists)
                else:
                    request.parsed = parse_body(body, check_lists)
                if lenient and (ignored := sort_fields(path, request.parsed, known, config.strict_request_fields)):
                    request.scope[IGNORED_SCOPE_KEY] = ignored
                    note_ignored(path, ignored)
            return await handler(request)

        return checked

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The route, its response (an error's too) naming the fields it ignored."""
        async def send_naming_ignored(message: Message) -> None:
            if message["type"] == "http.response.start" and (ignored := scope.get(IGNORED_SCOPE_KEY)):
                header = (IGNORED_FIELDS_HEADER, shown_names(ignored).encode("ascii"))
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await super().handle(scope, receive, send_naming_ignored)
