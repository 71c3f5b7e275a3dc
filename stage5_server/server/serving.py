"""What every generation endpoint does the same way: from a parsed request to a response.

    check the model name -> the trust group's cache salt -> ``engine.add_request`` once per prompt
    (it renders, tokenizes, checks lengths and fans ``n`` out) -> a JSON body from the final
    outputs, or SSE chunks of the delta outputs as they come, then ``[DONE]``

An endpoint module (``completions.py``, ``chat.py``) parses its request and writes its bodies
with a ``Responder``; ``OpenAIServing`` does the rest. ``X-Stagedserve-Timeline: 1`` (opt-in)
adds the request's server-side timeline (``metrics.request_phases``) as ``server_timeline``;
``X-KV-Transfer-Id`` (from the disaggregation proxy) names the transfer its blocks cross between a prefill and a
decode instance under (``kv_transfer/p2p.py``).

vLLM: ``OpenAIServing`` in ``vllm/entrypoints/openai/serving_engine.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, ClassVar, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from shared.llm_base import PromptType
from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from stage5_server.engine.frontend import AsyncEngine
from stage5_server.engine.output_processor import RequestOutputKind
from stage5_server.engine.stream import RequestStream
from stage5_server.errors import EngineError, RequestAborted
from stage5_server.lora.request import LoRARequest
from stage5_server.server.auth import RECEIVED_SCOPE_KEY, CacheSalter, trust_group
from stage5_server.server.chat_options import ChatOptions
from stage5_server.server.errors import APIError, api_error, engine_errors
from stage5_server.server.limits import RequestLimits, longest_token_chars
from stage5_server.server.lora_models import ServedModels
from stage5_server.server.media import MediaConnector, MediaOptions
from stage5_server.server.metrics import PrometheusStatLogger, request_phases
from stage5_server.server.sse import (
    SSE_DONE,
    ClientDisconnected,
    SSEResponse,
    final_output,
    sse,
    unless_disconnected,
)

GENERATION_APIS = {"chat.completion": "Chat Completions", "text_completion": "Completions",
                   "response": "Responses"}  # a responder's ``object`` -> the API's name in vLLM's errors
TIMELINE_HEADER = "x-stagedserve-timeline"  # "1": add ``server_timeline`` to the final body or chunk
KV_TRANSFER_HEADER = "x-kv-transfer-id"  # the disaggregation proxy's id for one request's blocks (kv_transfer/)


def in_transfer(prompt: PromptType, transfer_id: str) -> PromptType:
    """``prompt`` with the ``kv_transfer_params`` its blocks cross between a prefill and a decode instance under."""
    params = {"kv_transfer_params": {"transfer_id": transfer_id}}
    if isinstance(prompt, dict):
        return {**prompt, **params}
    return {("prompt" if isinstance(prompt, str) else "prompt_token_ids"): prompt, **params}


def usage_of(outputs: list[RequestOutput], n: int = 1, num_tokens: list[int] | None = None) -> dict[str, Any]:
    """Usage of one response: each prompt counted once (outputs come n per prompt), every sample's tokens
    (``num_tokens``: their counts, where ``outputs`` are deltas)."""
    firsts = outputs[::n]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(num_tokens if num_tokens is not None else (len(o.outputs[0].token_ids) for o in outputs))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)}}


def finish_reason(output: RequestOutput) -> str | None:
    reason = output.outputs[0].finish_reason
    return reason if reason in ("stop", "length") else None


def grammar_failed(outputs: list[RequestOutput]) -> APIError | None:
    """The error to answer with when the engine core ended a choice itself ("abort"): its structured-output
    grammar failed (a resource limit of the grammar engine, while compiling or generating). A client's
    abort never reaches a body."""
    if any(c.finish_reason == "abort" for o in outputs for c in o.outputs):
        return APIError(400, GRAMMAR_FAILED, code="grammar_failed")
    return None


GRAMMAR_FAILED = ("The structured-output constraint failed while generating: it exceeded the grammar engine's "
                  "limits (a recursive schema, a pathological regex, a very long choice list). Simplify it.")


def choices_of(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per choice (prompt i's sample j is choice ``i * n + j``, vLLM's order), each with its one
    completion and finished when that is."""
    return [replace(o, outputs=[c], finished=c.finished) for o in outputs for c in o.outputs]


class Admission(NamedTuple):
    cache_salt: str  # the trust group's prefix-cache salt
    lora_request: LoRARequest | None  # the adapter the request's ``model`` names (lora_models.py); None: the base


