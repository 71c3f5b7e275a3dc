"""The OpenAI-compatible HTTP server: security, the routes, and streaming.

``create_app(llm_or_async_llm, api_keys=...)`` returns a FastAPI app. Requests flow

    HTTP -> APIKeyMiddleware (401 unless a valid key; sets the trust group)
         -> BodySizeLimitMiddleware (413) -> route: parse strictly (protocol.py, 400)
         -> tokenize (``engine.call``) -> engine.add_request(cache_salt=group's salt)
         -> JSON response, or SSE ``data: {...}`` chunks ending in ``data: [DONE]``

The engine is an ``AsyncEngine``: ``AsyncLLM`` (the engine core on a thread of this
process) or ``MPAsyncLLM`` (the engine core in a process of its own; see ``core_client.py``).
A request that sends ``X-Stagedserve-Timeline: 1`` gets its server-side timeline
(``server_metrics.request_phases``) as an extra ``server_timeline`` key in the response
body, or in the stream's final choice chunk: opt-in, so standard clients see standard bodies.

The security boundary, which is stricter than vLLM's:

- Authentication is an ASGI middleware around the whole app, so it covers every route
  that exists or is added later, whatever its prefix (``/docs``, ``/openapi.json``,
  an unknown path), except ``/health`` (and ``/metrics`` when ``metrics_public``).
  vLLM checks ``/v1`` and a few other prefixes and leaves unprefixed aliases open.
- A key is checked against every configured key with ``hmac.compare_digest`` over
  SHA-256 digests: equal-length inputs and no early exit, so timing reveals nothing.
- Each key belongs to a trust group. The prefix-cache salt of a request is an HMAC of
  its group under a per-server random secret: groups never share cached blocks (no
  cross-tenant timing side channel) and no client can compute another group's salt.
  A client-supplied ``cache_salt`` is refused unless ``trust_client_cache_salt``, and
  even then it only partitions its own group's cache further.
- Bodies are capped (413), errors never carry tracebacks, and a failed engine step
  fails only the requests in flight (500) while the server keeps serving.

vLLM: ``vllm/entrypoints/openai/api_server.py`` (app, routes, auth middleware),
``serving_completion.py`` and ``serving_chat.py`` (request -> engine -> response).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.outputs import Logprob, RequestOutput
from shared.sampling_params import SamplingParams
from stage5_server.async_llm import (
    AsyncEngine,
    AsyncLLM,
    EngineDeadError,
    EngineError,
    RequestAborted,
    RequestStream,
)
from stage5_server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request_from_value_error,
    error_body,
    loc_to_param,
    now,
    usage,
)
from stage5_server.server_metrics import PrometheusStatLogger, request_phases

logger = logging.getLogger("stagedserve")

DEFAULT_MAX_BODY_BYTES = 4 << 20
PUBLIC_GROUP = "public"  # the one trust group of a server run without API keys
TRUST_GROUP_SCOPE_KEY = "stagedserve.trust_group"
TIMELINE_HEADER = "x-stagedserve-timeline"  # "1": add ``server_timeline`` to the final body or chunk
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


# ---- API keys and trust groups -----------------------------------------------------------------


class APIKeys:
    """API keys, each in a trust group, checked in constant time.

    ``keys`` is ``{key: group}`` or a list of keys. A key without a group (a list entry,
    or ``None`` as its group) is a group of its own, ``key#1``, ``key#2``, ...: sharing
    the prefix cache between keys is an explicit choice of the operator.
    """

    def __init__(self, keys: Mapping[str, str | None] | list[str]):
        pairs = list(keys.items()) if isinstance(keys, Mapping) else [(k, None) for k in keys]
        if not pairs:
            raise ValueError("api_keys: empty; pass None to run without authentication")
        self._digests: list[tuple[bytes, str]] = []
        for i, (key, group) in enumerate(pairs, start=1):
            if not isinstance(key, str) or not key or any(c.isspace() for c in key):
                raise ValueError(f"api_keys: key #{i} must be a non-empty string without whitespace")
            if group is None:
                group = f"key#{i}"
            elif not isinstance(group, str) or not _GROUP_NAME.match(group):
                raise ValueError(f"api_keys: group of key #{i} must match {_GROUP_NAME.pattern}, got {group!r}")
            self._digests.append((hashlib.sha256(key.encode()).digest(), group))
        if len({d for d, _ in self._digests}) != len(self._digests):
            raise ValueError("api_keys: the same key is listed twice")

    @property
    def groups(self) -> list[str]:
        return sorted({g for _, g in self._digests})

    def __len__(self) -> int:
        return len(self._digests)

    def authenticate(self, token: str | None) -> str | None:
        """The trust group of ``token``, or None. Compares against every key, always."""
        if token is None:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        group = None
        for key_digest, key_group in self._digests:
            if hmac.compare_digest(digest, key_digest):
                group = key_group
        return group


class CacheSalter:
    """Prefix-cache salts: ``HMAC(secret, group [, client salt])``, unguessable without the secret."""

    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)

    def salt(self, group: str, client_salt: str | None = None) -> str:
        message = b"stagedserve-cache-salt\x00" + group.encode() + b"\x00"
        if client_salt is not None:
            message += b"\x01" + client_salt.encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


def _route_path(scope: Scope) -> str:
    """The path the router matches (``scope["path"]`` less ``root_path``), as Starlette computes it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        return path[len(root):]
    return path


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


