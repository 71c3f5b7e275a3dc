"""Request bodies are well-formed Unicode, checked once, where the JSON is parsed.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``); Python parses it into a ``str`` that no
UTF-8 codec (the tokenizer's, the response's) can encode, so every later step would fail on it
with a 500. ``CheckedRoute`` parses each body once and answers 400, naming the field, before a
route sees it. A body without a ``\\ud`` escape cannot hold one and is not walked at all.

vLLM has no such check: its tokenizer raises on the string and the request answers 500.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException


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


def check_body(body: bytes) -> Any:
    """The parsed JSON body; ``MalformedText`` if a string in it holds a lone surrogate."""
    value = json.loads(body)
    if b"\\ud" in body or b"\\uD" in body:  # only an escape can spell a surrogate in valid UTF-8
        path = malformed_path(value)
        if path is not None:
            raise MalformedText(None if path == "<root>" else path)
    return value


class _CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = check_body(await self.body())
        return self._json


class CheckedRoute(APIRoute):
    """An ``APIRoute`` whose JSON body is checked for well-formed Unicode as it is parsed."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(_CheckedRequest(request.scope, request.receive))

        return checked
