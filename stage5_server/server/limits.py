"""What one request may ask of the server, each capped before any work that grows with it.

In the order they are checked, cheapest first: the body (413 by Content-Length up front, or
counted as it arrives); once it is parsed, and before the route's request model validates it
(``body.py``), the length of each list in it that validation would walk (``check_lists``:
prompts, messages, content parts, tools); then, before anything is rendered or tokenized, the
number of choices (prompts x ``n``), of logprobs per token position (choices x ``logprobs``), of
logprobs returned in all (choices x ``max_tokens`` x (``logprobs`` + 1)), the size of a
structured-output constraint, and a text too long for the context whatever it tokenizes to
(``check``). Each is a 400 (413 for the body) that names the server flag setting it. The
prompt's exact token count against the context comes after, in the engine's input processor, off
the event loop.

vLLM has none of these of its own (uvicorn reads any body, a prompt list is any length); a server
that tokenizes and samples for whatever it reads needs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stage5_server.server.errors import APIError, send_json

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class RequestLimits:
    """The caps on one request; each field's flag is ``--`` and its name with dashes (``FLAGS``)."""

    max_prompts_per_request: int = 256  # a completion's prompt list
    max_messages_per_request: int = 2048  # a chat conversation, a Responses input list, and their content parts
    max_tools_per_request: int = 128  # OpenAI's own cap on a request's tools
    max_logit_bias_per_request: int = 1024  # entries of logit_bias (to ban many tokens: bad_words)
    max_choices_per_request: int = 256  # prompts x n
    max_logprobs_per_request: int = 1280  # prompts x n x logprobs (+ prompts x prompt logprobs)
    max_returned_logprobs_per_request: int = 1 << 18  # prompts x n x max_tokens x (logprobs + 1)
    max_structured_output_bytes: int = 64 << 10  # the JSON of a schema, regex, choice list or grammar

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")

    def check_lists(self, route: str, body: Any) -> None:
        """Refuse a parsed body whose lists (and ``logit_bias``) are longer than the caps allow, before the
        route's request model validates it (validating costs microseconds an item, on the event loop)."""
        if not isinstance(body, dict):
            return
        for field, name in COUNTED_LISTS.get(route, ()):
            items = body.get(field)
            counted = dict if name == "max_logit_bias_per_request" else list  # another type: validation's 400
            if not isinstance(items, counted) or (field == "prompt" and items and isinstance(items[0], int)):
                continue  # nothing to count (a prompt of token ids is one prompt)
            if len(items) > getattr(self, name):
                raise self._over(name, field, f"{len(items)} {ITEM_NAMES[name]}")
            if name == "max_messages_per_request":  # each message's content parts count too
                parts = sum(len(item["content"]) for item in items
                            if isinstance(item, dict) and isinstance(item.get("content"), list))
                if parts > self.max_messages_per_request:
                    raise self._over(name, field, f"{parts} content parts")

    def check(self, prompts: list[Any], params: Any, context: tuple[int, int] | None = None,
              prompt_param: str = "prompt") -> None:
        """Refuse a request over a cap, cheapest check first. ``params``: its ``SamplingParams``.
        ``context``: ``(max_model_len, the most characters one token stands for)``; a text longer than
        their product cannot fit, whatever it tokenizes to, and is refused before it is tokenized."""
        n, logprobs, prompt_logprobs = params.n, params.logprobs, params.prompt_logprobs
        if len(prompts) > self.max_prompts_per_request:
            raise self._over("max_prompts_per_request", prompt_param, f"{len(prompts)} prompts")
        messages = sum(len(p["messages"]) for p in prompts if isinstance(p, dict) and "messages" in p)
        if messages > self.max_messages_per_request:
            raise self._over("max_messages_per_request", prompt_param, f"{messages} messages")
        if len(prompts) * n > self.max_choices_per_request:
            raise self._over("max_choices_per_request", "n", f"{len(prompts)} prompt(s) x n={n} choices")
        asked = len(prompts) * (n * (logprobs or 0) + (prompt_logprobs or 0))
        if asked > self.max_logprobs_per_request:
            raise self._over("max_logprobs_per_request", "logprobs", f"{asked} logprobs per token position "
                             f"({len(prompts)} prompt(s) x n={n} x logprobs={logprobs or 0})")
        if logprobs is not None:  # each output token's own logprob, and its ``logprobs`` alternatives
            max_tokens = params.max_tokens if params.max_tokens is not None else (context or (0,))[0]
            returned = len(prompts) * n * max_tokens * (logprobs + 1)
            if returned > self.max_returned_logprobs_per_request:
                raise self._over("max_returned_logprobs_per_request", "logprobs", f"up to {returned} logprobs in "
                                 f"all ({len(prompts)} prompt(s) x n={n} x max_tokens={max_tokens} x "
                                 f"(logprobs={logprobs} + 1))")
        structured = params.structured_outputs
        if structured is not None:
            size = len(json.dumps(structured.key()[1], ensure_ascii=False, default=str).encode())
            if size > self.max_structured_output_bytes:
                raise self._over("max_structured_output_bytes", "structured_outputs",
                                 f"a {structured.kind} constraint of {size} bytes")
        if context is not None:
            max_model_len, token_chars = context
            for i, prompt in enumerate(prompts):
                chars = text_chars(prompt)
                if chars > max_model_len * token_chars:
                    raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                                   f"your request has {chars} characters of text, at least {chars // token_chars} "
                                   f"tokens (no token of this model stands for more than {token_chars} "
                                   "characters). Please reduce the length of the input.",
                                   param=prompt_param if len(prompts) == 1 else f"{prompt_param}[{i}]",
                                   code="context_length_exceeded")

    def _over(self, name: str, param: str, what: str) -> APIError:
        return APIError(400, f"{param}: this request asks for {what}; this server allows at most "
                        f"{getattr(self, name)} (its {FLAGS[name]} flag sets that cap, by default "
                        f"{getattr(RequestLimits, name)}).", param=param, code="request_limit_exceeded")