async def _send_json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


class APIKeyMiddleware:
    """Every HTTP and WebSocket request needs a valid key, except ``public_paths``.

    Runs before routing, so it cannot be bypassed by a route it does not know about,
    and an unknown path answers 401 (not 404) to a client without a key.
    """

    def __init__(self, app: ASGIApp, keys: APIKeys | None, public_paths: frozenset[str]):
        self.app = app
        self.keys = keys
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        group = PUBLIC_GROUP if self.keys is None else self.keys.authenticate(_bearer_token(scope))
        if group is None and _route_path(scope) not in self.public_paths:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _send_json(send, 401, error_body(
                "Missing or invalid API key: send it as 'Authorization: Bearer <key>'.",
                "invalid_request_error", None, "invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        scope[TRUST_GROUP_SCOPE_KEY] = group
        await self.app(scope, receive, send)


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
                    return await _send_json(send, 400, APIError(400, "Invalid Content-Length header.").body())
                if int(value) > self.max_bytes:
                    return await _send_json(send, 413, too_large.body())
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


# ---- streaming -------------------------------------------------------------------------------


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


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``, or raise ``ClientDisconnected`` (cancelling it) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnected


async def _final_output(stream: RequestStream) -> RequestOutput:
    async for output in stream:
        if output.finished:
            return output
    raise EngineError("the request ended without a final output")


class _DeltaTracker:
    """What a stream has not sent yet, from cumulative outputs.

    Text that could still turn out to be the start of a stop string is held back
    (the longest stop string less one character) until the request finishes, so the
    streamed text always equals the final, stop-string-trimmed text.
    """

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


def _token_text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""  # filled in on the engine thread


def completion_logprobs(output: RequestOutput, start: int, end: int, text_offset: int) -> dict[str, Any] | None:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    completion = output.outputs[0]
    if completion.logprobs is None:
        return None
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        chosen = entry[token_id]  # the sampler always records the sampled token
        token = _token_text(chosen)
        result["tokens"].append(token)
        result["token_logprobs"].append(chosen.logprob)
        result["top_logprobs"].append({_token_text(lp): lp.logprob for lp in sorted(entry.values(),
                                                                                  key=lambda x: x.rank)})
        result["text_offset"].append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(output: RequestOutput, start: int, end: int, top_n: int) -> dict[str, Any] | None:
    """The chat format: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    completion = output.outputs[0]
    if completion.logprobs is None:
        return None

    def item(lp: Logprob) -> dict[str, Any]:
        token = _token_text(lp)
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for token_id, entry in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        chosen = entry[token_id]  # the sampler always records the sampled token
        top = sorted((lp for lp in entry.values() if lp.rank <= top_n), key=lambda x: x.rank)
        content.append({**item(chosen), "top_logprobs": [item(lp) for lp in top]})
    return {"content": content}


def _finish_reason(output: RequestOutput) -> str | None:
    reason = output.outputs[0].finish_reason
    return reason if reason in ("stop", "length") else None


# ---- the OpenAI endpoints ----------------------------------------------------------------------


class OpenAIServing:
    """Completions and chat completions over one ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, salter: CacheSalter,
                 trust_client_cache_salt: bool):
        self.engine = engine
        self.served_model_name = served_model_name
        self.salter = salter
        self.trust_client_cache_salt = trust_client_cache_salt

    # -- shared steps
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def cache_salt(self, request: Request, client_salt: str | None) -> str:
        if client_salt is not None and not self.trust_client_cache_salt:
            raise APIError(400, "cache_salt: this server sets the prefix-cache salt from your API key's trust "
                           "group; a client-supplied cache_salt is not accepted", param="cache_salt")
        group = request.scope.get(TRUST_GROUP_SCOPE_KEY)
        if group is None:  # only a public path has no group, and none of those generates
            raise APIError(401, "An API key is required.", code="invalid_api_key")
        return self.salter.salt(group, client_salt)

    async def on_engine(self, fn, *args) -> Any:
        try:
            return await self.engine.call(fn, *args)
        except ValueError as exc:
            raise bad_request_from_value_error(exc) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> None:
        limit = self.engine.max_model_len
        if num_prompt_tokens == 0:
            raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param)
        if num_prompt_tokens >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                           f"{num_prompt_tokens} input tokens, which leaves no room to generate. Please reduce the "
                           f"length of the input.", param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(400, f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is "
                           f"{limit} tokens and your request has {num_prompt_tokens} input tokens "
                           f"({max_tokens} > {limit} - {num_prompt_tokens}).", param="max_tokens",
                           code="context_length_exceeded")

    async def start(self, token_ids: list[int], params: SamplingParams, request_id: str,
                    salt: str, received: float) -> RequestStream:
        try:
            return await self.engine.add_request(token_ids, params, request_id, cache_salt=salt,
                                                 received_time=received)
        except ValueError as exc:
            raise bad_request_from_value_error(exc) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None

    async def respond(self, request: Request, stream: RequestStream, params: SamplingParams, build_json,
                      make_chunk=None, usage_chunk=None) -> Response:
        """Non-streaming (no ``make_chunk``): wait for the final output. Streaming: wait for the
        first, then SSE events built by ``make_chunk`` (and ``usage_chunk``, if usage is asked for).

        Waiting for the first output before sending headers lets an engine failure in
        the first step still answer with a 500 status rather than an error event.
        """
        try:
            if make_chunk is None:
                output = await _unless_disconnected(request, _final_output(stream))
                return JSONResponse(build_json(output))
            first = await _unless_disconnected(request, stream.get())
            return SSEResponse(self.events(first, stream, params, make_chunk, usage_chunk))
        except ClientDisconnected:
            self.engine.abort(stream.request_id)
            return Response(status_code=499)  # nobody is listening
        except (EngineError, RequestAborted) as exc:
            self.engine.abort(stream.request_id)
            raise _engine_api_error(exc) from None
        except BaseException:
            self.engine.abort(stream.request_id)
            raise

    async def events(self, first: RequestOutput, stream: RequestStream, params: SamplingParams,
                     make_chunk, usage_chunk) -> AsyncIterator[str]:
        """SSE events of one request; closing this generator early aborts the request."""
        tracker = _DeltaTracker(params)
        output = first
        try:
            while True:
                delta = tracker.advance(output)
                if delta is not None:
                    yield sse(make_chunk(output, *delta))
                if output.finished:
                    break
                output = await stream.get()
        except (EngineError, RequestAborted) as exc:
            yield sse(_engine_api_error(exc).body())
            yield SSE_DONE
            return
        finally:
            if not stream.finished:
                self.engine.abort(stream.request_id)
        if usage_chunk is not None:
            yield sse(usage_chunk(output))
        yield SSE_DONE

    # -- POST /v1/completions
    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        received = time.monotonic()
        timeline = _timeline_extra(request)
        self.check_model(body.model)
        salt = self.cache_salt(request, body.cache_salt)
        params = body.sampling_params(body.max_tokens, body.logprobs)
        prompt = body.prompt
        token_ids = prompt if isinstance(prompt, list) else await self.on_engine(self.engine.tokenizer.encode, prompt)
        self.check_lengths(len(token_ids), params.max_tokens, "prompt")
        request_id, created, model = f"cmpl-{uuid.uuid4().hex}", now(), self.served_model_name
        stream = await self.start(token_ids, params, request_id, salt, received)

        def base(choices: list, **extra) -> dict[str, Any]:
            return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": choices, **extra}

        def response(out: RequestOutput) -> dict[str, Any]:
            c = out.outputs[0]
            choice = {"index": 0, "text": c.text, "logprobs": completion_logprobs(out, 0, len(c.token_ids), 0),
                      "finish_reason": _finish_reason(out), "stop_reason": c.stop_reason}
            return base([choice], usage=_usage(out), **timeline(out))

        offset = 0

        def chunk(out: RequestOutput, text: str, start: int, end: int) -> dict[str, Any]:
            nonlocal offset
            logprobs = completion_logprobs(out, start, end, offset)
            offset += len(text)
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": _finish_reason(out) if out.finished else None}
            return base([choice], **({"usage": None} if body.include_usage else {}),
                        **(timeline(out) if out.finished else {}))

        def usage_chunk(out: RequestOutput) -> dict[str, Any]:
            return base([], usage=_usage(out))

        return await self.respond(request, stream, params, response, chunk if body.stream else None,
                                  usage_chunk if body.include_usage else None)

    # -- POST /v1/chat/completions
    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        received = time.monotonic()
        timeline = _timeline_extra(request)
        self.check_model(body.model)
        salt = self.cache_salt(request, body.cache_salt)
        top_n = body.top_logprobs or 0
        params = body.sampling_params(body.requested_max_tokens, body.num_logprobs)
        token_ids = await self.on_engine(self.engine.tokenizer.apply_chat_template, body.conversation())
        self.check_lengths(len(token_ids), params.max_tokens, "messages")
        request_id, created, model = f"chatcmpl-{uuid.uuid4().hex}", now(), self.served_model_name
        stream = await self.start(token_ids, params, request_id, salt, received)

        def base(obj: str, choices: list, **extra) -> dict[str, Any]:
            return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices,
                    **extra}

        def response(out: RequestOutput) -> dict[str, Any]:
            c = out.outputs[0]
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                      "logprobs": chat_logprobs(out, 0, len(c.token_ids), top_n),
                      "finish_reason": _finish_reason(out), "stop_reason": c.stop_reason}
            return base("chat.completion", [choice],
                        usage=_usage(out),
                        **timeline(out))

        first_chunk = True

        def chunk(out: RequestOutput, text: str, start: int, end: int) -> dict[str, Any]:
            nonlocal first_chunk
            delta: dict[str, Any] = {"content": text} if text or first_chunk else {}
            if first_chunk:
                delta = {"role": "assistant", **delta}
                first_chunk = False
            choice = {"index": 0, "delta": delta, "logprobs": chat_logprobs(out, start, end, top_n),
                      "finish_reason": _finish_reason(out) if out.finished else None}
            return base("chat.completion.chunk", [choice], **({"usage": None} if body.include_usage else {}),
                        **(timeline(out) if out.finished else {}))

        def usage_chunk(out: RequestOutput) -> dict[str, Any]:
            return base("chat.completion.chunk", [], usage=_usage(out))

        return await self.respond(request, stream, params, response, chunk if body.stream else None,
                                  usage_chunk if body.include_usage else None)


