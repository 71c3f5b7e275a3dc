"""What every generation endpoint does the same way: from a parsed request to a response.

    check the model name -> the trust group's cache salt -> tokenize (``engine.call``)
    -> check lengths -> ``engine.add_request`` -> a JSON body, or SSE chunks then ``[DONE]``

An endpoint module (``completions.py``, ``chat.py``) parses its request and writes its bodies
with a ``Responder``; ``OpenAIServing`` does the rest. ``X-Stagedserve-Timeline: 1`` (opt-in)
adds the request's server-side timeline (``metrics.request_phases``) as ``server_timeline``.

vLLM: ``OpenAIServing`` in ``vllm/entrypoints/openai/serving_engine.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from stage5_server.engine.errors import EngineError, RequestAborted
from stage5_server.engine.frontend import AsyncEngine
from stage5_server.engine.stream import RequestStream
from stage5_server.server.auth import RECEIVED_SCOPE_KEY, TRUST_GROUP_SCOPE_KEY, CacheSalter
from stage5_server.server.chat_options import ChatOptions
from stage5_server.server.errors import APIError, api_error, engine_errors
from stage5_server.server.metrics import PrometheusStatLogger, request_phases
from stage5_server.server.sse import (
    SSE_DONE,
    ClientDisconnected,
    DeltaTracker,
    SSEResponse,
    final_output,
    sse,
    unless_disconnected,
)

TIMELINE_HEADER = "x-stagedserve-timeline"  # "1": add ``server_timeline`` to the final body or chunk


def usage_of(outputs: list[RequestOutput], n: int = 1) -> dict[str, Any]:
    """Usage of one response: each prompt counted once (outputs come n per prompt), every sample's tokens."""
    firsts = outputs[::n]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)}}


def finish_reason(output: RequestOutput) -> str | None:
    reason = output.outputs[0].finish_reason
    return reason if reason in ("stop", "length") else None


class Responder:
    """How one request's bodies are written: the whole response, or stream chunks and a usage chunk.
    Prompt i's sample j is choice ``i * n + j`` (vLLM's order)."""

    object: ClassVar[str]  # the ``object`` of a whole response
    chunk_object: ClassVar[str]  # the ``object`` of a stream chunk

    def __init__(self, request_id: str, model: str, http_request: Request, include_usage: bool,
                 continuous_usage: bool = False, n: int = 1):
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # usage so far in every chunk
        self.n = n  # samples per prompt
        self.system_fingerprint: str | None = None  # set by ``OpenAIServing.generate``
        self.with_timeline = http_request.headers.get(TIMELINE_HEADER) == "1"

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        """The whole response's choice ``index``."""
        raise NotImplementedError

    def chunk(self, index: int, output: RequestOutput, text: str, start: int, end: int) -> dict[str, Any] | None:
        """Choice ``index``'s chunk for new ``text`` and output tokens ``start .. end``; None: nothing to send yet."""
        raise NotImplementedError

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return self.body(self.object, [self.choice(i, o) for i, o in enumerate(outputs)],
                         usage=usage_of(outputs, self.n), **self.timeline(outputs[0]))

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return self.body(self.chunk_object, [], usage=usage_of(outputs, self.n))

    # A stream as SSE frames: chat and completions send ``data:`` chunks and ``[DONE]``; the
    # Responses API overrides these for its typed events.
    def opening_frames(self) -> list[str]:
        return []

    def frames(self, index: int, output: RequestOutput, text: str, start: int, end: int) -> list[str]:
        chunk = self.chunk(index, output, text, start, end)
        return [] if chunk is None else [sse(chunk)]

    def closing_frames(self, outputs: list[RequestOutput]) -> list[str]:
        return ([sse(self.usage_chunk(outputs))] if self.include_usage else []) + [SSE_DONE]

    def error_frames(self, error: APIError) -> list[str]:
        return [sse(error.body()), SSE_DONE]

    def body(self, obj: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices, **extra}

    def chunk_body(self, output: RequestOutput, choice: dict[str, Any]) -> dict[str, Any]:
        usage = usage_of([output]) if self.continuous_usage else None
        return self.body(self.chunk_object, [choice], **({"usage": usage} if self.include_usage else {}),
                         **(self.timeline(output) if output.finished else {}))

    def timeline(self, output: RequestOutput) -> dict[str, Any]:
        return {"server_timeline": request_phases(output.timeline)} if self.with_timeline else {}