FLAGS = {name: "--" + name.replace("_", "-") for name in RequestLimits.__dataclass_fields__}

# The lists of each route's body that ``check_lists`` counts, and the cap on each.
COUNTED_LISTS: dict[str, tuple[tuple[str, str], ...]] = {
    "/v1/completions": (("prompt", "max_prompts_per_request"), ("logit_bias", "max_logit_bias_per_request")),
    "/v1/chat/completions": (("messages", "max_messages_per_request"), ("tools", "max_tools_per_request"),
                             ("logit_bias", "max_logit_bias_per_request")),
    "/v1/responses": (("input", "max_messages_per_request"), ("tools", "max_tools_per_request")),
    "/tokenize": (("messages", "max_messages_per_request"), ("tools", "max_tools_per_request")),
}
ITEM_NAMES = {"max_prompts_per_request": "prompts", "max_messages_per_request": "messages",
              "max_tools_per_request": "tools", "max_logit_bias_per_request": "logit_bias entries"}


def text_chars(prompt: Any) -> int:
    """Characters of text in a prompt: a string, ``{"prompt": text}``, or the strings of a conversation's
    ``messages`` and ``tools``, all of which the chat template writes into the prompt."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, dict):
        if isinstance(prompt.get("prompt"), str):
            return len(prompt["prompt"])
        stack, total = [prompt.get("messages"), prompt.get("tools")], 0
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                total += len(item)
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        return total
    return 0


def longest_token_chars(hf_tokenizer) -> int:
    """The most characters one token of this vocabulary stands for (its longest entry, which spells each
    byte as one character or more): a text of C characters has at least C / this many tokens."""
    return max((len(token) for token in hf_tokenizer.get_vocab()), default=1)


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
                    return await send_json(send, 400, APIError(400, "Invalid Content-Length header.").body())
                if int(value) > self.max_bytes:
                    return await send_json(send, 413, too_large.body())
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