class Responder:
    """How one request's bodies are written: the whole response, or stream chunks and a usage chunk.
    A stream's outputs are deltas: one per choice (``choices_of``), with only what is new."""

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
        self.num_tokens: dict[int, int] = {}  # per choice: output tokens streamed so far
        self.system_fingerprint: str | None = None  # set by ``OpenAIServing.generate``
        self.with_timeline = http_request.headers.get(TIMELINE_HEADER) == "1"

    async def prepare(self, serving: OpenAIServing, outputs: list[RequestOutput]) -> None:
        """Before the first body: anything it needs from the engine's tokenizer (``outputs``: each prompt's
        first output, with the token ids the engine took)."""

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        """The whole response's choice ``index``."""
        raise NotImplementedError

    def chunk(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        """Choice ``index``'s chunk for the delta ``output``; None: nothing to send yet."""
        raise NotImplementedError

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return self.body(self.object, [self.choice(i, o) for i, o in enumerate(outputs)],
                         usage=usage_of(outputs, self.n), **self.timeline(outputs[0]))

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return self.body(self.chunk_object, [], usage=usage_of(outputs, self.n, self.counts()))

    def counts(self) -> list[int]:
        return [self.num_tokens[i] for i in sorted(self.num_tokens)]

    def stream_frames(self, index: int, output: RequestOutput) -> list[str]:
        """The frames for choice ``index``'s delta ``output``, counting its tokens."""
        self.num_tokens[index] = self.num_tokens.get(index, 0) + len(output.outputs[0].token_ids)
        return self.frames(index, output)

    # A stream as SSE frames: chat and completions send ``data:`` chunks and ``[DONE]``; the
    # Responses API overrides these for its typed events.
    def opening_frames(self, firsts: list[RequestOutput]) -> list[str]:
        """Before any choice's first delta (``firsts``: each prompt's first output)."""
        return []

    def frames(self, index: int, output: RequestOutput) -> list[str]:
        chunk = self.chunk(index, output)
        return [] if chunk is None else [sse(chunk)]

    def closing_frames(self, outputs: list[RequestOutput]) -> list[str]:
        """``outputs``: each choice's last delta."""
        return ([sse(self.usage_chunk(outputs))] if self.include_usage else []) + [SSE_DONE]

    def error_frames(self, error: APIError) -> list[str]:
        return [sse(error.body()), SSE_DONE]

    def body(self, obj: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices, **extra}

    def chunk_body(self, output: RequestOutput, choice: dict[str, Any]) -> dict[str, Any]:
        usage = usage_of([output], num_tokens=[self.num_tokens[choice["index"]]]) if self.continuous_usage else None
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
                 chat_options: ChatOptions | None = None, limits: RequestLimits | None = None,
                 media: MediaOptions | None = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.salter = salter
        self.trust_client_cache_salt = trust_client_cache_salt
        self.system_fingerprint = system_fingerprint(engine, version)
        self.metrics = metrics  # told of each prompt whose n samples all finished
        self.chat_options = chat_options or ChatOptions()
        self.limits = limits or RequestLimits()
        self.media = MediaConnector(media or MediaOptions.from_env())  # images named by URL (media.py)
        self.context = (engine.max_model_len, longest_token_chars(engine.tokenizer.hf))  # RequestLimits.check
        self.models = ServedModels(served_model_name, engine)  # the base model and its LoRA adapters

    def check_limits(self, prompts: list[PromptType], params: SamplingParams, prompt_param: str = "prompt") -> None:
        """Refuse a request over one of the server's caps, before anything is rendered or tokenized."""
        self.limits.check(prompts, params, self.context, prompt_param)

    def record_parents(self, num_tokens: list[int], n: int) -> None:
        """``num_tokens``: each choice's output tokens; prompt i's samples are ``[i * n : (i + 1) * n]``."""
        if self.metrics is not None:
            for i in range(0, len(num_tokens), n):
                self.metrics.record_parent_finished(n, num_tokens[i:i + n])

    def admit(self, request: Request, model: str | None, client_salt: str | None) -> Admission:
        """What a request's ``model`` and key decide, once: the adapter the model names (404 for an unknown
        name), then the prefix-cache salt of its trust group."""
        lora_request = self.check_model(model, request)
        return Admission(self.cache_salt(request, client_salt), lora_request)

    def check_model(self, model: str | None, request: Request) -> LoRARequest | None:
        """404 unless ``model`` names the base model or an adapter the request's trust group may use; returns
        the adapter, if one."""
        if model is None or model == self.served_model_name:
            return None  # the base model: no adapter table to consult
        return self.models.resolve(model, trust_group(request))

    def cache_salt(self, request: Request, client_salt: str | None) -> str:
        if client_salt is not None and not self.trust_client_cache_salt:
            raise APIError(400, "cache_salt: this server sets the prefix-cache salt from your API key's trust "
                           "group; a client-supplied cache_salt is not accepted", param="cache_salt")
        return self.salter.salt(trust_group(request), client_salt)  # only a public path has no group

    async def on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` through ``engine.call`` (the tokenizer is the engine's to use)."""
        with engine_errors():
            return await self.engine.call(fn, *args)

    async def generate(self, request: Request, prompts: list[PromptType], params: SamplingParams,
                       admission: Admission, responder: Responder, stream: bool,
                       prompt_param: str = "prompt") -> Response:
        """One engine request per prompt (the engine fans ``n > 1`` out), answered with a JSON body or an SSE
        stream. ``admission``: the adapter and the salt ``admit`` found; ``prompt_param``: the field a prompt
        too long for the context is blamed on."""
        salt, lora_request = admission
        if self.engine.is_pooling:  # vLLM's answer when the model lacks the task
            raise APIError(400, f"The model does not support {GENERATION_APIS.get(responder.object, 'this')} API")
        self.check_limits(prompts, params, prompt_param)
        responder.system_fingerprint = f"{self.system_fingerprint}-w{self.engine.weight_version}"  # weight_sync/
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        streams: list[RequestStream] = []
        received = request.scope.get(RECEIVED_SCOPE_KEY)
        transfer_id = request.headers.get(KV_TRANSFER_HEADER)
        if transfer_id is not None:
            prompts = [in_transfer(prompt, transfer_id) for prompt in prompts]

        async def add_requests() -> None:
            try:
                for i, prompt in enumerate(prompts):
                    request_id = responder.request_id if len(prompts) == 1 else f"{responder.request_id}-{i}"
                    with engine_errors(prompt_param):
                        streams.append(await self.engine.add_request(prompt, params, request_id, cache_salt=salt,
                                                                     received_time=received, output_kind=kind,
                                                                     lora_request=lora_request))
            except BaseException:
                self.engine.abort([s.request_id for s in streams])
                raise

        if lora_request is None:
            await add_requests()
        else:
            with self.models.send(lora_request):  # the adapter stays listed until its requests are tracked
                try:
                    await add_requests()
                finally:
                    self.models.track(lora_request, [s.request_id for s in streams])
        return await self.respond(request, streams, params, responder, stream)

    async def respond(self, request: Request, streams: list[RequestStream], params: SamplingParams,
                      responder: Responder, streaming: bool) -> Response:
        """Wait for the final outputs, or (streaming) for each first output before the SSE events, so a
        failure in the first step still answers with a 500 status rather than an error event."""
        ids = [s.request_id for s in streams]
        try:
            if not streaming:
                finals = await unless_disconnected(request, asyncio.gather(*map(final_output, streams)))
                await responder.prepare(self, list(finals))
                if (error := grammar_failed(finals)) is not None:
                    raise error
                outputs = choices_of(finals)
                self.record_parents([len(o.outputs[0].token_ids) for o in outputs], params.n)
                return JSONResponse(responder.response(outputs))
            firsts = await unless_disconnected(request, asyncio.gather(*(s.get() for s in streams)))
            if (error := grammar_failed(firsts)) is not None:
                raise error
            await responder.prepare(self, list(firsts))
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
        """SSE events of every choice as its delta outputs arrive; closing this generator early aborts them all."""
        latest: dict[int, RequestOutput] = {}  # per choice: its latest delta
        waiting: dict[asyncio.Future, int] = {}  # the next output of each unfinished prompt
        try:
            for frame in responder.opening_frames(firsts):
                yield frame
            ready = list(enumerate(firsts))
            while True:
                for i, output in ready:
                    if (error := grammar_failed([output])) is not None:
                        for frame in responder.error_frames(error):
                            yield frame
                        return  # ``finally`` aborts the other choices
                    for choice in choices_of([output]):
                        index = i * params.n + choice.outputs[0].index
                        latest[index] = choice
                        for frame in responder.stream_frames(index, choice):
                            yield frame
                    if not output.finished:
                        waiting[asyncio.ensure_future(streams[i].get())] = i
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
        self.record_parents(responder.counts(), params.n)
        for frame in responder.closing_frames([o for _, o in sorted(latest.items())]):
            yield frame
