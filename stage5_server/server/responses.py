"""``POST /v1/responses``: OpenAI's Responses API, as the OpenAI Agents SDK calls it.

A request becomes the chat request it stands for and runs through chat's steps:

    instructions             -> a system message first
    input (text or items)    -> messages: a ``message`` item as itself, ``function_call`` items as
                                an assistant's ``tool_calls``, a ``function_call_output`` as a ``tool`` message
    tools, tool_choice       -> chat tools (flat ``{"type", "name"}`` for a named one)
    text.format              -> response_format;   max_output_tokens -> max_completion_tokens

The answer's ``output`` is a ``message`` item and a ``function_call`` item per call (``status``
``incomplete`` when cut short); streamed, the typed events come in the API's order, ending with
``response.completed`` (the openai client's stream helper does not take ``response.incomplete``).
Nothing is stored: ``previous_response_id`` and ``store: true`` are refused.

vLLM: ``vllm/entrypoints/openai/serving_responses.py`` and ``ResponsesRequest`` in
``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shared.outputs import RequestOutput
from stage5_server.server.chat import ToolCallReader, conversation_prompt, read_delta, tool_plan
from stage5_server.server.errors import APIError, bad_request_from_value_error, loc_to_param
from stage5_server.server.protocol import ChatCompletionRequest, IgnoredFields, JsonSchemaFormat, StrictModel
from stage5_server.server.serving import OpenAIServing, Responder, finish_reason, usage_of
from stage5_server.server.tool_parsers import StreamDelta, ToolCall


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None


class TextOptions(StrictModel):
    format: TextFormat | None = None
    verbosity: Any = None  # accepted; a model here has no verbosity setting


ITEM_TYPES = ("message", "function_call", "function_call_output")


class Item(BaseModel):
    """One input item, read loosely: a client sends back the output items it got; only these fields matter."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: Any = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Any = None


class ResponsesRequest(IgnoredFields):
    model: str | None = None
    input: Any  # text, or a list of items (``Item``)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # logprobs are not returned here
    stream_options: Any = None
    # vLLM's extensions
    seed: int | None = None
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # refused unless trusted (media.py)
    media_io_kwargs: dict[str, Any] | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any) -> str | list[Item]:
        if isinstance(value, str):
            if not value:
                raise ValueError("input: empty text")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("input: must be text or a non-empty list of items")
        items = []
        for i, raw in enumerate(value):
            if not isinstance(raw, dict):
                raise ValueError(f"input[{i}]: must be an object")
            if raw.get("type", "message") not in ITEM_TYPES:
                raise ValueError(f"input[{i}].type: {raw.get('type')!r} is not supported here; send one of "
                                 + ", ".join(ITEM_TYPES))
            try:
                items.append(Item.model_validate(raw))
            except ValidationError as exc:
                first = exc.errors()[0]
                raise ValueError(f"{loc_to_param(('input', i, *first['loc']))}: {first['msg']}") from None
        return items

    @field_validator("store")
    @classmethod
    def _store(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("store: responses are not stored here; send store false (or leave it out)")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _previous(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("previous_response_id: responses are not stored here; send the whole conversation")
        return value

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, value: dict | None) -> dict | None:
        if value and any(v is not None for v in value.values()):
            raise ValueError("reasoning: this model does not reason; send null")
        return value

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (see the module docstring)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            if item.type == "message":
                if item.role is None:
                    raise ValueError(f"input[{i}].role: a message needs a role")
                messages.append({"role": item.role, "content": _content_of(item.content, f"input[{i}].content")})
            elif item.type == "function_call":
                if not (item.call_id and item.name and item.arguments is not None):
                    raise ValueError(f"input[{i}]: a function_call needs call_id, name and arguments")
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                if not item.call_id:
                    raise ValueError(f"input[{i}].call_id: a function_call_output needs the call_id it answers")
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": _text_of(item.output, f"input[{i}].output")})
        return messages

    def as_chat_request(self) -> ChatCompletionRequest:
        """The chat request this one stands for; a ``ValueError`` names the Responses field."""
        fmt = self.text.format if self.text is not None else None
        response_format = None
        if fmt is not None and fmt.type == "json_object":
            response_format = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            response_format = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "output", "schema": fmt.schema_ or {"type": "object"},
                **({"strict": fmt.strict} if fmt.strict is not None else {})}}
        choice = self.tool_choice
        body = {
            "model": self.model, "messages": self.messages(), "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "seed": self.seed, "top_k": self.top_k, "logit_bias": self.logit_bias, "cache_salt": self.cache_salt,
            "user": self.user, "mm_processor_kwargs": self.mm_processor_kwargs,
            "media_io_kwargs": self.media_io_kwargs,
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": response_format,
            "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                      for t in self.tools] if self.tools else None,
            "tool_choice": {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, NamedFunction) else choice,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None


def _content_of(content: Any, field: str) -> str | list[dict[str, Any]]:
    """A message's content: text as ``_text_of``; with ``input_image`` parts, chat content parts (text and
    ``image_url``) for the chat request to check and the server to load."""
    if not (isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image"
                                              for p in content)):
        return _text_of(content, field)
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise ValueError(f"{field}: an input_image needs image_url (a data: or http(s) URL); "
                                 "file_id is not supported")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text_of([part], field)})
    return parts


