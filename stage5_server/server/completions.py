"""``POST /v1/completions``: a prompt (text or token ids) continued, whole or streamed.

``echo`` puts the prompt in front of the text; with ``logprobs`` the prompt's tokens get
theirs too (the first ``null``). ``text_offset`` indexes the returned text, so a special token
the text leaves out takes no characters (vLLM counts its spelling). ``echo`` with
``max_tokens: 0`` returns the scored prompt alone, as evaluation harnesses ask for.

vLLM: ``vllm/entrypoints/openai/serving_completion.py``.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from shared.outputs import Logprob, RequestOutput
from shared.tokenizer import Tokenizer
from stage5_server.server.protocol import CompletionRequest
from stage5_server.server.serving import OpenAIServing, Responder, finish_reason


def token_text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""  # the front end decodes it


# JSON has no infinity. A token the step could not sample (a grammar or a logit bias masked it out) has
# logprob -inf; it goes out as this number, as vLLM sends it.
MIN_WIRE_LOGPROB = -9999.0


def wire_logprob(logprob: Logprob) -> float:
    return max(logprob.logprob, MIN_WIRE_LOGPROB)


def completion_logprobs(output: RequestOutput, text_offset: int,
                        special: frozenset[int] = frozenset()) -> dict[str, Any] | None:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset.
    ``special``: token ids the generated text leaves out."""
    completion = output.outputs[0]
    if completion.logprobs is None:
        return None
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        token = _append(result, token_id, entry, text_offset)
        text_offset += 0 if token_id in special else len(token)
    return result


def prompt_logprobs(output: RequestOutput, prompt_text: str, first_token_text: str,
                    special: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The prompt's tokens in the same format, the first without a logprob; a special token takes
    characters only where ``prompt_text`` (what is echoed) spells it out."""
    def width(token_id: int, token: str, at: int) -> int:
        return len(token) if token_id not in special or prompt_text.startswith(token, at) else 0

    ids, entries = output.prompt_token_ids, output.prompt_logprobs or []
    result: dict[str, list] = {"tokens": [first_token_text], "token_logprobs": [None], "top_logprobs": [None],
                               "text_offset": [0]}
    text_offset = width(ids[0], first_token_text, 0)
    for token_id, entry in zip(ids[1:], entries[1:]):
        token = _append(result, token_id, entry, text_offset)
        text_offset += width(token_id, token, text_offset)
    return result


def _append(result: dict[str, list], token_id: int, entry: dict[int, Logprob], text_offset: int) -> str:
    chosen = entry[token_id]  # the sampler (or prefill) always records the chosen token
    token = token_text(chosen)
    result["tokens"].append(token)
    result["token_logprobs"].append(wire_logprob(chosen))
    ranked = sorted(entry.values(), key=lambda x: x.rank)
    result["top_logprobs"].append({token_text(lp): wire_logprob(lp) for lp in ranked})
    result["text_offset"].append(text_offset)
    return token


def _joined(prompt_part: dict[str, list] | None, generated: dict[str, Any] | None) -> dict[str, Any] | None:
    if prompt_part is None:
        return generated
    if generated is None:
        return prompt_part
    return {key: prompt_part[key] + generated[key] for key in prompt_part}


def echo_texts(tokenizer: Tokenizer, output: RequestOutput) -> tuple[str, str]:
    """What is echoed of a prompt (its text, or its token ids decoded) and its first token's text."""
    ids = output.prompt_token_ids
    return output.prompt if output.prompt is not None else tokenizer.decode(ids), tokenizer.decode(ids[:1], False)


class CompletionResponder(Responder):
    object = chunk_object = "text_completion"

    def __init__(self, *args: Any, echo: bool = False, generate: bool = True,
                 special_token_ids: frozenset[int] = frozenset(), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.echo: list[tuple[str, str]] | None = [] if echo else None  # per prompt: ``echo_texts``
        self.generate = generate  # False: echo with max_tokens 0, the generated token is not returned
        self.special = special_token_ids  # left out of decoded text: no width in text_offset
        self.text_offset: dict[int, int] = {}  # per choice: characters streamed so far

    async def prepare(self, serving: OpenAIServing, outputs: list[RequestOutput]) -> None:
        if self.echo is not None:  # the ids the engine took, not a second tokenization
            self.echo = [await serving.on_engine(echo_texts, serving.engine.tokenizer, o) for o in outputs]

    def _echoed(self, index: int, output: RequestOutput, text: str, logprobs: dict[str, Any] | None,
                offset: int) -> tuple[str, dict[str, Any] | None]:
        """``text`` and ``logprobs`` of choice ``index`` with the prompt in front (``offset``: where it starts)."""
        if not self.generate:
            text, logprobs = "", None
        if self.echo is None:
            return text, logprobs
        prompt_text, first_token_text = self.echo[index // self.n]
        prompt_part = None
        if output.prompt_logprobs is not None:
            prompt_part = prompt_logprobs(output, prompt_text, first_token_text, self.special)
            prompt_part["text_offset"] = [offset + o for o in prompt_part["text_offset"]]
        if logprobs is not None:  # the generated part starts after the prompt
            logprobs = {**logprobs, "text_offset": [o + len(prompt_text) for o in logprobs["text_offset"]]}
        return prompt_text + text, _joined(prompt_part, logprobs)

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        c = output.outputs[0]
        logprobs = completion_logprobs(output, 0, self.special)
        text, logprobs = self._echoed(index, output, c.text, logprobs, 0)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason(output) if self.generate else "length",
                "stop_reason": c.stop_reason if self.generate else None}

    def chunk(self, index: int, output: RequestOutput) -> dict[str, Any]:
        first = index not in self.text_offset
        offset = self.text_offset.get(index, 0)
        text, logprobs = output.outputs[0].text, completion_logprobs(output, offset, self.special)
        if first:
            text, logprobs = self._echoed(index, output, text, logprobs, offset)
        elif not self.generate:
            text, logprobs = "", None
        self.text_offset[index] = offset + len(text)
        finished = output.finished
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": (finish_reason(output) if self.generate else "length") if finished else None,
                  "stop_reason": output.outputs[0].stop_reason if finished and self.generate else None}
        return self.chunk_body(output, choice)


async def create_completion(serving: OpenAIServing, request: Request, body: CompletionRequest) -> Response:
    admission = serving.admit(request, body.model, body.cache_salt)
    generate = not (body.echo and body.max_tokens == 0)  # vLLM's echo_without_generation: generate one, show none
    params = body.sampling_params(body.max_tokens if generate else 1, body.logprobs,
                                  body.requested_structured_outputs())
    if body.echo and body.logprobs is not None:
        params = replace(params, prompt_logprobs=body.logprobs)  # vLLM: echo scores the prompt too
    responder = CompletionResponder(f"cmpl-{uuid.uuid4().hex}", body.model or serving.served_model_name, request,
                                    body.include_usage, body.continuous_usage, n=params.n,
                                    echo=body.echo, generate=generate,
                                    special_token_ids=serving.engine.tokenizer.special_token_ids)
    return await serving.generate(request, list(body.prompts), params, admission, responder, body.stream)


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(serving, request, body)
