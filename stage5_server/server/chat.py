"""``POST /v1/chat/completions``: messages rendered with the model's chat template, then generated.

With ``tools``, ``tool_choice`` decides how calls come about: ``none`` shows the model no tools
(vLLM shows them unless ``--exclude-tools-when-tool-choice-none``); ``auto`` shows them and reads
calls out of the text with ``--tool-call-parser`` (``tool_parsers.py``; needs
``--enable-auto-tool-choice``); ``required`` or a named function forces the call by structured
output, on any model. A template that cannot show tools (the default model's) gets them
described by the server in a Hermes system block, and the history's calls and results as text
(``shared/tool_prompt.py``). Calls come back as ``tool_calls`` with ``finish_reason: "tool_calls"``.

vLLM: ``vllm/entrypoints/openai/serving_chat.py``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response

from shared.outputs import Logprob, RequestOutput
from shared.structured_output import StructuredOutputsParams
from stage5_server.multimodal.processor import count_image_parts, has_image_parts, load_image_parts
from stage5_server.server.completions import token_text, wire_logprob
from stage5_server.server.errors import APIError
from stage5_server.server.media import RequestMediaLoader, check_image_count, check_request_mm_kwargs
from stage5_server.server.protocol import ChatCompletionRequest
from stage5_server.server.serving import OpenAIServing, Responder, finish_reason, usage_of
from stage5_server.server.sse import sse
from stage5_server.server.tool_parsers import (
    TOOL_PARSERS,
    ForcedToolCalls,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    parameters_schema,
    required_calls_schema,
)
from stage5_server.server.tool_protocol import NamedToolChoice


class ToolCallStream(Protocol):
    def feed(self, text: str) -> StreamDelta: ...
    def finish(self) -> StreamDelta: ...


def read_delta(stream: ToolCallStream, text: str, finished: bool) -> StreamDelta:
    """One delta's content and calls; the last delta's include what the stream held back."""
    got = stream.feed(text)
    if not finished:
        return got
    rest = stream.finish()
    return StreamDelta(got.content + rest.content, got.tool_calls + rest.tool_calls)


class ToolCallReader:
    """How one request's text becomes content and tool calls: whole (``parse``) or streamed
    (``stream()``, one per choice). ``max_calls``: 1 when ``parallel_tool_calls`` is false."""

    def __init__(self, parse: Callable[[str], ParsedOutput], stream: Callable[[], ToolCallStream],
                 max_calls: int | None = None):
        self._parse, self.stream, self.max_calls = parse, stream, max_calls

    def parse(self, text: str) -> ParsedOutput:
        parsed = self._parse(text)
        if self.max_calls is not None:
            parsed.tool_calls = parsed.tool_calls[:self.max_calls]
        return parsed


def chat_logprobs(output: RequestOutput, top_n: int) -> dict[str, Any] | None:
    """The chat format: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    completion = output.outputs[0]
    if completion.logprobs is None:
        return None

    def item(lp: Logprob) -> dict[str, Any]:
        token = token_text(lp)
        return {"token": token, "logprob": wire_logprob(lp), "bytes": list(token.encode())}

    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        chosen = entry[token_id]  # the sampler always records the sampled token
        top = sorted((lp for lp in entry.values() if lp.rank <= top_n), key=lambda x: x.rank)
        content.append({**item(chosen), "top_logprobs": [item(lp) for lp in top]})
    return {"content": content}