def _text_of(content: Any, field: str) -> str:
    """A string, or text parts (``input_text``, ``output_text``, ``text``) joined with a newline."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"{field}: only text parts (input_text, output_text) are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{field}: must be a string or a list of text parts")


class ResponsesResponder(Responder):
    """The ``response`` object, or the typed events of its stream."""

    object = chunk_object = "response"

    def __init__(self, *args: Any, body: ResponsesRequest, tool_calls: ToolCallReader | None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.request = body
        self.tool_calls = tool_calls
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output items so far (streaming)
        self.open: dict[str, Any] | None = None  # the item whose deltas are streaming
        self.stream = tool_calls.stream() if tool_calls is not None else None

    # ---- the whole response ----------------------------------------------------------------------
    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        [output] = outputs
        text = output.outputs[0].text
        if self.tool_calls is None:
            content, calls = text, []
        else:
            parsed = self.tool_calls.parse(text)
            content, calls = parsed.content, parsed.tool_calls
        items = ([message_item(f"msg_{uuid.uuid4().hex}", content)] if content else []) + [
            function_call_item(call) for call in calls]
        return self.body_of(items, output)

    def body_of(self, items: list[dict[str, Any]], output: RequestOutput | None) -> dict[str, Any]:
        r = self.request
        status, incomplete, usage = "in_progress", None, None
        if output is not None:
            cut = finish_reason(output) == "length"
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
            u = usage_of([output], num_tokens=self.counts() or None)  # streamed: counted as they came
            usage = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                     "total_tokens": u["total_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        choice = r.tool_choice
        return {
            "id": self.request_id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": items, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": r.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else (choice or "auto"),
            "parallel_tool_calls": r.parallel_tool_calls is not False, "temperature": r.temperature,
            "top_p": r.top_p, "max_output_tokens": r.max_output_tokens, "previous_response_id": None,
            "reasoning": None, "store": False, "truncation": "disabled", "metadata": r.metadata or {},
            "text": {"format": (r.text.format.model_dump(by_alias=True, exclude_none=True)
                                if r.text is not None and r.text.format is not None else {"type": "text"})},
            "user": r.user, "system_fingerprint": self.system_fingerprint,
        }

    # ---- the stream --------------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        data = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def opening_frames(self, firsts: list[RequestOutput]) -> list[str]:
        started = self.body_of([], None)
        return [self.event("response.created", response=started), self.event("response.in_progress", response=started)]

    def frames(self, index: int, output: RequestOutput) -> list[str]:
        text = output.outputs[0].text
        got = StreamDelta(content=text) if self.stream is None else read_delta(self.stream, text, output.finished)
        frames = []
        if got.content:
            if self.open is None or self.open["type"] != "message":
                frames += self.close_item()
                frames += self.open_item(message_item(f"msg_{uuid.uuid4().hex}", "", status="in_progress"))
            self.open["content"][0]["text"] += got.content
            frames.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=got.content,
                                     logprobs=[]))
        for call in got.tool_calls:
            if self.open is None or self.open.get("call_id") != call.id:
                limit = self.tool_calls.max_calls
                if limit is not None and sum(i["type"] == "function_call" for i in self.items) >= limit:
                    continue
                frames += self.close_item()
                frames += self.open_item(function_call_item(ToolCall(call.name, "", call.id), status="in_progress"))
            self.open["arguments"] += call.arguments
            frames.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, delta=call.arguments))
        if output.finished:
            frames += self.close_item()
        return frames

    def open_item(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open = item
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        frames = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)]
        if item["type"] == "message":
            frames.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     part=dict(item["content"][0])))
        return frames

    def close_item(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            frames = [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"], logprobs=[]),
                      self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part)]
        else:
            frames = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"])]
        return frames + [self.event("response.output_item.done", output_index=index, item=item)]

    def closing_frames(self, outputs: list[RequestOutput]) -> list[str]:
        # Always ``response.completed`` (as vLLM sends), its status saying ``incomplete`` if cut short:
        # the openai client's stream helper and the Agents SDK wait for that event alone.
        return [self.event("response.completed", response=self.body_of(self.items, outputs[0]))]

    def error_frames(self, error: APIError) -> list[str]:
        body = error.body()["error"]
        return [self.event("error", code=body.get("code") or body["type"], message=body["message"],
                           param=body.get("param"))]


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


async def create_response(serving: OpenAIServing, request: Request, body: ResponsesRequest) -> Response:
    admission = serving.admit(request, body.model, body.cache_salt)
    try:
        chat_body = body.as_chat_request()
    except ValueError as exc:
        raise bad_request_from_value_error(exc) from None
    tool_calls, structured = tool_plan(serving, chat_body)
    params = chat_body.sampling_params(chat_body.requested_max_tokens, None, structured)
    prompt = await conversation_prompt(serving, chat_body)
    responder = ResponsesResponder(f"resp_{uuid.uuid4().hex}", body.model or serving.served_model_name, request, False,
                                   body=body, tool_calls=tool_calls)
    return await serving.generate(request, [prompt], params, admission, responder, body.stream, "input")


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(serving, request, body)
