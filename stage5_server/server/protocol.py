"""The OpenAI wire format: request models, and requests -> SamplingParams.

Requests are parsed strictly: a wrong type, or a field these models do not define, is a 400 that
names it ("Unrecognized request argument supplied: foo"); at the top level of a body, the fields to
ignore as vLLM ignores them are dropped before these models see it (``request_fields.py``,
unless ``--strict-request-fields``). An OpenAI feature this server does not
implement is accepted only with the value that means "off" (``NOOP_VALUES``); fields that change
nothing a client can observe (``user``, ``store``, ...) are accepted and logged once each
(``IGNORED_FIELDS``). The sampling fields are vLLM's (penalties, ``min_p``, ``logit_bias``, ``n``,
``echo``, ...); structured output is ``response_format`` or vLLM's ``structured_outputs``. Chat
adds ``chat_template`` / ``chat_template_kwargs`` and the tool fields (``tool_protocol.py``).

vLLM: ``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutputsParams
from stage5_server.server.errors import bad_request_from_value_error
from stage5_server.server.tool_protocol import AssistantToolCall, ToolChoiceFields, arguments_object

logger = logging.getLogger("stagedserve")

# OpenAI fields this server does not implement: accepted only with a value that turns them off.
NOOP_VALUES: dict[str, tuple] = {
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": ("medium",),  # OpenAI's default
    # an assistant message sent back as the openai client returned it
    "refusal": (),
}


# Fields that change nothing a client can observe here: any value is accepted, and logged.
IGNORED_FIELDS = ("user", "safety_identifier", "metadata", "store", "service_tier",
                  "prompt_cache_key", "prompt_cache_retention", "stream_options.include_obfuscation",
                  "messages.annotations")


@functools.cache  # once per field and process: this is not a per-request log
def log_ignored(name: str) -> None:
    logger.info("request field %r is accepted and changes nothing here", name)


def is_noop(value: Any, allowed: tuple) -> bool:
    if value is None:
        return True
    for a in allowed:
        numeric = (int, float)
        if isinstance(a, numeric) and isinstance(value, numeric) and not isinstance(value, bool):
            if value == a:
                return True
        elif type(value) is type(a) and value == a:
            return True
    return False


def _check_noop(value: Any, info: ValidationInfo) -> Any:
    allowed = NOOP_VALUES[info.field_name]
    if not is_noop(value, allowed):
        hint = f" (only {', '.join(json.dumps(a) for a in allowed)} or null)" if allowed else ""
        raise ValueError(f"{info.field_name} is not supported by this server{hint}")
    return value


class StrictModel(BaseModel):
    # strict: no "5" -> 5 or true -> 1 coercion; forbid: an unknown field is an error, not a no-op (the top-level
    # fields to ignore are dropped before validation: request_fields.py).
    model_config = ConfigDict(extra="forbid", strict=True)


class IgnoredFields(StrictModel):
    """Accepted with any value; they change nothing a client can observe (logged: ``IGNORED_FIELDS``)."""

    user: str | None = None  # an end-user id for the operator's logs
    safety_identifier: Any = None  # OpenAI's successor of ``user``
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None  # routing hints for OpenAI's prompt cache; this server's is automatic
    prompt_cache_retention: Any = None


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, not only a final one
    include_obfuscation: bool | None = None  # OpenAI's chunk padding against length side channels; ignored


class JsonSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema: required when type is json_schema")
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema_ or {"type": "object"})
        return None


def structured_outputs_of(response_format: ResponseFormat | None, structured: dict | None
                          ) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, from either field; both at once is a 400."""
    if response_format is not None and response_format.type != "text" and structured is not None:
        raise bad_request_from_value_error(ValueError(
            "structured_outputs: send either response_format or structured_outputs, not both"))
    try:
        if structured is not None:
            return StructuredOutputsParams.from_dict(structured)
        return response_format.structured_outputs() if response_format is not None else None
    except ValueError as exc:
        raise bad_request_from_value_error(exc) from None


