"""The OpenAI wire format: request models, and requests -> SamplingParams.

Requests are parsed strictly. An unknown field is a 400 that names it ("Unrecognized
request argument supplied: foo"), a wrong type is a 400 that names it, and an OpenAI
feature this server does not implement (``n > 1``, ``best_of``, ``echo``, ``suffix``,
``logit_bias``, penalties, tools, JSON mode, ...) is accepted only with the value that
means "off", so nothing a client asks for is silently ignored. ``NOOP_VALUES`` lists them.

vLLM: ``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shared.sampling_params import SamplingParams
from stage5_server.server.errors import bad_request_from_value_error

# ---- request models ---------------------------------------------------------------------------

# OpenAI fields this server does not implement: accepted only with a value that turns them off.
NOOP_VALUES: dict[str, tuple] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "metadata": ({},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "prompt_cache_key": (),
    "service_tier": ("auto", "default"),
    "name": (),  # on a chat message: the chat template has no place for it
}


def _is_noop(value: Any, allowed: tuple) -> bool:
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
    if not _is_noop(value, allowed):
        hint = f" (only {', '.join(map(repr, allowed))} or null)" if allowed else ""
        raise ValueError(f"{info.field_name} is not supported by this server{hint}")
    return value


class StrictModel(BaseModel):
    # strict: no "5" -> 5 or true -> 1 coercion; forbid: an unknown field is an error, not a no-op.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


def _check_stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError("stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > 16:
        raise ValueError("stop: at most 16 stop strings")
    return stops


class _GenerationRequest(StrictModel):
    """Fields the two generation endpoints share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch.Generator accepts
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the operator's logs; changes nothing
    # vLLM's extensions
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    # OpenAI features not implemented here: only their "off" values are accepted
    n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None

    _check_noop = field_validator("n", "presence_penalty", "frequency_penalty", "logit_bias", "service_tier",
                                  "store", "metadata")(_check_noop)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        return _check_stop(value)

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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ``APIError(400)`` naming the field for values SamplingParams rejects."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos, seed=self.seed, logprobs=logprobs)
        except ValueError as exc:
            raise bad_request_from_value_error(exc) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: Any
    max_tokens: int | None = 16  # OpenAI's default for this endpoint
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    _check_noop_completion = field_validator("echo", "suffix", "best_of")(_check_noop)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            raise ValueError("prompt: batched prompts are not supported; send one prompt per request")
        raise ValueError("prompt must be a string or a non-empty list of token ids")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: Any
    name: Any = None

    _check_noop = field_validator("name")(_check_noop)

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str:
        """A string, or a list of text parts (joined); images and audio are refused."""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for part in value:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise ValueError("content: only text parts are supported")
                texts.append(TextPart.model_validate(part).text)
            return "".join(texts)
        raise ValueError("content must be a string or a list of text parts")


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # meaningless without tools, which are refused
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    prompt_cache_key: Any = None

    _check_noop_chat = field_validator("tools", "tool_choice", "functions", "function_call", "response_format",
                                       "modalities", "audio", "prediction", "reasoning_effort",
                                       "web_search_options", "prompt_cache_key")(_check_noop)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError("max_completion_tokens and max_tokens disagree; send one of them")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


class TokenizeRequest(StrictModel):
    """``POST /tokenize`` (vLLM's): either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("prompt: send exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