def system_fingerprint(engine: AsyncEngine, version: str) -> str:
    """``stagedserve-<version>-<hash8>`` of the model and configuration (vLLM's ``full`` fingerprint mode)."""
    config = {"model": str(getattr(engine, "model_path", "")), "stage": getattr(engine, "stage", ""),
              "engine_args": getattr(engine, "engine_args", {})}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    return f"stagedserve-{version}-{digest[:8]}"


class OpenAIServing:
    """The steps the generation endpoints share, over one ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, salter: CacheSalter,
                 trust_client_cache_salt: bool, version: str = "0", metrics: PrometheusStatLogger | None = None,
                 chat_options: ChatOptions | None = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.salter = salter
        self.trust_client_cache_salt = trust_client_cache_salt
        self.system_fingerprint = system_fingerprint(engine, version)
        self.metrics = metrics  # told of each prompt whose n samples all finished
        self.chat_options = chat_options or ChatOptions()

    def record_parents(self, outputs: list[RequestOutput], n: int) -> None:
        """Prompt i's samples are ``outputs[i * n : (i + 1) * n]`` (the fan-out's order)."""
        if self.metrics is not None:
            for i in range(0, len(outputs), n):
                self.metrics.record_parent_finished(n, outputs[i:i + n])

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

    async def generate(self, request: Request, prompts: list[list[int]], params: SamplingParams, salt: str,
                       responder: Responder, stream: bool) -> Response:
        """One engine request per prompt and sample (``n > 1`` fans out here with seeds ``seed + j``, as
        vLLM's ``ParentRequest``), answered with a JSON body or an SSE stream."""
        responder.system_fingerprint = self.system_fingerprint
        streams: list[RequestStream] = []
        received = request.scope.get(RECEIVED_SCOPE_KEY)
        try:
            for i, token_ids in enumerate(prompts):
                for j in range(params.n):
                    one = params if params.n == 1 else replace(
                        params, n=1, seed=None if params.seed is None else params.seed + j)
                    request_id = responder.request_id if len(prompts) * params.n == 1 else \
                        f"{responder.request_id}-{i}-{j}"
                    with engine_errors():
                        streams.append(await self.engine.add_request(token_ids, one, request_id, cache_salt=salt,
                                                                     received_time=received))
        except BaseException:
            self.engine.abort([s.request_id for s in streams])
            raise
        return await self.respond(request, streams, params, responder, stream)

    async def respond(self, request: Request, streams: list[RequestStream], params: SamplingParams,
                      responder: Responder, streaming: bool) -> Response:
        """Wait for the final outputs, or (streaming) for each first output before the SSE events, so a
        failure in the first step still answers with a 500 status rather than an error event."""
        ids = [s.request_id for s in streams]
        try:
            if not streaming:
                outputs = await unless_disconnected(request, asyncio.gather(*map(final_output, streams)))
                self.record_parents(list(outputs), params.n)
                return JSONResponse(responder.response(list(outputs)))
            firsts = await unless_disconnected(request, asyncio.gather(*(s.get() for s in streams)))
            return SSEResponse(self.events(list(firsts), streams, params, responder))
        except BaseException as exc:
            self.engine.abort(ids)
            if isinstance(exc, ClientDisconnected):
                return Response(status_code=499)  # nobody is listening
            if isinstance(exc, (EngineError, RequestAborted)):
                raise api_error(exc) from None
            raise

    async def events(self, firsts: list[RequestOutput], streams: list[RequestStream], params: SamplingParams,
                     responder: Responder) -> AsyncIterator[str]:
        """SSE events of every choice as its outputs arrive; closing this generator early aborts them all."""
        trackers = [DeltaTracker(params) for _ in streams]
        latest = list(firsts)
        waiting: dict[asyncio.Future, int] = {}  # the next output of each unfinished choice
        try:
            for frame in responder.opening_frames():
                yield frame
            ready = list(enumerate(firsts))
            while True:
                for index, output in ready:
                    latest[index] = output
                    delta = trackers[index].advance(output)
                    for frame in [] if delta is None else responder.frames(index, output, *delta):
                        yield frame
                    if not output.finished:
                        waiting[asyncio.ensure_future(streams[index].get())] = index
                if not waiting:
                    break
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                ready = [(waiting.pop(task), task.result()) for task in done]
        except (EngineError, RequestAborted) as exc:
            for frame in responder.error_frames(api_error(exc)):
                yield frame
            return
        finally:
            for task in waiting:
                task.cancel()
            unfinished = [s.request_id for s in streams if not s.finished]
            if unfinished:
                self.engine.abort(unfinished)
        self.record_parents(latest, params.n)
        for frame in responder.closing_frames(latest):
            yield frame
