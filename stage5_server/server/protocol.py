"""The OpenAI wire format: request models, and requests -> SamplingParams.

Requests are parsed strictly. An unknown field is a 400 that names it ("Unrecognized
request argument supplied: foo"), a wrong type is a 400 that names it, and an OpenAI
feature this server does not implement (``suffix``, tools, JSON mode, ...) is accepted
only with the value that means "off", so nothing a client asks for is silently ignored.
``NOOP_VALUES`` lists them. Fields that change nothing a client can observe (``user``,
``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``) are accepted with any
value and logged (``IGNORED_FIELDS``).

The sampling fields are vLLM's: the penalties, ``min_p``, ``min_tokens``, ``logit_bias``
(string keys, biases clamped to [-100, 100] as OpenAI and vLLM do),
``include_stop_str_in_output``, ``n`` (and ``best_of`` equal to it) and ``echo``. Chat
takes the ``developer`` role and a message ``name`` (both handed to the chat template, as
vLLM does), joins text parts with a newline, and prefers ``max_completion_tokens`` when
both token limits are sent.

vLLM: ``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shared.sampling_params import SamplingParams
from stage5_server.server.errors import bad_request_from_value_error

logger = logging.getLogger("stagedserve")

# ---- request models ---------------------------------------------------------------------------

# OpenAI fields this server does not implement: accepted only with a value that turns them off.
NOOP_VALUES: dict[str, tuple] = {
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "prompt_cache_key": (),
}


# Fields that change nothing a client can observe here: any value is accepted, and logged.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
_LOGGED: set[str] = set()


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
        hint = f" (only {', '.join(json.dumps(a) for a in allowed)} or null)" if allowed else ""
        raise ValueError(f"{info.field_name} is not supported by this server{hint}")
    return value


class StrictModel(BaseModel):
    # strict: no "5" -> 5 or true -> 1 coercion; forbid: an unknown field is an error, not a no-op.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, not only a final one


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted with any value; they change nothing a client can observe (logged: IGNORED_FIELDS).
    user: str | None = None  # an end-user id for the operator's logs
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
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
        for name in IGNORED_FIELDS:
            if name in type(self).model_fields and getattr(self, name) is not None and name not in _LOGGED:
                _LOGGED.add(name)  # once per field and process: this is not a per-request log
                logger.info("request field %r is accepted and changes nothing here", name)
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
                logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None)
        except ValueError as exc:
            raise bad_request_from_value_error(exc) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's ``continuous_usage_stats``, which takes ``include_usage`` too)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: a prompt (text or token ids), or a batch of them (one choice per
    prompt and sample, prompt i's sample j at index ``i * n + j``)."""

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


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None  # handed to the chat template, which may use it

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str:
        """A string, or a list of text parts (joined with a newline, as vLLM); images and audio are refused."""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for part in value:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise ValueError("content: only text parts are supported")
                texts.append(TextPart.model_validate(part).text)
            return "\n".join(texts)
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
    parallel_tool_calls: Any = None  # meaningless without tools, which are refused; accepted, logged
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

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` when sent (it replaces the deprecated ``max_tokens``; vLLM takes it too)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content, **({"name": m.name} if m.name is not None else {})}
                for m in self.messages]


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