class _GenerationRequest(IgnoredFields):
    """Fields the two generation endpoints share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch.Generator accepts
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    n: int = Field(default=1, ge=1, le=128)  # samples per prompt (parallel sampling)
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # vLLM's: exactly one of json, regex, choice, grammar, json_object

    @field_validator("presence_penalty", "frequency_penalty", "min_p", "repetition_penalty", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        return float(value) if type(value) is int else value  # 1 is as good as 1.0; strict mode would refuse it

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        """Token ids as strings (JSON keys) -> ints, each bias clamped to [-100, 100] (OpenAI's range)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("logit_bias must map token ids to numbers")
        bias = {}
        for token, amount in value.items():
            if not (isinstance(token, str) and token.isdigit()):
                raise ValueError(f"logit_bias: {json.dumps(token)} is not a token id")
            if type(amount) not in (int, float):
                raise ValueError(f"logit_bias: the bias of token {token} is not a number")
            bias[token] = float(min(100.0, max(-100.0, amount)))
        return bias

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(stops) > 16:
            raise ValueError("stop: at most 16 stop strings")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, value: str | None) -> str | None:
        if value is not None and not 0 < len(value) <= 256:
            raise ValueError("cache_salt must be 1 to 256 characters")
        return value

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's ``SamplingParams`` with ``structured_outputs`` (the constraint); a rejected value: a 400."""
        for name in IGNORED_FIELDS:
            if name in type(self).model_fields and getattr(self, name) is not None:
                log_ignored(name)
        if self.stream_options is not None and self.stream_options.include_obfuscation is not None:
            log_ignored("stream_options.include_obfuscation")
        pick = lambda value, default: default if value is None else value  # noqa: E731
        try:
            return SamplingParams(
                n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
                top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0), max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids or [], include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos, seed=self.seed, logprobs=logprobs,
                presence_penalty=pick(self.presence_penalty, 0.0), frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, 1.0),
                logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
                structured_outputs=structured_outputs)
        except ValueError as exc:
            raise bad_request_from_value_error(exc) from None

    def requested_structured_outputs(self) -> StructuredOutputsParams | None:
        return structured_outputs_of(self.response_format, self.structured_outputs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's ``continuous_usage_stats``, which takes ``include_usage`` too)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt (text or ids), or a batch; prompt i's sample j is choice ``i * n + j``."""

    prompt: Any
    max_tokens: int | None = 16  # OpenAI's default for this endpoint
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    echo: bool = False  # the prompt in front of the text (and of the logprobs)
    suffix: Any = None

    _check_noop_completion = field_validator("suffix")(_check_noop)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int] | list[str | list[int]]:
        def one(p: Any) -> bool:
            return (isinstance(p, str) and p != "") or (isinstance(p, list) and bool(p)
                                                       and all(type(t) is int for t in p))

        if one(value):
            return value
        if isinstance(value, list) and value and all(one(p) for p in value):
            return value
        raise ValueError("prompt must be a non-empty string, a non-empty list of token ids, or a list of those")

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        # best_of > n would return the n best of best_of samples; silently returning n samples
        # instead (what vLLM 0.32 does) would change the answer, so it is refused.
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of = n ({self.n}) is supported, got {self.best_of}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        single = isinstance(self.prompt, str) or all(type(t) is int for t in self.prompt)
        return [self.prompt] if single else list(self.prompt)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; one size fits this model's tower


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls (validated before content)
    content: Any = Field(default=None, validate_default=True)  # null only beside an assistant's tool_calls
    name: str | None = None  # handed to the chat template, which may use it
    tool_call_id: str | None = None  # a tool message: the call it answers
    # What the openai client's assistant message also carries (``message.model_dump()`` sent back):
    # accepted when it adds nothing to the prompt; a refusal or audio would, and is refused.
    refusal: Any = None
    annotations: Any = None  # citations of the reply, never part of the prompt: any value, logged
    audio: Any = None
    function_call: Any = None

    _check_noop_message = field_validator("refusal", "audio", "function_call")(_check_noop)

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, value: Any) -> Any:
        if value is not None:
            log_ignored("messages.annotations")
        return value

    @model_validator(mode="after")
    def _by_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has tool_calls")
        for i, call in enumerate(self.tool_calls or []):
            arguments_object(call.function.arguments, i)
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it: a tool call's ``arguments`` as an object (vLLM
        parses them too, so a template's ``tojson`` does not quote a string)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": arguments_object(c.function.arguments, i)}}
                for i, c in enumerate(self.tool_calls)]
        return message

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> str | list[dict[str, Any]] | None:
        """A string, or text parts joined with a newline (as vLLM); with an ``image_url`` part, the parts
        themselves (the API server loads the images, ``media.py``); null only beside an assistant's tool_calls."""
        if value is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return None
            raise ValueError("content: required, except in an assistant message with tool_calls")
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            parts: list[dict[str, Any]] = []
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": TextPart.model_validate(part).text})
                elif kind == "image_url":
                    url = ImagePart.model_validate(part).image_url.url
                    parts.append({"type": "image_url", "image_url": {"url": url}})
                else:
                    raise ValueError("content: only text and image_url parts are supported")
            if any(p["type"] == "image_url" for p in parts):
                return parts
            return "\n".join(p["text"] for p in parts)
        raise ValueError("content must be a string or a list of text and image_url parts")


class ChatCompletionRequest(_GenerationRequest, ToolChoiceFields):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template: str | None = None  # vLLM's; only if the server trusts request templates
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template (vLLM's)
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's; only if the server trusts them (media.py)
    media_io_kwargs: dict[str, Any] | None = None  # vLLM's; likewise
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    _check_noop_chat = field_validator("functions", "function_call", "modalities", "audio", "prediction",
                                       "reasoning_effort", "web_search_options", "verbosity")(_check_noop)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` when sent (it replaces the deprecated ``max_tokens``; vLLM takes it too)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _constraints(self) -> ChatCompletionRequest:
        constrained = self.structured_outputs is not None or (
            self.response_format is not None and self.response_format.type != "text")
        if self.forced_tool_choice and constrained:
            raise ValueError("tool_choice: a required or named tool call cannot be combined with "
                             "response_format or structured_outputs")
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_VARIABLES:
                raise ValueError(f"chat_template_kwargs: {key!r} is set by the server")
        return self

    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]


# Variables the server gives the chat template itself: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "chat_template",
                                         "tokenize", "documents"})