def _usage(output: RequestOutput) -> dict[str, Any]:
    return usage(len(output.prompt_token_ids), len(output.outputs[0].token_ids), output.num_cached_tokens)


def _timeline_extra(request: Request):
    """``{"server_timeline": phases}`` for a request that opted in with ``X-Stagedserve-Timeline: 1``."""
    if request.headers.get(TIMELINE_HEADER) != "1":
        return lambda output: {}
    return lambda output: {"server_timeline": request_phases(output.timeline)}


def _engine_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, RequestAborted):
        return APIError(503, "The request was aborted before it finished.", code="request_aborted")
    return APIError(500, str(exc), code="engine_error")


# ---- the app ---------------------------------------------------------------------------------


def _version() -> str:
    try:
        return metadata.version("stagedserve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _validation_error(exc: RequestValidationError) -> APIError:
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
    return APIError(400, message, param=param)


_HTTP_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def create_app(engine: AsyncEngine | Any, *, api_keys: Mapping[str, str | None] | list[str] | None = None,
               served_model_name: str | None = None, trust_client_cache_salt: bool = False,
               metrics_public: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               log_stats_interval: float | None = 10.0, cache_salt_secret: bytes | None = None) -> FastAPI:
    """The OpenAI-compatible app over an ``AsyncEngine``, or over an ``LLM`` (wrapped in an in-process
    ``AsyncLLM``, and shut down with the app).

    ``api_keys``: ``{key: trust group}`` or a list of keys (each its own group); None runs
    without authentication (keep the server on loopback then). ``log_stats_interval``
    applies only when an ``LLM`` is wrapped here.
    """
    owns_engine = not isinstance(engine, AsyncEngine)
    if owns_engine:
        engine = AsyncLLM(engine, log_stats_interval=log_stats_interval)
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be a positive integer, got {max_body_bytes!r}")
    keys = APIKeys(api_keys) if api_keys is not None else None
    model_name = served_model_name or engine.model_path
    metrics = PrometheusStatLogger(model_name, lambda: engine.stats, engine.max_model_len)
    engine.stat_loggers.append(metrics)
    serving = OpenAIServing(engine, model_name, CacheSalter(cache_salt_secret), trust_client_cache_salt)
    public_paths = frozenset({"/health"} | ({"/metrics"} if metrics_public else set()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if metrics in engine.stat_loggers:
            engine.stat_loggers.remove(metrics)
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="stagedserve", version=_version(), lifespan=lifespan,
                  description="An OpenAI-compatible server over the stagedserve engine.")
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.api_keys = keys
    app.state.public_paths = public_paths
    # Added last = outermost: authentication runs before anything else looks at the request.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(APIKeyMiddleware, keys=keys, public_paths=public_paths)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), code=_HTTP_CODES.get(exc.status_code))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, "Internal server error.", code="internal_error").body(), status_code=500)

    @app.get("/health", summary="Liveness: 200 while the engine core runs (no API key needed)")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(APIError(503, "The engine is not running.", code="engine_unavailable").body(),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    created = now()

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "stagedserve",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        serving.check_model(model)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(request, body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        tokenizer = engine.tokenizer
        if body.messages is not None:
            conversation = [{"role": m.role, "content": m.content} for m in body.messages]
            ids = await serving.on_engine(tokenizer.apply_chat_template, conversation, body.add_generation_prompt)
        elif body.add_special_tokens:
            ids = await serving.on_engine(tokenizer.encode, body.prompt)
        else:
            ids = await serving.on_engine(lambda text: tokenizer.hf.encode(text, add_special_tokens=False),
                                          body.prompt)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        tokenizer = engine.tokenizer

        def decode(ids: list[int]) -> str:
            vocab = len(tokenizer.hf)
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"tokens: token ids must be in [0, {vocab})")
            return tokenizer.decode(ids)

        return {"prompt": await serving.on_engine(decode, body.tokens)}

    @app.get("/metrics", summary="Prometheus metrics (needs an API key unless metrics_public)")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi_with_openai_errors(app, needs_key=keys is not None)
    return app


_ERROR_SCHEMA = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}},
}


