"""What every generation endpoint does the same way: from a parsed request to a response.

    check the model name -> the trust group's cache salt -> tokenize (``engine.call``)
    -> check lengths -> ``engine.add_request`` -> a JSON body, or SSE chunks then ``[DONE]``

An endpoint module (``completions.py``, ``chat.py``) parses its request and writes its bodies
with a ``Responder``; ``OpenAIServing`` does the rest. A request that sends
``X-Stagedserve-Timeline: 1`` gets its server-side timeline (``metrics.request_phases``) as an
extra ``server_timeline`` key in the response body, or in the stream's final choice chunk:
opt-in, so standard clients see standard bodies.

vLLM: ``OpenAIServing`` in ``vllm/entrypoints/openai/serving_engine.py``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from stage5_server.engine.errors import EngineError, RequestAborted
from stage5_server.engine.frontend import AsyncEngine
from stage5_server.engine.stream import RequestStream
from stage5_server.server.auth import RECEIVED_SCOPE_KEY, TRUST_GROUP_SCOPE_KEY, CacheSalter
from stage5_server.server.errors import APIError, api_error, engine_errors
from stage5_server.server.metrics import request_phases
from stage5_server.server.sse import (
    SSE_DONE,
    ClientDisconnected,
    DeltaTracker,
    SSEResponse,
    final_output,
    sse,
    unless_disconnected,
)
from stage5_server.server.tool_calling import ToolCallingOptions

TIMELINE_HEADER = "x-stagedserve-timeline"  # "1": add ``server_timeline`` to the final body or chunk


def usage_of(output: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


def finish_reason(output: RequestOutput) -> str | None:
    reason = output.outputs[0].finish_reason
    return reason if reason in ("stop", "length") else None


class Responder:
    """How one request's bodies are written: the whole response, or stream chunks and a usage chunk."""

    object: ClassVar[str]  # the ``object`` of a whole response
    chunk_object: ClassVar[str]  # the ``object`` of a stream chunk

    def __init__(self, request_id: str, model: str, http_request: Request, include_usage: bool):
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.with_timeline = http_request.headers.get(TIMELINE_HEADER) == "1"

    def response(self, output: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, output: RequestOutput, text: str, start: int, end: int) -> dict[str, Any] | None:
        """The chunk for ``text`` (new since the last chunk) and output tokens ``start .. end``; None
        when there is nothing to send yet (text held back to be read as a tool call)."""
        raise NotImplementedError

    def usage_chunk(self, output: RequestOutput) -> dict[str, Any]:
        return self.body(self.chunk_object, [], usage=usage_of(output))

    # A stream as SSE frames: chat and completions send ``data:`` chunks and ``[DONE]``; the
    # Responses API overrides these for its typed events.
    def opening_frames(self) -> list[str]:
        return []

    def frames(self, output: RequestOutput, text: str, start: int, end: int) -> list[str]:
        chunk = self.chunk(output, text, start, end)
        return [] if chunk is None else [sse(chunk)]

    def closing_frames(self, output: RequestOutput) -> list[str]:
        return ([sse(self.usage_chunk(output))] if self.include_usage else []) + [SSE_DONE]

    def error_frames(self, error: APIError) -> list[str]:
        return [sse(error.body()), SSE_DONE]

    def body(self, obj: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def whole(self, output: RequestOutput, choice: dict[str, Any]) -> dict[str, Any]:
        return self.body(self.object, [choice], usage=usage_of(output), **self.timeline(output))

    def chunk_body(self, output: RequestOutput, choice: dict[str, Any]) -> dict[str, Any]:
        return self.body(self.chunk_object, [choice], **({"usage": None} if self.include_usage else {}),
                         **(self.timeline(output) if output.finished else {}))

    def timeline(self, output: RequestOutput) -> dict[str, Any]:
        return {"server_timeline": request_phases(output.timeline)} if self.with_timeline else {}


class OpenAIServing:
    """The steps the generation endpoints share, over one ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, salter: CacheSalter,
                 trust_client_cache_salt: bool, tool_calling: ToolCallingOptions | None = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.salter = salter
        self.trust_client_cache_salt = trust_client_cache_salt
        self.tool_calling = tool_calling or ToolCallingOptions()

    def admit(self, request: Request, model: str | None, client_salt: str | None) -> str:
        """Check the model name; return the request's prefix-cache salt (its trust group's)."""
        self.check_model(model)
        return self.cache_salt(request, client_salt)

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

    async def on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` through ``engine.call`` (the tokenizer is the engine's to use)."""
        with engine_errors():
            return await self.engine.call(fn, *args)

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

    async def generate(self, request: Request, token_ids: list[int], params: SamplingParams, salt: str,
                       responder: Responder, stream: bool) -> Response:
        """Start the request in the engine and answer with its JSON body or its SSE stream."""
        with engine_errors():
            request_stream = await self.engine.add_request(token_ids, params, responder.request_id, cache_salt=salt,
                                                           received_time=request.scope.get(RECEIVED_SCOPE_KEY))
        return await self.respond(request, request_stream, params, responder, stream)

    async def respond(self, request: Request, stream: RequestStream, params: SamplingParams, responder: Responder,
                      streaming: bool) -> Response:
        """Non-streaming: wait for the final output. Streaming: wait for the first, then SSE events.

        Waiting for the first output before sending headers lets an engine failure in
        the first step still answer with a 500 status rather than an error event.
        """
        try:
            if not streaming:
                output = await unless_disconnected(request, final_output(stream))
                return JSONResponse(responder.response(output))
            first = await unless_disconnected(request, stream.get())
            return SSEResponse(self.events(first, stream, params, responder))
        except ClientDisconnected:
            self.engine.abort(stream.request_id)
            return Response(status_code=499)  # nobody is listening
        except (EngineError, RequestAborted) as exc:
            self.engine.abort(stream.request_id)
            raise api_error(exc) from None
        except BaseException:
            self.engine.abort(stream.request_id)
            raise

    async def events(self, first: RequestOutput, stream: RequestStream, params: SamplingParams,
                     responder: Responder) -> AsyncIterator[str]:
        """SSE events of one request; closing this generator early aborts the request."""
        tracker = DeltaTracker(params)
        output = first
        try:
            for frame in responder.opening_frames():
                yield frame
            while True:
                delta = tracker.advance(output)
                for frame in [] if delta is None else responder.frames(output, *delta):
                    yield frame
                if output.finished:
                    break
                output = await stream.get()
        except (EngineError, RequestAborted) as exc:
            for frame in responder.error_frames(api_error(exc)):
                yield frame
            return
        finally:
            if not stream.finished:
                self.engine.abort(stream.request_id)
        for frame in responder.closing_frames(output):
            yield frame
