"""The server's one error mapping: every failure a client sees is an OpenAI error object.

``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (a
``ValueError("field: why")`` names ``param``), 401 without a valid key, 404 for an unknown model
or route, 413 for a body over the limit, 500 when the engine failed on the request, 503 when no
engine runs or the request was aborted. Tracebacks stay in the log.

vLLM: ``ErrorResponse`` in ``vllm/entrypoints/openai/protocol.py`` and the handlers in
``api_server.py`` (vLLM's error ``type`` is an exception class name; OpenAI's is a category).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from stage5_server.errors import ContextLengthExceeded, EngineDeadError, EngineError, RequestAborted

logger = logging.getLogger("stagedserve")

_HTTP_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class APIError(Exception):
    """An error to send as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_PATH = re.compile(r"[A-Za-z_]\w*(\[\d+\]|\.[A-Za-z_]\w*)*")


def bad_request_from_value_error(exc: ValueError) -> APIError:
    """``ValueError("field: why")`` -> a 400 naming the field (a path such as ``input[2].role`` too)."""
    message = str(exc)
    field, sep, _ = message.partition(":")
    param = field if sep and _PATH.fullmatch(field) else None
    return APIError(400, message, param=param)


async def send_json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


def api_error(exc: BaseException) -> APIError | None:
    """The HTTP error for what an engine call raised, or None for a bug (the 500 handler's)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return bad_request_from_value_error(exc)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, RequestAborted):
        return APIError(503, "The request was aborted before it finished.", code="request_aborted")
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), code="engine_error")
    return None


@contextmanager
def engine_errors(prompt_param: str = "prompt") -> Iterator[None]:
    """Turn what the engine raises into the ``APIError`` a client should see; a prompt too long for the
    context is blamed on ``prompt_param``."""
    try:
        yield
    except ContextLengthExceeded as exc:
        param = prompt_param if exc.param == "prompt" else exc.param
        raise APIError(400, exc.message, param=param, code="context_length_exceeded") from None
    except (ValueError, EngineError, RequestAborted) as exc:
        raise api_error(exc) from None


def loc_to_param(loc: tuple) -> str | None:
    """Pydantic's ``("messages", 0, "role")`` -> ``"messages[0].role"``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """A body that does not parse as the route's request model -> a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request: it must be a JSON object.")
    loc = tuple(first.get("loc", ()))
    param = loc_to_param(loc)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if param is None:
        return bad_request_from_value_error(ValueError(message))
    if loc == ("body",):
        return APIError(400, f"The request body must be a JSON object ({message}).")
    if not message.startswith(param):
        message = f"{param}: {message}"
    named = message.partition(":")[0]  # a validator's message may name a path inside the field
    if named.startswith(param) and _PATH.fullmatch(named):
        param = named
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every exception that reaches FastAPI answers with an OpenAI error object."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), code=_HTTP_CODES.get(exc.status_code),
                         param=getattr(exc, "param", None))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, "Internal server error.", code="internal_error").body(), status_code=500)