_ENGINE_PATHS = frozenset({"/health", "/v1/completions", "/v1/chat/completions"})


def _openapi_with_openai_errors(app: FastAPI, needs_key: bool) -> dict[str, Any]:
    """FastAPI's schema, corrected to what the server answers: invalid input is a 400 with an
    OpenAI error object (FastAPI would document its own 422 body), and a missing or wrong key a 401."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for fastapi_own in ("HTTPValidationError", "ValidationError"):
        components.pop(fastapi_own, None)
    components["ErrorResponse"] = _ERROR_SCHEMA
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    public = app.state.public_paths
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            has_body = "requestBody" in operation
            if responses.pop("422", None) is not None or has_body:
                responses["400"] = {"description": "Invalid request", **error}
            if needs_key and path not in public:
                responses["401"] = {"description": "Missing or invalid API key", **error}
            if has_body or "{model}" in path:
                responses["404"] = {"description": "No such model", **error}
            if has_body:
                responses["413"] = {"description": "Request body too large", **error}
            if path in _ENGINE_PATHS:
                responses["500"] = {"description": "The engine failed while running the request", **error}
                responses["503"] = {"description": "The engine is not running", **error}
    app.openapi_schema = schema
    return schema


def describe_routes(app: FastAPI) -> list[str]:
    """``METHODS /path`` of every route, marking the ones that need no API key."""
    public = getattr(app.state, "public_paths", frozenset())
    needs_key = getattr(app.state, "api_keys", None) is not None
    lines = []
    for route in app.routes:
        methods = ",".join(sorted(getattr(route, "methods", None) or ["*"]))
        path = getattr(route, "path", "?")
        access = "public" if path in public or not needs_key else "API key"
        lines.append(f"{methods:<10} {path}  ({access})")
    return lines


# ---- running uvicorn on a thread (tests, the demo) ---------------------------------------------


class ServerThread:
    """uvicorn serving ``app`` on a background thread, on a loopback port chosen by the OS.

    ``with ServerThread(app) as server: httpx.get(server.url + "/health")``
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.host = host
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                        name="stagedserve-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