class ChatResponder(Responder):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any, top_logprobs: int, tool_calls: ToolCallReader | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.top_logprobs = top_logprobs
        self.tool_calls = tool_calls  # None: the text is all content
        self.streams: dict[int, ToolCallStream] = {}  # per choice, with tool_calls
        self.call_index: dict[int, dict[str, int]] = {}  # per choice: call id -> its index in the stream

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        c = output.outputs[0]
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        reason = finish_reason(output)
        if self.tool_calls is not None:
            parsed = self.tool_calls.parse(c.text)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [call.as_openai() for call in parsed.tool_calls]
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message,
                "logprobs": chat_logprobs(output, self.top_logprobs),
                "finish_reason": reason, "stop_reason": c.stop_reason}

    def opening_frames(self, firsts: list[RequestOutput]) -> list[str]:
        """Each choice's first chunk: the role alone, ``content: ""`` (as OpenAI's and vLLM's streams begin)."""
        frames = []
        for index in range(len(firsts) * self.n):
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None, "stop_reason": None}
            usage = {}
            if self.include_usage:  # nothing generated yet: the prompt's tokens, with continuous usage
                usage["usage"] = usage_of([firsts[index // self.n]], num_tokens=[0]) if self.continuous_usage else None
            frames.append(sse(self.body(self.chunk_object, [choice], **usage)))
        return frames

    def chunk(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        finished = output.finished
        content, calls = output.outputs[0].text, []
        if self.tool_calls is not None:
            got = read_delta(self.streams.setdefault(index, self.tool_calls.stream()), content, finished)
            content, calls = got.content, self._call_deltas(index, got.tool_calls)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        logprobs = chat_logprobs(output, self.top_logprobs)
        if not delta and not finished and (logprobs is None or self.tool_calls is not None):
            return None  # nothing new to show yet (text held back: part of a character, or of a tool call)
        reason = finish_reason(output) if finished else None
        if reason == "stop" and self.call_index.get(index):
            reason = "tool_calls"
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": output.outputs[0].stop_reason if finished else None}
        return self.chunk_body(output, choice)

    def _call_deltas(self, index: int, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """A call's first delta carries its id, type and name; later ones only the next piece of ``arguments``."""
        known = self.call_index.setdefault(index, {})
        deltas = []
        for call in calls:
            if call.id in known:
                deltas.append({"index": known[call.id], "function": {"arguments": call.arguments}})
                continue
            limit = self.tool_calls.max_calls
            if limit is not None and len(known) >= limit:
                continue
            known[call.id] = len(known)
            deltas.append(call.as_openai(known[call.id]))
        return deltas


def tool_plan(serving: OpenAIServing, body: ChatCompletionRequest,
              ) -> tuple[ToolCallReader | None, StructuredOutputsParams | None]:
    """How the request's tool calls are read, and the constraint that forces them (if any)."""
    tools, choice = body.tool_dicts(), body.effective_tool_choice
    max_calls = 1 if body.parallel_tool_calls is False else None
    structured = body.requested_structured_outputs()
    if not tools or choice == "none":
        return None, structured
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t["function"]["name"] == choice.function.name)
        return (ToolCallReader(ForcedToolCalls(tool["function"]["name"]).parse,
                               partial(ForcedToolCalls, tool["function"]["name"])),
                StructuredOutputsParams(json=parameters_schema(tool)))
    if choice == "required":
        schema = required_calls_schema(tools)
        if max_calls is not None:
            schema = {**schema, "maxItems": max_calls}
        return (ToolCallReader(ForcedToolCalls(None).parse, partial(ForcedToolCalls, None), max_calls),
                StructuredOutputsParams(json=schema))
    options = serving.chat_options
    if not options.enable_auto_tool_choice:
        raise APIError(400, 'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                       '--tool-call-parser (or send tool_choice "required", "none" or a named function)',
                       param="tool_choice")
    parser = TOOL_PARSERS[options.tool_call_parser]([t["function"]["name"] for t in tools])
    return ToolCallReader(parser.parse, parser.stream, max_calls), structured


async def conversation_prompt(serving: OpenAIServing, body: ChatCompletionRequest) -> dict[str, Any]:
    """The prompt the engine renders (``InputProcessor``). The tools are shown unless ``tool_choice`` is
    none: by the chat template, or described by the server where the template cannot show them. Images
    are loaded here, under the server's media rules (``media.py``), before the engine sees the request."""
    options = serving.chat_options
    if body.chat_template is not None and not options.trust_request_chat_template:
        raise APIError(400, "chat_template: this server renders only its own chat template (start it with "
                       "--trust-request-chat-template to accept one per request)", param="chat_template")
    if body.mm_processor_kwargs or body.media_io_kwargs:
        check_request_mm_kwargs(serving.media.options, body.mm_processor_kwargs, body.media_io_kwargs)
    messages = body.conversation()
    prompt = {"messages": messages, "chat_template": body.chat_template,
              "chat_template_kwargs": body.chat_template_kwargs,
              "control_tokens_in_messages": options.control_tokens_in_messages,
              "tools": None if body.effective_tool_choice == "none" else body.tool_dicts()}
    if any(isinstance(m["content"], list) for m in messages):  # parts stay a list only beside an image (protocol.py)
        prompt["messages"] = await load_images(serving, messages)
        if body.mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = body.mm_processor_kwargs
    return prompt


async def load_images(serving: OpenAIServing, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each image part loaded under the server's media rules; a model that takes no images,
    or too many images, is a 400 before anything is fetched."""
    if serving.engine.image_processor is None:
        first = next(i for i, m in enumerate(messages) if has_image_parts([m]))
        raise APIError(400, f"messages[{first}].content: this model takes no images (it is not a "
                       "vision-language model); send text content only", param=f"messages[{first}].content")
    check_image_count(serving.media.options, count_image_parts(messages))
    loader = RequestMediaLoader(serving.media)  # each URL once per request, off the event loop
    return await asyncio.to_thread(load_image_parts, messages, loader)  # the engine renders them


async def create_chat_completion(serving: OpenAIServing, request: Request, body: ChatCompletionRequest) -> Response:
    admission = serving.admit(request, body.model, body.cache_salt)
    tool_calls, structured = tool_plan(serving, body)
    params = body.sampling_params(body.requested_max_tokens, body.num_logprobs, structured)
    prompt = await conversation_prompt(serving, body)
    responder = ChatResponder(f"chatcmpl-{uuid.uuid4().hex}", body.model or serving.served_model_name, request,
                              body.include_usage, body.continuous_usage, n=params.n,
                              top_logprobs=body.top_logprobs or 0, tool_calls=tool_calls)
    return await serving.generate(request, [prompt], params, admission, responder, body.stream, "messages")


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(serving, request, body)
